r"""Norm baselines (Jiang et al. 2020; Neyshabur et al. 2017)."""

from __future__ import annotations

from . import MeasureResult, register
from ._layers import weight_matrices


@register(
    "frobenius_norm",
    description="Sum over weight matrices of the squared Frobenius norm, Σ_l ‖W_l‖_F².",
    reference="Jiang et al. 2020 (§C, 'frob-distance' family); Neyshabur et al. 2017",
    cost="none (parameters only)",
)
def frobenius_norm(ctx, opts) -> MeasureResult:
    r""":math:`\sum_l \|W_l\|_F^2` over Linear and Conv weights (biases excluded).
    Larger means a larger predicted gap."""
    p = ctx.problem
    per_layer = {}
    total = 0.0
    for wm in weight_matrices(ctx.model):
        w = p.params[wm.param_name].double()
        v = float((w * w).sum())
        per_layer[wm.module_name] = v
        total += v
    return MeasureResult(value=total, diagnostics={"layers": per_layer})
