r"""Hessian family: λmax and trace of :math:`H = \nabla^2 L(\theta)` over the measurement set."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..engine import linalg
from . import MeasureResult, register
from ._options import Integral, OneOf, Real, opt


@dataclass(frozen=True)
class LambdaMaxOptions:
    tol: float = opt(1e-3, Real(0, 1, "neither"), "relative Ritz residual ‖Hv − λv‖ ≤ tol·|λ| to stop at")
    max_steps: int = opt(100, Integral(1, None), "most Lanczos steps (each one HVP)")


@register(
    "hessian_lambda_max",
    options=LambdaMaxOptions,
    description="Largest algebraic eigenvalue of the loss Hessian (Lanczos, residual stopping).",
    reference="Keskar et al. 2017; Lanczos with full reorthogonalization (Golub & Van Loan §10.1)",
    stochastic=True,
    cost="one HVP per Lanczos step (≥ 20 steps)",
)
def hessian_lambda_max(ctx, opts: LambdaMaxOptions) -> MeasureResult:
    r"""Largest algebraic eigenvalue :math:`\lambda_{\max}(H)`, larger means sharper.

    Lanczos with full reorthogonalization from a seeded random start; at least 20
    Krylov steps (or the dimension), stopped when the Ritz residual
    :math:`\|Hv-\lambda v\|\le \mathrm{tol}\,|\lambda|`. Unlike power iteration,
    the *algebraic* maximum is found even when a negative eigenvalue has the
    largest magnitude. Diagnostics: ``residual`` (relative), ``steps``,
    ``converged``, ``min_ritz`` (smallest Ritz value).
    """
    eng = ctx.engine
    p = ctx.problem
    r = linalg.lanczos(
        eng.hvp,
        p.num_params,
        max_steps=opts.max_steps,
        min_steps=20,
        tol=opts.tol,
        k=1,
        generator=ctx.generator(),
        device=p.device,
        dtype=p.dtype,
    )
    lam = float(r.eigenvalues[0])
    rel = float(r.residuals[0] / max(abs(lam), 1e-30))
    return MeasureResult(
        value=lam,
        diagnostics={
            "residual": rel,
            "steps": r.steps,
            "converged": bool(r.converged),
            "min_ritz": float(r.eigenvalues[-1]),
        },
        status="ok" if r.converged else "not_converged",
    )


@dataclass(frozen=True)
class TraceOptions:
    method: str = opt("hutchinson", OneOf("hutchinson", "exact"), "estimator")
    tol: float = opt(0.01, Real(0, 1, "neither"), "stop when stderr ≤ tol·|estimate|")
    min_probes: int = opt(16, Integral(2, None), "fewest Rademacher probes")
    max_probes: int = opt(1000, Integral(2, None), "most probes (min_probes = max_probes fixes the count)")


@register(
    "hessian_trace",
    options=TraceOptions,
    description="Trace of the loss Hessian (Hutchinson with stderr stopping, or exact).",
    reference="Hutchinson 1989; Yao et al. 2020 (PyHessian)",
    stochastic=True,
    cost="one HVP per probe (exact: one per parameter)",
)
def hessian_trace(ctx, opts: TraceOptions) -> MeasureResult:
    r""":math:`\mathrm{Tr}(H)`, larger means sharper.

    ``hutchinson``: Rademacher probes in blocks, stopped once the standard error
    is at most ``tol`` times the estimate (after ``min_probes``, at most
    ``max_probes``). ``exact``: the sum of the diagonal from unit-vector HVPs
    (one per parameter, small models only).
    """
    if opts.min_probes > opts.max_probes:
        from ..errors import ConfigError

        raise ConfigError(
            f"The 'min_probes' parameter of hessian_trace ({opts.min_probes}) must not exceed "
            f"'max_probes' ({opts.max_probes})."
        )
    eng = ctx.engine
    p = ctx.problem
    if opts.method == "exact":
        d = linalg.exact_diagonal(eng.hvp, p.num_params, block=eng.block_size, device=p.device, dtype=p.dtype)
        return MeasureResult(value=float(d.sum()), stderr=0.0, diagnostics={"probes": p.num_params})
    r = linalg.hutchinson(
        eng.hvp,
        p.num_params,
        tol=opts.tol,
        min_probes=opts.min_probes,
        max_probes=opts.max_probes,
        block=eng.block_size,
        generator=ctx.generator(),
        device=p.device,
        dtype=p.dtype,
    )
    fixed = opts.min_probes == opts.max_probes
    return MeasureResult(
        value=r.estimate,
        stderr=r.stderr,
        diagnostics={
            "probes": r.probes,
            "rel_stderr": r.stderr / abs(r.estimate) if r.estimate else math.inf,
            "converged": bool(r.converged or fixed),
        },
        status="ok" if (r.converged or fixed) else "not_converged",
    )
