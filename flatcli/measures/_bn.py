r"""BatchNorm folding for the norm measures, PAC-Bayes flatness and the Fisher-Rao norm.

In eval mode a BatchNorm layer is the per-channel affine map
:math:`y = s \circ (z - \mu) + \beta` with :math:`s = \gamma / \sqrt{\sigma^2 + \epsilon}`
(running mean μ and variance σ², affine γ and β; γ = 1, β = 0 without
``affine``). When it directly follows a ``Linear`` or ``Conv{1,2,3}d`` layer
:math:`z = W x + b`, the pair equals one layer

.. math:: W' = \mathrm{diag}(s)\, W, \qquad b' = s \circ (b - \mu) + \beta

(for convolutions ``s`` scales each output channel). Norm measures (Jiang et al.
2020) are computed on W' so that they do not depend on how the scale is split
between a weight and the following normalization.

`fold_batchnorm` works on a deep copy of the model (the user's model, its
parameters and its running statistics are never touched), loads the given
functional parameters and buffers into it, and folds every BatchNorm whose input
is the output of a Linear/Conv layer used only there. Pairs are found by
``torch.fx`` tracing; when a model cannot be traced, consecutive
(Linear/Conv, BatchNorm) children of ``nn.Sequential`` containers are used.
A folded BatchNorm is replaced by ``nn.Identity`` and the layer gets the bias b'
(created when it had none). BatchNorms that cannot be folded (after a pooling or
an activation, before a layer, ``track_running_stats=False``) stay in place and
are listed in ``Folded.unfolded``.

`folded_measurement` builds a `Problem` and `CurvatureEngine` over the folded copy
for measures that perturb or differentiate the parameters (``pacbayes_flatness``,
``fisher_rao_norm``): the reference implementation of Jiang et al. (2020) folds
BatchNorm before its σ search, and on the folded parameterization these measures
no longer depend on how a scale is split between a layer and its BatchNorm.
"""

from __future__ import annotations

import contextlib
import copy
import linecache
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..engine.losses import NotApplicable
from ..errors import ConfigError

_LAYER_FOR_BN = {
    nn.BatchNorm1d: (nn.Linear, nn.Conv1d),
    nn.BatchNorm2d: (nn.Conv2d,),
    nn.BatchNorm3d: (nn.Conv3d,),
}


@dataclass
class Folded:
    """A folded copy of a model.

    module: the copy in eval mode (BatchNorms folded into their layers).
    pairs: (layer name, BatchNorm name) for each fold.
    unfolded: names of BatchNorm modules left in place.
    """

    module: nn.Module
    pairs: list[tuple[str, str]] = field(default_factory=list)
    unfolded: list[str] = field(default_factory=list)

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.module.named_parameters()}

    def buffers(self) -> dict[str, torch.Tensor]:
        return {n: b.detach() for n, b in self.module.named_buffers()}


def _compatible(layer: nn.Module, bn: nn.Module) -> bool:
    kinds = [k for k in _LAYER_FOR_BN if type(bn) is k]
    if not kinds or not isinstance(layer, _LAYER_FOR_BN[kinds[0]]):
        return False
    if not bn.track_running_stats or bn.running_mean is None or bn.running_var is None:
        return False
    out = layer.out_features if isinstance(layer, nn.Linear) else layer.out_channels
    return out == bn.num_features


@contextlib.contextmanager
def _fx_sources_released():
    """Forget the Python source torch.fx generates while tracing inside the block: fx keeps every
    traced graph's code in its loader and in `linecache` for the life of the process (about 7.5 KB
    per trace), so one trace per sweep unit grows a long-running worker without bound."""
    try:
        from torch.fx.graph_module import _loader
    except ImportError:  # another torch layout: nothing known to release
        yield
        return
    before = set(_loader.eval_cache)
    try:
        yield
    finally:
        for key in set(_loader.eval_cache) - before:
            _loader.eval_cache.pop(key, None)
            linecache.cache.pop(key, None)


def _pairs_fx(model: nn.Module) -> list[tuple[str, str]] | None:
    try:
        with _fx_sources_released():
            gm = torch.fx.symbolic_trace(model)
    except Exception:
        return None
    mods = dict(model.named_modules())
    calls: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    pairs = []
    for node in gm.graph.nodes:
        if node.op != "call_module" or not isinstance(mods.get(node.target), _BatchNorm):
            continue
        if len(node.args) != 1 or node.kwargs:
            continue
        src = node.args[0]
        if not isinstance(src, torch.fx.Node) or src.op != "call_module" or len(src.users) != 1:
            continue
        if calls.get(node.target) != 1 or calls.get(src.target) != 1:
            continue
        if _compatible(mods[src.target], mods[node.target]):
            pairs.append((src.target, node.target))
    return pairs


def _pairs_sequential(model: nn.Module) -> list[tuple[str, str]]:
    pairs = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Sequential):
            continue
        kids = list(mod.named_children())
        for (a, la), (b, lb) in zip(kids, kids[1:], strict=False):
            if isinstance(lb, _BatchNorm) and _compatible(la, lb):
                pre = f"{name}." if name else ""
                pairs.append((pre + a, pre + b))
    return pairs


def _set_module(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, attr, new)


@torch.no_grad()
def fold_batchnorm(
    model: nn.Module,
    params: dict[str, torch.Tensor] | None = None,
    buffers: dict[str, torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> Folded:
    """A deep copy of ``model`` with ``params``/``buffers`` loaded and BatchNorm folded.

    ``params`` and ``buffers`` (name → tensor, e.g. ``problem.params`` and
    ``problem.buffers``) override the copy's values; missing names keep the
    model's own. The copy is cast to ``dtype`` (default: that of ``params``).
    """
    work = copy.deepcopy(model)
    if dtype is None and params:
        dtype = next(iter(params.values())).dtype
    if dtype is not None:
        work = work.to(dtype)
    for n, t in (params or {}).items():
        work.get_parameter(n).copy_(t)
    for n, t in (buffers or {}).items():
        b = work.get_buffer(n)
        b.copy_(t.to(b.dtype))
    work.eval()
    # without a BatchNorm there is nothing to pair: no trace (it costs more than the norms)
    pairs = _pairs_fx(work) if has_batchnorm(work) else []
    if pairs is None:
        pairs = _pairs_sequential(work)
    for lname, bname in pairs:
        layer, bn = work.get_submodule(lname), work.get_submodule(bname)
        var = bn.running_var.to(layer.weight.dtype)
        mean = bn.running_mean.to(layer.weight.dtype)
        s = torch.rsqrt(var + bn.eps)
        if bn.affine and bn.weight is not None:
            s = s * bn.weight
        shift = -mean * s
        if bn.affine and bn.bias is not None:
            shift = shift + bn.bias
        w = layer.weight * s.reshape(-1, *([1] * (layer.weight.ndim - 1)))
        b = shift if layer.bias is None else layer.bias * s + shift
        layer.weight = nn.Parameter(w.detach().clone())
        layer.bias = nn.Parameter(b.detach().clone())
        _set_module(work, bname, nn.Identity())
    folded_names = {b for _, b in pairs}
    unfolded = [
        n for n, m in work.named_modules() if isinstance(m, _BatchNorm) and n not in folded_names
    ]
    return Folded(module=work, pairs=pairs, unfolded=unfolded)


def has_batchnorm(model: nn.Module) -> bool:
    """Whether ``model`` holds any BatchNorm module."""
    return any(isinstance(m, _BatchNorm) for m in model.modules())


@dataclass
class FoldedMeasurement:
    """The measurement problem of a measure that folds BatchNorm first.

    problem, engine: a `Problem` and `CurvatureEngine` over the folded copy (the
        measure's own ones when nothing was folded).
    diagnostics: ``fold_batchnorm`` (whether folding was asked), ``folded_batchnorm``
        (number of folds) and ``unfolded_batchnorm`` (names left in place).
    """

    problem: object
    engine: object
    diagnostics: dict
    own: bool  # True: ``problem``/``engine`` are the context's own

    def merge_counters(self, engine) -> None:
        """Add this engine's cost counters to ``engine`` (the one `run_measure` reads)."""
        if self.own:
            return
        engine.merge_counts(self.engine)


def _unfoldable(e: Exception) -> str:
    return (
        f"with BatchNorm folded, {e} (folding removes the BatchNorm parameters; "
        "use fold_batchnorm: false to measure them)"
    )


def folding_reason(problem, fold: bool) -> str | None:
    """The measures' ``applicable`` check of `folded_measurement`: the reason it will end
    ``not_applicable`` (the parameter selection names BatchNorm parameters folding removes), from
    a folded copy of the model and its problem (no products), or None."""
    if not fold or not has_batchnorm(problem.model):
        return None
    f = fold_batchnorm(
        problem.model, {**problem.params, **problem.frozen}, problem.buffers, dtype=problem.dtype
    )
    try:
        problem.derive(f.module)
    except ConfigError as e:
        return _unfoldable(e)
    return None


def folded_measurement(ctx, fold: bool) -> FoldedMeasurement:
    """The problem a measure runs on: the context's own, or one over a BatchNorm-folded copy.

    With ``fold`` and a model holding BatchNorm, the model is deep-copied with the
    problem's parameters and buffers, every foldable BatchNorm is folded into its
    preceding layer (`fold_batchnorm`), and a new `Problem` (same measurement set,
    loss, batch size, device, dtype, selection, ranks) and `CurvatureEngine` (same
    settings) are derived for the copy (`CurvatureEngine.derive`): the same function in eval
    mode, parameterized by the folded weights W' = diag(s) W and biases b' and without the
    BatchNorm affine parameters.
    Without BatchNorm, or with ``fold`` false, the context's own problem is used.
    """
    p = ctx.problem
    if not fold or not has_batchnorm(ctx.model):
        diag = {"fold_batchnorm": bool(fold), "folded_batchnorm": 0}
        if not fold and has_batchnorm(ctx.model):
            diag["unfolded_batchnorm"] = ",".join(
                n for n, m in ctx.model.named_modules() if isinstance(m, _BatchNorm)
            )
        return FoldedMeasurement(p, ctx.engine, diag, True)
    f = fold_batchnorm(ctx.model, {**p.params, **p.frozen}, p.buffers, dtype=p.dtype)
    try:
        fe = ctx.engine.derive(f.module)
    except ConfigError as e:
        raise NotApplicable(_unfoldable(e)) from None
    fp = fe.problem
    diag = {
        "fold_batchnorm": True,
        "folded_batchnorm": len(f.pairs),
        "unfolded_batchnorm": ",".join(f.unfolded),
    }
    return FoldedMeasurement(fp, fe, diag, False)


def init_buffers(ctx) -> dict[str, torch.Tensor]:
    """BatchNorm buffers at initialization: from the init state dict when present,
    otherwise those of a freshly built BatchNorm (running mean 0, variance 1)."""
    state = ctx.init_state or {}
    out = {}
    for mname, m in ctx.model.named_modules():
        if not isinstance(m, _BatchNorm) or m.running_mean is None:
            continue
        pre = f"{mname}." if mname else ""
        for attr, fresh in (("running_mean", torch.zeros_like), ("running_var", torch.ones_like)):
            key = pre + attr
            out[key] = state[key] if key in state else fresh(m.running_mean)
    return out


def folded_init_theta(ctx, fm: FoldedMeasurement) -> torch.Tensor | None:
    """θ⁰ in the parameterization of ``fm.problem`` (flat), or None when it is not known.

    Folded problems fold the initial parameters with the initial BatchNorm statistics
    (`init_buffers`), as ``distance_from_init`` does."""
    init = ctx.init_params
    p = ctx.problem
    if init is None or not all(n in init for n in p.names):
        return None
    if fm.own:
        return p.flatten(init)
    start = {n: init[n].to(p.device, p.dtype) for n in p.names}
    f0 = fold_batchnorm(
        ctx.model, {**start, **p.frozen}, {**p.buffers, **init_buffers(ctx)}, dtype=p.dtype
    )
    params0 = f0.params()
    fp = fm.problem
    if not all(n in params0 for n in fp.names):
        return None
    return fp.flatten({n: params0[n].to(fp.device, fp.dtype) for n in fp.names})
