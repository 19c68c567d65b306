r"""Mode connectivity: a trained quadratic Bezier curve between two checkpoints vs the straight line.

Garipov, Izmailov, Podoprikhin, Vetrov, Wilson, "Loss Surfaces, Mode
Connectivity, and Fast Ensembling of DNNs", NeurIPS 2018, Sec. 3; Draxler,
Veschgini, Salmhofer, Hamprecht, "Essentially No Barriers in Neural Network
Energy Landscape", ICML 2018. Two minima that the straight line separates by a
loss barrier are often joined by a simple curve along which the loss stays low.

**Curve** (Garipov et al. Sec. 3.2, the quadratic Bezier curve with endpoints
θ_a, θ_b and one bend θ_c):

.. math:: \phi_{\theta_c}(t) = (1 - t)^2\,\theta_a + 2t(1 - t)\,\theta_c + t^2\,\theta_b,
          \qquad t \in [0, 1].

**Training the bend** (Garipov et al. Sec. 3.1, the uniform-t objective):

.. math:: \min_{\theta_c}\; \mathbb{E}_{t \sim U(0, 1)}\, L(\phi_{\theta_c}(t)),

by stochastic optimization: each step draws one t uniformly and one minibatch
of the training set (both from one seeded generator; minibatches come from a
fresh permutation each epoch) and takes an Adam or SGD step on θ_c alone (the
endpoints stay fixed). θ_c starts at the midpoint (θ_a + θ_b)/2, where the
curve *is* the line, so training can only bend it away where that lowers the
loss. The objective is the plain training loss, without weight decay.
BatchNorm layers use the minibatch's statistics during this training (a point
θ(t) has no running statistics); every other module is in eval mode.

**Evaluation.** Both paths are evaluated on the same grid of t in [0, 1]
(t = 0 and 1 included), in eval mode, on the measurement sets: the line
θ(t) = (1 − t)θ_a + tθ_b as in `flatcli.landscape.interpolate`, the curve
φ(t) above. Floating-point buffers other than BatchNorm statistics follow the
line on both paths. For models with BatchNorm, the running statistics are
**recomputed at every evaluated t on both paths** on the train measurement set
(`flatcli.landscape.bnstats`), as Garipov et al. do, endpoints included: the
values at t = 0 and 1 are then those of the checkpoints with freshly computed
statistics, not with their stored ones.

**Barrier** of each path (the summary's ``line_train_loss_barrier``,
``curve_train_loss_barrier``, and the same for the test loss and the errors),
as for the interpolation (`flatcli.landscape.loss_grid.summarize`):

.. math:: B = \max_{t \in [0, 1]} L(\theta(t)) - \max(L(\theta(0)), L(\theta(1))) \;\ge 0.

Draxler et al. (Sec. 2) call the height of the highest point of the best path
the saddle energy; a curve barrier near 0 next to a positive line barrier says
the two minima are connected by a low-loss path that the line misses.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.func import functional_call

from ..engine import Batch, Problem, eval_mode, get_loss
from ..engine.batch import model_output
from ..errors import ConfigError, MeasurementError
from ..loading.checkpoints import check_state
from ..run.results import jsonable
from ..run.settings import Settings
from ..validation import Integral, OneOf, Optional, Real, check_fields, opt
from .bnstats import BatchNormRecomputer, batchnorm_buffer_names
from .evaluate import (
    ChunkFn,
    Progress,
    ViewOptions,
    evaluate_splits,
    problem_kwargs,
    split_problems,
)
from .loss_grid import LandscapeResult, summarize
from .slices import axis_grid

BEND_OPTIMIZERS = ("adam", "sgd")
DEFAULT_BEND_LR = {"adam": 1e-3, "sgd": 1e-2}
SGD_MOMENTUM = 0.9
PATHS = ("line", "curve")


@dataclass(frozen=True)
class ConnectView(ViewOptions):
    """``view="connect"``: the path and optimizer settings of `connect_landscape`, validated at
    construction (a bad value is a `ConfigError` naming the field).

    ``steps`` points on the t grid over [0, 1] (t = 0 and 1 included). The bend trains
    ``bend_steps`` steps (0 keeps the midpoint: the curve is then the line) of ``bend_optimizer``
    ("adam" or "sgd" with momentum 0.9; learning rate ``bend_lr``, default 1e-3 for adam and 1e-2
    for sgd) on minibatches of ``bend_batch_size``, seeded by the settings' ``seed``, starting
    from ``bend_init`` (name → tensor, from Python only; default the midpoint (θ_a + θ_b)/2).
    ``points_per_pass`` and ``on_progress``: `ViewOptions`."""

    steps: int = opt(25, Integral(2), "points on the t grid")
    bend_steps: int = opt(1000, Integral(0), "optimizer steps of the bend training")
    bend_lr: float | None = opt(None, Optional(Real(0, None, "neither", text=False)), "bend lr")
    bend_optimizer: str = opt("adam", OneOf(*BEND_OPTIMIZERS), "the bend's optimizer")
    bend_batch_size: int = opt(128, Integral(1), "minibatch size of the bend training")
    bend_init: Mapping[str, torch.Tensor] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        check_fields(self)


def lr_factor(step: int, steps: int) -> float:
    """Garipov et al.'s schedule as a function of the budget fraction a = step / steps: 1 up to
    a = 0.5, then linear down to 0.01 at a = 0.9, then 0.01."""
    a = step / max(steps, 1)
    if a <= 0.5:
        return 1.0
    if a <= 0.9:
        return 1.0 - (a - 0.5) / 0.4 * 0.99
    return 0.01


def bezier(
    a: Mapping[str, torch.Tensor],
    b: Mapping[str, torch.Tensor],
    c: Mapping[str, torch.Tensor],
    t: float | torch.Tensor,
) -> dict[str, torch.Tensor]:
    """φ(t) = (1 − t)²·a + 2t(1 − t)·c + t²·b for every name of ``a``.

    ``t`` is a float or a tensor broadcastable against the parameters (e.g.
    shape (K, 1, …) for K stacked points).
    """
    return {n: (1 - t) ** 2 * a[n] + 2 * t * (1 - t) * c[n] + t**2 * b[n] for n in a}


def _line(
    a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], t
) -> dict[str, torch.Tensor]:
    return {n: (1 - t) * a[n] + t * b[n] for n in a}


@dataclass
class ConnectResult:
    """The line and the fitted Bezier curve between two checkpoints.

    ``line`` and ``curve``: `LandscapeResult` of kind "interpolation" over the
    same t grid in [0, 1] (``alpha`` is t), each with its own barrier summary.
    ``bend``: the trained θ_c (trainable parameters, name → tensor, CPU).
    ``history``: the bend training, arrays ``step``, ``t``, ``loss`` (the
    minibatch loss at each step). ``summary``: the line's and the curve's
    summaries prefixed ``line_`` and ``curve_``.
    """

    line: LandscapeResult
    curve: LandscapeResult
    bend: dict[str, torch.Tensor]
    history: dict[str, np.ndarray]
    summary: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)
    seconds: float = 0.0
    kind: str = "connect"
    bend_state: dict[str, torch.Tensor] = field(default_factory=dict)

    def frame(self):
        """Both paths as one pandas DataFrame: path, t, train_loss, train_acc, test_loss, test_acc."""
        import pandas as pd

        parts = []
        for name, res in (("line", self.line), ("curve", self.curve)):
            df = pd.DataFrame(res.rows()).rename(columns={"alpha": "t"})
            df.insert(0, "path", name)
            parts.append(df)
        return pd.concat(parts, ignore_index=True)

    def history_frame(self):
        """The bend training as a pandas DataFrame: step, t, loss."""
        import pandas as pd

        return pd.DataFrame(self.history)

    def to_json(self) -> dict[str, Any]:
        """``connect.json`` as a JSON-ready dict: kind, summary, seconds and the meta entries."""
        return jsonable(
            {"kind": self.kind, "summary": self.summary, "seconds": self.seconds, **self.meta}
        )


# ------------------------------------------------------------------ bend training
def _batches(n: int, batch_size: int, gen: torch.Generator):
    """Endless minibatch indices: a fresh permutation per epoch, incomplete last batch dropped
    (the whole set when it is smaller than one batch)."""
    bs = min(batch_size, n)
    while True:
        perm = torch.randperm(n, generator=gen)
        for i in range(0, n - bs + 1, bs):
            yield perm[i : i + bs]


def _fit_bend(
    work: torch.nn.Module,
    a: dict[str, torch.Tensor],
    b: dict[str, torch.Tensor],
    fit: tuple[torch.Tensor, torch.Tensor],
    *,
    init: Mapping[str, torch.Tensor] | None = None,
    buffers: Callable[[float], dict[str, torch.Tensor]] | None = None,
    steps: int = 1000,
    lr: float | None = None,
    optimizer: str = "adam",
    batch_size: int = 128,
    seed: int = 0,
    loss: str = "cross_entropy",
    on_step: Callable[[int], None] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """Train the bend θ_c of the Bezier curve between ``a`` and ``b`` (see the module docstring).

    Parameters
    ----------
    work : the network, in the modes it should train in (BatchNorm train,
        the rest eval); called through ``functional_call`` with the curve's
        parameters and ``buffers(t)``; its own buffers may be updated.
    a, b : the endpoints' trainable parameters (same device and dtype).
    fit : the training data (a `flatcli.engine.batch.Batch` or an (x, y) pair); minibatches are
        moved to ``a``'s device.
    init : the starting bend (default the midpoint (a + b)/2).
    buffers : t → buffers to pass (e.g. interpolated non-BatchNorm buffers).
    steps, lr, optimizer, batch_size, seed : the step budget, learning rate
        (default 1e-3 for Adam, 1e-2 for SGD with momentum 0.9), "adam" or
        "sgd", minibatch size, seed of t and of the minibatches.

    Returns
    -------
    (bend, history): the trained θ_c (detached) and arrays step, t, loss.
    """
    if optimizer not in BEND_OPTIMIZERS:
        raise ConfigError(
            f"`bend_optimizer` must be one of {', '.join(BEND_OPTIMIZERS)}. Got {optimizer!r} instead."
        )
    lr = DEFAULT_BEND_LR[optimizer] if lr is None else float(lr)
    steps = int(steps)
    like = next(iter(a.values()))
    data = Batch.of(fit)
    loss_fn = get_loss(loss)
    c = _initial_bend(a, b, init, like)
    opt = _bend_optimizer(list(c.values()), optimizer, lr)
    gen = torch.Generator().manual_seed(int(seed))
    batches = _batches(data.rows, int(batch_size), gen)
    hist_t = np.empty(steps)
    hist_loss = np.empty(steps)
    for k in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * lr_factor(k, steps)
        t = float(torch.rand((), generator=gen, dtype=torch.float64))
        idx = next(batches)
        mb = data.select(idx).to(like.device, like.dtype)
        extra = buffers(t) if buffers is not None else {}
        args, kwargs = mb.model_inputs()
        out = model_output(functional_call(work, {**extra, **bezier(a, b, c, t)}, args, kwargs))
        value = loss_fn.sum(out, mb) / loss_fn.units(mb).sum().item()
        if not bool(torch.isfinite(value)):
            raise MeasurementError(
                f"bend training: the loss is {float(value.detach())} at step {k + 1} (t = {t:.3g}); "
                "lower `bend_lr` or check the data"
            )
        opt.zero_grad(set_to_none=True)
        value.backward()
        opt.step()
        hist_t[k], hist_loss[k] = t, float(value.detach())
        if on_step is not None:
            on_step(k + 1)
    bend = {n: v.detach() for n, v in c.items()}
    return bend, {"step": np.arange(1, steps + 1), "t": hist_t, "loss": hist_loss}


def _initial_bend(
    a: Mapping[str, torch.Tensor],
    b: Mapping[str, torch.Tensor],
    init: Mapping[str, torch.Tensor] | None,
    like: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The bend to start from, ``init`` or the midpoint (a + b)/2: fresh leaf tensors that require
    gradients, on ``like``'s device and in its dtype."""
    return {
        n: (init[n] if init is not None else (a[n] + b[n]) / 2)
        .detach()
        .to(like.device, like.dtype)
        .clone()
        .requires_grad_(True)
        for n in a
    }


def _bend_optimizer(params: list[torch.Tensor], optimizer: str, lr: float) -> torch.optim.Optimizer:
    """Adam, or SGD with momentum `SGD_MOMENTUM`, over ``params``."""
    if optimizer == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.SGD(params, lr=lr, momentum=SGD_MOMENTUM)


def _on_device_of(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``v`` on ``like``'s device, and in ``like``'s dtype when ``v`` is floating point."""
    v = v.to(like.device)
    return v.to(like.dtype) if v.is_floating_point() else v


# ------------------------------------------------------------------ evaluation
def _path_chunks(
    point: Callable[[torch.Tensor], dict[str, torch.Tensor]],
    ts: np.ndarray,
    like: torch.Tensor,
    stacked: dict[str, torch.Tensor] | None = None,
) -> ChunkFn:
    """Points ``point(t)`` for t = ts[first:stop] (a (K,)-tensor), plus ``stacked[name][first:stop]``."""

    def chunk(first: int, stop: int) -> dict[str, torch.Tensor]:
        t = torch.as_tensor(ts[first:stop], dtype=like.dtype, device=like.device)
        out = point(t)
        for n, v in (stacked or {}).items():
            out[n] = v[first:stop]
        return out

    return chunk


@dataclass
class _Endpoints:
    """The two checkpoints on the evaluation device.

    ``problems``: a `Problem` per split over θ_a's network; ``a``, ``b``: the
    trainable parameters of θ_a and θ_b; ``buf_a``, ``buf_b``: their
    floating-point buffers other than the BatchNorm statistics (which follow
    the line on both paths); ``bn_names``: the BatchNorm statistics, recomputed
    at every evaluated t.
    """

    problems: dict[str, Problem]
    a: dict[str, torch.Tensor]
    b: dict[str, torch.Tensor]
    buf_a: dict[str, torch.Tensor]
    buf_b: dict[str, torch.Tensor]
    bn_names: list[str]

    @property
    def train(self) -> Problem:
        """The train split's `Problem` (θ_a's parameters, the device and dtype)."""
        return self.problems["train"]

    @property
    def like(self) -> torch.Tensor:
        """A tensor with the evaluation device and dtype."""
        pa = self.train
        return (
            pa.params[pa.names[0]]
            if pa.names
            else torch.zeros((), device=pa.device, dtype=pa.dtype)
        )


def _endpoints(
    model_a: torch.nn.Module,
    model_b: torch.nn.Module,
    train: tuple[torch.Tensor, torch.Tensor],
    test: tuple[torch.Tensor, torch.Tensor] | None,
    bn_names: list[str],
    kw: dict[str, Any],
) -> _Endpoints:
    """The endpoints' problems and tensors (``kw``: loss, batch_size, device, dtype)."""
    problems = split_problems(model_a, train, test, **kw)
    pa = problems["train"]
    pb = Problem(model_b, Batch.of(train).select(slice(0, 1)), **kw)
    other = [n for n, v in pa.buffers.items() if v.is_floating_point() and n not in bn_names]
    return _Endpoints(
        problems=problems,
        a=pa.params,
        b={n: pb.params[n] for n in pa.names},
        buf_a={n: pa.buffers[n] for n in other},
        buf_b={n: pb.buffers[n] for n in other},
        bn_names=bn_names,
    )


@dataclass(frozen=True)
class _BendOptions:
    """How the bend is trained (see `_fit_bend`)."""

    steps: int
    lr: float | None
    optimizer: str
    batch_size: int
    seed: int

    @property
    def effective_lr(self) -> float:
        """The learning rate used: ``lr`` or the optimizer's default."""
        return DEFAULT_BEND_LR[self.optimizer] if self.lr is None else float(self.lr)


def _check_bend_batch_size(bend_batch_size: int, bn_names: list[str]) -> None:
    """`ConfigError` unless a bend minibatch holds ≥ 1 sample (≥ 2 with BatchNorm, which trains on
    the minibatch's statistics)."""
    if bn_names and int(bend_batch_size) < 2:
        raise ConfigError(
            f"`bend_batch_size` must be ≥ 2 for a model with BatchNorm. Got {bend_batch_size} instead."
        )
    if int(bend_batch_size) < 1:
        raise ConfigError(f"`bend_batch_size` must be ≥ 1. Got {bend_batch_size} instead.")


def _train_bend(
    model_a: torch.nn.Module,
    ends: _Endpoints,
    fit: tuple[torch.Tensor, torch.Tensor],
    init: Mapping[str, torch.Tensor] | None,
    opts: _BendOptions,
    loss: str,
    progress: Progress,
) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """`_fit_bend` on a private copy of the network with BatchNorm on batch statistics and every
    other module in eval mode; the non-BatchNorm buffers follow the line."""
    pa = ends.train
    work = copy.deepcopy(model_a).to(device=pa.device, dtype=pa.dtype)
    for m in work.modules():  # BatchNorm on batch statistics, everything else in eval mode
        m.train(isinstance(m, torch.nn.modules.batchnorm._BatchNorm))
    for p in work.parameters():
        p.requires_grad_(False)
    return _fit_bend(
        work,
        ends.a,
        ends.b,
        fit,
        init=None if init is None else {n: init[n] for n in pa.names},
        buffers=lambda t: _line(ends.buf_a, ends.buf_b, t),
        steps=opts.steps,
        lr=opts.lr,
        optimizer=opts.optimizer,
        batch_size=opts.batch_size,
        seed=opts.seed,
        loss=loss,
        on_step=lambda k: progress.advance(1),
    )


def connect_landscape(
    model_a: torch.nn.Module,
    model_b: torch.nn.Module,
    train,
    test=None,
    *,
    fit=None,
    options: ConnectView | None = None,
    settings: Settings | None = None,
    **fields,
) -> ConnectResult:
    """Fit a quadratic Bezier curve between two checkpoints; loss along it and along the line.

    Parameters
    ----------
    model_a, model_b : the endpoints θ_a and θ_b (neither is modified);
        ``model_a`` provides the network's code, ``model_b`` must match it in
        parameter and buffer names and shapes.
    train, test : (x, y) measurement sets: every point of both paths gets
        train (and test) loss and accuracy; BatchNorm statistics are
        recomputed on ``train``.
    fit : (x, y) data the bend is trained on (default ``train``).
    options : the `ConnectView`: ``steps`` of the t grid and the bend training's ``bend_steps``,
        ``bend_lr``, ``bend_optimizer``, ``bend_batch_size``, ``bend_init``, and
        ``points_per_pass``, ``on_progress`` (default ``ConnectView()``: 25 points, 1000 Adam
        steps at 1e-3 on minibatches of 128).
    settings : the `flatcli.run.settings.Settings` (loss, batch size, device, precision, ``seed``: the
        seed of the bend training, t and minibatches); its fields may be given as keywords.

    The two checkpoints are called A and B in messages and in ``meta["checkpoints"]``
    (`flatcli.api.landscape` puts their paths there).

    Returns
    -------
    `ConnectResult`: ``summary["line_train_loss_barrier"]`` and
    ``summary["curve_train_loss_barrier"]`` (≥ 0; lower is better
    connected), the same for the error and the test split, and both paths.

    References
    ----------
    Garipov et al., NeurIPS 2018, Sec. 3.1–3.2 (Bezier curve, uniform-t
    objective, recomputed BatchNorm statistics); Draxler et al., ICML 2018.

    Examples
    --------
    >>> res = connect_landscape(a, b, (x, y), options=ConnectView(bend_steps=500))  # doctest: +SKIP
    >>> res.summary["line_train_loss_barrier"], res.summary["curve_train_loss_barrier"]  # doctest: +SKIP
    (0.45, 0.003)
    """
    o = options if options is not None else ConnectView()
    steps, bend_init, labels = o.steps, o.bend_init, ("A", "B")
    st = Settings.build(settings, **fields)
    seed, loss = st.seed, st.loss
    t0 = time.perf_counter()
    ts = axis_grid((0.0, 1.0), int(steps), include=(0.0, 1.0))
    state_a = model_a.state_dict()
    check_state(state_a, state_a, labels[0], labels[0], "landscape connect")
    check_state(model_b.state_dict(), state_a, labels[1], labels[0], "landscape connect")
    bn_names = batchnorm_buffer_names(model_a)
    _check_bend_batch_size(o.bend_batch_size, bn_names)
    opts = _BendOptions(o.bend_steps, o.bend_lr, o.bend_optimizer, o.bend_batch_size, seed)
    fit = train if fit is None else fit
    with eval_mode(model_a), eval_mode(model_b):
        ends = _endpoints(model_a, model_b, train, test, bn_names, problem_kwargs(st))
        n_evals = (2 * len(ts) if bn_names else 0) + 2 * len(ts) * len(ends.problems)
        progress = o.progress(opts.steps + n_evals)
        bend, history = _train_bend(model_a, ends, fit, bend_init, opts, loss, progress)
        pa = ends.train
        recompute = BatchNormRecomputer(model_a, pa.device, pa.dtype) if bn_names else None
        evaluate = _PathEvaluator(ends, ts, recompute, o.points_per_pass, progress)
        results = {path: evaluate(path, bend) for path in PATHS}
        meta = _connect_meta(
            ends, bend, history, opts, labels=labels, steps=int(steps), n_fit=Batch.of(fit).rows
        )
    out = ConnectResult(
        line=results["line"],
        curve=results["curve"],
        bend={n: v.detach().to("cpu") for n, v in bend.items()},
        history=history,
        bend_state=_bend_state(state_a, bend, pa.names),
    )
    out.summary = {f"{path}_{k}": v for path in PATHS for k, v in results[path].summary.items()}
    out.meta = meta
    out.seconds = time.perf_counter() - t0
    return out


def _path_point(
    path: str, ends: _Endpoints, bend: Mapping[str, torch.Tensor]
) -> Callable[[torch.Tensor], dict[str, torch.Tensor]]:
    """The function t (a (K,)-tensor) → the K stacked points of ``path``: the curve φ(t) for the
    trainable parameters on "curve", the line θ(t) otherwise (and for the buffers on both paths)."""
    ends_a = {**ends.a, **ends.buf_a}

    def point(t: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for n, va in ends_a.items():
            tt = t.view((-1,) + (1,) * va.ndim)
            vb = ends.b[n] if n in ends.b else ends.buf_b[n]
            if path == "curve" and n in bend:
                out[n] = bezier({n: va}, {n: vb}, {n: bend[n]}, tt)[n]
            else:
                out[n] = _line({n: va}, {n: vb}, tt)[n]
        return out

    return point


@dataclass
class _PathEvaluator:
    """Evaluates a path between the endpoints at every t of ``ts`` on every split, with the
    BatchNorm statistics recomputed at every t when ``recompute`` is given."""

    ends: _Endpoints
    ts: np.ndarray
    recompute: BatchNormRecomputer | None
    points_per_pass: int | None
    progress: Progress

    def __call__(self, path: str, bend: Mapping[str, torch.Tensor]) -> LandscapeResult:
        """The line or the curve as a `LandscapeResult` of kind "interpolation" with its summary."""
        point = _path_point(path, self.ends, bend)
        stacked = None if self.recompute is None else self._statistics(point)
        metrics, diags = evaluate_splits(
            self.ends.problems,
            _path_chunks(point, self.ts, self.ends.like, stacked),
            len(self.ts),
            self.points_per_pass,
            self.progress.advance,
        )
        self._check_finite(metrics, path)
        res = LandscapeResult(kind="interpolation", alpha=self.ts, beta=None, **metrics)
        res.meta = {"path": path, "evaluator": diags}
        res.summary = summarize(res)
        return res

    def _statistics(
        self, point: Callable[[torch.Tensor], dict[str, torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        """The BatchNorm statistics recomputed on the train set at each t, stacked along t."""
        pa = self.ends.train
        per_t = []
        for t in self.ts:
            at_t = point(torch.tensor([t], dtype=pa.dtype, device=pa.device))
            pt = {n: v[0] for n, v in at_t.items()}
            per_t.append(self.recompute({n: pt[n] for n in pa.names}, pa.batches, pt))
            self.progress.advance(1)
        return {n: torch.stack([s[n] for s in per_t]) for n in per_t[0]}

    def _check_finite(self, metrics: dict[str, np.ndarray], path: str) -> None:
        """`MeasurementError` when a split's loss is NaN anywhere along the path."""
        n_pts = len(self.ts)
        for split in self.ends.problems:
            bad = np.flatnonzero(np.isnan(metrics[f"{split}_loss"]))
            if len(bad):
                raise MeasurementError(
                    f"the {split} loss is NaN along the {path} at {len(bad)} of {n_pts} points "
                    f"(first at t = {self.ts[bad[0]]:.4g})"
                )


def _norm(tensors: Mapping[str, torch.Tensor], names: list[str]) -> float:
    """The Euclidean norm of the tensors ``names`` of ``tensors`` together, in float64."""
    return float(sum(tensors[n].double().pow(2).sum() for n in names) ** 0.5)


def _window_mean(values: np.ndarray, last: bool, width: int = 50) -> float | None:
    """The mean of the first (or last) ``width`` values; None when there are none."""
    if not len(values):
        return None
    if last:
        return float(values[-min(width, len(values)) :].mean())
    return float(values[: max(1, min(width, len(values)))].mean())


def _connect_meta(
    ends: _Endpoints,
    bend: Mapping[str, torch.Tensor],
    history: dict[str, np.ndarray],
    opts: _BendOptions,
    *,
    labels: tuple[str, str],
    steps: int,
    n_fit: int,
) -> dict[str, Any]:
    """How the curve was made and where the bend went: `ConnectResult.meta`."""
    pa, names = ends.train, ends.train.names
    mid = {n: (ends.a[n] + ends.b[n]) / 2 for n in names}
    return {
        "checkpoints": list(labels),
        "steps": steps,
        "bend_steps": opts.steps,
        "bend_optimizer": opts.optimizer,
        "bend_lr": opts.effective_lr,
        "bend_batch_size": min(opts.batch_size, n_fit),
        "n_fit": n_fit,
        "seed": int(opts.seed),
        "num_params": pa.num_params,
        "n_train": pa.n,
        "n_test": ends.problems["test"].n if "test" in ends.problems else None,
        "distance": _norm({n: ends.b[n] - ends.a[n] for n in names}, names),
        "bend_distance_from_midpoint": _norm({n: bend[n] - mid[n] for n in names}, names),
        "bn_recomputed": ends.bn_names,
        "fit_loss_first": _window_mean(history["loss"], last=False),
        "fit_loss_last": _window_mean(history["loss"], last=True),
    }


def _bend_state(
    state_a: Mapping[str, torch.Tensor], bend: Mapping[str, torch.Tensor], names: list[str]
) -> dict[str, torch.Tensor]:
    """θ_a's state dict on the CPU with the bend in place of the trainable parameters."""
    out = {k: v.detach().to("cpu").clone() for k, v in state_a.items()}
    for n in names:
        out[n] = bend[n].detach().to("cpu", out[n].dtype).clone()
    return out
