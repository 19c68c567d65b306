"""A cap on an iterative estimator's work: wall-clock seconds and products with the operator.

The estimators (`lanczos`, `hutchinson`, `hutchpp`, `slq`) take ``budget=Budget(...)``, check it
between blocks of products, and stop with their current estimate and ``stopped_by_budget=True``
when it is spent. One `Budget` may serve several estimator calls in turn (a measure that runs
Lanczos then SLQ): each call adds the products it spent (`Budget.spend`), so the product cap is
shared, and the clock runs from the budget's creation.

What is guaranteed: a product cap is never passed, except that an estimator always does its first
unit of work (Lanczos: one block; Hutchinson/Hutch++: two probes, the fewest with a standard error;
SLQ: one run), so that a value exists; a time cap is checked between blocks, so it is passed by at
most one block of products.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Budget:
    """At most ``max_seconds`` of wall time from creation and ``max_products`` products (None: no cap).

    >>> b = Budget(max_products=10)
    >>> b.allow(16, 4), b.exhausted(9), b.exhausted(10)
    (6, False, True)
    >>> b.spend(4); b.left()
    6
    """

    max_seconds: float | None = None
    max_products: int | None = None
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False)
    spent: int = 0  # products spent by earlier calls under this budget
    start: float = field(default=math.nan, repr=False)

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
        """Whether the time cap is reached."""
        return self.max_seconds is not None and self.elapsed() >= self.max_seconds

    def exhausted(self, n_products: int = 0) -> bool:
        """Whether the cap is reached once the caller has spent ``n_products`` products in this call."""
        return self.left(n_products) == 0 or self.out_of_time()

    def allow(self, k: int, n_products: int = 0) -> int:
        """How many of ``k`` wanted products the caller may do now (``n_products`` already done in this
        call): ``k`` cut to the products left; 0 when the time is up."""
        if self.out_of_time():
            return 0
        left = self.left(n_products)
        return int(k) if left is None else int(min(k, left))

    def spend(self, n: int) -> None:
        """Record ``n`` products spent by a finished call."""
        self.spent += int(n)


def no_budget() -> Budget:
    """A budget without caps (what the estimators use when given none)."""
    return Budget()
