"""Timings that cannot explode: the dry-run's timed calls and the lines fitted through them.

A call's seconds are read on a clock that is noisy (other processes, the allocator, a page-fault
storm): a few milliseconds on a call of a few milliseconds. Three rules keep that noise from
being multiplied into the prediction:

* **Repeats, robustly** (`timed`): a first call discarded, then the least of three timed calls,
  or of two when they agree (within `AGREE`) and add up to `ENOUGH` seconds. Interference (other
  processes, a page-fault storm) only ever adds time, so the least of the repeats stands and an
  outlier (one call of 41 s among calls of 40 ms) never does. The spread of the repeats (half
  their range, or the median deviation of three) is the call's noise.
* **Calls long enough to measure** (`autorange`, `grow`): a call too short for the clock is
  repeated in a loop until the loop takes at least `MIN_SPAN`; a call over a micro-batch of rows
  is timed on micro-batches of 1, 2, 4, … rows until the largest is `MIN_SPAN` longer than the
  one before it (the difference is measured, not noise), the micro-batch reaches the batch's rows, or the
  quantity's timings have taken `GROW_SECONDS`; a whole batch's call still that short is timed
  in loops.
* **A line that must be plausible** (`fit`): ``t(u) = c + d·u`` per batch of u units, through
  the two largest grown sizes (where it is extrapolated from: a cost that changes its slope at a
  few rows, as when a kernel starts to use its threads, does not bend it), weighed by their
  noise, is extrapolated to the mean batch. A negative slope (the rows
  cost nothing measurable) keeps the largest call's seconds per batch; an intercept below zero
  (calls grow faster than their rows) falls back to per-unit scaling from the largest call. The
  per-batch value is then kept between the largest call's seconds and their per-unit scaling (the
  bounds a line with ``c, d ≥ 0`` allows), so no fit predicts more than per-unit scaling does.

The fit's spread (the two points' noise, from their repeats) gives a standard error of the
prediction; `Timing` carries the prediction and its interval (±2 standard
errors).

>>> t = fit([(1, 0.010, 0.001), (2, 0.012, 0.001), (4, 0.016, 0.001)], units=64, batches=4)
>>> round(t.seconds, 3)  # c = 0.008, d = 0.002 per unit: 4·0.008 + 0.002·64
0.16
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

ENOUGH = 0.3  # seconds of timed calls after which two agreeing repeats stand
AGREE = 1.25  # two repeats agree when the larger is at most this times the smaller
REPEATS = 3  # the most timed calls of one quantity at one size
MIN_SPAN = 0.05  # seconds a grown quantity's largest call must exceed its first by
GROW_SECONDS = 2.0  # seconds of timed calls after which a quantity stops growing
MAX_LOOP = 4096  # the most calls `autorange` loops in one timed sample
SUPERLINEAR = 0.001  # seconds a call may exceed its rows' share of the call before it


def _clock() -> float:
    """`time.perf_counter`, read after the CUDA kernels queued so far have finished (a product
    returns before its kernels do)."""
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def now() -> float:
    """The clock in use: `_clock`, looked up at each call (tests replace it)."""
    return _clock()


def spread_of(times: Sequence[float]) -> float:
    """The noise of repeated timings: half the range of two, the median absolute deviation of
    three or more (robust to one outlier); 0 for one."""
    if len(times) < 2:
        return 0.0
    if len(times) == 2:
        return abs(times[0] - times[1]) / 2
    med = statistics.median(times)
    return float(statistics.median(abs(t - med) for t in times))


def timed(fn: Callable[[], object], warm: bool = False) -> tuple[float, float]:
    """(seconds, noise) of ``fn()`` warm: a first call discarded (``warm``: the caller made it),
    then the least of `REPEATS` timed calls, or of two once they agree within `AGREE` and add up
    to `ENOUGH` seconds (module docstring)."""
    if not warm:
        fn()
    times: list[float] = []
    while len(times) < REPEATS:
        t0 = now()
        fn()
        times.append(max(now() - t0, 0.0))
        if len(times) == 2 and sum(times) >= ENOUGH and max(times) <= AGREE * min(times):
            break
    return min(times), spread_of(times)


def autorange(fn: Callable[[], object]) -> tuple[float, float]:
    """(seconds, noise) of one call of ``fn``, timed in loops of 1, 2, 4, … calls until a loop
    takes `MIN_SPAN` seconds (at most `MAX_LOOP` calls, or ¼ s of real time), then
    `timed` on that loop: a call of microseconds is measured over enough of them. One clock
    (`now`) for the loop and its cap: a cap on another clock let a test's fake clock and the real
    one disagree about when to stop (a prediction off by 2.6x in one run of two)."""
    n, started = 1, now()
    while n < MAX_LOOP and now() - started < 0.25:
        t0 = now()
        for _ in range(n):
            fn()
        if now() - t0 >= MIN_SPAN:
            break
        n *= 2

    def loop() -> None:
        for _ in range(n):
            fn()

    seconds, noise = timed(loop, warm=True)
    return seconds / n, noise / n


Point = tuple[int, float, float]  # (units, seconds, noise) of one timed size


def grow(
    time_at: Callable[[int], tuple[float, float]],
    units_at: Callable[[int], int],
    rows: int,
    loop_at: Callable[[int], tuple[float, float]] | None = None,
) -> list[Point]:
    """The timed points of a call over micro-batches of 1, 2, 4, … rows (at most ``rows``, the
    batch's): ``time_at(r)`` its (seconds, noise) on r rows, ``units_at(r)`` their scored units.
    Grows until the largest call exceeds the one before it (half its rows) by `MIN_SPAN` on a
    third size or later (confirmed by a second timing: one slow spell never stops the growth),
    the rows reach ``rows``, or the timings took `GROW_SECONDS` (at least two sizes when the
    batch has two rows). A call that costs more than its rows' share of the call before it (by
    `SUPERLINEAR`: impossible for ``c, d ≥ 0``) is timed again too, the lesser standing; still
    above, it is kept at that share and its seconds do not count towards `GROW_SECONDS`: a slow
    spell that outlasts both timings never ends the growth on a slowed point. A whole batch's call still
    shorter than `MIN_SPAN` is timed again in loops (``loop_at(r)``, `autorange`): it is what the
    prediction rests on."""
    points: list[Point] = []
    r, prev, spent, rows = 1, 1, 0.0, max(1, int(rows))
    while True:
        t0 = now()
        seconds, noise = time_at(r)
        bound = points[-1][1] * r / prev + SUPERLINEAR if points else math.inf
        if points and (seconds - points[-1][1] >= MIN_SPAN or seconds > bound):
            seconds, noise = min((seconds, noise), time_at(r))  # one slow spell never stands
        slowed = seconds > bound  # still: kept at its rows' share of the call before it, and
        seconds = min(seconds, bound)  # the spell's seconds do not count towards the growth's
        if r >= rows and seconds < MIN_SPAN and loop_at is not None:
            seconds, noise = loop_at(r)
        spent += 0.0 if slowed else max(now() - t0, 0.0)
        points.append((units_at(r), seconds, noise))
        if r >= rows or (len(points) >= 2 and spent >= GROW_SECONDS):
            return envelope(points)
        if len(points) >= 3 and seconds - points[-2][1] >= MIN_SPAN:
            return envelope(points)
        prev, r = r, min(2 * r, rows)


def envelope(points: Sequence[Point]) -> list[Point]:
    """``points`` with each seconds the least of its own and those of the larger micro-batches
    after it: a call over more rows never costs less, so a point above a later one was slowed
    by interference."""
    out: list[Point] = []
    least = math.inf
    for u, t, s in reversed(points):
        least = min(least, t)
        out.append((u, least, s))
    return out[::-1]


@dataclass(frozen=True)
class Timing:
    """Predicted seconds of a call over a whole set, with an interval (``low``, ``high``) from the
    fit's spread; ``how``: "fit", "flat" (negative slope) or "per-unit" (one point, or an
    implausible line)."""

    seconds: float
    low: float
    high: float
    how: str = "fit"

    @property
    def relative(self) -> float:
        """The interval's half-width over the seconds (0 when the seconds are 0)."""
        return (self.high - self.low) / 2 / self.seconds if self.seconds > 0 else 0.0


FLOOR = 1e-6  # seconds: the least noise a timed point is weighed with


def _line(points: Sequence[Point]) -> tuple[float, float, float, float, float]:
    """Weighted least squares ``t = c + d·u``, each point weighed by 1 / its noise² (at least
    `FLOOR`): (c, d, var c, var d, cov c d); with three points or more the covariance is scaled
    by the residuals' reduced chi-square when it exceeds 1 (noise the repeats did not show)."""
    w = [1.0 / max(s, FLOOR) ** 2 for _, _, s in points]
    us = [float(u) for u, _, _ in points]
    ts = [t for _, t, _ in points]
    sw = sum(w)
    mu = sum(wi * u for wi, u in zip(w, us, strict=True)) / sw
    mt = sum(wi * t for wi, t in zip(w, ts, strict=True)) / sw
    sxx = sum(wi * (u - mu) ** 2 for wi, u in zip(w, us, strict=True))
    d = sum(wi * (u - mu) * (t - mt) for wi, u, t in zip(w, us, ts, strict=True)) / sxx
    c = mt - d * mu
    scale = 1.0
    if len(points) > 2:
        chi2 = sum(wi * (t - c - d * u) ** 2 for wi, u, t in zip(w, us, ts, strict=True))
        scale = max(1.0, chi2 / (len(points) - 2))
    var_d = scale / sxx
    return c, d, scale / sw + mu * mu * var_d, var_d, -mu * var_d


def fit(points: Sequence[Point], units: int, batches: int) -> Timing:
    """The seconds over ``units`` scored units in ``batches`` batches of a call timed at
    ``points`` (module docstring): ``batches · t(ū)``, ū the mean batch's units, t the line
    through the two largest sizes."""
    batches = max(1, int(batches))
    points = sorted(points)[-2:]
    mean = units / batches
    u_max, t_max, s_max = max(points, key=lambda p: p[0])
    scaled = t_max * mean / max(u_max, 1)
    lo, hi = min(t_max, scaled), max(t_max, scaled)
    if len({p[0] for p in points}) < 2:
        per, var, how = scaled, (s_max * mean / max(u_max, 1)) ** 2, "per-unit"
    else:
        c, d, vc, vd, cov = _line(points)
        if d < 0:
            per, var, how = t_max, s_max**2, "flat"
        elif c < 0:
            per, var, how = scaled, (s_max * mean / max(u_max, 1)) ** 2, "per-unit"
        else:
            per, var, how = c + d * mean, vc + mean * mean * vd + 2 * mean * cov, "fit"
    per = min(max(per, lo), hi)
    se = math.sqrt(max(var, 0.0))
    low, high = max(per - 2 * se, 0.0), per + 2 * se
    return Timing(batches * per, batches * low, batches * high, how)
