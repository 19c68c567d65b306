r"""Local entropy under the quadratic approximation (Chaudhari et al. 2017; Hochreiter & Schmidhuber 1997).

Chaudhari et al. (ICLR 2017, eq. 3) define the local entropy of θ as the log of
the Gaussian-smoothed Gibbs volume :math:`\int \exp(-L(\theta') - \tfrac{\gamma}{2}\|\theta - \theta'\|^2) d\theta'`.
With the quadratic approximation :math:`L(\theta') \approx L(\theta) + \tfrac12 \delta^\top H_+ \delta`
(negative curvature clipped to 0), the log-volume lost to curvature relative to a
flat basin is

.. math:: E = \tfrac12 \log\det(I + H_+/\gamma) = \tfrac12 \sum_i \log(1 + \max(\lambda_i, 0)/\gamma),

reported as the value (larger means sharper). Estimated by stochastic Lanczos
quadrature (`flatcli.engine.linalg.slq`): ``slq_runs`` Rademacher starts,
``slq_steps`` Lanczos steps each, Ritz values below 0 clipped to 0; ``stderr``
over runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..engine import linalg
from . import MeasureResult, register
from ._options import Integral, Real, opt


@dataclass(frozen=True)
class LocalEntropyOptions:
    """Options of ``local_entropy``."""

    gamma: float = opt(
        1.0,
        Real(0, None, "neither"),
        "coupling γ of the smoothing (scale of curvature that counts)",
    )
    slq_runs: int = opt(4, Integral(1, None), "SLQ random starts")
    slq_steps: int = opt(25, Integral(1, None), "Lanczos steps per SLQ run (one HVP each)")


@register(
    "local_entropy",
    options=LocalEntropyOptions,
    description="Local-entropy volume loss ½ log det(I + H₊/γ) by stochastic Lanczos quadrature.",
    reference="Chaudhari et al. 2017 (Entropy-SGD, eq. 3, quadratic approximation); Hochreiter & Schmidhuber 1997",
    stochastic=True,
    cost="slq_runs·slq_steps HVPs (defaults 4 × 25 = 100, PyHessian's density budget)",
    estimate=lambda o, d: {"n_hvp": o.slq_runs * min(o.slq_steps, d.P)},
)
def local_entropy(ctx, opts: LocalEntropyOptions) -> MeasureResult:
    r""":math:`\tfrac12\log\det(I + H_+/\gamma)` by SLQ, larger means sharper.

    Diagnostics: ``runs``, ``steps`` (Lanczos steps per run, capped by the number
    of parameters), ``max_ritz``, ``min_ritz`` (over runs) and
    ``negative_weight`` (the SLQ mass on negative Ritz values, clipped to 0)."""
    eng = ctx.engine
    r = linalg.slq(eng.hessian(), runs=opts.slq_runs, steps=opts.slq_steps, generator=ctx.generator())
    gamma = opts.gamma
    value, se = r.expect(lambda t: 0.5 * np.log1p(np.maximum(t, 0.0) / gamma))
    neg = float(np.mean([np.sum(w[t < 0]) for t, w in zip(r.nodes, r.weights, strict=True)]))
    diag = {
        "runs": opts.slq_runs,
        "steps": int(max(len(t) for t in r.nodes)),
        "max_ritz": float(max(np.max(t) for t in r.nodes)),
        "min_ritz": float(min(np.min(t) for t in r.nodes)),
        "negative_weight": neg,
    }
    return MeasureResult(value=value, stderr=se if opts.slq_runs > 1 else None, diagnostics=diag)
