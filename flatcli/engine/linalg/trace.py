"""Trace estimators: Hutchinson (1989) and Hutch++ (Meyer, Musco, Musco & Woodruff, SOSA 2021,
Alg. 1) with its adaptive sketch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ._common import (
    MIN_SAMPLES,
    EstimatorSettings,
    as_operator,
    rowdot,
    settings_or_default,
    t_factor,
)
from ._store import device_capacity
from .budget import Budget, no_budget
from .declarations import Cost
from .sem import mean_stderr
from .slq import slq, slq_group_size
from .stop import ProbeStop
from .vectors import space_of

NEAR_ZERO_RUNS, NEAR_ZERO_STEPS = 4, 10  # the SLQ estimate of Tr|H| behind the near-zero floor


def near_zero_vectors(dim: int, device=None, dtype=torch.float32) -> int:
    """P-vectors (in ``dtype``'s size) the near-zero floor's SLQ holds at its peak: the float64
    starts of all `NEAR_ZERO_RUNS` runs, and per run in lockstep (`flatcli.engine.linalg.slq_group_size`:
    all four on a small model, one at a time when their bases pass the group's memory) its basis
    (`NEAR_ZERO_STEPS`), the current vector, its product and the reorthogonalization's two
    temporaries."""
    steps = min(NEAR_ZERO_STEPS, dim)
    group = slq_group_size(dim, steps, NEAR_ZERO_RUNS, device=device, dtype=dtype)
    starts = NEAR_ZERO_RUNS * max(1, 8 // (torch.finfo(dtype).bits // 8))
    return group * (steps + 4) + starts


@dataclass
class TraceResult:
    """A trace estimate with its standard error and cost.

    ``stderr`` is the standard error of the mean of the samples times Student's `t_factor` of
    their count (``stderr_mean`` without it), so ±2·stderr is about a 95% interval whatever the
    count; ``converged`` needs at least `MIN_SAMPLES` samples.

    For Hutch++ ``samples`` are the residual-space quadratic forms and
    ``low_rank`` the exactly computed part :math:`\\mathrm{Tr}(Q^\\top H Q)`.
    """

    estimate: float
    stderr: float
    probes: int  # products with H spent in total
    converged: bool
    samples: np.ndarray = field(repr=False, default=None)
    method: str = "hutchinson"
    low_rank: float = 0.0
    sketch: int = 0
    block_samples: np.ndarray | None = field(repr=False, default=None)  # (len(samples), blocks)
    block_low_rank: np.ndarray | None = field(repr=False, default=None)  # (blocks,)
    near_zero: bool = (
        False  # stopped at the absolute floor tol·Tr|H| (`NearZeroFloor`), not at tol·|estimate|
    )
    abs_trace: float | None = (
        None  # the SLQ estimate of Tr|H| behind that floor, when one was computed
    )
    abs_trace_stderr: float | None = None  # its standard error (runs and quadrature)
    stopped_by_budget: bool = False  # the `Budget` ran out before the tolerance was met
    stderr_mean: float = math.nan  # the standard error of the mean without the t factor

    @property
    def n_hvp(self) -> int:
        """Products with H spent (= ``probes``)."""
        return self.probes

    def block_estimates(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(estimates, stderrs) of the block traces when ``blocks`` were given, else None.

        Each probe's quadratic form splits exactly into its blocks, so the block
        estimates sum to ``estimate`` (up to rounding) whatever the probes."""
        if self.block_samples is None:
            return None
        bs = np.asarray(self.block_samples, dtype=np.float64)
        low = self.block_low_rank if self.block_low_rank is not None else np.zeros(bs.shape[1])
        m = bs.shape[0]
        if m == 0:
            return low.copy(), np.zeros_like(low)
        mean, se = mean_stderr(bs, axis=0)
        return low + mean, se * t_factor(m)


# byte value -> its 8 bits as ±1 (little-endian), for one gather per probe instead of bit tests


def _block_forms(Z: torch.Tensor, HZ: torch.Tensor, blocks) -> torch.Tensor:
    """The parts :math:`z_b^\top (Hz)_b` of each row's :math:`z^\top Hz` over the blocks, (K, B)
    float64, each by `rowdot` (batched dots: on CPU about a tenth of a float64 sum of the
    elementwise product)."""
    return torch.stack([rowdot(Z[:, b], HZ[:, b]) for b in blocks], 1)


class NearZeroFloor:
    r"""The absolute floor under a relative tolerance on a trace that may be 0.

    ``stderr ≤ tol·|estimate|`` cannot be met when the trace is near 0 (an indefinite Hessian
    whose positive and negative curvature cancel): the estimator would walk to ``max_probes``.
    The floor is ``stderr ≤ tol·T`` with :math:`T \approx \mathrm{Tr}|H| = \sum_i |\lambda_i|`,
    the size the trace would have if all curvature had one sign: the trace is then known to
    ``tol`` of the curvature's total magnitude. For a positive semi-definite H,
    :math:`\mathrm{Tr}|H| = \mathrm{Tr}\,H`, so the floor is the relative tolerance itself and
    changes nothing.

    When it applies: T is estimated once, only when the relative test fails and either the
    trace is not distinguishable from 0 (:math:`|\text{estimate}| < 2\,\text{stderr}`) or the
    relative test cannot be met within ``max_probes`` (at the spread seen so far it needs
    :math:`m\,(\text{stderr}/(\mathrm{tol}\,|\text{estimate}|))^2` samples, more than the cap
    leaves), by stochastic Lanczos quadrature of :math:`f(t) = |t|` (`NEAR_ZERO_RUNS` = 4
    Rademacher starts × `NEAR_ZERO_STEPS` = 10 steps, 40 products, seeded from the estimator's
    generator's seed so the probes that follow are unchanged), or read from ``stop.abs_trace``
    when the caller has SLQ runs of the same operator already (no products; with their
    standard error). The floor then holds only when the intervals say the trace is near 0 at the
    spectrum's scale (`near_zero`): the upper end of :math:`|\mathrm{Tr}\,H|`'s interval,
    ``|estimate| + 2·stderr``, at most 5% of the lower end of T's, ``T − 2·stderr(T)`` (T's
    stderr: Student's t of its 4 runs and their quadrature error, `SLQResult.stderr`, which is
    conservative: on small networks' Hessians the lower end is 0.2–0.35 of T). Then
    :math:`\mathrm{Tr}|H| \ge 20|\mathrm{Tr}\,H|`: all but a twentieth of the curvature's
    magnitude cancels, and the floor uses ``max(T, |estimate|)``. Comparing the two point
    estimates instead fired at a true ratio of 6% in 1 of 20 runs at ``tol`` 0.01 and 7 of 20 at
    0.05; with the intervals no run fires at 8% and above (tests/measures/test_fidelity.py keeps
    the coverage table). A trace the intervals do not place below 5% (T about
    :math:`|\text{estimate}|`, as for a PSD Hessian, or a trace at 6% of T) keeps the relative
    test and walks to ``max_probes``: ``not_converged`` when it misses. Example (a tiny GPT-2
    with random weights): trace 38 of :math:`\mathrm{Tr}|H| \approx 1{,}550` (2.5%), 1% of 38
    would need about 7,100 probes.

    Cost of reaching it: Hutchinson's variance per probe is :math:`2\|H\|_F^2` minus the diagonal
    part, so about :math:`2\|H\|_F^2 / (\mathrm{tol}\cdot\mathrm{Tr}|H|)^2 = 2 / (\mathrm{tol}^2\,
    r_{eff})` probes, :math:`r_{eff} = (\mathrm{Tr}|H|)^2/\|H\|_F^2` the effective rank: few on
    a network's Hessian with many eigenvalues of similar size, and ``max_probes`` still bounds it.
    """

    CANCEL = 20.0  # near 0 at the spectrum's scale: Tr|H| ≥ CANCEL·|Tr H| (the trace ≤ 5% of it)

    def __init__(self, op, stop: ProbeStop, generator: torch.Generator):
        self.op, self.dim, self.tol, self.max_probes = op, op.dim, stop.tol, stop.max_probes
        self.known = stop.abs_trace
        self.seed = int(generator.initial_seed()) ^ 0x5EED
        self.scale: float | None = None
        self.scale_stderr = 0.0  # T's standard error (Student's t of its runs and quadrature)
        self.products = 0

    def near_zero(self, est: float, se: float) -> bool:
        r"""Whether the interval says the trace is near 0 at the spectrum's scale: the upper end of
        :math:`|\mathrm{Tr}\,H|`, ``|est| + 2·se``, is at most 1/`CANCEL` (5%) of the lower end
        of T, ``T − 2·stderr(T)`` (both ends of intervals of about 95%)."""
        low = (self.scale or 0.0) - 2 * self.scale_stderr
        return abs(est) + 2 * se <= low / self.CANCEL

    def _out_of_reach(self, est: float, se: float, used: int, samples: int) -> bool:
        """Whether ``stderr ≤ tol·|est|`` needs more samples than ``max_probes`` leaves (False when
        none are left: a fixed count, ``min_probes = max_probes``, spends no products on T)."""
        if used >= self.max_probes:
            return False
        if est == 0 or not math.isfinite(se):
            return True
        return samples * (se / (self.tol * abs(est))) ** 2 > samples + max(
            0, self.max_probes - used
        )

    def reached(
        self, est: float, se: float, budget: Budget, used: int, samples: int | None = None
    ) -> bool:
        """Whether ``se`` is within the floor (computing T first when the test needs it and the
        budget allows its products); False while the relative tolerance may still be met.
        ``samples``: the samples behind ``se`` (default ``used``, the products spent)."""
        if se <= self.tol * abs(est):
            return False
        near = abs(est) < 2 * se
        if self.scale is None:
            cost = NEAR_ZERO_RUNS * min(NEAR_ZERO_STEPS, self.dim)
            if used >= self.max_probes and self.known is None:
                return False  # no probe left to save: T's products would only relabel the result
            if not (
                near or self._out_of_reach(est, se, used, used if samples is None else samples)
            ):
                return False
            known = self.known() if self.known is not None else None
            if known is not None:  # SLQ runs the caller already has: no products
                value, err = known if isinstance(known, tuple) else (known, 0.0)
                self.scale, self.scale_stderr = max(0.0, float(value)), float(err)
            elif budget.allow(cost, used) < cost:
                return False
            else:
                g = torch.Generator().manual_seed(self.seed)
                r = slq(self.op, runs=NEAR_ZERO_RUNS, steps=NEAR_ZERO_STEPS, generator=g)
                value, err = r.stderr(np.abs)[:2]
                self.scale, self.scale_stderr, self.products = max(0.0, value), err, r.n_hvp
        return self.near_zero(est, se) and se <= self.tol * max(self.scale, abs(est))


def probes_to_tolerance(samples, tol: float) -> float:
    r"""Hutchinson samples predicted to reach ``stderr ≤ tol·|mean|`` at the spread of ``samples``:
    :math:`m\,(t_m s_m / (\mathrm{tol}\,|\bar x|))^2` for m samples of mean :math:`\bar x` and
    standard error of the mean :math:`s_m` (Student's `t_factor` of m included); inf for fewer
    than 2 samples or a zero mean, where no count is predicted.

    >>> from flatcli.engine.linalg import probes_to_tolerance
    >>> round(probes_to_tolerance([9.0, 11.0, 9.0, 11.0], 0.1), 2)  # 4·(0.577·1.624/1)²
    3.52
    """
    m = len(samples)
    if m < 2:
        return math.inf
    est, se = mean_stderr(np.asarray(samples, dtype=np.float64))
    if est == 0:
        return math.inf
    return m * (se * t_factor(m) / (tol * abs(est))) ** 2


def _first(k: int, budget: Budget, used: int, least: int) -> int:
    """Products of the next block: ``k`` cut to the budget, but up to ``least`` products in all
    while fewer are done (a value with a standard error needs two samples)."""
    allowed = budget.allow(k, used)
    return max(allowed, min(k, least - used)) if used < least else allowed


def hutchinson(
    op,
    *,
    stop: ProbeStop = ProbeStop(),
    generator: torch.Generator,
    blocks: list[slice] | None = None,
    start: tuple[torch.Tensor, torch.Tensor] | None = None,
    settings: EstimatorSettings | None = None,
) -> TraceResult:
    r"""Hutchinson's estimator :math:`\mathrm{Tr}(H) \approx \frac1m \sum_i z_i^\top H z_i`.

    Rademacher probes, drawn and multiplied in blocks of ``settings.block_size``; the first
    block holds ``min_probes``. ``stop`` (a `ProbeStop`): stops when the standard error of the mean,
    :math:`s/\sqrt{m}` (``s`` the sample standard deviation of the
    :math:`z_i^\top H z_i`), is at most ``tol * |estimate|`` (``converged``), or at the
    absolute floor ``tol * Tr|H|`` of a trace near 0 (`NearZeroFloor`: ``converged`` and
    ``near_zero``), or at ``max_probes``, or when ``budget`` (a `Budget`, checked between
    blocks) is spent (``stopped_by_budget``, with the estimate so far).
    ``op`` is an operator, or anything `as_operator` takes. ``probes`` counts every
    product (the floor's 40 included).


    ``blocks`` (slices partitioning the coordinates, e.g. parameter tensors): the
    same probes also estimate each block's trace :math:`\mathrm{Tr}(H_{bb})` by
    :math:`\frac1m\sum_i z_{i,b}^\top (Hz_i)_b` (unbiased:
    :math:`\mathbb{E}[z_b^\top (Hz)_b] = \sum_{j \in b} H_{jj}`), and the parts of
    every probe sum exactly to its :math:`z^\top Hz`; see
    `TraceResult.block_estimates`. Stopping looks at the total only.

    Parameters
    ----------
    op : CurvatureOperator or Operator
        The symmetric operator: a `flatcli.engine.operators.CurvatureOperator`, or anything
        `as_operator` takes (a bare ``V (K, P) -> H V`` as ``as_operator(mv, dim)``); it gives P
        and the device and dtype of the vectors.
    stop : ProbeStop
        ``tol``, ``min_probes``, ``max_probes``, the `Budget` and the near-zero floor.
    generator : torch.Generator
        Seeded CPU generator of the probes.
    blocks : list of slice, optional
        Slices partitioning the coordinates (e.g. parameter tensors) whose traces are estimated from
        the same probes.
    start : (Z, HZ), optional
        Rademacher probes (rows) already multiplied, the first samples (`hutchpp`'s sketch when a
        cap leaves no room for its residual samples); they count as products spent.
    settings : EstimatorSettings, optional
        The vectors per product call (``block_size``) and the progress hook (``report``).

    Returns
    -------
    TraceResult
        The estimate, its standard error, the probes, convergence flags and the block estimates.
    """
    op, opts, budget = as_operator(op), settings_or_default(settings), stop.the_budget()
    space, floor = space_of(op), NearZeroFloor(op, stop, generator)
    if blocks is not None and space.parts is not None:
        raise ValueError(
            "hutchinson: blocks are slices of a flat vector; a per-parameter space has none"
        )
    samples: list[float] = []
    parts: list[list[float]] = []

    least = max(stop.min_probes, MIN_SAMPLES)  # no tolerance test on fewer samples
    block, max_probes = opts.block(), stop.max_probes

    def result(converged, near_zero=False, stopped=False):
        est, se = mean_stderr(samples)
        bs = np.asarray(parts, dtype=np.float64) if blocks is not None else None
        n = len(samples) + floor.products
        budget.spend(n)
        return TraceResult(
            est,
            se * t_factor(len(samples)),
            n,
            converged,
            np.asarray(samples),
            block_samples=bs,
            near_zero=near_zero,
            abs_trace=floor.scale,
            abs_trace_stderr=floor.scale_stderr if floor.scale is not None else None,
            stopped_by_budget=stopped,
            stderr_mean=se,
        )

    def add(Z, HZ) -> None:
        if blocks is None:
            samples.extend(space.dot(Z, HZ).cpu().tolist())
        else:
            part = _block_forms(Z, HZ, blocks)  # the probe's form is the sum of its parts
            samples.extend(part.sum(1).cpu().tolist())
            parts.extend(part.cpu().tolist())

    if start is not None:
        add(start[0], space.native(start[1]))
    while len(samples) < max_probes:
        left = max_probes - len(samples)
        k = _first(
            min(max(stop.min_probes - len(samples), block, 1), left),
            budget,
            len(samples) + floor.products,
            2,
        )
        if k == 0:
            return result(False, stopped=True)
        Z = space.probes(k, generator)
        add(Z, space.native(op.matmat_rows(Z)))
        est, se = mean_stderr(samples)
        se = se * t_factor(len(samples))
        if len(samples) >= least:
            opts.progress(probes=len(samples), value=est, stderr=se)
            if se <= stop.tol * abs(est):
                return result(True)
            if floor.reached(est, se, budget, len(samples)):
                return result(True, near_zero=True)
        if len(samples) < max_probes and budget.exhausted(len(samples) + floor.products):
            return result(False, stopped=True)
    est, se = mean_stderr(samples)
    return result(
        len(samples) >= MIN_SAMPLES and se * t_factor(len(samples)) <= stop.tol * abs(est)
    )


def hutchpp(
    op,
    *,
    stop: ProbeStop = ProbeStop(),
    sketch: int | None = None,
    generator: torch.Generator,
    blocks: list[slice] | None = None,
    settings: EstimatorSettings | None = None,
) -> TraceResult:
    r"""Hutch++ (Meyer, Musco, Musco & Woodruff 2021, Alg. 1) with stderr stopping and a growing sketch.

    1. Sketch: :math:`Y = HS` for ``r`` Rademacher columns :math:`S`,
       :math:`Q = \mathrm{orth}(Y)`.
    2. Low-rank part, exact: :math:`t_Q = \mathrm{Tr}(Q^\top H Q)`.
    3. Residual part by Hutchinson on :math:`PHP`, :math:`P = I - QQ^\top`:
       samples :math:`g_i^\top P H P g_i` with projected Rademacher :math:`g_i`.

    Estimate :math:`t_Q + \overline{g^\top PHPg}`. Since
    :math:`\mathrm{Tr}(H) = \mathrm{Tr}(Q^\top HQ) + \mathrm{Tr}(PHP)` for every
    :math:`Q`, the estimate is unbiased conditionally on the sketch, so the
    reported stderr, that of the residual mean, is the whole standard error.
    ``probes`` counts all products with H. Stops like `hutchinson`: at ``tol`` relative, at the
    near-zero floor (`NearZeroFloor`, the same Tr|H| scale: the residual's stderr is the whole
    stderr), at ``max_probes``, or when ``budget`` is spent (the sketch is then sized to the
    products the budget leaves, ``stopped_by_budget`` set). Under a cap that leaves, after the
    sketch's first ``r`` products, no room for its ``r`` further products and `MIN_SAMPLES`
    residual samples (a time cap at the speed of those products, or a product cap), the sketch is
    dropped: its Rademacher probes are Hutchinson samples, and `hutchinson` continues from them on
    the products left (``method`` ``"hutchinson"``), so a value never comes without a finite
    standard error. The sketch grows only while the cap leaves room for the growth and for
    residual samples after it.

    Sketch size. With a fixed budget (``min_probes == max_probes``) or an
    explicit ``sketch``, the split is Alg. 1's: ``r = min_probes // 3`` (or
    ``sketch``), ``2r`` products for the low-rank part, the rest for the
    residual. With stderr stopping the budget is unknown, so the sketch starts
    at ``max(1, min_probes // 3)`` and grows while it pays: after each block of
    ``k`` residual probes, if the residual samples predict that more than
    ``4 (r + k)`` of them would still be needed to reach ``tol``, the block's
    products :math:`HG` (which lie in the range of H, like :math:`HS`) join the
    sketch (``k`` more products for :math:`HQ_{new}`), the residual samples are
    restarted for the new :math:`P`, and ``k`` doubles up to ``block``. Growth
    stops at a third of ``max_probes``. Stopping needs at least 16 residual
    samples (2 with a fixed budget) and ``min_probes`` products in total.

    ``blocks`` (slices partitioning the coordinates): block traces from the same
    products, :math:`\mathrm{Tr}(H_{bb}) = \mathrm{Tr}_b(QQ^\top H) + \mathrm{Tr}_b(PH)`
    with :math:`\mathrm{Tr}_b(M) = \sum_{j\in b} M_{jj}`: the first part exactly,
    :math:`\sum_{j \in b}\sum_r Q_{jr}(HQ)_{jr}`, the second by the block parts
    :math:`(Pg)_b^\top (HPg)_b` of the residual samples (unbiased for
    :math:`\mathrm{Tr}_b(PH)` since :math:`\mathbb{E}[Pg\,g^\top P] = P`), which sum
    exactly to each sample; see `TraceResult.block_estimates`.

    Parameters
    ----------
    op, stop, generator, blocks
        As in `hutchinson`.
    settings : EstimatorSettings, optional
        As in `hutchinson`; its ``max_device_vectors`` also bounds the sketch vectors on the
        device (the rest stream from host memory; the same estimates to rounding).
    sketch : int, optional
        A fixed sketch size (Alg. 1's split); default: grown while it pays.

    Returns
    -------
    TraceResult
        As `hutchinson`'s, with the final ``sketch`` size.
    """
    op, opts, budget = as_operator(op), settings_or_default(settings), stop.the_budget()
    space = space_of(op)
    if blocks is not None and space.parts is not None:
        raise ValueError(
            "hutchpp: blocks are slices of a flat vector; a per-parameter space has none"
        )
    matvec, dim, device, block = op.matmat_rows, op.dim, op.device, opts.block()
    tol, min_probes, max_probes = stop.tol, stop.min_probes, stop.max_probes
    left = budget.left()
    cap = (
        max_probes if left is None else max(2, min(max_probes, left))
    )  # products this call may spend
    fixed = sketch is not None or min_probes >= cap
    r = int(sketch) if sketch else max(1, min_probes // 3)
    r = max(1, min(r, dim, max(1, (cap - MIN_SAMPLES) // 2)))  # leave MIN_SAMPLES residual probes
    sk = _Sketch(
        matvec,
        space,
        blocks,
        space.store(
            max_rows=max_probes,
            capacity=device_capacity(opts.max_device_vectors, dim, device, torch.float64),
            wide=True,
        ),
        budget,
    )
    sk.floor = NearZeroFloor(op, stop, generator)
    S = space.probes(r, generator)
    Y = matvec(S)
    if budget.capped and budget.allow(r + MIN_SAMPLES, r) < r + MIN_SAMPLES:
        # the cap leaves no room for the sketch's own products and residual samples: the sketch's
        # probes are Hutchinson samples (Rademacher sᵢ, sᵢᵀHsᵢ), continued on what the cap leaves
        return hutchinson(
            op, stop=stop, generator=generator, blocks=blocks, start=(S, Y), settings=settings
        )
    sk.add(space.wide(Y))
    used = r + sk.rank
    if sk.rank >= dim:
        return sk.result(used, [], [], 0.0, True)
    min_samples = MIN_SAMPLES if fixed else min(16, max(MIN_SAMPLES, cap - used))
    growing = not fixed
    step = min(block, max(8, r))
    samples: list[float] = []
    parts: list[list[float]] = []
    while used < cap:
        k = step if growing else max(min_probes - used, min_samples - len(samples), block, 1)
        k = budget.allow(max(1, min(k, cap - used)), used + sk.floor.products)
        if k == 0:
            break
        G = sk.project(space.wide(space.probes(k, generator)))
        HG = space.wide(matvec(space.native(G)))
        used += k
        if growing:
            room = k + min_samples  # the new directions' products, then residual samples again
            if (
                _sketch_pays(samples + space.sumprod(G, HG).tolist(), sk, k, tol, dim, cap, used)
                and budget.allow(room, used + sk.floor.products) >= room
            ):
                used += sk.add(
                    HG
                )  # the block's products lie in range(H), like HS: they join the sketch
                samples, parts = [], []
                step = min(block, 2 * step)
                continue
            growing = False
        samples.extend(space.sumprod(G, HG).tolist())
        if blocks is not None:
            parts.extend(_block_forms(G, HG, blocks).tolist())
        if used >= min(min_probes, cap) and len(samples) >= min_samples:
            m, se = mean_stderr(samples)
            se = se * t_factor(len(samples))
            opts.progress(probes=used, value=sk.low + m, stderr=se)
            if se <= tol * abs(sk.low + m):
                return sk.result(used, samples, parts, se, True)
            if sk.floor.reached(sk.low + m, se, budget, used, len(samples)):
                return sk.result(used, samples, parts, se, True, near_zero=True)
    return _hutchpp_stopped(sk, used, samples, parts, tol, max_probes)


def _hutchpp_stopped(
    sk: _Sketch, used: int, samples: list, parts: list, tol: float, max_probes: int
) -> TraceResult:
    """Hutch++'s result when its products ran out: ``max_probes``, or the budget before it."""
    stopped = used < max_probes
    if len(samples) < 2:
        return sk.result(used, samples, parts, math.inf, False, stopped=stopped)
    m, se = mean_stderr(samples)
    se = se * t_factor(len(samples))
    ok = len(samples) >= MIN_SAMPLES and se <= tol * abs(sk.low + m)
    return sk.result(used, samples, parts, se, ok, stopped=stopped)


class _Sketch:
    r"""Hutch++'s exactly traced part: an orthonormal basis Q (float64) of sketched directions,
    :math:`\mathrm{Tr}(Q^\top HQ)` and its parts per block of coordinates."""

    def __init__(self, matvec, space, blocks, store, budget: Budget | None = None):
        self.matvec, self.space, self.blocks = matvec, space, blocks
        self.Q = store  # rows: the orthonormal sketch directions (float64)
        self.budget = budget if budget is not None else no_budget()
        self.floor: NearZeroFloor | None = None
        self.low = 0.0
        self.low_b = np.zeros(len(blocks) if blocks is not None else 0)

    @property
    def rank(self) -> int:
        return len(self.Q)

    def project(self, G):
        """Rows of G with their components along Q removed (P g for P = I − QQᵀ)."""
        return G if len(self.Q) == 0 else self.Q.project_out(G)[0]

    def add(self, Y) -> int:
        r"""Orthonormalize the rows of Y against Q (twice) and add them, tracing :math:`Q_n^\top HQ_n`
        exactly; returns the products spent (one per new direction)."""
        if len(self.Q):
            Y = self.project(self.project(Y))  # twice is enough
        sp = self.space
        Qn = sp.qr(Y)[0]  # rows
        HQn = sp.wide(self.matvec(sp.native(Qn)))
        self.low += float(sp.total(Qn, HQn))
        if self.blocks is not None:
            prod = (Qn * HQn).double()
            self.low_b += np.array([float(prod[:, b].sum()) for b in self.blocks])
        self.Q.append(Qn)
        return sp.count(Qn)

    def result(
        self,
        used: int,
        samples: list[float],
        parts: list,
        se: float,
        converged: bool,
        near_zero: bool = False,
        stopped: bool = False,
    ) -> TraceResult:
        """The estimate ``Tr(QᵀHQ) + mean(samples)`` as a `TraceResult` (``used`` products, plus the
        near-zero floor's when it was computed, recorded in the budget)."""
        m = float(np.mean(samples)) if samples else 0.0
        nb = len(self.low_b)
        bs = (
            np.asarray(parts, dtype=np.float64).reshape(len(parts), nb)
            if self.blocks is not None
            else None
        )
        extra = self.floor.products if self.floor is not None else 0
        self.budget.spend(used + extra)
        return TraceResult(
            self.low + m,
            se,
            used + extra,
            converged,
            np.asarray(samples),
            "hutchpp",
            self.low,
            self.rank,
            block_samples=bs,
            block_low_rank=self.low_b.copy() if self.blocks is not None else None,
            near_zero=near_zero,
            abs_trace=self.floor.scale if self.floor is not None else None,
            abs_trace_stderr=(
                self.floor.scale_stderr
                if self.floor is not None and self.floor.scale is not None
                else None
            ),
            stopped_by_budget=stopped,
            stderr_mean=se / t_factor(len(samples)) if len(samples) > 1 else se,
        )


def _sketch_pays(
    cand: list[float], sk: _Sketch, k: int, tol: float, dim: int, max_probes: int, used: int
) -> bool:
    """Whether the residual samples ``cand`` predict more than ``4 (r + k)`` further samples to reach
    ``tol`` while the sketch may still grow by ``k`` (at most a third of the budget)."""
    m, se = mean_stderr(cand)
    est = sk.low + m
    need = (se / (tol * abs(est))) ** 2 * len(cand) if est and len(cand) > 1 else math.inf
    budget_ok = sk.rank + k <= min(dim - 1, max_probes // 3) and used + k < max_probes
    return need > 4 * (sk.rank + k) and budget_ok


# ---------------------------------------------------------------------------- declared costs


def near_zero_cost(dim: int) -> Cost:
    """The near-zero floor's products (`NearZeroFloor`): `NEAR_ZERO_RUNS` SLQ runs of
    `NEAR_ZERO_STEPS` steps, when the trace cancels."""
    return Cost(hvp=(0, NEAR_ZERO_RUNS * min(NEAR_ZERO_STEPS, dim)))


def hutchinson_cost(
    dim: int, stop: ProbeStop, *, floor: bool = True, device=None, dtype=torch.float32
) -> Cost:
    """What `hutchinson` declares under ``stop``: its first block of ``min_probes`` probes (at most
    ``max_probes``) up to ``max_probes``, in blocks of the engine's size, and (``floor``) the
    near-zero floor's SLQ beside them (`near_zero_cost`). Vectors: the first block's probes and
    their products, and the near-zero floor's runs in lockstep on ``device``
    (`near_zero_vectors`) while it runs.

    Parameters
    ----------
    dim : int
        P, the vector length.
    stop : ProbeStop
        Its ``min_probes`` and ``max_probes``.
    floor : bool
        Whether the near-zero floor may run (False: a fixed-count check).
    device, dtype : optional
        Where the vectors live and their type.

    Returns
    -------
    Cost
        Products (block 0: the engine's), vectors.
    """
    first = min(stop.min_probes, stop.max_probes)
    probes = Cost(hvp=(first, stop.max_probes), block=0, vectors=2 * first)
    if not floor:
        return probes
    nz = near_zero_vectors(dim, device, dtype)
    return probes + near_zero_cost(dim) + Cost(vectors=(0, nz))


def hutchpp_cost(dim: int, stop: ProbeStop, *, device=None, dtype=torch.float32) -> Cost:
    """What `hutchpp` declares: `hutchinson_cost`'s probes and its sketch beside them, up to a
    third of ``max_probes`` P-vectors."""
    sketch = Cost(vectors=min(dim, stop.max_probes // 3))
    return hutchinson_cost(dim, stop, device=device, dtype=dtype) + sketch
