"""One checkpoint's time budget (``runtime.budget``, ``--budget``) shared among its measures.

Each measure gets, when it starts, the seconds left of the checkpoint's budget times its share of
the predicted cost of the measures not yet run: ``left × w_i / Σ_{j ≥ i} w_j``. The time already
spent is thereby subtracted, and what an earlier measure left unused flows to the later ones.
The weight ``w`` of a measure is the geometric mean of the least and the most of its registry
``estimate`` (the products it will count, `flatcli.measures.MeasureSpec.estimate`; the geometric
mean because adaptive estimators' caps, e.g. local_entropy's 400 SLQ runs, lie far above what they
usually spend), in HVP equivalents: one HVP
counts 1, a gradient or a VJP 0.5, a forward pass 0.2 (a Hessian-vector product is a double
backward, about twice a gradient; a gradient about 2–3 forward passes). A measure without an
estimate counts as one HVP. The share is the measure's ``max_seconds`` unless it set a smaller
one itself (`flatcli.measures.MeasureSpec.budget`).

A sweep measures each (checkpoint, measure) unit on its own, possibly on different workers and in
any order, so there nothing flows: each unit gets the fixed share ``total × w_i / Σ_j w_j`` of all
the configured measures (``among``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from .measures import Dims, MeasureSpec

WEIGHTS = {"n_hvp": 1.0, "n_grad": 0.5, "n_vjp": 0.5, "n_forward": 0.2}


def predicted_cost(spec: MeasureSpec, dims: Dims) -> float:
    """The geometric mean of ``spec``'s least and most predicted products, in HVP equivalents (1
    without an estimate)."""
    est = spec.estimate(dims)
    if not est:
        return 1.0
    cost = sum(WEIGHTS.get(k, 0.0) * math.sqrt(lo * hi) for k, (lo, hi) in est.items())
    return max(1.0, float(cost))


class BudgetPlan:
    """Seconds of a checkpoint's budget ``total`` for each measure of ``specs`` in turn (module
    docstring); the clock starts at construction.

    >>> from flatcli.measures import MeasureSpec
    >>> t = [0.0]
    >>> plan = BudgetPlan(30.0, [1.0, 2.0, 3.0], clock=lambda: t[0])
    >>> plan.share(0)
    5.0
    >>> t[0] = 2.0  # the first measure used 2 of its 5 s: the 3 left flow to the others
    >>> plan.share(1)
    11.2
    """

    def __init__(
        self,
        total: float,
        weights: Sequence[float],
        clock: Callable[[], float] = time.perf_counter,
        fixed: Sequence[float] | None = None,
    ):
        self.total, self.weights, self.clock = (
            float(total),
            [max(1e-12, float(w)) for w in weights],
            clock,
        )
        self.fixed = None if fixed is None else list(fixed)
        self.start = clock()

    @classmethod
    def of(
        cls,
        total: float | None,
        specs: Sequence[MeasureSpec],
        dims: Callable[[], Dims],
        among: Sequence[MeasureSpec] | None = None,
    ) -> BudgetPlan | None:
        """The plan of ``total`` seconds over ``specs`` (``dims`` computes the sizes the estimates need,
        called only with a budget); None without a budget. With ``among`` (every measure of the
        checkpoint, ``specs`` some of them), each of ``specs`` gets its fixed share of ``total``."""
        if total is None:
            return None
        d = dims()
        weights = [predicted_cost(s, d) for s in specs]
        if among is not None:
            every = sum(predicted_cost(s, d) for s in among)
            return cls(total, weights, fixed=[total * w / every for w in weights])
        return cls(total, weights)

    def left(self) -> float:
        """Seconds of the budget left now."""
        return max(0.0, self.total - (self.clock() - self.start))

    def share(self, i: int) -> float:
        """The seconds measure ``i`` may spend, if it starts now."""
        if self.fixed is not None:
            return self.fixed[i]
        rest = sum(self.weights[i:])
        return self.left() * self.weights[i] / rest
