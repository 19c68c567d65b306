r"""Fisher-Rao norm (Liang, Poggio, Rakhlin & Stokes, AISTATS 2019).

.. math:: \|\theta\|_{fr}^2 = \frac1n \sum_{(x, y) \in S} \langle \theta, \nabla_\theta \ell(x, y; \theta) \rangle^2

(the empirical form of their Definition 2 with the expectation over S). The
directional derivatives :math:`\langle \theta, \nabla_\theta \ell_i \rangle` of
all samples of a batch come from *one* forward-mode product through the engine
(`flatcli.engine.CurvatureEngine.per_unit_directional`): the Jacobian-vector
product of the vector of per-sample losses in the direction θ (the double-backward
trick when an operation has no forward-mode rule), one pass per batch.

For bias-free ReLU networks with L hidden layers, f is (L+1)-homogeneous in θ,
so ⟨θ, ∇_θ f⟩ = (L+1) f and the norm equals (L+1)² · mean ⟨∂ℓ/∂f, f⟩²
(their Theorem 3.1): the test oracle.

Invariance: rescaling a hidden ReLU node (incoming weights and bias × α, outgoing weights × 1/α)
scales those parameters' gradients by 1/α and α, so every product θ_j ∂ℓ/∂θ_j, and hence
⟨θ, ∇ℓ⟩ and the norm, is unchanged (Liang et al. 2019, §3); the measure claims invariance.

``labels: data`` uses the measurement set's labels; ``labels: model`` draws each
label from the model's softmax (seeded), the "model Fisher" variant (cross-entropy
only).

BatchNorm. With ``fold_batchnorm: true`` (default) every BatchNorm that follows a
Linear/Conv layer is folded into it first (`flatcli.measures._bn`) and θ is the
folded parameter vector (W' = diag(γ/√(σ²+ε)) W, b'; no γ, β): the norm of the
eval-mode function's own layers, as for the norm measures. The raw
parameterization (W, b, γ, β) is a different quantity, kept with
``fold_batchnorm: false``: in eval mode BatchNorm is a fixed affine map (running
statistics), so the layer before it is *not* scale-invariant and its weights do
contribute to ⟨θ, ∇ℓ⟩ (only batch statistics, in train mode, would make it
degree 0). Per sample, with z = Wx + b, s = γ/√(σ²+ε) and the BatchNorm output
y = s∘(z − μ) + β: the folded pair contributes :math:`\langle y, \nabla_y \ell\rangle`;
the raw one contributes that through γ and β, plus :math:`\langle W, \nabla_W\ell\rangle +
\langle b, \nabla_b\ell\rangle = \langle s \circ z, \nabla_y \ell\rangle` (= ⟨y − β + s∘μ, ∇_yℓ⟩,
summed over positions for convolutions), so the scale direction is
counted twice in the raw form: on the ConvBN test network the raw value is 0.652,
the folded one 0.257 (tests/measures/test_fisher_rao.py). When something was folded, the
diagnostic ``raw_parameterization_value`` reports the raw form as well (one more
forward-mode pass over S).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..engine.linalg.sem import mean_stderr
from ..errors import ConfigError
from . import Cost, Measure, MeasureResult
from ._bn import folded_measurement, folding_reason
from ._options import Bool, OneOf, opt


@dataclass(frozen=True)
class FisherRaoOptions:
    """Options of ``fisher_rao_norm``."""

    labels: str = opt(
        "data", OneOf("data", "model"), "labels from the data, or drawn from the model's softmax"
    )
    fold_batchnorm: bool = opt(
        True, Bool(), "fold BatchNorm into the preceding layer first (θ = the folded parameters)"
    )


class FisherRaoNorm(Measure):
    r""":math:`\|\theta\|_{fr}^2`, larger means a larger predicted gap; exact for
    ``labels: data`` (``stderr`` None). For ``labels: model`` the labels are a
    seeded draw and ``stderr`` is the standard error of the mean of the
    per-sample terms. Diagnostics: ``labels``, ``mean_abs_direction`` (mean of
    \|⟨θ, ∇ℓ_i⟩\|), ``n_jvp`` (forward-mode passes over S), ``folded_batchnorm``, and
    ``raw_parameterization_value`` (the same mean on the unfolded W, b, γ, β) when a
    BatchNorm was folded."""

    name = "fisher_rao_norm"
    options = FisherRaoOptions
    description = "Fisher-Rao norm: mean over S of ⟨θ, ∇_θ ℓ(x, y; θ)⟩² (forward-mode, per-sample)."
    reference = "Liang, Poggio, Rakhlin & Stokes 2019 (AISTATS, Def. 2 and Thm. 3.1); Jiang et al. 2020 (§C)"
    stochastic = False
    invariant = True

    def declare_cost(self, o, d) -> Cost:
        """One pass over the measurement set for the per-sample directions (a second with a folded
        BatchNorm, for ``raw_parameterization_value``); ``labels: model`` adds the forward pass that
        draws the labels."""
        return Cost(grad=(1, 1 + int(o.fold_batchnorm)), forward=int(o.labels == "model"))

    def applicable(self, o, p):
        return folding_reason(p, o.fold_batchnorm)

    def compute(self, ctx, opts: FisherRaoOptions) -> MeasureResult:
        fm = folded_measurement(ctx, opts.fold_batchnorm)
        try:
            res = _fisher_rao(ctx, fm, opts)
        finally:
            fm.merge_counters(ctx.engine)
        labels = res.diagnostics.pop("_labels", None)
        if (
            fm.own or not fm.diagnostics["folded_batchnorm"]
        ):  # nothing folded: the raw form is the value
            return res
        d = ctx.engine.per_unit_directional(ctx.problem.theta, labels=labels).double()
        res.diagnostics["raw_parameterization_value"] = float((d * d).mean())
        res.diagnostics["n_jvp"] += 1
        return res


def _fisher_rao(ctx, fm, opts: FisherRaoOptions) -> MeasureResult:
    p = fm.problem
    theta = p.theta
    gen = ctx.generator()
    if opts.labels == "model" and p.loss_name not in ("cross_entropy", "causal_lm"):
        raise ConfigError(
            "The 'labels' parameter of fisher_rao_norm is 'model', which needs loss: cross_entropy or "
            f"causal_lm (labels drawn from the softmax); the loss is {p.loss_name!r}. Use labels: data."
        )
    labels = None
    if opts.labels == "model":  # one label per sample drawn from the softmax (one forward pass)
        probs = fm.engine.per_unit(lambda Z, t: torch.softmax(Z.double(), dim=1))
        labels = torch.multinomial(probs.cpu(), 1, generator=gen)[:, 0].to(p.device)
    d = fm.engine.per_unit_directional(theta, labels=labels).double()
    sq = d * d
    value = float(sq.mean())
    diag = {
        "labels": opts.labels,
        "mean_abs_direction": float(d.abs().mean()),
        "n_jvp": 1,
        **fm.diagnostics,
    }
    if not fm.own:
        diag["_labels"] = labels  # the same draws for the raw parameterization
    if not math.isfinite(value):
        return MeasureResult(value=value, diagnostics=diag, status="non_finite")
    stderr = float(mean_stderr(sq)[1]) if opts.labels == "model" else None
    return MeasureResult(value=value, stderr=stderr, diagnostics=diag)
