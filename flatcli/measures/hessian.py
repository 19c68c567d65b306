r"""Hessian family: λmax, trace and spectrum of :math:`H = \nabla^2 L(\theta)` over the measurement set.

All three use exact Hessian-vector products over the whole measurement set
(`flatcli.engine.CurvatureEngine.hessian`), so no mini-batch bias enters
(:math:`\mathbb{E}[\lambda_{\max}(H_B)] \ge \lambda_{\max}(H)`), and report their
cost (``n_hvp``) and convergence in diagnostics.

`hessian_trace`'s per-layer traces (``per_layer``, default ``json``): for every parameter
tensor b, :math:`\mathrm{Tr}(H_{bb})` from the same products: each probe's
:math:`z^\top Hz` is split into its parts :math:`z_b^\top (Hz)_b`, unbiased for
the block traces and summing exactly to the probe's value, so the per-layer
estimates sum to the total (up to rounding) and each has its own standard
error (Hutch++: the sketch part split exactly, the residual samples split
likewise; `flatcli.engine.linalg.hutchpp`); ``exact``: the diagonal summed per
tensor. Diagnostics ``layers`` (name → trace) and ``layers_stderr``;
``columns`` adds the scalar diagnostics ``layer_<name>`` and
``layer_<name>_stderr`` (CSV columns ``<label>_layer_<name>``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..engine import linalg
from ..errors import ConfigError
from . import Measure, MeasureResult
from ._esd import ESD_FLOOR, esd_figure, plot_esd  # noqa: F401  (their home before)
from ._options import Integral, OneOf, Optional, Real, opt
from ._slq_shared import kept_abs_trace, no_slq_run, shared_slq
from ._trace_auto import auto_check, trace_auto_cost, trace_method
from ._warm import keep_ritz_vectors, warm_start

PADDING_NOTE = (  # the padding convention, in every Hessian measure's description
    " An nn.Embedding's padding_idx row is a frozen coordinate (curvature M·H·M), unless its "
    "weight is tied to a module that trains the row (an MLM/LM head): true Hessian there."
)
CONTROL_PROBES = 8  # fp32 control probes of a TF32 trace (each one TF32 and one fp32 HVP)

# ---------------------------------------------------------------------------- λmax


@dataclass(frozen=True)
class LambdaMaxOptions:
    """Options of ``hessian_lambda_max``."""

    tol: float = opt(
        1e-3, Real(0, 1, "neither"), "relative Ritz residual ‖Hv − λv‖ ≤ tol·|λ| to stop at"
    )
    max_steps: int = opt(100, Integral(1, None), "most Lanczos steps (each one HVP)")
    min_steps: int | None = opt(
        None,
        Optional(Integral(1, None)),
        "fewest Lanczos steps (null: certified by the Kuczyński-Woźniakowski bound, see "
        "flatcli.engine.linalg.certified_min_steps: 8 at P = 80, 12 at 84k, 14 at 11M)",
    )
    per_layer: str = opt(
        "none",
        OneOf("none", "json", "columns"),
        "block λmax of H restricted to each parameter tensor: none; json (diagnostics "
        "'layers'); columns (also one scalar diagnostic, i.e. CSV column, per tensor)",
    )


class HessianLambdaMax(Measure):
    r"""Largest algebraic eigenvalue :math:`\lambda_{\max}(H)`, larger means sharper.

    Lanczos with full reorthogonalization from a seeded random start, stopped when the
    Ritz residual :math:`\|Hv-\lambda v\|\le \mathrm{tol}\,|\lambda|` after at least
    ``min_steps`` Krylov steps (default: `flatcli.engine.linalg.certified_min_steps`, the
    steps after which a random start finds the *top* eigenvalue, not just some eigenvalue,
    with probability ≥ 99%; it replaces the earlier fixed floor of 20). Unlike power
    iteration, the *algebraic* maximum is found even when a negative eigenvalue has the
    largest magnitude. Diagnostics: ``residual`` (relative), ``steps``, ``converged``,
    ``min_ritz`` (smallest Ritz value, an upper bound of λmin; ``min_kept_ritz`` after thick
    restarts, the smallest Ritz value of the kept vectors, which says nothing about λmin).
    Unconverged (a cap, or ``max_steps``) the value is a Ritz value, at most λmax: a lower bound,
    and ``bound`` says ``lower bound`` (the table's status text too).

    Near zero: when λmax is 0 at the tolerance's resolution of the spectrum
    (:math:`|\lambda| < \mathrm{tol}\cdot\max|\theta|`, e.g. a Hessian whose top eigenvalue is 0
    under larger negative ones) the relative residual test cannot be met; Lanczos then stops at
    the absolute floor :math:`\mathrm{tol}^2 \max|\theta|` (`flatcli.engine.linalg.lanczos`) and the
    status is ``near_zero``. Caps (``max_seconds``, ``max_hvps``, ``runtime.budget``): the
    Ritz value so far, status ``budget``.

    Precision (``runtime.precision: auto`` on a GPU with tensor cores): the Lanczos products
    run in TF32, then the final Ritz vector gets one fp32 HVP; the reported value and residual
    are its fp32 Rayleigh quotient and residual (``tf32_value`` and ``tf32_residual`` keep the
    fast ones), and ``converged`` is judged in fp32. When that fp32 residual is above ``tol``
    (TF32 rounding puts a floor near 1e-3 under the residual: on ResNet-18 the TF32 vector's fp32
    residual was 1.3e-2), Lanczos continues in fp32 from the TF32 vector until the fp32 residual
    meets ``tol`` (``fp32_refine_steps`` fp32 HVPs; the TF32 run's steps keep the certified floor,
    the refinement starts next to the top eigenvector and needs no floor of its own).
    ``fp32_control_rel_diff`` is :math:`|\lambda_{\rm fast} - \lambda_{\rm fp32}|/|\lambda_{\rm fp32}|`,
    the fast value against the fp32 Rayleigh quotient of its own Ritz vector.

    ``runtime.precision: bf16`` is verified the same way (``bf16_value``, ``bf16_residual``): the
    Lanczos products run through the model in bfloat16 (vectors and recurrences in float32), the
    final Ritz vector's product runs with the weights upcast to float32, and the fp32 refinement, if
    any, too (it needs the float32 forward's memory). Measured bias of the bf16 value: the benchmark pages of the docs.

    ``per_layer`` (``json`` or ``columns``): for every parameter tensor b, the
    largest algebraic eigenvalue of the diagonal block :math:`H_{bb} = P_b H P_b`
    (:math:`P_b` the coordinate projection onto the tensor; products through the
    engine's Hessian operator with vectors zero outside the block), by the same Lanczos
    in the block's own dimension P_b (exact when P_b is small: the space is exhausted).
    Diagnostics ``layers`` (name → block λmax), ``layers_residual`` and
    ``layers_converged``; ``columns`` adds the scalar diagnostics
    ``layer_<name>`` (CSV columns ``<label>_layer_<name>``). By Cauchy
    interlacing every block λmax is at most λmax(H). Cost: one Lanczos per tensor.
    """

    name = "hessian_lambda_max"
    low_precision = (
        True  # bf16 products: λmax and traces verified in fp32, the spectrum as with TF32
    )
    stops_early = True  # its estimator checks the budget between blocks
    options = LambdaMaxOptions
    description = (
        "Largest algebraic eigenvalue of the loss Hessian (Lanczos, residual stopping); "
        "per-tensor block λmax with per_layer. Unconverged (a cap) it is a lower bound, and says so."
        + PADDING_NOTE
    )
    reference = "Keskar et al. 2017; Lanczos with full reorthogonalization (Golub & Van Loan §10.1)"
    stochastic = True

    def declare_cost(self, o: LambdaMaxOptions, d) -> linalg.Cost:
        """Lanczos under the measure's stop (its basis capped by ``runtime.max_basis_vectors``); with
        fp32 verification (precision auto with TF32 products, or bf16) the Ritz pair's check and the
        fp32 refinement it may need. ``per_layer`` json or columns adds one Lanczos per parameter
        tensor, which is not declared."""
        stop = linalg.KrylovStop(
            min_steps=o.min_steps, max_steps=o.max_steps, max_basis=d.max_basis
        )
        cost = linalg.lanczos_cost(d.P, stop)
        if d.verify:
            refine = linalg.KrylovStop(min_steps=1, max_steps=o.max_steps)
            cost = cost + linalg.verify_eigenpair_cost()
            cost = cost + linalg.lanczos_cost(d.P, refine).products().optional()
        return cost

    def compute(self, ctx, opts: LambdaMaxOptions) -> MeasureResult:
        eng, verify = ctx.engine, ctx.engine.precision.verify
        start, min_steps = warm_start(ctx, opts.min_steps)
        stop = linalg.KrylovStop(
            tol=opts.tol, min_steps=min_steps, max_steps=opts.max_steps, budget=ctx.budget
        )
        r = linalg.lanczos(
            eng.hessian(),
            k=1,
            v0=start,
            generator=ctx.generator(),
            return_vectors=verify or ctx.warm is not None,
            stop=stop,
            settings=eng.estimator_settings,
        )
        keep_ritz_vectors(ctx, r)
        lam = float(r.eigenvalues[0])
        rel = float(r.residuals[0] / max(abs(lam), 1e-30))
        converged = bool(r.converged)
        # after thick restarts the smallest Ritz value is that of the kept vectors: nothing like λmin
        low_ritz = "min_kept_ritz" if r.restarts else "min_ritz"
        diag = {
            "residual": rel,
            "steps": r.steps,
            "converged": converged,
            low_ritz: float(r.eigenvalues[-1]),
            "basis_vectors": r.basis_vectors,
            "restarts": r.restarts,
        }
        stopped, near_zero = r.stopped_by_budget, r.near_zero
        if verify:
            H32 = eng.hessian(precision="fp32")
            lam32, rel32 = linalg.verify_eigenpair(H32, r.ritz_vectors[0])
            low = eng.precision.low_name  # tf32 or bf16
            diag.update(
                {
                    f"{low}_value": lam,
                    f"{low}_residual": rel,
                    "verified": "fp32",
                    "fp32_refine_steps": 0,
                    "fp32_control_rel_diff": abs(lam - lam32) / max(abs(lam32), 1e-30),
                }
            )
            # the fast products' rounding keeps the residual above tol: finish in fp32 from its vector
            if rel32 > opts.tol:
                r32 = linalg.lanczos(
                    H32,
                    k=1,
                    v0=r.ritz_vectors[0],
                    generator=ctx.generator(1),
                    stop=linalg.KrylovStop(opts.tol, 1, opts.max_steps, ctx.budget),
                    settings=eng.estimator_settings,
                )
                lam32 = float(r32.eigenvalues[0])
                rel32 = float(r32.residuals[0] / max(abs(lam32), 1e-30))
                diag["fp32_refine_steps"] = r32.steps
                stopped, near_zero = stopped or r32.stopped_by_budget, r32.near_zero
            converged = rel32 <= opts.tol or (
                near_zero
                and rel32 * abs(lam32) <= opts.tol**2 * max(abs(lam32), abs(diag[low_ritz]))
            )
            diag.update(residual=rel32, converged=converged)
            lam = lam32
        if (
            not converged
        ):  # a Ritz value is at most λmax: unconverged, it is a bound, not an estimate
            diag["bound"] = "lower bound"
        if ctx.warm is not None:
            diag["warm_start"] = start is not None
        if opts.per_layer != "none":
            diag.update(_block_lambda_max(ctx, opts))
        return MeasureResult(
            value=lam, diagnostics=diag, status=_status(converged, near_zero, stopped)
        )


def _status(converged: bool, near_zero: bool, stopped: bool) -> str:
    """A measure's status from its estimator's flags: ``budget`` when its cap stopped it first,
    ``near_zero`` when a relative tolerance was met at its absolute floor (`flatcli.engine.linalg`)."""
    if stopped and not converged:
        return "budget"
    if not converged:
        return "not_converged"
    return "near_zero" if near_zero else "ok"


def block_matvec(op, dim: int, sl: slice):
    """``V (K, P_b) -> (H P_b V)`` restricted to the block: the product of :math:`P_b H P_b`
    in the block's own coordinates, one product of the operator ``op`` per vector."""

    def mv(V):
        full = torch.zeros(V.shape[0], dim, dtype=V.dtype, device=V.device)
        full[:, sl] = V
        return op(full)[:, sl]

    return mv


def _block_lambda_max(ctx, opts: LambdaMaxOptions) -> dict:
    eng, p = ctx.engine, ctx.problem
    H, basis = eng.hessian(), eng.estimator_settings.basis_rows
    lams, res, conv = {}, {}, {}
    for i, (name, sl) in enumerate(p.param_slices().items()):
        size = sl.stop - sl.start
        r = linalg.lanczos(
            linalg.as_operator(
                block_matvec(H, p.num_params, sl), size, device=p.device, dtype=p.dtype
            ),
            k=1,
            generator=ctx.generator(100 + i),
            stop=linalg.KrylovStop(
                opts.tol, opts.min_steps, opts.max_steps, ctx.budget, basis(size, p.num_params)
            ),
        )
        lam = float(r.eigenvalues[0])
        lams[name] = lam
        res[name] = float(r.residuals[0] / max(abs(lam), 1e-30))
        conv[name] = bool(r.converged)
    out = {"layers": lams, "layers_residual": res, "layers_converged": conv}
    if opts.per_layer == "columns":
        out.update({f"layer_{n}": v for n, v in lams.items()})
    return out


# ---------------------------------------------------------------------------- trace


@dataclass(frozen=True)
class TraceOptions:
    """Options of ``hessian_trace``."""

    method: str = opt(
        "auto",
        OneOf("auto", "hutchinson", "hutchpp", "exact"),
        "estimator (auto: exact when P ≤ 4·min_probes; up to 2·(max_probes + 40), min_probes "
        "check probes predict Hutchinson's probes to tol, then the cheaper of it and exact; "
        "above, hutchpp when its largest sketch takes at most 256 MiB and the count adapts, "
        "else hutchinson)",
    )
    tol: float = opt(0.01, Real(0, 1, "neither"), "stop when stderr ≤ tol·|estimate|")
    min_probes: int = opt(16, Integral(2, None), "fewest Rademacher probes (HVPs)")
    max_probes: int = opt(
        1000, Integral(2, None), "most probes (HVPs); min_probes = max_probes fixes the count"
    )
    per_layer: str = opt(
        "json",
        OneOf("none", "json", "columns"),
        "per-tensor traces from the same probes (free): none; json (diagnostics 'layers', "
        "'layers_stderr'); columns (also one scalar diagnostic, i.e. CSV column, per tensor)",
    )


class HessianTrace(Measure):
    r""":math:`\mathrm{Tr}(H)`, larger means sharper.

    ``hutchinson``: :math:`\frac1m\sum_i z_i^\top H z_i` with Rademacher probes
    in blocks, stopped once the standard error of the mean is at most ``tol``
    times the estimate (after ``min_probes``, at most ``max_probes``).

    ``hutchpp`` (Meyer et al. 2021, Alg. 1): an orthonormal sketch
    :math:`Q \approx \mathrm{range}(H)` whose part :math:`\mathrm{Tr}(Q^\top HQ)`
    is computed exactly; the rest, :math:`\mathrm{Tr}(PHP)` with
    :math:`P = I - QQ^\top`, is estimated by Hutchinson on projected probes and
    stopped like ``hutchinson``. The sketch starts at ``min_probes // 3``
    vectors and grows while the residual variance says it pays (see
    `flatcli.engine.linalg.hutchpp`); with ``min_probes = max_probes`` the split
    is Alg. 1's thirds. ``probes`` counts every HVP, ``sketch`` is the final
    sketch size; the reported stderr is that of the residual mean, which is the
    whole standard error because the estimate is unbiased whatever the sketch.
    Far fewer probes than Hutchinson when the top of the spectrum carries much
    of the trace, as at trained minima (see the benchmark pages of the docs).

    ``exact``: the sum of the diagonal from unit-vector HVPs (one per
    parameter, small models only). ``auto`` (the default) chooses by predicted products
    (`flatcli.measures._trace_auto`): ``exact`` when P ≤ 4·``min_probes`` (64 at the
    defaults); when P is above twice the most products of a stochastic trace (2,080 at the
    defaults), ``hutchpp`` if the count adapts and its largest sketch (a third of ``max_probes``
    float64 P-vectors) takes at most 256 MiB, else ``hutchinson``; in between ``min_probes`` check probes (seed offset 5, diagnostics ``check_probes`` and
    ``check_predicted_probes``) predict Hutchinson's probes to ``tol``, and Hutchinson runs (its
    probes capped at P − ``min_probes``) when they are at most half of what the exact trace costs
    beyond the check, else the exact trace: never more than P products plus the check (or the
    near-zero floor's 40).

    Near zero (``hutchinson``, ``hutchpp``): a trace near 0 at the spectrum's scale (an
    indefinite Hessian whose curvatures cancel) stops at the absolute floor
    ``stderr ≤ tol·Tr|H|``, status ``near_zero``, only when the intervals say so: the upper end of
    the interval of :math:`|\mathrm{Tr}\,H|` (``|value| + 2·stderr``) at most 5% of the lower end
    of that of :math:`\mathrm{Tr}|H|` (``abs_trace − 2·abs_trace_stderr``; Tr|H| by SLQ, 40 HVPs,
    or from the checkpoint's SLQ runs; `flatcli.engine.linalg.NearZeroFloor`; PSD: Tr|H| = Tr H,
    nothing changes).
    Otherwise the relative test stays: ``not_converged`` at ``max_probes``, with ``abs_trace``
    in the diagnostics when it was computed.
    Interval: ``stderr`` is the standard error of the mean times Student's t factor for the
    samples' count (diagnostics ``stderr_mean``, ``t_factor``, ``samples``), so ±2·stderr is
    about 95% with few probes; no tolerance test passes on fewer than 4 samples (Hutch++: 4
    residual samples). A fixed count (``min_probes = max_probes``) is judged like an adaptive
    one: ``ok`` only when its stderr is within ``tol`` (at least 4 samples), else
    ``not_converged`` with the value and interval of its probes.
    Caps (``max_seconds``, ``max_hvps``, ``runtime.budget``): the estimate and stderr of the
    probes done, status ``budget``; ``exact`` cannot stop early. ``hutchpp`` under a cap too short
    for its sketch and residual samples continues as Hutchinson from its sketch's probes
    (``method`` ``hutchinson`` in the diagnostics): a capped value always has a finite stderr.

    Per-layer traces (``per_layer``): from the same products (module docstring).

    Precision (``runtime.precision: auto`` on a GPU with tensor cores): the probes run with
    TF32 products; a paired control sample of 8 probes computed with both TF32 and fp32
    products (`flatcli.engine.linalg.precision_control`, 16 HVPs) estimates the bias TF32
    puts into each probe: ``fp32_control_rel_diff`` and ``fp32_control_diff`` in the
    diagnostics, and status ``precision_warning`` when that bias exceeds the estimate's
    standard error. ``exact`` always uses fp32 products. ``runtime.precision: bf16`` is checked by
    the same paired control (bfloat16 against float32 products through the model).
    """

    name = "hessian_trace"
    low_precision = (
        True  # bf16 products: λmax and traces verified in fp32, the spectrum as with TF32
    )
    options = TraceOptions
    description = (
        "Trace of the loss Hessian (exact or Hutchinson by predicted products, or Hutch++, "
        "with stopping at a Student-t stderr ≤ tol·|trace| on at least 4 samples); per-tensor traces "
        "in diagnostics." + PADDING_NOTE
    )
    reference = "Hutchinson 1989; Meyer et al. 2021 (Hutch++, Alg. 1); Yao et al. 2020 (PyHessian)"
    stochastic = True

    def stops_early(self, o):  # its estimator checks the budget between blocks
        return o.method != "exact"

    def declare_cost(self, o: TraceOptions, d) -> linalg.Cost:
        """The estimator `trace_method` chooses (``auto`` with its check: `trace_auto_cost`): probes in
        blocks of the engine's size with the near-zero floor's SLQ beside them, Hutch++ with its
        sketch, or the exact trace (P products); with fp32 verification the control probes. The
        per-tensor traces come from the same probes, at no extra product."""
        method = trace_method(o.method, d.P, o)
        if method == "exact":
            return linalg.exact_diagonal_cost(d.P)
        stop = linalg.ProbeStop(min_probes=o.min_probes, max_probes=o.max_probes)
        if method == "check":
            cost = trace_auto_cost(o, d)
        elif method == "hutchpp":
            cost = linalg.hutchpp_cost(d.P, stop, device=d.device, dtype=d.dtype)
        else:
            cost = linalg.hutchinson_cost(d.P, stop, device=d.device, dtype=d.dtype)
        if d.verify:
            cost = cost + linalg.precision_control_cost(CONTROL_PROBES)
        return cost

    def compute(self, ctx, opts: TraceOptions) -> MeasureResult:
        if opts.min_probes > opts.max_probes:
            raise ConfigError(
                f"The 'min_probes' parameter of hessian_trace ({opts.min_probes}) must not exceed "
                f"'max_probes' ({opts.max_probes})."
            )
        eng, p = ctx.engine, ctx.problem
        opts = dataclasses.replace(opts, method=trace_method(opts.method, p.num_params, opts))
        slices = p.param_slices()
        auto = {}
        if opts.method == "check":
            opts, auto = auto_check(ctx, opts)
        if opts.method == "exact":
            return _exact_trace(ctx, opts, auto)
        H = eng.hessian()
        est = linalg.hutchpp if opts.method == "hutchpp" else linalg.hutchinson
        r = est(
            H,
            stop=linalg.ProbeStop(
                opts.tol, opts.min_probes, opts.max_probes, ctx.budget, lambda: kept_abs_trace(ctx)
            ),
            generator=ctx.generator(),
            blocks=list(slices.values()) if opts.per_layer != "none" else None,
            settings=eng.estimator_settings,
        )
        # a fixed count (min_probes = max_probes) is judged like any other: ok only when its interval
        # passes the tolerance test (the estimator's ``converged``), else not_converged
        diag = {
            **auto,
            "probes": r.probes,
            "rel_stderr": r.stderr / abs(r.estimate) if r.estimate else math.inf,
            "converged": bool(r.converged),
            "method": r.method,  # hutchpp under a cap too short for its sketch: hutchinson
            "samples": len(r.samples),
            "stderr_mean": r.stderr_mean,
            "t_factor": linalg.t_factor(len(r.samples)),
        }
        if r.abs_trace is not None:
            diag["abs_trace"] = r.abs_trace  # the SLQ estimate of Tr|H| behind the near-zero floor
            diag["abs_trace_stderr"] = r.abs_trace_stderr
        if opts.method == "hutchpp":
            diag["sketch"] = r.sketch
            diag["low_rank_trace"] = r.low_rank
        if opts.per_layer != "none":
            means, ses = r.block_estimates()
            names = list(slices)
            diag.update(
                _layer_diagnostics(
                    {n: float(v) for n, v in zip(names, means, strict=True)},
                    {n: float(v) for n, v in zip(names, ses, strict=True)},
                    opts.per_layer,
                )
            )
        status = _status(r.converged, r.near_zero, r.stopped_by_budget)
        if eng.precision.verify:
            c = linalg.precision_control(
                H, eng.hessian(precision="fp32"), probes=CONTROL_PROBES, generator=ctx.generator(7)
            )
            diag.update(
                fp32_control_rel_diff=c.rel_diff,
                fp32_control_diff=c.diff,
                fp32_control_probes=c.probes,
            )
            if abs(c.diff) > r.stderr:
                status = "precision_warning"  # the TF32 bias exceeds the estimate's standard error
        return MeasureResult(value=r.estimate, stderr=r.stderr, diagnostics=diag, status=status)


def _exact_trace(ctx, opts: TraceOptions, auto: dict) -> MeasureResult:
    """The sum of the diagonal from P unit-vector products in fp32 (stderr 0)."""
    p, eng = ctx.problem, ctx.engine
    d = linalg.exact_diagonal(eng.hessian(precision="fp32"), settings=eng.estimator_settings)
    diag = {**auto, "probes": p.num_params, "method": "exact"}
    if opts.per_layer != "none":
        tr = {n: float(d[sl].sum()) for n, sl in p.param_slices().items()}
        diag.update(_layer_diagnostics(tr, {n: 0.0 for n in tr}, opts.per_layer))
    return MeasureResult(value=float(d.sum()), stderr=0.0, diagnostics=diag)


def _layer_diagnostics(traces: dict, stderrs: dict, mode: str) -> dict:
    out = {"layers": traces, "layers_stderr": stderrs}
    if mode == "columns":
        for n in traces:
            out[f"layer_{n}"] = traces[n]
            out[f"layer_{n}_stderr"] = stderrs[n]
    return out


# ---------------------------------------------------------------------------- spectrum

SPECTRUM_TOL = 1e-3
LANCZOS_TIME_SHARE = 0.5  # of a time cap, what the SLQ runs leave the top-k Lanczos
DENSITY_POINTS = 128


@dataclass(frozen=True)
class SpectrumOptions:
    """Options of ``hessian_spectrum``."""

    top_k: int = opt(
        5, Integral(1, None), "how many largest eigenvalues (block Lanczos, block size top_k)"
    )
    slq_runs: int = opt(
        4, Integral(1, None), "stochastic Lanczos quadrature runs (Rademacher starts)"
    )
    slq_steps: int = opt(25, Integral(2, None), "Lanczos steps per SLQ run")
    z: float = opt(
        1.0,
        Real(0, None, "neither"),
        "shift z of the effective dimension N_eff(z) = Σ λ₊/(λ₊ + z), λ₊ = max(λ, 0)",
    )
    tol: float = opt(
        0.1,
        Real(0, 1, "neither"),
        "status ok when N_eff's stderr (runs and quadrature) ≤ tol·N_eff, else not_converged",
    )


def effective_dimension(eigenvalues: np.ndarray, z: float) -> np.ndarray:
    r""":math:`f(\lambda) = \lambda_+/(\lambda_+ + z)` with :math:`\lambda_+ = \max(\lambda, 0)`, elementwise;
    :math:`N_{\mathrm{eff}}(z) = \sum_i f(\lambda_i)`."""
    lp = np.maximum(np.asarray(eigenvalues, dtype=np.float64), 0.0)
    return lp / (lp + z)


def _spectrum_stop(k: int, budget=None) -> linalg.KrylovStop:
    """The top-k block Lanczos's stop: `SPECTRUM_TOL`, at most max(50, 10·k) steps."""
    return linalg.KrylovStop(tol=SPECTRUM_TOL, max_steps=max(50, 10 * k), budget=budget)


class HessianSpectrum(Measure):
    r"""Spectrum of :math:`H`; value :math:`N_{\mathrm{eff}}(z) = \sum_i \frac{\lambda_{i+}}{\lambda_{i+} + z}`
    with :math:`\lambda_+ = \max(\lambda, 0)` (the clipping is part of the definition),
    larger means sharper (more directions with curvature above :math:`z`).

    * Effective dimension (Maddox, Benton & Wilson 2020, eq. 2) estimated by
      stochastic Lanczos quadrature (``slq_runs`` Rademacher starts,
      ``slq_steps`` steps each, all runs batched; the defaults, 4 × 25 + the top-k
      Lanczos, stay within about 150 HVPs, sized for a ResNet-18 on thousands of samples): :math:`N_{\mathrm{eff}}(z) =
      \mathrm{Tr}\, f(H)` with :math:`f(\lambda) = \lambda_+/(\lambda_+ + z)`.
      Negative eigenvalues (saddle directions, small at a minimum) count 0:
      :math:`\lambda/(\lambda+z)` has a pole at :math:`-z`. ``stderr`` combines the
      standard error over runs (diagnostic ``stderr_runs``, times Student's t factor for
      few runs) with an estimate of the Lanczos quadrature error, which is the same in
      every run and which the spread over runs does not show (``quadrature_error``;
      `flatcli.engine.linalg.SLQResult.stderr`).
    * ``z`` (default 1.0) is a fixed curvature threshold in loss units, the
      prior precision of Maddox et al.'s Bayesian reading: a direction counts as
      determined by the data when its curvature exceeds ``z``. A fixed ``z``
      keeps the measure oriented (scaling all curvatures up raises
      :math:`N_{\mathrm{eff}}`); a shift relative to :math:`\lambda_{\max}` would
      make it blind to overall sharpness. Compare values only at equal ``z``
      and loss.
    * Top-k eigenvalues by block Lanczos (block size ``top_k``, full
      reorthogonalization, at least `flatcli.engine.linalg.certified_min_steps` Krylov
      vectors, stopped when every one of the k Ritz residuals is at most 1e-3 relative, at
      most ``max(50, 10·top_k)`` HVPs); ``condition_number`` is
      :math:`\lambda_1/\lambda_k` (None when :math:`\lambda_k \le 0`).
    * The SLQ runs are shared with ``local_entropy`` in one checkpoint's run (same seed and
      ``slq_steps``): whichever measure runs second takes the runs the first one did and
      computes only the ones it needs beyond them (`flatcli.measures._slq_shared`); values are
      those it computes alone.
    * Status: ``ok`` when at least `flatcli.engine.linalg.MIN_SAMPLES` runs give a ``stderr`` of
      at most ``tol`` (default 0.1) × N_eff, else ``not_converged`` (raise ``slq_runs`` when
      ``stderr_runs`` dominates, ``slq_steps`` when ``quadrature_error`` does).
    * Caps (``max_seconds``, ``max_hvps``, ``runtime.budget``): the SLQ runs go first with their
      own share (half of a time cap; of a product cap all but the top-k Lanczos' certified steps),
      the top-k Lanczos takes the rest; the SLQ runs stop early: status ``budget``, ``slq_runs`` the runs done. A run cut before 3 Gauss
      nodes counts for nothing; with no run left the value is NaN and ``reason`` says "no SLQ
      run completed within its share".
    * The spectral density on a grid of 128 points spanning the Ritz values
      (Gaussian kernel of width two grid steps), as lists ``density_grid`` and
      ``density``; the SLQ nodes and weights too (``slq_nodes``,
      ``slq_weights``), for `plot_esd`.
    """

    name = "hessian_spectrum"
    low_precision = (
        True  # bf16 products: λmax and traces verified in fp32, the spectrum as with TF32
    )
    stops_early = True  # its estimator checks the budget between blocks
    options = SpectrumOptions
    description = (
        "Effective dimension N_eff(z) = Σ λ₊/(λ₊ + z) of the loss Hessian, λ₊ = max(λ, 0) "
        "(negative curvature counts 0), by SLQ with status ok at stderr ≤ tol·N_eff; top-k "
        "eigenvalues, condition number and spectral density in diagnostics." + PADDING_NOTE
    )
    reference = "Maddox, Benton & Wilson 2020 (N_eff, eq. 2); Ghorbani et al. 2019 and Ubaru et al. 2017 (SLQ)"
    stochastic = True

    def declare_cost(self, o: SpectrumOptions, d) -> linalg.Cost:
        """The SLQ runs in lockstep and the top-k block Lanczos beside them (its working vectors
        bounded by the runs' bases)."""
        stop = _spectrum_stop(o.top_k)  # the same products as with top_k cut to P, which caps them
        lanczos = linalg.lanczos_cost(d.P, stop, k=o.top_k, block=o.top_k, work=False)
        return lanczos + linalg.slq_cost(d.P, o.slq_runs, o.slq_steps)

    def artifacts(self, result: MeasureResult, stem: Path, title: str) -> list[Path]:
        if "density" not in (result.diagnostics or {}):
            return []
        return [plot_esd(result, stem.with_suffix(".png"), title=title)]

    def compute(self, ctx, opts: SpectrumOptions) -> MeasureResult:
        eng, P = ctx.engine, ctx.problem.num_params
        k = min(opts.top_k, P)
        s = _slq_share(ctx, opts)
        r = linalg.lanczos(
            eng.hessian(),
            k=k,
            block=k,
            generator=ctx.generator(),
            stop=_spectrum_stop(k, ctx.budget),
            settings=eng.estimator_settings,
        )
        top = [float(v) for v in r.eigenvalues[:k]]
        top_res = [
            float(res / max(abs(v), 1e-30)) for res, v in zip(r.residuals[:k], top, strict=True)
        ]
        lam_k = top[-1]
        diag = {
            "z": opts.z,
            "tol": opts.tol,
            "lambda_max": top[0],
            "top_eigenvalues": top,
            "top_residuals": top_res,
            "top_converged": bool(r.converged),
            "lanczos_steps": r.steps,
            "condition_number": top[0] / lam_k if lam_k > 0 else None,
        }
        if len(s.nodes) < 2:  # the cap left no run (of ≥ MIN_NODES Gauss nodes) or one: no stderr
            out = no_slq_run(s, lambda t: effective_dimension(t, opts.z))
            return MeasureResult(
                value=math.nan, diagnostics={**diag, **out.diagnostics}, status=out.status
            )
        neff, se, se_runs, quad = s.stderr(lambda t: effective_dimension(t, opts.z))
        n = len(s.nodes)
        converged = n >= linalg.MIN_SAMPLES and se <= opts.tol * abs(neff)
        stopped = s.stopped_by_budget or (r.stopped_by_budget and not r.converged)
        nodes = np.concatenate(s.nodes)
        lo = min(float(nodes.min()), top[-1])
        hi = max(float(nodes.max()), top[0])
        width = max(hi - lo, 1e-12 * max(abs(hi), 1.0))
        grid = np.linspace(lo - 0.05 * width, hi + 0.05 * width, DENSITY_POINTS)
        sigma = 2 * (grid[1] - grid[0])
        diag.update(
            {
                "slq_runs": n,
                "rel_stderr": se / abs(neff) if neff and n > 1 else math.nan,
                "converged": bool(converged),
                "stderr_runs": se_runs,
                "t_factor": linalg.t_factor(n),
                "quadrature_error": quad,
                "slq_steps": int(max(len(t) for t in s.nodes)),
                "density_grid": grid.tolist(),
                "density": s.density(grid, sigma).tolist(),
                "density_sigma": float(sigma),
                "slq_nodes": [t.tolist() for t in s.nodes],
                "slq_weights": [w.tolist() for w in s.weights],
            }
        )
        return MeasureResult(
            value=neff,
            stderr=se if n > 1 else None,
            status="budget" if stopped else "ok" if converged else "not_converged",
            diagnostics=diag,
        )


def _slq_share(ctx, opts: SpectrumOptions) -> linalg.SLQResult:
    """The SLQ runs of `hessian_spectrum`, run before the top-k Lanczos under their own share of
    the caps: of a time cap ``1 − LANCZOS_TIME_SHARE`` of the seconds left, of a product cap what
    leaves the Lanczos its certified steps (at most half of the products left)."""
    P, budget = ctx.problem.num_params, ctx.budget
    share = budget
    if budget.capped:
        secs = budget.max_seconds
        if secs is not None:
            secs = budget.elapsed() + (1 - LANCZOS_TIME_SHARE) * (secs - budget.elapsed())
        left = budget.left()
        prods = budget.max_products
        if left is not None:
            k = min(opts.top_k, P)
            least = linalg.krylov_steps(P, _spectrum_stop(k), block=k)[0]
            prods = budget.max_products - min(least, left // 2)
        share = dataclasses.replace(budget, max_seconds=secs, max_products=prods)
    s = shared_slq(ctx, opts.slq_steps).runs(opts.slq_runs, share)  # shared with local_entropy
    if share is not budget:
        budget.spend(share.spent - budget.spent)
    return s
