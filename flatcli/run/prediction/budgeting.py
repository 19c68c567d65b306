"""How one checkpoint's run spends its budget (``runtime.budget``): the order its measures run in,
the split of the budget among them with each measure's minimum first (`flatcli.run.prediction.shares`), the
measures refused at the start because their minimum does not fit, and the split learnt again from
the measured seconds per product after each measure (`flatcli.run.prediction.predict.Fit.learn`).
`flatcli.run.measuring.measure_model` calls these around its measures."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from ...engine import Problem
from ...measures import MeasureCache, MeasureResult, MeasureSpec
from ..results import Row
from ..settings import Settings
from .predict import Fit
from .shares import BudgetSplit, budget_order


def split_budget(st: Settings, specs, fit: Fit, problem: Problem, reuse, among):
    """(order, split, refused) of a checkpoint's measures under ``runtime.budget``: the order
    they run in (`flatcli.run.prediction.shares.budget_order`; as configured in a sweep's unit or without a
    budget), the `BudgetSplit` (None without a budget) and those refused at the start
    (`refused_at_start`)."""
    order = specs
    if st.budget is not None and among is None:
        order = budget_order(specs, fit.dims)
    split = BudgetSplit.of(
        st.budget,
        order,
        fit.cost(problem, reuse, among),
        among,
        minima=None if among is not None else fit.minima(problem, reuse),
        overrun=None if among is not None else fit.overrun,
    )
    return order, split, refused_at_start(split, order)


def learner(split: BudgetSplit | None, fit: Fit, order, row: Row, shared: MeasureCache, how):
    """``learn(label)`` after each measure under a budget: once a measure has taken products, the
    predicted seconds per product become the measured ones (`flatcli.run.prediction.predict.Fit.learn`),
    the later measures' seconds are predicted again and what is left of the budget is split
    again (`BudgetSplit.replan`); the first block of a later measure expects the measured speed.
    Nothing in a sweep's unit (fixed shares) or without a budget. ``how``: (problem, reuse,
    among) as the split was weighed."""
    if split is None or split.fixed is not None:
        return lambda label: None
    problem, reuse, among = how
    labels = [s.label for s in order]

    def learn(label: str) -> None:
        per = fit.learn(row.results.get(label))
        if per is None:
            return
        shared.seconds_per_product = fit.times.hvp1
        split.replan(
            labels.index(label),
            fit.cost(problem, reuse, among)(order),
            fit.minima(problem, reuse)(order),
        )
        logging.getLogger("flatcli").info(
            "budget: %s measured %.3g s per product; %.3g s left re-split", label, per, split.left()
        )

    return learn


def refused_on_some_rank(row: Row, spec: MeasureSpec, problem: Problem, refused) -> bool:
    """Whether ``spec`` was refused at the start (`refused_at_start`), on this rank or, across ranks, on
    some rank (their collectives stay in step); then its row gets status ``budget``, NaN, not
    started and the reason."""
    if refused is None:  # no budget on any rank: nothing refused, no collective
        return False
    here = spec.label in refused
    if problem.dist.active:
        there = problem.dist.any(here)
    else:
        there = here
    if not there:
        return False
    why = refused.get(spec.label, "not started: another rank's budget could not give it a value")
    row.results[spec.label] = MeasureResult(
        value=math.nan, status="budget", diagnostics={"reason": why, "started": False}
    )
    return True


def refused_at_start(
    split: BudgetSplit | None, specs: Sequence[MeasureSpec]
) -> dict[str, str] | None:
    """Label → why the budget cannot give that measure a value (`BudgetSplit.refused`, decided at
    the start), each said at once on the ``flatcli`` logger, before the first measure runs; None
    without a budget (or fixed shares: a sweep's unit)."""
    if split is None or split.fixed is not None:
        return None
    out = {specs[i].label: why for i, why in split.refused.items()}
    for label, why in out.items():
        logging.getLogger("flatcli").warning("budget: %s %s", label, why)
    return out
