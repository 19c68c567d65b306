r"""Linear interpolation between two checkpoints (Goodfellow, Vinyals, Saxe, ICLR 2015).

.. math:: \theta(t) = (1 - t)\,\theta_a + t\,\theta_b

on a grid of ``steps`` values of t over ``span`` (default [−0.5, 1.5], as in
Goodfellow et al.'s figures; t outside [0, 1] extrapolates). The grid always
contains t = 0 and t = 1, computed as ``(1 − t)·θ_a + t·θ_b`` so that both
endpoints are bit-for-bit the checkpoints' own parameters.

Floating-point buffers (BatchNorm running mean and variance) are interpolated
the same way, so each endpoint is exactly its own network; extrapolated
running variances are clamped at 0. Integer buffers (``num_batches_tracked``)
come from θ_a.

Barrier height (the summary's ``train_loss_barrier``, see `result.summarize`):

.. math:: B = \max_{t \in [0, 1]} L(\theta(t)) - \max(L(\theta_a), L(\theta_b)) \;\ge 0,

over the grid points in [0, 1]. Frankle, Dziugaite, Roy, Carbin (ICML 2020,
"Linear mode connectivity and the lottery ticket hypothesis", Sec. 2) measure
the error barrier against the *mean* of the endpoints' errors; flatcli uses the
max so that two minima of different depth joined by a monotone path have
barrier 0, and reports the same definition for the error (``*_error_barrier``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..engine import Batch, Problem, eval_mode
from ..errors import ConfigError
from ..run.settings import Settings
from ..validation import Integral, check_fields, opt
from .evaluate import ViewOptions, evaluate_splits, problem_kwargs, split_problems
from .loss_grid import LandscapeResult, summarize
from .slices import axis_grid, parse_span

DEFAULT_SPAN = (-0.5, 1.5)


def interpolation_chunks(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], ts: np.ndarray
) -> Callable[[int, int], dict[str, torch.Tensor]]:
    """Points θ(t_k) = (1 − t_k)·a + t_k·b, stacked for points first..stop-1."""

    def chunk(first: int, stop: int) -> dict[str, torch.Tensor]:
        out = {}
        for n, pa in a.items():
            t = torch.as_tensor(ts[first:stop], dtype=pa.dtype, device=pa.device).view(
                (-1,) + (1,) * pa.ndim
            )
            v = (1 - t) * pa.unsqueeze(0) + t * b[n].unsqueeze(0)
            if n.endswith("running_var"):
                v = v.clamp_min(0)
            out[n] = v
        return out

    return chunk


def _check_same_architecture(pa: Problem, pb: Problem) -> None:
    if pa.names != pb.names or pa.shapes != pb.shapes:
        diff = [
            f"{n}: {tuple(pa.params[n].shape)} vs {tuple(pb.params[n].shape)}"
            for n in pa.names
            if n in pb.params and pa.params[n].shape != pb.params[n].shape
        ]
        missing = sorted(set(pa.names) ^ set(pb.names))
        raise ConfigError(
            "`to`: the two checkpoints have different architectures; "
            + "; ".join(
                diff[:4]
                + ([f"parameters in only one: {', '.join(missing[:4])}"] if missing else [])
            )
        )


@dataclass(frozen=True)
class InterpolateView(ViewOptions):
    """``view="interpolate"``: the line (1 − t)·θ_a + t·θ_b between two checkpoints, with its
    barrier (`interpolation_landscape`), validated at construction: ``steps`` points over
    ``span`` (t = 0 and 1 added when missing), ``span`` (a, b) or "a,b", default -0.5,1.5;
    ``points_per_pass`` and ``on_progress``: `ViewOptions`."""

    steps: int = opt(25, Integral(2), "points over span")
    span: str | Sequence[float] | None = None

    def __post_init__(self):
        check_fields(self)
        parse_span(self.span, DEFAULT_SPAN)


def interpolation_landscape(
    model_a: torch.nn.Module,
    model_b: torch.nn.Module,
    train,
    test=None,
    *,
    options: InterpolateView | None = None,
    settings: Settings | None = None,
    **fields,
) -> LandscapeResult:
    """Loss and accuracy along θ(t) = (1 − t)θ_a + tθ_b (neither model is modified).

    ``model_a`` provides the function (its module code) and θ_a; ``model_b``
    only its parameters and buffers, which must match ``model_a``'s in names
    and shapes. ``options``: the `InterpolateView` (``steps``, ``span``, ``points_per_pass``,
    ``on_progress``; default 25 points over (−0.5, 1.5)). ``settings`` (or its fields as
    keywords): loss, batch size, device, precision. Returns a `LandscapeResult` of kind
    "interpolation" whose ``alpha`` axis is t.
    """
    opts = options if options is not None else InterpolateView()
    steps, span = opts.steps, opts.span
    st = Settings.build(settings, **fields)
    lo, hi = parse_span(span, DEFAULT_SPAN)
    t0 = time.perf_counter()
    ts = axis_grid((lo, hi), steps, include=(0.0, 1.0))
    with eval_mode(model_a), eval_mode(model_b):
        kw = problem_kwargs(st)
        problems = split_problems(model_a, train, test, **kw)
        pa = problems["train"]
        pb = Problem(model_b, Batch.of(train).select(slice(0, 1)), **kw)
        _check_same_architecture(pa, pb)
        float_buffers = [n for n, v in pa.buffers.items() if v.is_floating_point()]
        if sorted(float_buffers) != sorted(
            n for n, v in pb.buffers.items() if v.is_floating_point()
        ):
            raise ConfigError(
                "`to`: the two checkpoints hold different buffers (BatchNorm statistics)"
            )
        end_a = {**pa.params, **{n: pa.buffers[n] for n in float_buffers}}
        end_b = {**pb.params, **{n: pb.buffers[n] for n in float_buffers}}
        progress = opts.progress(len(ts) * len(problems))
        metrics, diags = evaluate_splits(
            problems,
            interpolation_chunks(end_a, end_b, ts),
            len(ts),
            opts.points_per_pass,
            progress.advance,
        )
        dist = float(sum((end_b[n] - end_a[n]).double().pow(2).sum() for n in pa.names) ** 0.5)
    res = LandscapeResult(kind="interpolation", alpha=ts, beta=None, **metrics)
    res.meta = {
        "span": [lo, hi],
        "steps": int(steps),
        "num_params": pa.num_params,
        "n_train": pa.n,
        "n_test": problems["test"].n if "test" in problems else None,
        "distance": dist,
        "interpolated_buffers": float_buffers,
        "evaluator": diags,
    }
    res.summary = summarize(res)
    res.seconds = time.perf_counter() - t0
    return res
