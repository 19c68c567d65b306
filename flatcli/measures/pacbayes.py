r"""PAC-Bayes flatness: the largest isotropic Gaussian noise the network tolerates.

Jiang et al. 2020 ("Fantastic generalization measures", §C.4 and Alg. 1);
Dziugaite & Roy 2017. With u ~ N(0, σ²I) on every trainable parameter,

.. math:: \sigma^* = \max\{\sigma \in [0, \sigma_{\max}] :
   \mathbb{E}_u\, e(\theta + u) - e(\theta) \le \text{target}\}

where e is the 0-1 error over the measurement set S (``criterion: error``) or the
loss L (``criterion: loss``). The reported value is :math:`1/\sigma^{*2}` (larger
means sharper). σ is the standard deviation of the noise (a widely copied
reference implementation passes σ² where the standard deviation belongs: not
here).

Estimation. The expectation uses ``samples`` Monte-Carlo draws u_k = s ∘ ξ_k,
ξ_k ~ N(0, I) drawn from fixed seeds, the same ξ_k at every σ (common random
numbers: the estimated deviation is then monotone in σ for a quadratic loss, and
the bisection compares like with like). Bisection on [0, σ_max] for ``depth``
steps; a midpoint σ is accepted at once when its deviation d satisfies
target − 0.01 < d ≤ target (Jiang et al.'s tolerance ε_σ = 1e-2 on the
deviation); otherwise σ* is the largest σ found to meet the target.

``magnitude_aware: true``: u_i ~ N(0, σ²θ_i² + ε²) with ε = 1e-3 (Jiang et al.
§C.4, "magnitude-aware perturbation").

Saturation is reported, never hidden: if the deviation at σ_max is still at most
the target (typically a train accuracy near 100% on an insensitive model, or an
error already near chance), σ* ≥ σ_max: status ``saturated``, diagnostic
``saturated = "sigma_max"`` and value 1/σ_max² (an upper bound of the true
value). If even the smallest σ tried exceeds the target, status ``saturated``,
``saturated = "below"`` and value 1/σ_hi² with σ_hi = σ_max/2^depth (a lower
bound).

BatchNorm. With ``fold_batchnorm: true`` (default) every BatchNorm that follows a
Linear/Conv layer is folded into it first (`flatcli.measures._bn`), as the
reference implementation of Jiang et al. does before its σ search, and the noise
is put on the folded parameters (W' = diag(γ/√(σ²+ε)) W, b'; no γ, β): the value
then does not depend on how a scale is split between a layer and its BatchNorm
(a function-preserving rescaling of a Conv-BN pair leaves it unchanged).
``fold_batchnorm: false`` perturbs the raw parameters, BatchNorm's γ and β
included. Diagnostics ``folded_batchnorm`` / ``unfolded_batchnorm``.

Bound. When the initial parameters θ⁰ are known and the noise is isotropic the
diagnostic ``bound`` is Jiang et al.'s (eq. 43 form)
:math:`\|\theta - \theta^0\|^2 / (4\sigma^{*2}) + \log(n/\sigma^*) + 10`, n the
size of the measurement set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..engine.linalg.sem import mean_stderr
from . import Cost, Measure, MeasureResult
from ._bn import folded_init_theta, folded_measurement, folding_reason
from ._layers import class_outputs_or_error
from ._options import Bool, Integral, OneOf, Real, opt

DEVIATION_TOL = 1e-2  # Jiang et al.'s ε_σ
MAGNITUDE_EPS = 1e-3


@dataclass(frozen=True)
class PacBayesOptions:
    """Options of ``pacbayes_flatness``."""

    target: float = opt(
        0.1, Real(0, None, "neither"), "allowed increase of the criterion under noise"
    )
    criterion: str = opt("error", OneOf("error", "loss"), "0-1 error over S or the loss L")
    sigma_max: float = opt(
        2.0, Real(0, None, "neither"), "upper end of the bisection interval for σ"
    )
    depth: int = opt(15, Integral(1, None), "bisection steps")
    samples: int = opt(10, Integral(1, None), "Monte-Carlo draws per bisection step")
    magnitude_aware: bool = opt(False, Bool(), "u_i ~ N(0, σ²θ_i² + 1e-6) instead of N(0, σ²)")
    fold_batchnorm: bool = opt(
        True,
        Bool(),
        "fold BatchNorm into the preceding layer first (Jiang et al.'s reference does)",
    )


def _criterion_fn(p, eng, criterion: str):
    if criterion == "loss":
        return lambda th: eng.loss(th)
    two = p.batch.select(slice(0, 2))
    with torch.no_grad():
        out = p.forward(p.params, two)
    c = p.loss_fn.classes(out, two)
    class_outputs_or_error(
        out if c is None else c[0],
        two.target if c is None else c[1],
        "The 'criterion' parameter of pacbayes_flatness is 'error', which",
        "Use criterion: loss.",
    )

    def error(th):
        return eng.loss_and_error(th)[1]  # one forward pass over S

    return error


class PacbayesFlatness(Measure):
    r""":math:`1/\sigma^{*2}`, larger means sharper; see the module docstring.

    Diagnostics: ``sigma`` (σ*), ``deviation`` and ``deviation_stderr`` (the
    Monte-Carlo estimate at σ* and its standard error over draws), ``base`` (the
    criterion at θ), ``bracket_lo``/``bracket_hi``, ``steps``, ``accepted``
    (stopped by the tolerance), ``saturated``, and ``bound`` when θ⁰ is known.
    """

    name = "pacbayes_flatness"
    options = PacBayesOptions
    description = (
        "PAC-Bayes flatness 1/σ*²: σ* the largest Gaussian noise std raising the error by ≤ target."
    )
    reference = "Jiang et al. 2020 (§C.4, Alg. 1; 'pacbayes.flatness'); Dziugaite & Roy 2017"
    stochastic = True

    def declare_cost(self, o, d) -> Cost:
        """Forward passes: the one at θ, and ``samples`` draws at each of the bisection's σ (at
        least one σ, at most ``depth`` + 1)."""
        return Cost(forward=(1 + o.samples, 1 + o.samples * (o.depth + 1)))

    def applicable(self, o, p):
        return folding_reason(p, o.fold_batchnorm)

    def compute(self, ctx, opts: PacBayesOptions) -> MeasureResult:
        fm = folded_measurement(ctx, opts.fold_batchnorm)
        try:
            return _pacbayes(ctx, fm, opts)
        finally:
            fm.merge_counters(ctx.engine)


def _pacbayes(ctx, fm, opts: PacBayesOptions) -> MeasureResult:
    p = fm.problem
    theta = p.theta
    crit = _criterion_fn(p, fm.engine, opts.criterion)
    base = crit(theta)
    if not math.isfinite(base):
        return MeasureResult(
            value=math.nan, diagnostics={"base": base, **fm.diagnostics}, status="non_finite"
        )
    if opts.magnitude_aware:
        std_of = lambda s: torch.sqrt(s * s * theta * theta + MAGNITUDE_EPS**2)  # noqa: E731
    else:
        std_of = lambda s: torch.full_like(theta, s)  # noqa: E731

    def deviation(sigma: float) -> tuple[float, float]:
        std = std_of(sigma)
        vals = []
        for k in range(opts.samples):
            xi = torch.randn(p.num_params, generator=ctx.generator(1 + k), dtype=torch.float64)
            v = crit(theta + std * xi.to(p.device, p.dtype)) - base
            # a non-finite perturbed loss is an infinitely large deviation
            vals.append(v if math.isfinite(v) else math.inf)
        t = torch.tensor(vals, dtype=torch.float64)
        mean, se = mean_stderr(t)
        mean = float(mean)
        return mean, (float(se) if math.isfinite(mean) else math.nan)

    diag: dict = {"base": base, "criterion": opts.criterion, **fm.diagnostics}
    d_max, se_max = deviation(opts.sigma_max)
    if d_max <= opts.target:
        diag.update(
            sigma=opts.sigma_max,
            deviation=d_max,
            deviation_stderr=se_max,
            saturated="sigma_max",
            steps=0,
        )
        return MeasureResult(value=1.0 / opts.sigma_max**2, diagnostics=diag, status="saturated")
    lo, hi = 0.0, opts.sigma_max
    lo_dev, lo_se = 0.0, 0.0
    accepted = False
    steps = 0
    for _ in range(opts.depth):
        steps += 1
        mid = 0.5 * (lo + hi)
        d, se = deviation(mid)
        if d <= opts.target:
            lo, lo_dev, lo_se = mid, d, se
            if opts.target - d < DEVIATION_TOL:
                accepted = True
                break
        else:
            hi = mid
    diag.update(bracket_lo=lo, bracket_hi=hi, steps=steps, accepted=accepted)
    if lo == 0.0:
        diag.update(sigma=hi, saturated="below")
        return MeasureResult(value=1.0 / hi**2, diagnostics=diag, status="saturated")
    sigma = lo
    diag.update(sigma=sigma, deviation=lo_dev, deviation_stderr=lo_se, saturated="no")
    theta0 = folded_init_theta(ctx, fm) if not opts.magnitude_aware else None
    if theta0 is not None:
        dist2 = float(((theta - theta0.to(theta)) ** 2).sum())
        diag["bound"] = dist2 / (4 * sigma**2) + math.log(p.n / sigma) + 10.0
    return MeasureResult(value=1.0 / sigma**2, diagnostics=diag)
