"""A cap on an iterative estimator's work: wall-clock seconds and products with the operator.

The estimators (`lanczos`, `hutchinson`, `hutchpp`, `slq`) take ``budget=Budget(...)``, check it
between blocks of products, and stop with their current estimate and ``stopped_by_budget=True``
when it is spent. One `Budget` may serve several estimator calls in turn (a measure that runs
Lanczos then SLQ): each call adds the products it spent (`Budget.spend`), so the product cap is
shared, and the clock runs from the budget's creation.

What is guaranteed: a product cap is never passed, except that an estimator always does its first
unit of work (Lanczos: one block; Hutchinson/Hutch++: two probes, the fewest with a standard error;
SLQ: one run), so that a value exists; a time cap is checked between blocks, and blocks are cut to
the products the time left allows at the speed seen so far (`Budget.allow`; before any product, at
``per_product`` seconds each when that is known, else two products), so it is passed by about one product (or one SLQ run, or the first unit).

Across ranks (torchrun) every product is collective, so every rank must stop at the same block:
``agree`` (whether the time is up on some rank) and ``agree_count`` (one count for all ranks) make
the time decisions common; product caps are deterministic and need neither.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Budget:
    """At most ``max_seconds`` of wall time from creation and ``max_products`` products (None: no cap).

    >>> from flatcli.engine.linalg import Budget
    >>> b = Budget(max_products=10)
    >>> b.allow(16, 4), b.exhausted(9), b.exhausted(10)
    (6, False, True)
    >>> b.spend(4); b.left()
    6
    """

    max_seconds: float | None = None
    max_products: int | None = None
    clock: Callable[[], float] = field(
        default_factory=lambda: time.perf_counter, repr=False
    )  # read when the budget is made (a test may replace time.perf_counter)
    spent: int = 0  # products spent by earlier calls under this budget
    start: float = field(default=math.nan, repr=False)
    per_product: float | None = None  # seconds one product is expected to take (the dry-run's)
    agree: Callable[[bool], bool] | None = field(
        default=None, repr=False
    )  # ranks: the flag on some rank
    agree_count: Callable[[int], int] | None = field(
        default=None, repr=False
    )  # ranks: one count for all

    def __post_init__(self):
        if math.isnan(self.start):
            self.start = self.clock()

    @property
    def capped(self) -> bool:
        """Whether any cap is set."""
        return self.max_seconds is not None or self.max_products is not None

    def elapsed(self) -> float:
        """Seconds since the budget was created."""
        return self.clock() - self.start

    def left(self, n_products: int = 0) -> int | None:
        """Products still allowed after ``n_products`` more than `spent` (None: no product cap)."""
        if self.max_products is None:
            return None
        return max(0, int(self.max_products) - self.spent - int(n_products))

    def out_of_time(self) -> bool:
        """Whether the time cap is reached (on some rank, with ``agree``)."""
        if self.max_seconds is None:
            return False
        late = self.elapsed() >= self.max_seconds
        return self.agree(late) if self.agree is not None else late

    def exhausted(self, n_products: int = 0) -> bool:
        """Whether the cap is reached once the caller has spent ``n_products`` products in this call."""
        return self.left(n_products) == 0 or self.out_of_time()

    def allow(self, k: int, n_products: int = 0) -> int:
        """How many of ``k`` wanted products the caller may do now (``n_products`` already done in this
        call): ``k`` cut to the products left and, under a time cap, to those the seconds left allow at
        the speed seen so far (elapsed / products; before any product ``per_product`` seconds each, or
        2 products when unknown: the first block measures the speed); 0 when the time is up. A
        block is cut only when the time left does not allow it, so a cap that is never reached
        changes no block and no result."""
        if self.out_of_time():
            return 0
        left = self.left(n_products)
        k = int(k) if left is None else int(min(k, left))
        if self.max_seconds is not None and k > 0:
            done = self.spent + int(n_products)
            left_s = self.max_seconds - self.elapsed()
            if done > 0:
                fit = int(left_s * done / max(self.elapsed(), 1e-9))
            else:  # no speed seen yet: the expected one, else two products to measure it
                fit = int(left_s / self.per_product) if self.per_product else 2
            fit = self.agree_count(fit) if self.agree_count is not None else fit
            k = max(1, min(k, fit))
        return k

    def spend(self, n: int) -> None:
        """Record ``n`` products spent by a finished call."""
        self.spent += int(n)


def no_budget() -> Budget:
    """A budget without caps (what the estimators use when given none)."""
    return Budget()
