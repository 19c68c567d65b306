"""One checkpoint's time budget (``runtime.budget``, ``--budget``) shared among its measures.

Each measure is weighed by its predicted **seconds**: the least its registry ``estimate`` declares
(products, passes, vector operations), timed on this checkpoint (`flatcli.run.prediction.predict.Fit`: one
forward pass, one gradient, one HVP); at least one forward pass. A measure predicted to end
``not_applicable`` weighs 0.

Each measure also has a **minimum** ``m``: the predicted seconds it needs to return a value at all
(`flatcli.run.prediction.predict.Fit.minimum`: its least seconds when it cannot stop early; its first unit
of work, two products or one pass, when it can). Minima come first:

* **at the start**, every measure that stops early is kept (it always returns a value, from its
  first unit of work), then those that cannot whose minima fit the budget beside them, the
  cheapest first; every other one is refused at once (status ``budget``, not started, the reason
  naming its minimum), and the run says so before the first measure;
* when measure ``i`` starts with ``left`` seconds left, the later measures whose minima fit
  ``left`` beside it (the cheapest first) are those it must leave time for. With ``S`` and ``M``
  the sums of their (and its) least seconds ``p`` and minima ``m``, its share is

      left − (S − p_i)                                  when left ≥ S
      m_i + (left − M) × (p_i − m_i) / (S − M)          otherwise

  The first: everything except what the later measures are predicted to need; a measure that
  needs more than predicted (an adaptive estimator that converges late) may use the slack of the
  whole budget, so a budget at least as large as the unbudgeted cost stops nothing and changes no
  value. The second: its minimum, and of what is left above the minima a part in proportion to
  the least work it has beyond its minimum (its tolerance share); a measure that cannot stop
  early has ``m = p`` and gets exactly its prediction. A measure that stops early passes its share
  by about one product (`flatcli.engine.linalg.Budget`): its share is that much smaller
  (``overrun``; never below its minimum) unless it is the last, so the later minima stay whole.
  A measure stopped by its share returns its estimate so far (status ``budget``); what it left
  unused flows on, and the last one gets all that is left, so a short budget is spent.

The least, not the most, of a declared range is what a measure reserves: an adaptive estimator's
cap (``local_entropy`` declares 100–10,000 products) never takes the time of the measures before
it. The share is the measure's ``max_seconds`` unless it set a smaller one itself
(`flatcli.measures.MeasureSpec.budget`).

Under a budget the measures that cannot stop early run first, those with one declared count
before those with a wide range (`budget_order`).

A sweep measures each (checkpoint, measure) unit on its own, possibly on different workers and in
any order, so there nothing flows: each unit gets the fixed share ``total × p_i / Σ_j p_j`` of all
the configured measures (``among``), ``p`` there the least products in HVP equivalents
(`least_work`), so that every worker computes the same shares.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ...measures import Dims, MeasureSpec

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
    predicted least seconds of each) and ``minima`` (the seconds each needs to return a value at
    all; default its cost; module docstring); the clock starts at construction (or ``start``).
    ``refused``: index → why a measure is not started, decided at the start (its minimum does not
    fit beside the others'; never one that stops early, ``early``).

    >>> t = [0.0]
    >>> split = BudgetSplit(30.0, [1.0, 2.0, 3.0], clock=lambda: t[0])
    >>> split.share(0)  # enough: all but the 5 s the others need
    25.0
    >>> t[0] = 26.0  # it used 26 s: 4 s left hold the 2 s measure's least, not both (5 s)
    >>> split.share(1)
    4.0
    >>> t[0] = 28.0  # it used 2 s: the last one gets what is left
    >>> split.share(2)
    2.0
    """

    def __init__(
        self,
        total: float,
        costs: Sequence[float],
        clock: Callable[[], float] | None = None,
        fixed: Sequence[float] | None = None,
        start: float | None = None,
        minima: Sequence[float] | None = None,
        overrun: Sequence[float] | None = None,
        early: Sequence[bool] | None = None,
    ):
        clock = clock or time.perf_counter  # read now (a test may replace time.perf_counter)
        self.total, self.clock = float(total), clock
        self.costs = [max(0.0, float(c)) for c in costs]
        self.minima = [
            min(max(0.0, float(m)), c)
            for m, c in zip(self.costs if minima is None else minima, self.costs, strict=True)
        ]
        self.overrun = [0.0] * len(self.costs) if overrun is None else list(overrun)
        self.early = [False] * len(self.costs) if early is None else [bool(e) for e in early]
        self.fixed = None if fixed is None else list(fixed)
        self.start = clock() if start is None else start
        self.refused: dict[int, str] = {}
        if self.fixed is None:
            every = range(len(self.costs))
            keep = self._fitting(every, self.total)
            need = sum(self.minima)
            for i in every:
                if i not in keep:
                    self.refused[i] = (
                        f"not started: it needs at least {self.minima[i]:.3g} s to return a "
                        f"value, and the {self.total:.3g} s budget does not hold that beside "
                        f"the other measures' least ({need - self.minima[i]:.3g} s)"
                    )

    def _fitting(self, among, left: float) -> set[int]:
        """The measures of ``among`` whose minima fit ``left`` seconds together: every one that
        stops early (it always returns a value, from its first unit of work) or needs no time,
        then those that cannot, the cheapest first (the most measures with a value)."""
        keep = {j for j in among if self.early[j]}
        used = sum(self.minima[j] for j in keep)
        for j in sorted(set(among) - keep, key=lambda j: (self.minima[j], j)):
            if self.minima[j] == 0.0 or used + self.minima[j] <= left * (1 + 1e-12):
                keep.add(j)
                used += self.minima[j]
        return keep

    @classmethod
    def of(
        cls,
        total: float | None,
        specs: Sequence[MeasureSpec],
        cost: Callable[[Sequence[MeasureSpec]], list[float]],
        among: Sequence[MeasureSpec] | None = None,
        clock: Callable[[], float] | None = None,
        minima: Callable[[Sequence[MeasureSpec]], list[float]] | None = None,
        overrun: Callable[[Sequence[MeasureSpec]], list[float]] | None = None,
    ) -> BudgetSplit | None:
        """The split of ``total`` seconds over ``specs``; ``cost(specs)``: their predicted seconds,
        in order (called only with a budget, on the split's clock; `flatcli.run.prediction.predict.Fit.cost`
        weighs work they share once); ``minima(specs)``: the seconds each needs to return a
        value (`flatcli.run.prediction.predict.Fit.minima`; default its cost); ``overrun(specs)``: the
        seconds each may pass its share by (`flatcli.run.prediction.predict.Fit.overrun`: one product for a
        measure that stops early); None without a budget. With
        ``among`` (every measure of the checkpoint, ``specs`` some of them), each of ``specs``
        gets its fixed share of ``total``."""
        if total is None:
            return None
        clock = clock or time.perf_counter
        start = clock()
        costs = list(cost(specs))
        if among is not None:
            every = sum(cost(among))
            fixed = [total * c / every if every > 0 else total / len(among) for c in costs]
            return cls(total, costs, clock, fixed=fixed, start=start)
        floors = None if minima is None else list(minima(specs))
        over = None if overrun is None else list(overrun(specs))
        early = [s.stops_early() for s in specs]
        return cls(total, costs, clock, start=start, minima=floors, overrun=over, early=early)

    def replan(self, after: int, costs: Sequence[float], minima: Sequence[float]) -> None:
        """New least seconds and minima (every measure's, in order) for the measures after index
        ``after``: what is left of the budget is split again at their next `share` (a plan
        that learns: `flatcli.run.prediction.predict.Fit.learn`). Those refused at the start stay refused."""
        for j in range(after + 1, len(self.costs)):
            self.costs[j] = max(0.0, float(costs[j]))
            self.minima[j] = min(max(0.0, float(minima[j])), self.costs[j])

    def left(self) -> float:
        """Seconds of the budget left now."""
        return max(0.0, self.total - (self.clock() - self.start))

    def share(self, i: int) -> float:
        """The seconds measure ``i`` may spend, if it starts now (module docstring); 0 for a
        measure refused at the start."""
        if self.fixed is not None:
            return self.fixed[i]
        if i in self.refused:
            return 0.0
        left = self.left()
        later = [j for j in range(i, len(self.costs)) if j not in self.refused]
        rest = self._fitting(later, left) | {i}
        need = sum(self.costs[j] for j in rest)
        if left >= need:  # enough: all but what the later measures' least needs
            share = left - (need - self.costs[i])
        else:
            surplus = max(0.0, left - sum(self.minima[j] for j in rest))
            extra = sum(self.costs[j] - self.minima[j] for j in rest)
            part = (self.costs[i] - self.minima[i]) / extra if extra > 0 else 1.0 / len(rest)
            share = min(left, self.minima[i] + surplus * part)
        if len(rest) > 1:  # what it may pass its share by is not taken from the later ones
            share = max(min(share, self.minima[i]), share - self.overrun[i])
        return share


def budget_order(specs: Sequence[MeasureSpec], dims: Dims | None = None) -> list[MeasureSpec]:
    """The order a checkpoint's measures run in under a budget: those that cannot stop early
    first, by the spread of their declared work (with ``dims``: most − least, in HVP
    equivalents; one count first, a search that may take far more than its least last), then
    those that can stop early; ties in the configured order. What a measure that cannot stop takes beyond its prediction
    is then taken from the slack of those that can, which always return a value from their first
    unit. Values do not depend on the order (every measure is seeded; shared work gives each the
    value it has alone)."""

    def spread(spec: MeasureSpec) -> float:  # most − least declared, in HVP equivalents
        if spec.stops_early() or dims is None:
            return 0.0
        est = spec.estimate(dims) or {}
        lo = hvp_equivalents({k: v[0] for k, v in est.items()})
        return hvp_equivalents({k: v[1] for k, v in est.items()}) - lo

    return sorted(specs, key=lambda s: (s.stops_early(), spread(s)))


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
