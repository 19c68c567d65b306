r"""The computable terms of Tsuzuku, Sato & Sugiyama's PAC-Bayes bound (ICML 2020, Thm. 6.1, eqs. 32–34).

Our reading of the OCR'd theorem: for d weight matrices, λ from a finite set Λ
independent of S, ε ∈ (0, 0.1], R > 0, a loss bounded in [0, 1] and
``max_i |θ̄_i| ≤ b``, if every entry of F = max(D, 0) is at most M, there is a
Gaussian posterior Q(θ | θ̄) with mean θ̄ and covariance Σ, ‖Σ‖_F = O(λ^{-1/2}),
such that with probability 1 − δ over S and Q

.. math::

    L_D(Q) \le L_S(Q) + \frac{1}{\sqrt\lambda}\,\mathrm{NS}_2(R) + \frac{\Xi_3}{\lambda}
    + \frac{\lambda}{2m}, \qquad
    \mathrm{NS}_2(R) = \Big(\sum_l \min_{\gamma \in [-R, R]^{h_l}} (e^{\gamma})^\top F_l U_l^\top e^{-\gamma}\Big)^{1/2},
    \qquad \Xi_3 = \tilde O(hd)\cdot C_{\epsilon,\delta,M,b,R,|\Lambda|},

(eqs. 32, 33, 34; the paper prints the curvature term of eq. 32 as NS₃(R) and
defines it in eq. 33 as eq. 26's NS₂(R) with the clamped estimate F̄ in place of
H̄; we read both as the same quantity, which is `normalized_sharpness` with
``box`` = R). m is the size of S, taken as the measurement set's n: measure on
the whole training set for the bound to be one.

**Which terms, for the posterior that is sampled.** Thm 6.1 comes from the
PAC-Bayes bound of its eq. 1, :math:`L_D(Q) \le L_S(Q) + \lambda/2m +
(\ln(1/\delta) + \mathrm{KL}(Q\|P))/\lambda`, with L_S(Q) measured (Monte Carlo
and Hoeffding) and the posterior variance chosen by the second-order
approximation to balance the loss increase (A) against KL/λ (B) (eq. 4). For the
posterior below (variances η²e^{γ_i}b_j on weight matrices, prior of equal
variances and mean 0) the KL is exactly h/(2η²), and (A) ≈ ½η²NS₂(R)²; the
balance η² = √(h/λ)/NS₂(R) makes both

.. math:: \frac{\mathrm{KL}(Q\|P)}{\lambda} = \frac{h}{2\lambda\eta^2} = \frac{\sqrt h}{2}\,\frac{\mathrm{NS}_2(R)}{\sqrt\lambda}.

That is the bound's curvature term for the Q that is sampled: the printed
NS₂(R)/√λ times √h/2. The factor is multiplicative on a λ^{-1/2} term, so the
additive Ξ₃/λ cannot absorb it (the former version reported NS₂(R)/√λ and said
it could; its diagnostics had ``kl_over_lam / curvature_term`` = √h/2 = 5.66 at
h = 128). No posterior of this family gives NS₂(R)/√λ for both (A) and (B): a KL/λ
of NS₂(R)/√λ needs η² = h/(2√λ NS₂(R)), and then (A) ≈ (h/4)·NS₂(R)/√λ.

What is computed (the measure's value is the sum of the terms below):

* L_S(Q) by Monte Carlo: ``mc_samples`` draws θ_k ~ Q (seeded), each
  evaluated on S with a bounded loss (``mc_loss``): the 0-1 error (in [0, 1])
  or the per-sample loss clipped at ``loss_clip`` (in [0, loss_clip]); the
  reported upper end is the mean plus the two-sided Hoeffding half-width
  :math:`B\sqrt{\ln(2/\delta')/(2K)}` (B the range of the loss, K the draws,
  δ′ = ``confidence``), valid with probability 1 − δ′ over the draws (union with
  the bound's δ: 1 − δ − δ′ overall).
* KL(Q‖P)/λ = ½√(h/λ)·NS₂(R) (``curvature_term``) with λ = ``lam`` (default √m,
  the order the paper gives as optimal); the paper's printed NS₂(R)/√λ is in
  ``ns_over_sqrt_lam``.
* λ/(2m).

Left symbolic: Ξ₃/λ: ln(1/δ)/λ and the union-bound costs of choosing the prior's
scales (γ, η) and λ from finite grids (eq. 34 gives only its order, Õ(hd) times a
constant in ε, δ, M, b, R and ``|Λ|``, whose exact form is in the paper's Appendix
D.5). The second-order error term E(L_S, Q) of Props. 4.x/6.1 does not appear:
Thm 6.1 bounds L_D(Q) through the measured L_S(Q).

**Vacuous bounds are said so.** The value bounds the expected bounded loss, which
never exceeds its range B (1 for the error). When the value is ≥ B the bound says
nothing, even before Ξ₃/λ is added: the status is then ``vacuous`` and the
diagnostic ``vacuous`` true (with ``vacuous_by`` = value − B). The posterior's own
error is ``ls_q``; at chance level (e.g. 0.9 for 10 classes) the noise of Q has
destroyed the network's function, a second sign the bound cannot be tight.

**The posterior Q (our reconstruction).** The theorem only states
‖Σ‖_F = O(λ^{-1/2}); its construction (Appendix D.5) is not in the text we
have. We take the decomposition of eq. 23, W = η Diag(e^{γ/2}) V Diag(c^{1/2}),
with V's posterior N(V̄, I): independent Gaussian noise on the entries of every
weight matrix (biases and normalization parameters are not perturbed), with
variances

.. math::

    \sigma^2_{l,ij} = \eta^2\, e^{\gamma_{l,i}}\, b_{l,j}, \qquad
    b_{l,j} = \sum_k U_l[k, j]\, e^{-\gamma_{l,k}}, \qquad
    \eta^2 = \frac{\sqrt{h/\lambda}}{\mathrm{NS}_2(R)}, \quad h = \sum_l (\text{columns of } W_l),

γ_l the minimizer of eq. 33 (its common shift cancels). Under the second-order
approximation this Q gives (A) = ½ Σ F σ² = ½ η² NS₂(R)² and, against a prior
of mean 0 and equal variances, KL = ½ Σ U/σ² = h/(2η²); η balances the two, so that
(A) = KL/λ = ½ √(h/λ) NS₂(R) (above). (The mirror choice
σ² = η² e^{γ_i} / a_j, a_j = Σ_i F_ij e^{γ_i}, gives the same two values.)
Diagnostics ``second_order_gap`` (½ η² NS₂², the surrogate-loss increase the
second-order approximation predicts under Q) and ``kl_over_lam`` (= ``curvature_term``) report them.
Rows whose γ reaches +R (dead ReLU nodes: a zero row of F costs nothing to
second order) get the largest noise the box allows; the Monte-Carlo term then
shows how far the second-order picture is off.

Invariance: Q moves with the weights under node-wise rescaling (σ_ij scales
like W_ij) as long as no γ sits at the box, so at equal seeds L_S(Q) and the
value are unchanged then; a row pinned at the box (dead node) keeps its noise
while its weights rescale. The measure therefore claims no invariance.

Larger means a looser bound (sharper).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..engine.linalg.sem import mean_stderr
from ..errors import MeasurementError
from . import Cost, Measure, MeasureResult
from ._hessian_diag import (
    DiagonalOptions,
    diagonal_cost,
    diagonal_reason,
    diagonal_shared,
    estimate_diagonal,
    jackknife,
)
from ._layers import class_outputs_or_error, weight_matrices
from ._options import Integral, OneOf, Optional, Real, opt
from .normalized_sharpness import normalized_sharpness_from_diagonal


@dataclass(frozen=True)
class NSBoundOptions(DiagonalOptions):
    """Options of ``ns_bound``."""

    box: float = opt(20.0, Real(0, None, "neither"), "R: γ ∈ [-box, box] (eq. 33)")
    lam: float | None = opt(None, Optional(Real(0, None, "neither")), "λ of eq. 32 (default √m)")
    mc_samples: int = opt(100, Integral(2, None), "Monte-Carlo draws θ ~ Q for L_S(Q)")
    confidence: float = opt(
        0.05, Real(0, 1, "neither"), "δ′ of the two-sided Hoeffding interval of L_S(Q)"
    )
    mc_loss: str = opt(
        "error", OneOf("error", "clipped_loss"), "bounded loss of L_S(Q): 0-1 error or clipped loss"
    )
    loss_clip: float = opt(
        1.0, Real(0, None, "neither"), "clipped_loss: per-sample loss clipped to [0, loss_clip]"
    )


def posterior_std(W: torch.Tensor, D: torch.Tensor, gamma: np.ndarray, eta2: float) -> torch.Tensor:
    r"""σ_ij = (η² e^{γ_i} b_j)^{1/2}, b_j = Σ_k W_kj² e^{−γ_k}, for W, D viewed as (rows × rest); shaped like W."""
    W2 = W.reshape(W.shape[0], -1).double().cpu()
    g = torch.as_tensor(gamma, dtype=torch.float64)
    g = g - g.max()  # the common shift cancels; keep e^{γ} ≤ 1
    b = (W2 * W2 * torch.exp(-g)[:, None]).sum(0)
    return (eta2 * torch.exp(g)[:, None] * b[None, :]).sqrt().reshape(W.shape)


def _bounded_loss(ctx, opts: NSBoundOptions):
    """θ ↦ the mean bounded loss over S (forward passes only) and its range B."""
    p = ctx.problem
    error = opts.mc_loss == "error"
    if error:
        two = p.batch.select(slice(0, 2))
        with torch.no_grad():
            out = p.forward(p.params, two)
        c = p.loss_fn.classes(out, two)
        class_outputs_or_error(
            out if c is None else c[0],
            two.target if c is None else c[1],
            "The 'mc_loss' parameter of ns_bound is 'error', which",
            "Use mc_loss: clipped_loss.",
        )

    def unit(Z, t):
        if error:
            return (Z.argmax(-1) != t).double()
        return p.loss_fn.unit_losses(Z, t).double().clamp(0.0, opts.loss_clip)

    def loss(th: torch.Tensor) -> float:
        return (
            float(ctx.engine.per_unit(unit, th, classes=error).sum()) / p.n
        )  # one forward pass over S

    return loss, (1.0 if opts.mc_loss == "error" else opts.loss_clip)


def _ns(p, model, diag, box):
    params = {n: t.detach() for n, t in p.params.items()}
    return normalized_sharpness_from_diagonal(model, params, p.param_slices(), diag, box)


class NsBound(Measure):
    r"""L̂_S(Q) + Hoeffding half-width + ½√(h/λ)·NS₂(R) + λ/(2m); larger = looser bound (sharper).

    With K draws from the posterior Q, a loss of range B, δ′ = ``confidence``, h the
    columns of all weight matrices, m the size of the measurement set, λ = ``lam`` and
    NS₂(R) the `normalized_sharpness` with ``box`` = R:

    .. math::

        \hat L_S(Q) + B\sqrt{\frac{\ln(2/\delta')}{2K}}
        + \frac{\sqrt h}{2}\,\frac{\mathrm{NS}_2(R)}{\sqrt\lambda} + \frac{\lambda}{2m}.

    Parameters (options)
    --------------------
    hessian_diag, samples, radius, eps, check, check_probes, max_exact : the diagonal, as in
        `normalized_sharpness` (default ``auto``).
    box : float, default 20 — R of eq. 33.
    lam : float, default √m — λ of eq. 32.
    mc_samples : int, default 100 — K draws from Q.
    confidence : float, default 0.05 — δ′ of the Hoeffding interval.
    mc_loss : {"error", "clipped_loss"}, default "error" — the bounded loss of L_S(Q).
    loss_clip : float, default 1 — the range of ``clipped_loss``.

    Diagnostics: ``ls_q`` (Monte-Carlo mean), ``ls_q_stderr``, ``ls_q_hoeffding``
    ([lower, upper]), ``hoeffding_width``, ``ls_theta`` (the bounded loss at θ̄),
    ``ns_r`` (NS₂(R)), ``curvature_term`` (KL/λ = ½√(h/λ)·NS₂(R)), ``ns_over_sqrt_lam``
    (the paper's printed NS₂(R)/√λ), ``lam``, ``lam_term`` (λ/2m), ``m``, ``h``,
    ``eta2``, ``second_order_gap`` (½η²NS₂²), ``kl_over_lam`` (h/(2λη²)),
    ``posterior_std_max``, ``box_hit``, ``vacuous`` and ``vacuous_by`` (value − B;
    status ``vacuous`` when ≥ 0), ``symbolic`` (what is left out), the diagonal's
    ``diag_*`` and the engine's counts.

    References: Tsuzuku, Sato & Sugiyama (2020), ICML, Thm. 6.1, eqs. 23, 26,
    32–34; Hoeffding (1963).
    """

    name = "ns_bound"
    options = NSBoundOptions
    description = (
        "Computable part of Tsuzuku et al.'s PAC-Bayes bound for the sampled posterior Q: Hoeffding upper end of "
        "L_S(Q) by Monte Carlo + KL(Q‖P)/λ = ½√(h/λ)·NS₂(R) + λ/(2m) (Ξ₃/λ left symbolic); status vacuous when ≥ the loss range."
    )
    reference = "Tsuzuku, Sato & Sugiyama, ICML 2020, Thm. 6.1 (eqs. 32–34), NS₂(R) of eqs. 26/33"
    stochastic = True
    invariant = False

    def declare_cost(self, o, d) -> Cost:
        """The diagonal of `normalized_sharpness` (``hessian_diag``, over the weight matrices) and
        the posterior's ``mc_samples`` forward passes with the one at θ."""
        return diagonal_cost(o, d, d.matrices) + Cost(forward=o.mc_samples + 1)

    def shared(self, o, d):
        return diagonal_shared(o, d, d.matrix_tensors)

    def applicable(self, o, p):
        return diagonal_reason(o, p)

    def compute(self, ctx, opts: NSBoundOptions) -> MeasureResult:
        p, model = ctx.problem, ctx.model
        wms = [wm for wm in weight_matrices(model) if wm.param_name in p.param_slices()]
        est = estimate_diagonal(ctx, opts, [wm.param_name for wm in wms])
        diag = est.mean()
        ns, sols = _ns(p, model, diag, opts.box)
        ns_se, _ = jackknife(est, lambda d: _ns(p, model, d, opts.box)[0], ns)
        if not (math.isfinite(ns) and ns > 0):
            raise MeasurementError(
                f"ns_bound: NS₂(R) = {ns}; the posterior scale η² = √(h/λ)/NS₂(R) is undefined"
            )
        m = p.n
        lam = float(opts.lam) if opts.lam is not None else math.sqrt(m)
        h = sum(wm.columns for wm in wms)
        eta2 = math.sqrt(h / lam) / ns
        slices = p.param_slices()
        theta = p.theta
        std = torch.zeros(p.num_params, dtype=torch.float64)
        for wm in wms:
            sol = sols[wm.module_name or wm.param_name]
            sl = slices[wm.param_name]
            W = p.params[wm.param_name]
            s = posterior_std(
                wm.as_matrix(W), wm.as_matrix(diag[sl].reshape(W.shape)), sol.gamma, eta2
            )
            std[sl] = wm.from_matrix(s).reshape(-1)
        loss, B = _bounded_loss(ctx, opts)
        ls_theta = loss(theta)
        gen = ctx.generator(offset=1)
        draws = []
        for _ in range(opts.mc_samples):
            eps_ = torch.randn(p.num_params, generator=gen, dtype=torch.float64)
            draws.append(loss(theta + (std * eps_).to(theta.device, theta.dtype)))
        draws = np.asarray(draws)
        K = len(draws)
        mean, mc_se = mean_stderr(draws)
        width = B * math.sqrt(math.log(2.0 / opts.confidence) / (2 * K))
        curvature = h / (2 * lam * eta2)  # KL(Q‖P)/λ = ½√(h/λ)·NS₂(R)
        lam_term = lam / (2 * m)
        value = mean + width + curvature + lam_term
        stderr = math.sqrt(
            mc_se**2 + (0.0 if ns_se is None else 0.5 * math.sqrt(h / lam) * ns_se) ** 2
        )
        hits = [k for k, s in sols.items() if s.box_hit]
        diagnostics = {
            **est.info,
            "ls_q": mean,
            "ls_q_stderr": mc_se,
            "ls_q_hoeffding": [mean - width, mean + width],
            "hoeffding_width": width,
            "ls_theta": ls_theta,
            "mc_loss": opts.mc_loss,
            "loss_range": B,
            "ns_r": ns,
            "ns_r_stderr": ns_se,
            "box": opts.box,
            "curvature_term": curvature,
            "ns_over_sqrt_lam": ns / math.sqrt(lam),
            "lam": lam,
            "lam_term": lam_term,
            "m": m,
            "h": h,
            "eta2": eta2,
            "second_order_gap": 0.5 * eta2 * ns * ns,
            "kl_over_lam": h / (2 * lam * eta2),
            "posterior_std_max": float(std.max()),
            "box_hit": bool(hits),
            "box_hit_layers": hits,
            "vacuous": value >= B,
            "vacuous_by": value - B,
            "symbolic": "Ξ₃/λ, Ξ₃ = Õ(hd)·C(ε, δ, M, b, R, |Λ|) (eq. 34); confidence 1 − δ − δ′",
        }
        status = "vacuous" if value >= B else "ok"
        return MeasureResult(value=value, stderr=stderr, diagnostics=diagnostics, status=status)
