"""One checkpoint's time budget (``runtime.budget``, ``--budget``) shared among its measures.

Each measure is weighed by its predicted **seconds**: the least its registry ``estimate`` declares
(products, passes, vector operations), timed on this checkpoint (`flatcli.run.predict.Fit`: one
forward pass, one gradient, one HVP); at least one forward pass. A measure predicted to end
``not_applicable`` weighs 0.

When measure ``i`` starts with ``left`` seconds of the budget left and ``S`` the predicted seconds
of it and the measures after it, its share is

    max(left × p_i / S,  left − (S − p_i))

* the budget is large enough (``left ≥ S``): the second term, everything except what the later
  measures are predicted to need. A measure that needs more than predicted (an adaptive estimator
  that converges late) may therefore use the slack of the whole budget, so a budget at least as
  large as the unbudgeted cost stops nothing and changes no value;
* the budget is short (``left < S``): the first term, the measure's part of what is left in
  proportion to its prediction. A measure stopped by its share returns its estimate so far
  (status ``budget``); one that cannot stop early is not started when its prediction exceeds its
  share. Either way what it left unused flows on to the measures after it, and the last one gets
  all that is left, so a short budget is spent.

The least, not the most, of a declared range is what a measure reserves: an adaptive estimator's
cap (``local_entropy`` declares 100–10,000 products) never takes the time of the measures before
it. The share is the measure's ``max_seconds`` unless it set a smaller one itself
(`flatcli.measures.MeasureSpec.budget`).

A sweep measures each (checkpoint, measure) unit on its own, possibly on different workers and in
any order, so there nothing flows: each unit gets the fixed share ``total × p_i / Σ_j p_j`` of all
the configured measures (``among``), ``p`` there the least products in HVP equivalents
(`least_work`), so that every worker computes the same shares.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ..measures import Dims, MeasureSpec

WEIGHTS = {"n_hvp": 1.0, "n_grad": 0.5, "n_vjp": 0.5, "n_forward": 0.2}


def least_work(spec: MeasureSpec, dims: Dims) -> float:
    """The least products ``spec``'s estimate declares, in HVP equivalents (an HVP 1, a gradient
    or VJP pass 0.5, a forward pass 0.2), at least one forward pass: a sweep's weight, the same on
    every worker (timings are not)."""
    est = spec.estimate(dims) or {}
    return max(0.2, hvp_equivalents({k: lo for k, (lo, _) in est.items()}))


def hvp_equivalents(counts: dict[str, float]) -> float:
    """Counters (``n_hvp``, ``n_grad``, ...) in HVP equivalents (`WEIGHTS`)."""
    return sum(WEIGHTS.get(k, 0.0) * float(n) for k, n in counts.items())


class BudgetSplit:
    """Seconds of a checkpoint's budget ``total`` for each measure in turn, from ``costs`` (the
    predicted seconds of each, module docstring); the clock starts at construction (or ``start``).

    >>> t = [0.0]
    >>> split = BudgetSplit(30.0, [1.0, 2.0, 3.0], clock=lambda: t[0])
    >>> split.share(0)  # enough: all but the 5 s the others need
    25.0
    >>> t[0] = 26.0  # the first measure used 26 s: 4 s left for 5 s predicted
    >>> split.share(1)
    1.6
    """

    def __init__(
        self,
        total: float,
        costs: Sequence[float],
        clock: Callable[[], float] | None = None,
        fixed: Sequence[float] | None = None,
        start: float | None = None,
    ):
        clock = clock or time.perf_counter  # read now (a test may replace time.perf_counter)
        self.total, self.clock = float(total), clock
        self.costs = [max(0.0, float(c)) for c in costs]
        self.fixed = None if fixed is None else list(fixed)
        self.start = clock() if start is None else start

    @classmethod
    def of(
        cls,
        total: float | None,
        specs: Sequence[MeasureSpec],
        cost: Callable[[Sequence[MeasureSpec]], list[float]],
        among: Sequence[MeasureSpec] | None = None,
        clock: Callable[[], float] | None = None,
    ) -> BudgetSplit | None:
        """The split of ``total`` seconds over ``specs``; ``cost(specs)``: their predicted seconds,
        in order (called only with a budget, on the split's clock; `flatcli.run.predict.Fit.cost`
        weighs work they share once); None without a budget. With ``among`` (every measure of the
        checkpoint, ``specs`` some of them), each of ``specs`` gets its fixed share of ``total``."""
        if total is None:
            return None
        clock = clock or time.perf_counter
        start = clock()
        costs = list(cost(specs))
        if among is not None:
            every = sum(cost(among))
            fixed = [total * c / every if every > 0 else total / len(among) for c in costs]
            return cls(total, costs, clock, fixed=fixed, start=start)
        return cls(total, costs, clock, start=start)

    def left(self) -> float:
        """Seconds of the budget left now."""
        return max(0.0, self.total - (self.clock() - self.start))

    def share(self, i: int) -> float:
        """The seconds measure ``i`` may spend, if it starts now (module docstring)."""
        if self.fixed is not None:
            return self.fixed[i]
        left, rest = self.left(), sum(self.costs[i:])
        if rest <= 0.0:
            return left
        return max(left * self.costs[i] / rest, left - (rest - self.costs[i]))


def stopped_by_share(spec: MeasureSpec, result) -> bool:
    """Whether ``result`` of ``spec`` ended because its share of the budget ran out (started,
    stopped early with its estimate so far), not by a cap of its own (``max_seconds``,
    ``max_hvps``)."""
    if result is None or result.status != "budget" or not spec.stops_early():
        return False
    if result.diagnostics.get("started") is False:
        return False
    return spec.max_seconds is None and spec.max_hvps is None


def continuations(split: BudgetSplit | None, specs: Sequence[MeasureSpec], results: dict):
    """(index, share) of each measure of ``specs`` to run again, in order, once every measure has
    run: those stopped by their share (`stopped_by_share`, ``results``: label → result) while
    time is left. Each gets the seconds left in proportion to the predicted seconds of those still
    to go (the last all of them), and is run again only when that is at least twice what it had
    spent: a seeded estimator run again repeats its first products and goes on from there, so the
    second run's estimate is the one a larger share would have given. Nothing in a sweep (fixed
    shares) or without a budget. A generator: the time left is read as each one starts."""
    if split is None or split.fixed is not None:
        return
    todo = [i for i, s in enumerate(specs) if stopped_by_share(s, results.get(s.label))]
    for n, i in enumerate(todo):
        rest = sum(split.costs[j] for j in todo[n:])
        weight = split.costs[i] / rest if rest > 0 else 1.0 / (len(todo) - n)
        share = split.left() * weight
        if share >= 2.0 * results[specs[i].label].seconds:
            yield i, share


def continued(first, second):
    """The result of a measure run again with more time (`continuations`): the second run's, its
    seconds both runs' together (``continued_after_seconds``: the first's); the first when the
    second did not end ``ok``/``budget`` (a failure keeps the estimate so far)."""
    if second is None or second.status not in ("ok", "budget", "near_zero"):
        return first
    diag = {**second.diagnostics, "continued_after_seconds": first.seconds}
    return type(second)(
        value=second.value,
        stderr=second.stderr,
        diagnostics=diag,
        seconds=first.seconds + second.seconds,
        status=second.status,
    )


def in_turn(
    split: BudgetSplit | None,
    specs: Sequence[MeasureSpec],
    results: dict,
    run,
    after,
    again: bool = True,
):
    """``run(spec, share)`` for each of ``specs`` in turn with its share of ``split`` (None without
    a budget), ``after(label)`` once each has run; then, with time left and ``again`` (False across
    ranks: the clocks differ), those stopped by their share again (`continuations`, `continued`):
    their results in ``results`` (label → result)."""
    for i, spec in enumerate(specs):
        run(spec, None if split is None else split.share(i))
        after(spec.label)
    for i, share in continuations(split if again else None, specs, results):
        label = specs[i].label
        first = results[label]
        run(specs[i], share)
        results[label] = continued(first, results.get(label))
        after(label)
