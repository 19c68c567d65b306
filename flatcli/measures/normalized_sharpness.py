r"""Normalized sharpness and its parameter-wise relatives (Tsuzuku, Sato & Sugiyama, ICML 2020).

Notation: θ̄ the parameters at the checkpoint (n of them), :math:`D_i` the
Hessian diagonal of the training loss L_S at θ̄ (estimated by ``hessian_diag``,
see `flatcli.measures._hessian_diag`), :math:`F_i = \max(D_i, 0)` (the paper's
eq. 31 applied to any estimate).

**Node-wise normalized sharpness (eq. 35), measure ``normalized_sharpness``.**
For every weight matrix :math:`W_l` (``nn.Linear`` weights, and convolution
weights with one row per output channel, the paper's App. F) with :math:`h`
rows,

.. math::

    U_l = W_l \circ W_l, \qquad F_l = \max(D_l, 0), \qquad M_l = F_l U_l^\top
    \in \mathbb{R}_{\ge 0}^{h \times h},

:math:`D_l` the diagonal entries for :math:`W_l` arranged like :math:`W_l`, and

.. math::

    \mathrm{NS}_l^2 = \inf_{\gamma \in [-R, R]^h} \sum_{i,k} M_l[i,k]\, e^{\gamma_i - \gamma_k}
    = \inf_\gamma\, (e^{\gamma})^\top F_l U_l^\top e^{-\gamma},
    \qquad \mathrm{NS} = \Big(\sum_l \mathrm{NS}_l^2\Big)^{1/2}.

Deliberate departure: eq. 35 takes the infimum over all of
:math:`\mathbb{R}^h`; we restrict γ to the box :math:`[-R, R]^h` (``box``,
default R = 20), the form NS₂(R) of Prop. 6.1 / Thm. 6.1 (eqs. 26, 33), which
leave R free. The box keeps degenerate rows (dead ReLU nodes, whose row of
:math:`F_l` is zero) finite; ``box_hit`` reports when it binds. The objective
is minimized in float64 through its logarithm (a log-sum-exp, convex in γ) with
L-BFGS-B under the box bounds.

Invariance: rescaling a hidden ReLU node's incoming weights and bias by
:math:`\alpha > 0` and its outgoing weights by :math:`1/\alpha` scales row
:math:`i` of :math:`U_l` by :math:`\alpha^2` and of :math:`F_l` by
:math:`\alpha^{-2}` (absorbed by :math:`\gamma_i`), and leaves the products
:math:`F_{l+1}[\cdot, i]\, U_{l+1}[\cdot, i]` unchanged, so NS does not change
(as long as the shifted γ stays in the box).

**Parameter-wise form (Sec. 4, Prop. 4.1, eq. 17), ``form: parameter``.** Our
reading of the OCR'd eqs. 7–17: θ = η μ ∘ e^σ with prior μ ~ N(0, I),
σ ~ N(β, η′²I) and posterior μ ~ N(μ̄, I), σ ~ N(σ̄, η′²I), θ̄ = η μ̄ ∘ e^{σ̄}.
To second order the two PAC-Bayes terms are (A) ≈ ½η² Σ D_i e^{2σ̄_i} +
½η′² Σ D_i θ̄_i² and (B) = KL/λ = (1/2λ)[η⁻² Σ θ̄_i² e^{−2σ̄_i} + η′⁻² ‖σ̄ − β‖²];
with η² = λ^{-1/2} and η′² = λ′ λ^{-1/2} their sum is
(λ′/2√λ)·FR + (1/2√λ)·NS₀(λ′) (eq. 15), where

.. math::

    \mathrm{FR} = \sum_{i=1}^n D_i\, \bar\theta_i^2 \quad\text{(eq. 16)},\qquad
    \mathrm{NS}_0(\lambda') = \sum_{i=1}^n \min_{\bar\sigma_i \in \mathbb{R},\, \beta_i \in B}
    \Big[F_i e^{2\bar\sigma_i} + \bar\theta_i^2 e^{-2\bar\sigma_i}
    + \frac{(\bar\sigma_i - \beta_i)^2}{\lambda'}\Big] \quad\text{(eq. 17)},

summed over all n trainable parameters (biases and normalization parameters
included, as the paper's θ ∈ ℝⁿ), and Ξ = ln(1/δ) + ``n ln|B| + 2 ln|Λ| + ln|Λ′|``
(eq. 18). Eq. 17 needs :math:`F_i \ge 0` (with :math:`D_i < 0` the minimum is
−∞): we use :math:`F = \max(D, 0)` as the paper's Sec. 6 says its eq. 31
applies to these propositions too. Options: ``lambda_prime`` (λ′) and the grid
B = ``beta_points`` equally spaced values on [−``beta_range``, ``beta_range``]
(one point: B = {0}). The limit λ′ → ∞ is eq. 19,
:math:`\mathrm{NS}_1 = \tfrac12 \lim \mathrm{NS}_0 = \sum_i |\bar\theta_i| \sqrt{F_i}`
(diagnostic ``ns1``).

Computation: per parameter the objective is jointly convex in (σ̄, β), so its
minimum over β of the partial minimum is convex in β and attained, over ℝ, at
the unregularized optimum σ* = ¼ ln(θ̄²/F) (value 2|θ̄|√F); over the grid B at
one of the two points of B around σ* (the end point when σ* is outside B or
infinite). For each such β the 1-D convex problem in σ̄ is solved by a
safeguarded Newton iteration in float64 inside a bracket known in closed form
([β, σ*] or, when F = 0 or θ̄ = 0, the Lambert-W bound
:math:`|\bar\sigma - \beta| \le \tfrac12\ln(1 + 2\lambda' c)`).

Scale dependence (Sec. 5, Prop. 4.2). Under a function-preserving rescaling
θ_i → c_i θ_i, D_i → D_i / c_i², the optimal σ̄_i moves by ln c_i while B stays
where it is (B must not depend on S): NS₀(λ′) equals NS₀ with B shifted by
−ln c_i, so it changes under node-wise rescaling; ``outside_grid`` counts the
parameters whose σ* falls outside B, where the grid can no longer follow.
Its limit NS₁ and FR are unchanged by any such element-wise rescaling
(``|θ_i|√D_i`` and D_i θ_i² are), but Prop. 4.2's constant ``Ξ₁ = O(n)·C(ε, δ, |Λ|, M, b, λ)``
depends on the scale through ``b = max |θ̄_i|`` and M = max F_i (diagnostics
``b``, ``M``), and both Ξ and Ξ₁ grow with the number of parameters n (the
``n_ln_B`` diagnostic is eq. 18's ``n ln|B|``). The node-wise NS of eq. 35 has
neither a grid nor a per-parameter constant: it is exactly invariant. The
check-invariance hook therefore claims invariance only for ``form: node``.

**Fisher-Rao-like term (eq. 16), measure ``fisher_rao_term``.**
FR = Σ_i D_i θ̄_i² over all trainable parameters, with the raw (unclamped)
diagonal: at a non-minimum it may be negative and is reported as it is. It is
the second-order value of the parameter-scaled expected sharpness of
Neyshabur et al. (2017) and matches the Fisher-Rao norm of Liang et al. (2019)
under regularity conditions, as the paper notes after Prop. 4.1. Invariance:
each term D_i θ̄_i² is unchanged by any function-preserving element-wise
rescaling θ_i → c_i θ_i (D_i scales by 1/c_i²), in particular by the node-wise
and layer-wise rescalings of ReLU networks and the BatchNorm-aware ones of
`flatcli.invariance`, so the measure claims that invariance (with a
rescaling-equivariant diagonal); it is not invariant to reparameterizations
that mix parameters.

Larger means sharper for all three.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import MeasurementError
from . import Cost, Measure, MeasureResult
from ._hessian_diag import (
    DiagonalOptions,
    diagonal_cost,
    diagonal_reason,
    diagonal_shared,
    equivariance_claim,
    estimate_diagonal,
    jackknife,
)
from ._layers import weight_matrices
from ._options import Integral, OneOf, Real, opt


@dataclass(frozen=True)
class NormalizedSharpnessOptions(DiagonalOptions):
    """Options of ``normalized_sharpness`` (the diagonal estimator's, the box, the form)."""

    box: float = opt(
        20.0, Real(0, None, "neither"), "γ is restricted to the box [-box, box] (form: node)"
    )
    form: str = opt(
        "node", OneOf("node", "parameter"), "node: eq. 35 (node-wise); parameter: NS₀ of eq. 17"
    )
    lambda_prime: float = opt(1.0, Real(0, None, "neither"), "λ′ of eq. 17 (form: parameter)")
    beta_range: float = opt(
        10.0, Real(0, None, "left"), "B spans [-beta_range, beta_range] (form: parameter)"
    )
    beta_points: int = opt(41, Integral(1, None), "|B|, equally spaced points (form: parameter)")


@dataclass
class LayerSolution:
    """The solution of one layer's problem: ``value`` = NS_l² and its optimizer record."""

    value: float
    gamma: np.ndarray = field(repr=False)
    grad_norm: float = 0.0  # ∞-norm of the projected gradient of log f at the solution
    box_hit: bool = False
    iterations: int = 0
    success: bool = True


def _log_objective(gamma: np.ndarray, logM: np.ndarray, mask: np.ndarray):
    r"""Log f(γ) with f = Σ M_ik exp(γ_i − γ_k), and its gradient, computed stably."""
    A = logM + gamma[:, None] - gamma[None, :]
    amax = float(A[mask].max())
    E = np.where(mask, np.exp(np.where(mask, A, amax) - amax), 0.0)
    s = float(E.sum())
    grad = (E.sum(1) - E.sum(0)) / s
    return amax + math.log(s), grad


def _projected_grad_norm(gamma: np.ndarray, grad: np.ndarray, box: float) -> float:
    g = grad.copy()
    at_hi = gamma >= box * (1 - 1e-12)
    at_lo = gamma <= -box * (1 - 1e-12)
    g[at_hi & (g < 0)] = 0.0  # descent would leave the box
    g[at_lo & (g > 0)] = 0.0
    return float(np.abs(g).max()) if g.size else 0.0


def solve_layer(M: np.ndarray, box: float, gamma0: np.ndarray | None = None) -> LayerSolution:
    r"""NS_l² = min over γ ∈ [−box, box]^h of Σ_{i,k} M[i,k] exp(γ_i − γ_k), for M ≥ 0 (h × h).

    Minimizes the convex log-sum-exp ``log f`` with L-BFGS-B in float64 from
    ``gamma0`` (default 0). An all-zero M gives 0.
    """
    M = np.asarray(M, dtype=np.float64)
    h = M.shape[0]
    scale = float(M.max()) if M.size else 0.0
    if not math.isfinite(scale):
        raise MeasurementError("normalized_sharpness: the layer matrix F Uᵀ is not finite")
    if scale <= 0.0:
        return LayerSolution(0.0, np.zeros(h))
    if h == 1:
        return LayerSolution(float(M[0, 0]), np.zeros(1))
    mask = M > 0
    with np.errstate(divide="ignore"):
        logM = np.where(mask, np.log(np.where(mask, M / scale, 1.0)), 0.0)
    x0 = np.zeros(h) if gamma0 is None else np.clip(np.asarray(gamma0, dtype=np.float64), -box, box)
    import scipy.optimize  # here: 0.5 s at start-up otherwise, for every command that lists measures

    res = scipy.optimize.minimize(
        _log_objective,
        x0,
        args=(logM, mask),
        jac=True,
        method="L-BFGS-B",
        bounds=[(-box, box)] * h,
        options={"maxiter": 10_000, "maxfun": 20_000, "ftol": 1e-15, "gtol": 1e-11, "maxcor": 30},
    )
    gamma = res.x
    fval, grad = _log_objective(gamma, logM, mask)
    gnorm = _projected_grad_norm(gamma, grad, box)
    hit = bool(np.any(np.abs(gamma) >= box * (1 - 1e-9)))
    return LayerSolution(
        value=scale * math.exp(fval),
        gamma=gamma,
        grad_norm=gnorm,
        box_hit=hit,
        iterations=int(res.nit),
        success=bool(res.success) or gnorm <= 1e-8,
    )


def layer_matrix(W: torch.Tensor, D: torch.Tensor) -> np.ndarray:
    """M = max(D, 0) (W ∘ W)ᵀ for W, D viewed as (rows × rest), in float64."""
    W2 = W.reshape(W.shape[0], -1).double()
    F = D.reshape(W.shape[0], -1).to(W2.device, torch.float64).clamp_min(0.0)
    return (F @ (W2 * W2).T).cpu().numpy()


def normalized_sharpness_from_diagonal(
    model: torch.nn.Module,
    params: dict[str, torch.Tensor],
    slices: dict[str, slice],
    diag: torch.Tensor,
    box: float = 20.0,
    warm: dict[str, np.ndarray] | None = None,
) -> tuple[float, dict[str, LayerSolution]]:
    """NS = sqrt(Σ_l NS_l²) from a Hessian diagonal over the flat parameter vector.

    ``params``: name → tensor; ``slices``: where each parameter sits in ``diag``.
    Returns NS and the per-layer solutions keyed by module name.
    """
    sols: dict[str, LayerSolution] = {}
    for wm in weight_matrices(model):
        if wm.param_name not in slices:
            continue  # frozen or tied weight: not a free parameter of θ
        W = params[wm.param_name]
        D = diag[slices[wm.param_name]].reshape(W.shape)
        key = wm.module_name or wm.param_name
        M = layer_matrix(wm.as_matrix(W), wm.as_matrix(D))
        sols[key] = solve_layer(M, box, None if warm is None else warm.get(key))
    if not sols:
        raise MeasurementError(
            "normalized_sharpness: the model has no trainable Linear or Conv weight matrix"
        )
    total = sum(s.value for s in sols.values())
    return math.sqrt(total), sols


# ---------------------------------------------------------------------------- parameter-wise (eq. 17)
def beta_grid(beta_range: float, beta_points: int) -> np.ndarray:
    """B: ``beta_points`` equally spaced values on [−beta_range, beta_range] ({0} for one point)."""
    if beta_points == 1:
        return np.zeros(1)
    return np.linspace(-beta_range, beta_range, beta_points)


def _min_over_sigma(
    logF: np.ndarray, logT: np.ndarray, beta: np.ndarray, lam: float, sstar: np.ndarray
):
    r"""Argmin and min over σ of g(σ) = F e^{2σ} + θ² e^{−2σ} + (σ − β)²/λ′, elementwise.

    ``logF``/``logT`` are log F and log θ² (−inf for zeros), ``sstar`` the
    unregularized optimum ¼ ln(θ²/F) (±inf when F or θ is zero). Safeguarded
    Newton inside the bracket between β and the root bound.
    """
    hasF, hasT = np.isfinite(logF), np.isfinite(logT)
    log2l = math.log(2 * lam)
    # Lambert-W bounds: with one of the two terms absent, |σ − β| = ½ W(2λ′c) ≤ ½ ln(1 + 2λ′c)
    up = beta + 0.5 * np.logaddexp(0.0, np.where(hasT, log2l + logT - 2 * beta, -np.inf))
    down = beta - 0.5 * np.logaddexp(0.0, np.where(hasF, log2l + logF + 2 * beta, -np.inf))
    both = hasF & hasT
    lo = np.where(both, np.minimum(beta, np.where(both, sstar, 0.0)), np.where(hasT, beta, down))
    hi = np.where(both, np.maximum(beta, np.where(both, sstar, 0.0)), np.where(hasT, up, beta))
    none = ~hasF & ~hasT
    lo, hi = np.where(none, beta, lo), np.where(none, beta, hi)
    sigma = 0.5 * (lo + hi)

    def d1d2(s):
        a = np.exp(logF + 2 * s)
        b = np.exp(logT - 2 * s)
        return 2 * a - 2 * b + 2 * (s - beta) / lam, 4 * a + 4 * b + 2 / lam

    for _ in range(200):
        g1, g2 = d1d2(sigma)
        hi = np.where(
            g1 > 0, sigma, hi
        )  # g is convex: the root of g' lies left of a positive slope
        lo = np.where(g1 < 0, sigma, lo)
        newton = sigma - g1 / g2
        inside = (newton > lo) & (newton < hi)
        nxt = np.where(inside, newton, 0.5 * (lo + hi))
        done = np.abs(nxt - sigma) <= 1e-15 * (1.0 + np.abs(sigma))
        sigma = nxt
        if bool(done.all()) or bool((hi - lo <= 1e-15 * (1.0 + np.abs(sigma))).all()):
            break
    value = np.exp(logF + 2 * sigma) + np.exp(logT - 2 * sigma) + (sigma - beta) ** 2 / lam
    return sigma, value


def parameter_wise_terms(theta: np.ndarray, F: np.ndarray, betas: np.ndarray, lam: float):
    r"""The n terms of NS₀(λ′) (eq. 17) and their optimal σ̄, β; F ≥ 0.

    Returns (terms, sigma, beta, sstar) as float64 arrays; ``sstar`` is the
    unregularized optimum ¼ ln(θ²/F) (±inf where F or θ is zero, nan where both are).
    """
    theta = np.asarray(theta, dtype=np.float64)
    F = np.asarray(F, dtype=np.float64)
    with np.errstate(divide="ignore"):
        logF = np.log(F)
        logT = np.log(theta * theta)
    hasF, hasT = np.isfinite(logF), np.isfinite(logT)
    sstar = np.where(
        hasF & hasT, 0.25 * (np.where(hasT, logT, 0) - np.where(hasF, logF, 0)), np.nan
    )
    sstar = np.where(~hasF & hasT, np.inf, np.where(hasF & ~hasT, -np.inf, sstar))
    B = np.sort(np.asarray(betas, dtype=np.float64))
    key = np.where(np.isnan(sstar), 0.0, sstar)
    pos = np.searchsorted(B, key)
    cand = [B[np.clip(pos - 1, 0, len(B) - 1)], B[np.clip(pos, 0, len(B) - 1)]]
    best_v = best_s = best_b = None
    for b in cand:
        s, v = _min_over_sigma(logF, logT, b, lam, sstar)
        if best_v is None:
            best_v, best_s, best_b = v, s, b
        else:
            take = v < best_v
            best_v, best_s, best_b = (
                np.where(take, v, best_v),
                np.where(take, s, best_s),
                np.where(take, b, best_b),
            )
    return best_v, best_s, best_b, sstar


def _parameter_wise(p, diag: torch.Tensor, opts: NormalizedSharpnessOptions):
    """NS₀(λ′) over all trainable parameters, with per-tensor parts and the eq. 15–19 companions."""
    theta = p.theta.detach().double().cpu().numpy()
    D = diag.double().cpu().numpy()
    F = np.maximum(D, 0.0)
    B = beta_grid(opts.beta_range, opts.beta_points)
    terms, _, _, sstar = parameter_wise_terms(theta, F, B, opts.lambda_prime)
    value = float(terms.sum())
    slices = p.param_slices()
    finite = np.isfinite(sstar)
    outside = (~np.isnan(sstar)) & (~finite | (sstar < B.min()) | (sstar > B.max()))
    extras = {
        "tensors": {n: float(terms[sl].sum()) for n, sl in slices.items()},
        "ns1": float(np.sum(np.abs(theta) * np.sqrt(F))),
        "fr": float(np.sum(D * theta * theta)),
        "outside_grid": int(outside.sum()),
        "n_params": int(theta.size),
        "n_ln_B": float(theta.size * math.log(len(B))),
        "b": float(np.abs(theta).max()) if theta.size else 0.0,
        "M": float(F.max()) if F.size else 0.0,
    }
    return value, extras


# ---------------------------------------------------------------------------- the measures
def _node_wise(p, model, diag: torch.Tensor, box: float, warm=None):
    params = {n: t.detach() for n, t in p.params.items()}
    return normalized_sharpness_from_diagonal(model, params, p.param_slices(), diag, box, warm)


def _weight_names(p, model) -> list[str]:
    slices = p.param_slices()
    return [wm.param_name for wm in weight_matrices(model) if wm.param_name in slices]


class NormalizedSharpness(Measure):
    r"""Normalized sharpness NS (eq. 35, ``form: node``) or NS₀(λ′) (eq. 17, ``form: parameter``); larger = sharper.

    With :math:`W_l` the weight matrices (:math:`h_l` rows), :math:`D_l` the Hessian
    diagonal of the training loss arranged like :math:`W_l` and R = ``box``:

    .. math::

        \mathrm{NS} = \Big(\sum_l \min_{\gamma \in [-R, R]^{h_l}} \sum_{i,k}
        M_l[i,k]\, e^{\gamma_i - \gamma_k}\Big)^{1/2}, \qquad
        M_l = \max(D_l, 0)\,(W_l \circ W_l)^\top.

    Parameters (options)
    --------------------
    hessian_diag : {"auto", "ggn", "exact", "scaled", "finite_difference", "hutchinson"}, default "auto"
        See `flatcli.measures._hessian_diag`. ``auto`` is exact for networks
        piecewise linear in each parameter (ReLU, pooling, BatchNorm in eval).
    samples : int, default 64 — probes of the stochastic estimators.
    radius : float, default 1e-3 — r of ``finite_difference``.
    eps : float, default 1e-8 — keeps |θ| away from 0 (``scaled``, ``finite_difference``).
    check : int, default 3 — coordinates per tensor where ``auto`` compares H_ii with the Gauss-Newton G_ii.
    check_probes : int, default 2 — Gaussian probes per tensor where ``auto`` checks that the remainder
        block P(H − G)P vanishes (its false-pass probability is in `flatcli.measures._hessian_diag`).
    max_exact : int, default 4096 — unit-vector HVPs ``auto`` may spend on curved tensors.
    box : float, default 20 — γ ∈ [−box, box]^h (the R of eqs. 26/33).
    form : {"node", "parameter"}, default "node".
    lambda_prime : float, default 1 — λ′ of eq. 17.
    beta_range, beta_points : float, int, default 10, 41 — the grid B of eq. 17.

    Diagnostics (node form): ``layers`` (NS_l per module), ``grad_norm``
    (largest projected gradient ∞-norm of the log objective over layers),
    ``box_hit`` and ``box_hit_layers``, ``optimizer_iterations``; (parameter
    form): ``tensors`` (NS₀ part per parameter tensor), ``ns1`` (eq. 19),
    ``fr`` (eq. 16), ``outside_grid``, ``n_params``, ``n_ln_B``, ``b``, ``M``;
    both: the estimator's diagnostics (``diag_*``), ``jackknife_bias`` and the
    engine's counts. Stochastic estimators give a jackknife ``stderr`` that
    includes the jackknife bias estimate.

    References: Tsuzuku, Sato & Sugiyama (2020), "Normalized Flat Minima:
    Exploring Scale Invariant Definition of Flat Minima for Neural Networks
    using PAC-Bayesian Analysis", ICML, eqs. 15–19, 29–31, 35.
    """

    name = "normalized_sharpness"
    options = NormalizedSharpnessOptions
    description = (
        "Normalized sharpness: per-layer convex minimum over row scales of Σ M_ik e^(γ_i−γ_k), "
        "M = max(D,0)(W∘W)ᵀ; form: parameter gives the parameter-wise NS₀(λ′)."
    )
    reference = "Tsuzuku, Sato & Sugiyama, ICML 2020, eq. 35 (form: parameter: eq. 17; diagonal: eqs. 29–31)"
    stochastic = True

    def invariant(self, opts: NormalizedSharpnessOptions) -> bool | str:
        if opts.form == "parameter":
            return (
                "form: parameter (eq. 17) anchors each σ̄_i to the data-independent grid B, "
                "so node-wise rescaling changes it (Sec. 5, Prop. 4.2)"
            )
        return equivariance_claim(opts)

    def invariance_note(self, a: MeasureResult, b: MeasureResult, opts) -> str | None:
        if a.diagnostics.get("box_hit") or b.diagnostics.get("box_hit"):
            return (
                "γ hit the box [-box, box]; rescalings beyond e^box are not absorbed (raise 'box')"
            )
        if a.diagnostics.get("diag_estimated") or b.diagnostics.get("diag_estimated"):
            return "part of the Hessian diagonal was estimated by Hutchinson probes (raise 'max_exact')"
        return None

    def declare_cost(self, o, d) -> Cost:
        """The Hessian diagonal of ``hessian_diag`` over the weight matrices
        (`flatcli.measures._hessian_diag.diagonal_cost`)."""
        return diagonal_cost(o, d, d.matrices)

    def shared(self, o, d):
        return diagonal_shared(o, d, d.matrix_tensors)

    def applicable(self, o, p):
        return diagonal_reason(o, p)

    def compute(self, ctx, opts: NormalizedSharpnessOptions) -> MeasureResult:
        p = ctx.problem
        tensors = _weight_names(p, ctx.model) if opts.form == "node" else None
        est = estimate_diagonal(ctx, opts, tensors)
        diag = est.mean()
        if opts.form == "parameter":
            value, extras = _parameter_wise(p, diag, opts)
            stderr, bias = jackknife(est, lambda d: _parameter_wise(p, d, opts)[0], value)
            converged = True
        else:
            value, sols = _node_wise(p, ctx.model, diag, opts.box)
            warm = {k: s.gamma for k, s in sols.items()}
            stderr, bias = jackknife(
                est, lambda d: _node_wise(p, ctx.model, d, opts.box, warm)[0], value
            )
            hits = [k for k, s in sols.items() if s.box_hit]
            converged = all(s.success for s in sols.values())
            extras = {
                "layers": {k: math.sqrt(s.value) for k, s in sols.items()},
                "grad_norm": max(s.grad_norm for s in sols.values()),
                "layer_grad_norms": {k: s.grad_norm for k, s in sols.items()},
                "box_hit": bool(hits),
                "box_hit_layers": hits,
                "optimizer_iterations": int(sum(s.iterations for s in sols.values())),
            }
        if not math.isfinite(value):
            raise MeasurementError(f"normalized_sharpness is not finite ({value})")
        diagnostics = {
            **est.info,
            "form": opts.form,
            "samples": sum(k for _, k in est.groups),
            **extras,
            "jackknife_bias": bias,
            "converged": converged,
        }
        return MeasureResult(
            value=value,
            stderr=stderr,
            diagnostics=diagnostics,
            status="ok" if converged else "not_converged",
        )


@dataclass(frozen=True)
class FisherRaoTermOptions(DiagonalOptions):
    """Options of ``fisher_rao_term`` (those of the Hessian-diagonal estimator)."""

    pass


def _fr(p, diag: torch.Tensor) -> tuple[float, dict[str, float]]:
    theta = p.theta.detach().double().cpu()
    terms = diag.double() * theta * theta
    return float(terms.sum()), {n: float(terms[sl].sum()) for n, sl in p.param_slices().items()}


class FisherRaoTerm(Measure):
    r""":math:`\mathrm{FR} = \sum_i [\nabla^2 L_S(\bar\theta)]_{ii}\, \bar\theta_i^2` (eq. 16), larger = sharper.

    Options: the Hessian-diagonal options of `normalized_sharpness`
    (``hessian_diag`` default ``auto``, ``samples``, ``radius``, ``eps``,
    ``check``, ``check_probes``, ``max_exact``). The diagonal is not clamped: at a non-minimum
    with an indefinite Hessian FR may be negative. Invariant to element-wise
    function-preserving rescalings (node-wise, layer-wise, BatchNorm-aware);
    see the module docstring.

    Diagnostics: ``tensors`` (the part of every parameter tensor), the
    estimator's ``diag_*`` diagnostics, ``jackknife_bias``, the engine's counts.

    References: Tsuzuku, Sato & Sugiyama (2020), ICML, eqs. 15–16; Liang,
    Poggio, Rakhlin & Stokes (2019) for the Fisher-Rao norm it approximates.
    """

    name = "fisher_rao_term"
    options = FisherRaoTermOptions
    description = "Fisher-Rao-like term FR = Σ_i H_ii θ_i² over all parameters (raw diagonal: negative parts kept)."
    reference = "Tsuzuku, Sato & Sugiyama, ICML 2020, eq. 16 (Prop. 4.1, eq. 15)"
    stochastic = True

    invariant = staticmethod(equivariance_claim)

    def declare_cost(self, o, d) -> Cost:
        """The Hessian diagonal of ``hessian_diag`` over every parameter tensor
        (`flatcli.measures._hessian_diag.diagonal_cost`)."""
        return diagonal_cost(o, d, d.tensors)

    def shared(self, o, d):
        return diagonal_shared(o, d, range(len(d.tensors)))

    def applicable(self, o, p):
        return diagonal_reason(o, p)

    def compute(self, ctx, opts: FisherRaoTermOptions) -> MeasureResult:
        p = ctx.problem
        est = estimate_diagonal(ctx, opts)
        value, parts = _fr(p, est.mean())
        stderr, bias = jackknife(est, lambda d: _fr(p, d)[0], value)
        if not math.isfinite(value):
            raise MeasurementError(f"fisher_rao_term is not finite ({value})")
        diagnostics = {
            **est.info,
            "samples": sum(k for _, k in est.groups),
            "tensors": parts,
            "jackknife_bias": bias,
        }
        return MeasureResult(value=value, stderr=stderr, diagnostics=diagnostics)
