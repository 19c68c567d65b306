r"""Measures for curvature during training: the gradient norm, the top-k Hessian eigenvalues and the
preconditioned sharpness of adaptive optimizers (`flatcli.tracking.Tracker` records them every few
steps; each is also an ordinary measure of a checkpoint).

The Krylov measures here and ``hessian_lambda_max`` start warm inside a tracker
(`flatcli.measures._warm`): from the previous evaluation's Ritz vectors, with the same residual test.

What the tracker and its plot need to know about a measure lives here too, so that nothing outside
``flatcli/measures/`` names a measure: `TRACKED_BY_DEFAULT` (the tracker's default measures) and
`gd_threshold` (the measures whose stability line is 2/η under gradient descent).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine import NotApplicable, linalg
from . import Cost, Measure, MeasureResult
from ._options import Integral, Optional, Real, Str, opt
from ._preconditioner import finite_positive, load_state, preconditioner
from ._warm import keep_ritz_vectors, warm_start
from .hessian import PADDING_NOTE, _status

TRACKED_BY_DEFAULT = ("hessian_lambda_max", "gradient_norm")
# whose value is compared with the gradient-descent stability threshold 2/η (Cohen et al. 2021)
GD_THRESHOLD = frozenset({"hessian_lambda_max", "hessian_top_eigenvalues"})


def gd_threshold(name: str) -> bool:
    """Whether the measure ``name`` is a sharpness that gradient descent at step size η keeps
    below 2/η (the plot draws that line)."""
    return name in GD_THRESHOLD


# ---------------------------------------------------------------------------- gradient norm


class GradientNorm(Measure):
    r""":math:`\|\nabla L(\theta)\|_2` over the whole measurement set, exact; ``loss`` in
    diagnostics (the same pass). Larger means farther from a stationary point."""

    name = "gradient_norm"
    description = (
        "Euclidean norm ‖∇L(θ)‖ of the loss gradient over the measurement set (exact; "
        "not a flatness measure: how far θ is from a stationary point, tracked during training)"
    )
    reference = "the loss gradient over the measurement set (one full-set gradient pass)"

    def declare_cost(self, o, d) -> Cost:
        """One gradient pass over the measurement set."""
        return Cost(grad=1)

    def compute(self, ctx, opts) -> MeasureResult:
        loss, g = ctx.engine.loss_grad()
        return MeasureResult(value=float(g.double().norm()), diagnostics={"loss": float(loss)})


# ---------------------------------------------------------------------------- top-k eigenvalues


@dataclass(frozen=True)
class TopEigenvaluesOptions:
    """Options of ``hessian_top_eigenvalues``."""

    top_k: int = opt(3, Integral(1, None), "how many largest eigenvalues (block size top_k)")
    tol: float = opt(
        1e-3, Real(0, 1, "neither"), "relative Ritz residual of each of the top_k pairs to stop at"
    )
    max_steps: int = opt(100, Integral(1, None), "most Hessian-vector products")
    min_steps: int | None = opt(
        None,
        Optional(Integral(1, None)),
        "fewest products (null: certified_min_steps(P) from a random start, 3 from a warm one)",
    )


def _top_stop(o: TopEigenvaluesOptions, min_steps, budget=None) -> linalg.KrylovStop:
    """The block Lanczos's stop: at most ``max_steps`` products, and its first block."""
    return linalg.KrylovStop(o.tol, min_steps, max(o.max_steps, o.top_k), budget)


class HessianTopEigenvalues(Measure):
    r"""The ``top_k`` largest algebraic eigenvalues :math:`\lambda_1 \ge \dots \ge \lambda_k` of H
    (value :math:`\lambda_1`, larger means sharper), by block Lanczos (block size ``top_k``, so
    that an eigenvalue of multiplicity up to ``top_k`` is found) stopped when every one of the
    ``top_k`` relative Ritz residuals is at most ``tol``. Diagnostics: ``eigenvalues``,
    ``residuals`` (JSON), ``lambda_1`` ... ``lambda_k`` (columns), ``steps``, ``converged``;
    ``warm_start`` inside a tracker. With TF32 products each Ritz pair gets one fp32 product and
    the values and residuals reported are its fp32 Rayleigh quotient and residual."""

    name = "hessian_top_eigenvalues"
    stops_early = True
    options = TopEigenvaluesOptions
    description = (
        "Largest algebraic eigenvalue of the loss Hessian with the next top_k − 1 "
        "(block Lanczos, every one of the top_k Ritz residuals stopped at tol; lambda_1..lambda_k "
        "columns); warm-started inside a tracker." + PADDING_NOTE
    )
    reference = "block Lanczos with full reorthogonalization (Golub & Van Loan §10.3.6)"
    stochastic = True

    def declare_cost(self, o: TopEigenvaluesOptions, d) -> Cost:
        """Block Lanczos in blocks of ``top_k`` (warm inside a tracker: from its first block); with
        fp32 verification one product per Ritz pair."""
        cost = linalg.lanczos_cost(
            d.P, _top_stop(o, o.min_steps), k=o.top_k, block=o.top_k, warm=True
        )
        if d.verify:
            cost = cost + linalg.verify_eigenpair_cost(min(d.P, o.top_k)).optional()
        return cost

    def compute(self, ctx, opts: TopEigenvaluesOptions) -> MeasureResult:
        eng, P = ctx.engine, ctx.problem.num_params
        k = min(opts.top_k, P)
        start, min_steps = warm_start(ctx, opts.min_steps)
        r = linalg.lanczos(
            eng.hessian(),
            k=k,
            block=k,
            v0=start,
            generator=ctx.generator(),
            return_vectors=True,
            stop=_top_stop(opts, min_steps, ctx.budget),
            settings=eng.estimator_settings,
        )
        keep_ritz_vectors(ctx, r)
        vals = [float(v) for v in r.eigenvalues[:k]]
        res = [float(e / max(abs(v), 1e-30)) for e, v in zip(r.residuals[:k], vals, strict=True)]
        converged = bool(r.converged)
        if eng.precision.verify:
            H32 = eng.hessian(precision="fp32")
            pairs = [linalg.verify_eigenpair(H32, x) for x in r.ritz_vectors]
            vals, res = [p[0] for p in pairs], [p[1] for p in pairs]
            converged = all(e <= opts.tol for e in res)
        diag = {
            "eigenvalues": vals,
            "residuals": res,
            "steps": r.steps,
            "converged": converged,
            **{f"lambda_{i + 1}": v for i, v in enumerate(vals)},
        }
        if ctx.warm is not None:
            diag["warm_start"] = start is not None
        status = _status(converged, r.near_zero, r.stopped_by_budget)
        return MeasureResult(value=vals[0], diagnostics=diag, status=status)


# ---------------------------------------------------------------------------- preconditioned


@dataclass(frozen=True)
class PreconditionedOptions:
    """Options of ``preconditioned_lambda_max``."""

    tol: float = opt(
        1e-3, Real(0, 1, "neither"), "relative Ritz residual ‖Av − λv‖ ≤ tol·|λ| to stop at"
    )
    max_steps: int = opt(100, Integral(1, None), "most Lanczos steps (each one HVP)")
    min_steps: int | None = opt(
        None,
        Optional(Integral(1, None)),
        "fewest Lanczos steps (null: certified_min_steps(P) from a random start, 3 from a warm one)",
    )
    optimizer_state: str | None = opt(
        None,
        Optional(Str()),
        "a saved optimizer state dict (torch.save(optimizer.state_dict()), or a checkpoint holding "
        "one); null: the tracker's optimizer",
    )


def _needs_state(opts: PreconditionedOptions, problem) -> str | None:
    if opts.optimizer_state is None:
        return (
            "needs an adaptive optimizer's state: the optimizer of a tracked training run, or "
            "optimizer_state (a saved optimizer state dict)"
        )
    return None


def _preconditioned_stop(o: PreconditionedOptions, min_steps, budget=None) -> linalg.KrylovStop:
    return linalg.KrylovStop(o.tol, min_steps, o.max_steps, budget)


class PreconditionedLambdaMax(Measure):
    r"""Largest eigenvalue of :math:`A = P^{-1/2} H P^{-1/2}` (that of :math:`P^{-1}H`), larger
    means sharper relative to the optimizer's steps; P the diagonal
    :math:`\mathrm{diag}(\sqrt{\hat v} + \epsilon)` of `flatcli.measures._preconditioner` (the
    learning-rate-free form; the step is :math:`\eta P^{-1}\hat m`). Lanczos with the residual test
    on :math:`\|Ax - \theta x\| \le \mathrm{tol}\,|\theta|`, products :math:`D\,H\,(D\,V)`,
    :math:`D = P^{-1/2}`, through the engine's Hessian (fp32 products when the engine verifies).
    Diagnostics: ``optimizer`` (adam or rmsprop), ``beta1``, ``lr`` and ``threshold``
    (:math:`(2+2\beta_1)/((1-\beta_1)\eta)` for Adam, :math:`(2+2\mu)/\eta` for RMSprop: where the
    preconditioned sharpness settles at the edge of stability), ``residual``, ``steps``,
    ``converged``. Without an optimizer state: ``not_applicable``."""

    name = "preconditioned_lambda_max"
    stops_early = True
    options = PreconditionedOptions
    description = (
        "Preconditioned sharpness λmax(P^-1/2 H P^-1/2) of an adaptive optimizer, "
        "P = diag(√v̂ + ε) from its second moment (Adam, AdamW with bias correction; RMSprop); "
        "threshold (2 + 2β₁)/((1 − β₁)η) in diagnostics"
    )
    reference = (
        "Cohen et al. 2022, Adaptive gradient methods at the edge of stability (§2); "
        "Kingma & Ba 2015 (Alg. 1)"
    )
    stochastic = True

    applicable = staticmethod(_needs_state)

    def declare_cost(self, o: PreconditionedOptions, d) -> Cost:
        """Lanczos on the preconditioned operator, with the preconditioner's vector beside it; none
        without an optimizer state (not_applicable)."""
        lanczos = linalg.lanczos_cost(d.P, _preconditioned_stop(o, o.min_steps))
        return (lanczos + Cost(vectors=1)).optional()

    def compute(self, ctx, opts: PreconditionedOptions) -> MeasureResult:
        source = ctx.optimizer
        if source is None:
            if opts.optimizer_state is None:
                raise NotApplicable(_needs_state(opts, ctx.problem))
            source = load_state(opts.optimizer_state)
        pre = preconditioner(source, ctx.problem)
        if not finite_positive(pre.diagonal):
            raise NotApplicable(
                "P has zero or non-finite entries (ε = 0 and a coordinate never moved)"
            )
        eng = ctx.engine
        H = eng.hessian(precision="fp32") if eng.precision.verify else eng.hessian()
        d = pre.diagonal.rsqrt()
        op = linalg.as_operator(
            lambda V: H.matmat_rows(V * d) * d,
            ctx.problem.num_params,
            device=ctx.problem.device,
            dtype=ctx.problem.dtype,
        )
        start, min_steps = warm_start(ctx, opts.min_steps)
        r = linalg.lanczos(
            op,
            k=1,
            v0=start,
            generator=ctx.generator(),
            return_vectors=ctx.warm is not None,
            stop=_preconditioned_stop(opts, min_steps, ctx.budget),
        )
        keep_ritz_vectors(ctx, r)
        lam = float(r.eigenvalues[0])
        diag = {
            "optimizer": pre.kind,
            "beta1": pre.beta1,
            "lr": pre.lr,
            "threshold": pre.threshold,
            "residual": float(r.residuals[0] / max(abs(lam), 1e-30)),
            "steps": r.steps,
            "converged": bool(r.converged),
            "preconditioner_min": float(pre.diagonal.min()),
            "preconditioner_max": float(pre.diagonal.max()),
        }
        if ctx.warm is not None:
            diag["warm_start"] = start is not None
        status = _status(bool(r.converged), r.near_zero, r.stopped_by_budget)
        return MeasureResult(value=lam, diagnostics=diag, status=status)
