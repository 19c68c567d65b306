r"""When a tracker evaluates: every N steps, or within an overhead budget of the training time.

With ``budget = b`` the tracker keeps its own wall time S (evaluations and writes) near b times the
training's wall time T (the time between its calls, everything the loop does but the tracker):
a step is due when :math:`S + c/2 \le b\,T`, c the seconds of the last evaluation. Without the
half, the next evaluation would start only when it fits entirely and the overhead would settle
below b; with it, each evaluation starts when its midpoint fits, so S/T oscillates around b within
about c/(2T). The first call is always due (nothing is known yet). ``every = N`` makes only steps
divisible by N candidates; with both, a candidate must also fit the budget.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..errors import ConfigError


@dataclass
class Schedule:
    """Which steps a tracker evaluates (``every``, ``budget``) and the clock that keeps the budget.

    Parameters
    ----------
    every : int, optional
        Evaluate at steps divisible by ``every`` (None: every step is a candidate).
    budget : float, optional
        The most tracker time as a fraction of training time, in (0, 1] (None: no budget).
    """

    every: int | None = None
    budget: float | None = None
    spent: float = 0.0  # seconds the tracker took (evaluations and writes)
    trained: float = 0.0  # seconds the training took between the tracker's calls
    last_cost: float = 0.0  # seconds of the last evaluation
    evaluations: int = 0
    _since: float | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.every is not None and (
            isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1
        ):
            raise ConfigError(f"`every` must be an int ≥ 1. Got {self.every!r} instead.")
        if self.budget is not None and not (
            isinstance(self.budget, (int, float)) and 0 < float(self.budget) <= 1
        ):
            raise ConfigError(
                f"`budget` must be a fraction in (0, 1]. Got {self.budget!r} instead."
            )

    def tick(self, now: float | None = None) -> None:
        """Count the training time since the tracker last returned (call on entry)."""
        now = time.perf_counter() if now is None else now
        if self._since is not None:
            self.trained += max(0.0, now - self._since)

    def due(self, step: int) -> bool:
        """Whether ``step`` is evaluated."""
        if self.every is not None and step % self.every != 0:
            return False
        if self.budget is None or self.evaluations == 0:
            return True
        return self.spent + 0.5 * self.last_cost <= self.budget * self.trained

    def charge(self, seconds: float, evaluated: bool, now: float | None = None) -> None:
        """Add the tracker's ``seconds`` (call on exit); ``evaluated``: an evaluation ran."""
        self.spent += seconds
        if evaluated:
            self.last_cost = seconds
            self.evaluations += 1
        self._since = time.perf_counter() if now is None else now

    @property
    def overhead(self) -> float:
        """Tracker time over training time so far (NaN before any training time)."""
        return self.spent / self.trained if self.trained > 0 else float("nan")
