r"""Normalized sharpness (Tsuzuku, Sato & Sugiyama, ICML 2020).

For every weight matrix :math:`W_l` (``nn.Linear`` weights, and convolution
weights with one row per output channel) with :math:`h` rows,

.. math::

    U_l = W_l \circ W_l, \qquad F_l = \max(D_l, 0), \qquad M_l = F_l U_l^\top
    \in \mathbb{R}_{\ge 0}^{h \times h},

where :math:`D_l` holds the Hessian-diagonal entries of the loss for the
entries of :math:`W_l`, arranged like :math:`W_l`. The normalized sharpness of
the layer (the paper's eq. 35) is the value of a convex problem over the row
scales :math:`\gamma`,

.. math::

    \mathrm{NS}_l^2 = \inf_{\gamma \in [-R, R]^h} \sum_{i,k} M_l[i,k]\, e^{\gamma_i - \gamma_k},
    \qquad \mathrm{NS} = \Big(\sum_l \mathrm{NS}_l^2\Big)^{1/2}.

The box :math:`[-R, R]^h` (``box``, default 20 as in the paper's Prop. 6.1)
keeps degenerate rows (e.g. dead ReLU nodes, whose row of :math:`F_l` is zero)
finite. The objective is minimized in float64 through its logarithm (a
log-sum-exp, convex in :math:`\gamma`) with L-BFGS-B under the box bounds.

Invariance: rescaling a hidden ReLU node's incoming weights and bias by
:math:`\alpha > 0` and its outgoing weights by :math:`1/\alpha` scales row
:math:`i` of :math:`U_l` by :math:`\alpha^2` and of :math:`F_l` by
:math:`\alpha^{-2}` (absorbed by :math:`\gamma_i`), and leaves the products
:math:`F_{l+1}[\cdot, i]\, U_{l+1}[\cdot, i]` unchanged, so NS does not change.

Hessian-diagonal estimators (``hessian_diag``):

* ``scaled`` (default): eq. 29 in the limit :math:`r \to 0`,
  :math:`D \approx \frac1m \sum_s s \circ H(|\theta| \circ s) / |\theta|` with
  Rademacher :math:`s` and exact HVPs (`flatcli.engine.linalg.scaled_diagonal`);
  it transforms exactly like the true diagonal under node rescaling, sample by
  sample, so NS stays invariant at equal seeds.
* ``finite_difference``: eqs. 29–30 with radius :math:`r` (``radius``),
  :math:`D \approx \frac1m \sum_s s \circ \frac{\nabla L(\theta + r v_s) - \nabla L(\theta - r v_s)}{2 r (|\theta| + \epsilon)}`,
  :math:`v_s = (|\theta| + \epsilon) \circ s`; two gradients per sample, works
  for non-smooth networks.
* ``hutchinson``: :math:`\frac1m \sum_z z \circ Hz` (not rescaling-equivariant
  sample by sample: invariant only in expectation).
* ``exact``: unit-vector HVPs, one per parameter (small models and tests).

Stochastic estimators report a delete-a-group jackknife standard error over
``min(8, samples)`` groups of samples.

Larger means sharper.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import scipy.optimize
import torch

from ..engine import linalg
from ..errors import MeasurementError
from . import MeasureResult, register
from ._layers import weight_matrices
from ._options import Integral, OneOf, Real, opt

JACKKNIFE_GROUPS = 8


@dataclass(frozen=True)
class NormalizedSharpnessOptions:
    hessian_diag: str = opt(
        "scaled",
        OneOf("scaled", "finite_difference", "hutchinson", "exact"),
        "Hessian-diagonal estimator (exact: one HVP per parameter)",
    )
    samples: int = opt(64, Integral(1, None), "random probes of the stochastic diagonal estimators")
    radius: float = opt(1e-3, Real(0, None, "neither"), "relative perturbation radius r of finite_difference")
    eps: float = opt(1e-8, Real(0, None, "neither"), "ε added to |θ| (finite_difference) or replacing |θ| = 0 (scaled)")
    box: float = opt(20.0, Real(0, None, "neither"), "γ is restricted to the box [-box, box]")


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
    r"""log f(γ) with f = Σ M_ik exp(γ_i − γ_k), and its gradient, computed stably."""
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
        sols[key] = solve_layer(layer_matrix(W, D), box, None if warm is None else warm.get(key))
    if not sols:
        raise MeasurementError("normalized_sharpness: the model has no trainable Linear or Conv weight matrix")
    total = sum(s.value for s in sols.values())
    return math.sqrt(total), sols


def _fd_group(eng, theta: torch.Tensor, k: int, radius: float, eps: float, generator) -> torch.Tensor:
    """Sum over k Rademacher samples of s ∘ (∇L(θ + r v) − ∇L(θ − r v)) / (2 r (|θ| + ε)), v = (|θ| + ε) ∘ s."""
    a = theta.abs() + eps
    acc = torch.zeros(theta.numel(), dtype=torch.float64)
    S = linalg.rademacher(k, theta.numel(), generator, theta.device, theta.dtype)
    for s in S:
        v = radius * a * s
        gp = eng.grad(theta + v)
        gm = eng.grad(theta - v)
        acc += (s * (gp - gm) / (2 * radius * a)).double().cpu()
    return acc


def _diag_groups(ctx, opts: NormalizedSharpnessOptions) -> list[tuple[torch.Tensor, int]]:
    """The Hessian diagonal as a list of (sum over a group of samples, group size)."""
    eng, p = ctx.engine, ctx.problem
    P = p.num_params
    if opts.hessian_diag == "exact":
        return [(linalg.exact_diagonal(eng.hvp, P, block=eng.block_size, device=p.device, dtype=p.dtype), 1)]
    gen = ctx.generator()
    G = min(JACKKNIFE_GROUPS, opts.samples)
    sizes = [opts.samples // G + (1 if g < opts.samples % G else 0) for g in range(G)]
    theta = p.theta
    out = []
    for k in sizes:
        if opts.hessian_diag == "scaled":
            mean, _ = linalg.scaled_diagonal(eng.hvp, theta, samples=k, eps=opts.eps, block=eng.block_size, generator=gen)
            out.append((mean * k, k))
        elif opts.hessian_diag == "hutchinson":
            mean, _ = linalg.hutchinson_diagonal(
                eng.hvp, P, samples=k, block=eng.block_size, generator=gen, device=p.device, dtype=p.dtype
            )
            out.append((mean * k, k))
        else:
            out.append((_fd_group(eng, theta, k, opts.radius, opts.eps, gen), k))
    return out


def _claim(opts: NormalizedSharpnessOptions) -> bool | str:
    if opts.hessian_diag == "hutchinson":
        return "hessian_diag: hutchinson probes are not rescaling-equivariant (invariant only in expectation)"
    return True


def _note(a: MeasureResult, b: MeasureResult, opts: NormalizedSharpnessOptions) -> str | None:
    if a.diagnostics.get("box_hit") or b.diagnostics.get("box_hit"):
        return "γ hit the box [-box, box]; rescalings beyond e^box are not absorbed (raise 'box')"
    return None


@register(
    "normalized_sharpness",
    options=NormalizedSharpnessOptions,
    description="Normalized sharpness: per-layer convex minimum over row scales of Σ M_ik e^(γ_i−γ_k), M = max(D,0)(W∘W)ᵀ.",
    reference="Tsuzuku, Sato & Sugiyama, ICML 2020, eq. 35 (diagonal: eqs. 29–30)",
    stochastic=True,
    invariant=_claim,
    invariance_note=_note,
    cost="samples HVPs (scaled, hutchinson), 2·samples gradients (finite_difference), P HVPs (exact)",
)
def normalized_sharpness(ctx, opts: NormalizedSharpnessOptions) -> MeasureResult:
    r"""Normalized sharpness :math:`\mathrm{NS} = (\sum_l \mathrm{NS}_l^2)^{1/2}`, larger means sharper.

    Parameters (options)
    --------------------
    hessian_diag : {"scaled", "finite_difference", "hutchinson", "exact"}, default "scaled"
    samples : int, default 64 — Rademacher probes of the stochastic estimators.
    radius : float, default 1e-3 — r of ``finite_difference``.
    eps : float, default 1e-8 — keeps |θ| away from 0.
    box : float, default 20 — γ ∈ [−box, box]^h.

    Diagnostics: ``layers`` (NS_l per module), ``grad_norm`` (largest projected
    gradient ∞-norm of the log objective over layers), ``box_hit`` and
    ``box_hit_layers``, ``optimizer_iterations``, plus the engine's HVP and
    gradient counts. Stochastic estimators give a jackknife ``stderr``.

    References: Tsuzuku, Sato & Sugiyama (2020), "Normalized Flat Minima:
    Exploring Scale Invariant Definition of Flat Minima for Neural Networks
    using PAC-Bayesian Analysis", ICML, eq. 35 and eqs. 29–30.
    """
    p = ctx.problem
    groups = _diag_groups(ctx, opts)
    total_n = sum(k for _, k in groups)
    total = sum(s for s, _ in groups)
    diag = total / total_n
    slices = p.param_slices()
    params = {n: t.detach() for n, t in p.params.items()}
    value, sols = normalized_sharpness_from_diagonal(ctx.model, params, slices, diag, opts.box)
    if not math.isfinite(value):
        raise MeasurementError(f"normalized_sharpness is not finite ({value})")
    stderr = None
    if opts.hessian_diag != "exact" and len(groups) >= 2:
        warm = {k: s.gamma for k, s in sols.items()}
        loo = []
        for s_g, k_g in groups:
            d_g = (total - s_g) / (total_n - k_g)
            v, _ = normalized_sharpness_from_diagonal(ctx.model, params, slices, d_g, opts.box, warm)
            loo.append(v)
        loo = np.asarray(loo)
        G = len(loo)
        stderr = float(math.sqrt((G - 1) / G * float(((loo - loo.mean()) ** 2).sum())))
    grad_norm = max(s.grad_norm for s in sols.values())
    hits = [k for k, s in sols.items() if s.box_hit]
    converged = all(s.success for s in sols.values())
    diagnostics = {
        "hessian_diag": opts.hessian_diag,
        "samples": 0 if opts.hessian_diag == "exact" else total_n,
        "layers": {k: math.sqrt(s.value) for k, s in sols.items()},
        "grad_norm": grad_norm,
        "layer_grad_norms": {k: s.grad_norm for k, s in sols.items()},
        "box_hit": bool(hits),
        "box_hit_layers": hits,
        "optimizer_iterations": int(sum(s.iterations for s in sols.values())),
        "converged": converged,
    }
    return MeasureResult(
        value=value, stderr=stderr, diagnostics=diagnostics, status="ok" if converged else "not_converged"
    )
