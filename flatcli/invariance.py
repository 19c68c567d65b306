r"""Function-preserving rescalings and the reparameterization-invariance check.

A network with positively homogeneous activations (ReLU, leaky ReLU, max/avg
pooling, flatten, dropout in eval mode) computes the same function after

* **node-wise** rescaling: the incoming weights and bias of hidden node (or conv
  channel) :math:`i` are multiplied by :math:`\alpha_i > 0` and its outgoing
  weights by :math:`1/\alpha_i`;
* **layer-wise** rescaling: the same with one :math:`\alpha` for every node of
  a layer (layer :math:`l` times :math:`\alpha`, layer :math:`l+1` times
  :math:`1/\alpha`).

BatchNorm-aware: in eval mode a BatchNorm is a per-channel affine map with
fixed statistics, so a convolution followed by BatchNorm is *not* rescaled
itself (its scale would reach the normalization's running statistics and
``eps``); the BatchNorm's affine weight and bias are rescaled instead, and the
next layer's inputs by :math:`1/\alpha`. Running statistics are never touched.

Rescalable pairs (producer, consumer) are proposed from the order in which leaf
modules run (a producer is a Linear/Conv or an affine BatchNorm right after
one, then only homogeneous modules, then a Linear/Conv consumer; a Linear
after a flatten of C channels gets each channel's block of inputs), and each pair is
kept only if rescaling it alone leaves the network output unchanged on the
measurement data (relative tolerance ``1e-10`` in float64). Functional
activations inside ``forward`` are thus handled correctly: a pair that crosses
``torch.tanh`` fails the check and is dropped; a residual connection likewise.

`check_invariance` measures the original and the rescaled network with equal
seeds, in float64, and reports each measure's relative change
:math:`|\mu' - \mu| / |\mu|` next to the Hessian trace's (which is *not*
invariant: it changes by a large factor). A measure that claims invariance
(registry flag ``invariant``) holds it when its relative change is at most
``tol`` (default ``1e-6``). Whether a measure claims invariance, possibly only
with some options, which options the check turns on, and the remarks printed
with it are the measure's own rules (`flatcli.measures.MeasureInfo`); this
module names no measure.

>>> from flatcli.api import check_invariance
>>> report = check_invariance("config.yaml", "runs/a.pt")       # doctest: +SKIP
>>> report.exit_code, [(r.label, r.rel_change) for r in report.results]  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .engine import eval_mode
from .engine.batch import Batch, model_output
from .errors import ConfigError, ExitCode, MeasurementError, exit_code_of
from .loading.data import subset
from .measures import INVARIANCE_REFERENCE, MeasureSpec, get_measure, list_measures
from .run.measuring import as_specs, check_finite_model, measure_model
from .run.results import atomic_write, ensure_writable_dir
from .run.settings import MeasureOptions, Settings
from .validation import TRANSFORMS, Function, OneOf, Optional, Real, check_fields, opt

__all__ = [
    "RescalePair",
    "InvarianceResult",
    "InvarianceReport",
    "InvarianceOptions",
    "find_rescalable_pairs",
    "rescale",
    "node_wise_rescale",
    "layer_wise_rescale",
    "claims_invariance",
    "check_invariance_model",
    "prepare_specs",
]

DEFAULT_TOL = 1e-6
DEFAULT_SCALE = 10.0
OUTPUT_TOL = 1e-10  # relative change of the network output allowed for a rescaling (float64)

_WEIGHT_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_HOMOGENEOUS = (
    nn.ReLU, nn.LeakyReLU, nn.PReLU, nn.Identity, nn.Flatten,
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d,
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
)  # fmt: skip


# ---------------------------------------------------------------------------- rescalings
@dataclass(frozen=True)
class RescalePair:
    """Output channels of ``producer`` scaled by α, the matching inputs of ``consumer`` by 1/α.

    ``repeat``: how many consecutive consumer inputs each channel feeds (a Linear after
    flattening C channels of H×W has ``repeat = H·W``)."""

    producer: str
    consumer: str
    channels: int
    repeat: int = 1


def _out_channels(m: nn.Module) -> int:
    if isinstance(m, _BN):
        return m.num_features
    return m.weight.shape[0]


def _call(model: nn.Module, rows: Batch) -> torch.Tensor:
    """The model's output tensor on a batch of named inputs."""
    args, kwargs = rows.model_inputs()
    return model_output(model(*args, **kwargs))


def _leaf_order(model: nn.Module, x: Batch) -> list[str]:
    """Names of the leaf modules in the order they run on ``x``."""
    order: list[str] = []
    handles = []
    for name, mod in model.named_modules():
        if next(mod.children(), None) is None and name:
            handles.append(mod.register_forward_hook(lambda m, i, o, name=name: order.append(name)))
    try:
        with torch.no_grad():
            _call(model, x)
    finally:
        for h in handles:
            h.remove()
    return order


def _candidates(model: nn.Module, order: list[str]) -> list[RescalePair]:
    mods = dict(model.named_modules())
    out: list[RescalePair] = []
    for i, pname in enumerate(order):
        pm = mods[pname]
        if isinstance(pm, _WEIGHT_LAYERS):
            if i + 1 < len(order) and isinstance(mods[order[i + 1]], _BN):
                continue  # the BatchNorm after it is the producer
        elif not (
            isinstance(pm, _BN)
            and pm.affine
            and i > 0
            and isinstance(mods[order[i - 1]], _WEIGHT_LAYERS)
        ):
            continue
        if getattr(pm, "weight", None) is None:
            continue
        for cname in order[i + 1 :]:
            cm = mods[cname]
            if isinstance(cm, _WEIGHT_LAYERS):
                C = _out_channels(pm)
                cin = cm.weight.shape[1]
                if isinstance(cm, nn.Linear) and cin % C == 0:
                    out.append(RescalePair(pname, cname, C, cin // C))
                elif not isinstance(cm, nn.Linear) and cm.groups == 1 and cin == C:
                    out.append(RescalePair(pname, cname, C, 1))
                break
            if not isinstance(cm, _HOMOGENEOUS):
                break
    return out


@torch.no_grad()
def _apply(model: nn.Module, pair: RescalePair, alpha: torch.Tensor) -> None:
    """In place: producer rows (and bias) × α, consumer input columns × 1/α."""
    mods = dict(model.named_modules())
    pm, cm = mods[pair.producer], mods[pair.consumer]
    a = alpha.to(pm.weight)
    pm.weight.mul_(a.view(-1, *([1] * (pm.weight.ndim - 1))))
    if getattr(pm, "bias", None) is not None:
        pm.bias.mul_(a)
    ain = alpha.to(cm.weight).repeat_interleave(pair.repeat)
    cm.weight.div_(ain.view(1, -1, *([1] * (cm.weight.ndim - 2))))


def _rel_out_change(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / max(float(a.abs().max()), 1e-300)


def _forward(model: nn.Module, x: Batch, batch_size: int = 1024) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([_call(model, rows) for rows in x.split(batch_size)])


def find_rescalable_pairs(
    model: nn.Module, x, *, seed: int = 0, tol: float = OUTPUT_TOL
) -> list[RescalePair]:
    """Every (producer, consumer) pair whose node-wise rescaling alone keeps ``model``'s output on ``x``
    (an input tensor or a `flatcli.engine.batch.Batch` of named inputs).

    ``model`` must be in eval mode and float64 for the tolerance to be meaningful;
    it is restored exactly after each trial."""
    xs = Batch.of(x).select(slice(0, 256))
    base = _forward(model, xs)
    mods = dict(model.named_modules())
    g = torch.Generator().manual_seed(10_007 + seed)
    kept = []
    for pair in _candidates(model, _leaf_order(model, xs.select(slice(0, 2)))):
        saved = {
            k: t.detach().clone()
            for name in (pair.producer, pair.consumer)
            for k, t in ((f"{name}.{n}", p) for n, p in mods[name].named_parameters(recurse=False))
        }
        alpha = torch.exp(
            torch.empty(pair.channels, dtype=torch.float64).uniform_(-1.0, 1.0, generator=g)
        )
        _apply(model, pair, alpha)
        ok = _rel_out_change(base, _forward(model, xs)) <= tol
        with torch.no_grad():
            for name in (pair.producer, pair.consumer):
                for n, p in mods[name].named_parameters(recurse=False):
                    p.copy_(saved[f"{name}.{n}"])
        if ok:
            kept.append(pair)
    return kept


def _factors(kind: str, pair: RescalePair, scale: float, g: torch.Generator) -> torch.Tensor:
    ls = math.log(scale)
    if kind == "node":
        return torch.exp(
            ls * torch.empty(pair.channels, dtype=torch.float64).uniform_(-1.0, 1.0, generator=g)
        )
    sign = 1.0 if float(torch.rand((), generator=g)) < 0.5 else -1.0
    return torch.full((pair.channels,), math.exp(sign * ls), dtype=torch.float64)


def rescale(
    model: nn.Module,
    pairs: Sequence[RescalePair],
    kind: str = "both",
    scale: float = DEFAULT_SCALE,
    seed: int = 0,
) -> nn.Module:
    """A rescaled copy of ``model`` (the original is untouched).

    kind: ``"node"`` (α_i log-uniform in [1/scale, scale] per node), ``"layer"``
    (one α ∈ {scale, 1/scale} per pair), or ``"both"`` (node-wise, then layer-wise)."""
    if kind not in TRANSFORMS:
        raise ConfigError(
            f"the rescaling must be one of {', '.join(TRANSFORMS)}. Got {kind!r} instead."
        )
    if not (isinstance(scale, (int, float)) and scale >= 1.0 and math.isfinite(scale)):
        raise ConfigError(f"`scale` must be a float ≥ 1. Got {scale!r} instead.")
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(int(seed))
    for k in ("node", "layer") if kind == "both" else (kind,):
        for pair in pairs:
            _apply(out, pair, _factors(k, pair, scale, g))
    return out


def node_wise_rescale(
    model: nn.Module, pairs: Sequence[RescalePair], scale: float = DEFAULT_SCALE, seed: int = 0
) -> nn.Module:
    """Every hidden node of every pair rescaled by its own α_i, log-uniform in [1/scale, scale]."""
    return rescale(model, pairs, "node", scale, seed)


def layer_wise_rescale(
    model: nn.Module, pairs: Sequence[RescalePair], scale: float = DEFAULT_SCALE, seed: int = 0
) -> nn.Module:
    """Every pair rescaled by one α ∈ {scale, 1/scale} (producer × α, consumer × 1/α)."""
    return rescale(model, pairs, "layer", scale, seed)


# ---------------------------------------------------------------------------- the check
@dataclass(frozen=True)
class InvarianceResult:
    """One measure on the original and the rescaled network."""

    label: str
    name: str
    claims_invariance: bool
    original: float
    rescaled: float
    rel_change: float
    held: bool | None  # None when the measure claims no invariance
    note: str = ""  # the measure's remark on this check (its registry's invariance_note)
    error: str = ""  # why the measure failed (values are NaN then)


@dataclass
class InvarianceReport:
    """The invariance check of one checkpoint: the rescaling and every measure's comparison."""

    checkpoint: str
    transform: str
    scale: float
    seed: int
    tol: float
    pairs: list[RescalePair]
    output_rel_change: float
    results: list[InvarianceResult] = field(default_factory=list)
    reference: str | None = None  # label of the Hessian-trace row
    threads: str = ""  # torch's intra-op threads in words (set by flatcli.api.check_invariance)

    @property
    def passed(self) -> bool:
        """Every measure that claims invariance held it within ``tol``."""
        return all(r.held for r in self.results if r.claims_invariance)

    @property
    def exit_code(self) -> int:
        """0 when every measure that claims invariance held it, else 1."""
        return ExitCode.OK if self.passed else ExitCode.FAILED

    def to_json(self) -> dict[str, Any]:
        """The check as a JSON-ready dict (``flatcli check-invariance -o invariance.json``, which
        ``flatcli report`` shows): the checkpoint, the rescaling in words, whether every claimed
        invariance held, the tolerance and each measure's comparison (non-finite values as
        ``null``)."""

        def num(v: float) -> float | None:
            return v if math.isfinite(v) else None

        return {
            "checkpoint": self.checkpoint,
            "describe": self.describe(),
            "passed": self.passed,
            "tol": self.tol,
            "output_rel_change": num(self.output_rel_change),
            "results": [
                {
                    **dataclasses.asdict(r),
                    "original": num(r.original),
                    "rescaled": num(r.rescaled),
                    "rel_change": num(r.rel_change),
                }
                for r in self.results
            ],
        }

    def write_json(self, path) -> None:
        """Write `to_json` to ``path`` (atomically; its folder is created)."""
        ensure_writable_dir(Path(path).expanduser().parent, "the folder of --output")
        atomic_write(Path(path).expanduser(), json.dumps(self.to_json(), indent=2) + "\n")

    def describe(self) -> str:
        """The rescaling in words (kind, range of factors, seed, layer pairs)."""
        kinds = {"node": "node-wise", "layer": "layer-wise", "both": "node-wise then layer-wise"}[
            self.transform
        ]
        return (
            f"{kinds} rescaling, α ∈ [1/{self.scale:g}, {self.scale:g}], seed {self.seed}, "
            f"{len(self.pairs)} layer pair(s): "
            + ", ".join(f"{p.producer}→{p.consumer}" for p in self.pairs)
        )


def claims_invariance(spec) -> bool:
    """Whether the configured measure claims invariance to node-wise rescaling (its registry rule)."""
    return spec.claims_invariance()[0]


def prepare_specs(measures, add_invariant: bool) -> list:
    """The specs to check: ``measures`` (plus every measure that may claim invariance with
    ``add_invariant``), each with its registry's invariance options, and the non-invariant reference."""
    specs = as_specs(measures) if measures is not None else []
    if add_invariant:
        have = {s.name for s in specs}
        specs += [
            MeasureSpec(i.name, i.name)
            for i in list_measures()
            if i.may_claim_invariance and i.name not in have and not i.needs_init
        ]
    out = []
    for s in specs:
        extra = {
            k: v
            for k, v in get_measure(s.name).invariance_options.items()
            if k not in (s.options or {})
        }
        if extra:
            s = dataclasses.replace(s, options={**(s.options or {}), **extra})
        out.append(s)
    if not any(s.name == INVARIANCE_REFERENCE for s in out):
        labels = {s.label for s in out}
        label = (
            INVARIANCE_REFERENCE
            if INVARIANCE_REFERENCE not in labels
            else f"{INVARIANCE_REFERENCE}_reference"
        )
        out.append(MeasureSpec(INVARIANCE_REFERENCE, label))
    return out


def _rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(b - a) / abs(a) if a != 0 else math.inf


@dataclass(frozen=True)
class InvarianceOptions:
    """How the invariance check rescales and compares (``options=`` of `check_invariance_model`
    and `flatcli.api.check_invariance`), validated at construction (a bad value is a `ConfigError`
    naming the field).

    ``transform``: "node", "layer" or "both" (default); ``scale``: the factors α range over
    [1/scale, scale] (≥ 1, default 10); ``tol``: the relative change up to which a claimed
    invariance holds (> 0, default 1e-6); ``progress``: ``progress(stage, label, info)``, ``stage``
    "original" or "rescaled", called with an empty label when a stage starts, then as
    `flatcli.run.measuring.measure_model`'s progress."""

    transform: str = opt("both", OneOf(*TRANSFORMS), "the rescalings")
    scale: float = opt(DEFAULT_SCALE, Real(1, None, text=False), "α in [1/scale, scale]")
    tol: float = opt(DEFAULT_TOL, Real(0, None, "neither", text=False), "relative change allowed")
    progress: Callable[[str, str, dict], None] | None = opt(
        None, Optional(Function()), "progress(stage, label, info)"
    )

    def __post_init__(self):
        check_fields(self)


def check_invariance_model(
    model: nn.Module,
    train: tuple[torch.Tensor, torch.Tensor],
    measures: Sequence[Any] | str | None = None,
    *,
    test: tuple[torch.Tensor, torch.Tensor] | None = None,
    init_state: dict[str, torch.Tensor] | None = None,
    settings: Settings | None = None,
    options: InvarianceOptions | None = None,
    checkpoint: str = "<model>",
    **fields: Any,
) -> InvarianceReport:
    """Rescale ``model`` without changing its function, measure both in float64, compare.

    Parameters
    ----------
    model : the network (not modified).
    train, test : the data (named tensors or (x, y) pairs); the measurement set is ``split``
        subsampled as in `flatcli.api.measure_model`.
    measures : names / ``{name: options}`` / `MeasureSpec` objects; None: every registered measure that
        claims invariance. The non-invariant reference (the Hessian trace) is always added.
    settings : a `flatcli.run.settings.Settings` (or its fields as keywords: ``loss``, ``split``,
        ``num_samples``, ``batch_size``, ``data_seed``, ``device``, ``hvp_mode``, ``block_size``);
        ``seed`` is the seed of the rescaling and of every stochastic measure (equal for both runs);
        the precision is always fp64.
    init_state : the state dict at initialization (``distance_from_init``).
    options : an `InvarianceOptions` (``transform``, ``scale``, ``tol``, ``progress``; default
        ``InvarianceOptions()``: both rescalings, α in [0.1, 10], tol 1e-6).
    checkpoint : the name the report carries.

    Returns an `InvarianceReport`; ``report.exit_code`` is 0 when every measure that claims
    invariance held it. Raises `MeasurementError` when no function-preserving rescaling exists.
    """
    o = options if options is not None else InvarianceOptions()
    transform, scale, tol, progress = o.transform, o.scale, o.tol, o.progress
    st = Settings.build(settings, **fields).replace(precision="fp64")
    specs = prepare_specs(measures, add_invariant=measures is None)
    data = {"train": train, "test": test}
    if data.get(st.split) is None:
        raise ConfigError(
            f"measure_data.split is {st.split!r} but no {st.split} data is configured"
        )
    m64 = copy.deepcopy(model).to(st.device, torch.float64)
    check_finite_model(m64, data[st.split], st)
    pairs, rescaled, change = _rescaled_copy(m64, data[st.split], st, transform, scale)
    rows = []
    for stage, m in (("original", m64), ("rescaled", rescaled)):
        cb = None
        if progress is not None:
            progress(stage, "", {})
            cb = lambda lab, info, stage=stage: progress(stage, lab, info)  # noqa: E731
        rows.append(
            measure_model(
                m,
                train,
                specs,
                test=test,
                init_state=init_state,
                settings=st,
                options=MeasureOptions(checkpoint=checkpoint, progress=cb),
            )
        )
    _raise_input_errors(rows)
    report = InvarianceReport(
        checkpoint=checkpoint,
        transform=transform,
        scale=float(scale),
        seed=int(st.seed),
        tol=float(tol),
        pairs=pairs,
        output_rel_change=change,
    )
    for s in specs:
        report.results.append(_compare(s, rows[0], rows[1], tol))
        if s.name == INVARIANCE_REFERENCE and report.reference is None:
            report.reference = s.label
    return report


def _rescaled_copy(m64: nn.Module, data, st: Settings, transform: str, scale: float):
    """(pairs, rescaled copy, relative output change) for the float64 model ``m64``."""
    mx = subset(data, st.num_samples, st.data_seed).to(st.device, torch.float64)
    with eval_mode(m64):
        pairs = find_rescalable_pairs(m64, mx, seed=st.seed)
        if not pairs:
            raise MeasurementError(
                "no function-preserving rescaling found: the model needs consecutive Linear/Conv layers "
                "joined by positively homogeneous activations (ReLU, leaky ReLU, pooling)"
            )
        rescaled = rescale(m64, pairs, transform, scale, st.seed)
        with eval_mode(rescaled):
            change = _rel_out_change(_forward(m64, mx), _forward(rescaled, mx))
    if change > OUTPUT_TOL:
        raise MeasurementError(
            f"the rescaled network's output changed by {change:.3g} (relative): not function-preserving"
        )
    return pairs, rescaled, change


def _raise_input_errors(rows) -> None:
    """A failure on bad input (exit code 2) or of the whole row is the check's failure."""
    for r in rows:
        if r.status == "error" and not r.results and not r.errors:
            raise (ConfigError if exit_code_of(r.error_kind) == 2 else MeasurementError)(r.error)
        for label, kind in r.error_kinds.items():
            if exit_code_of(kind) == 2:  # bad input (e.g. relative_flatness 'layer'): exit code 2
                raise ConfigError(r.errors[label])


def _compare(s, row_a, row_b, tol: float) -> InvarianceResult:
    """One measure on the original (``row_a``) and the rescaled network (``row_b``)."""
    a, b = row_a.results.get(s.label), row_b.results.get(s.label)
    claims = claims_invariance(s)
    if a is None or b is None:
        err = row_a.errors.get(s.label) or row_b.errors.get(s.label) or "failed"
        return InvarianceResult(
            s.label,
            s.name,
            claims,
            math.nan,
            math.nan,
            math.nan,
            False if claims else None,
            error=err,
        )
    rc = _rel(a.value, b.value)
    info = get_measure(s.name)
    note = (info.invariance_note(a, b, s.parsed()) if info.invariance_note else None) or ""
    return InvarianceResult(
        s.label, s.name, claims, a.value, b.value, rc, (rc <= tol) if claims else None, note
    )


def needs_init(spec) -> bool:
    """Whether the configured measure needs the initial parameters."""
    return get_measure(spec.name).needs_init
