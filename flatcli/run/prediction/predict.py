"""Predicted seconds and memory of a run (``--dry-run``), from products timed on the real model.

`time_products` measures one product of the engine's block on micro-batches of a checkpoint's
measurement set (`micro_problem`: its first row and its first two): its peak memory, scaled to the
first batch's rows. It times a forward pass, a gradient and a one-vector product on micro-batches
grown from one row until the difference is measured, and fits each as ``c + d·units`` per batch
(``c`` the share a call pays whatever its rows, the parameters'; ``d`` per scored sample or
token) to the whole set, with an interval from the timings' spread (`flatcli.run.prediction.timing`: the
rules that keep noise from being multiplied into the prediction). Nothing is built over more
than one batch, so a dry-run holds less than the run; on models whose product is slow enough to
matter it costs a fraction of it. `predict` turns a measure's declared counts (its registry
``estimate``: products, ``hvp_block``, ``vectors``) into seconds (and their interval) and a
peak-memory figure, or its ``applicable`` check's reason when it will end ``not_applicable``.
`flatcli.api.costs` times one checkpoint per shape and reuses its times for the others.

The model of time: a product call of k vectors costs ``a + b·k`` seconds, ``a`` and ``b`` from
the one-vector product and the block's (the block's cost over one vector's on the first row,
applied to the fitted one-vector seconds; an engine block of one takes k vectors as k one-vector
products); when the run keeps its gradient graphs, a measure that takes products pays their
build once (``build``: the largest timed micro-batch's first product's seconds above a warm
one's, scaled as the product scales, at most two gradients); a
gradient or per-sample VJP pass costs the timed gradient, a forward pass the timed forward pass,
and a P-length dot product or axpy of the estimator's own (``vector_ops``: Lanczos's
reorthogonalization) a timed projection's share.

Memory (``peak_bytes``): what the process holds before the products (``resident``: the weights,
the measurement set, Python and torch; CPU: VmRSS, CUDA: allocated bytes), θ, the gradient and
the vectors the estimator holds at its peak (P numbers each, the dtype's size; a Lanczos basis at
``max_basis_vectors``, a trace's first block of probes with their products and its near-zero
floor's SLQ), plus one product of the engine's block as the run takes it, counted: its gradient
graph, the other batches' graphs when they are kept (``runtime.cache_graphs``), recompute and
the forward's precision.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ...engine import CurvatureEngine, Problem, eval_mode
from ...engine import dist as ranks
from ...loading.data import subset
from ..settings import Settings
from . import timing
from .memory import (
    keeps_graphs,
    measure_peak,
    product_bytes,
    resident_bytes,
    trim_heap,
    vectors_kept,
)
from .shares import hvp_equivalents, least_work

BLOCK = 4  # rows of the basis a timed reorthogonalization projects against (`vector_op`)


@dataclass
class ProductTimes:
    """Seconds of one forward pass, one gradient, one HVP of one vector and one of ``block``
    vectors over the measurement set; ``engine_block`` the engine's block size; ``product_bytes``
    the memory one block product took (``memory``: how it was measured); P, element size."""

    forward: float
    grad: float
    hvp1: float
    hvp_block: float
    block: int
    engine_block: int
    product_bytes: int
    memory: str
    P: int
    element: int
    vector_op: float = (
        0.0  # seconds of one P-length dot product or axpy (a 16-vector basis projection / 32)
    )
    batched_vector_op: float = (
        0.0  # the same in runs of their own bases (SLQ's lockstep projection)
    )
    resident: int = 0  # bytes in use before the products: weights, data, torch (CPU: VmRSS)
    build: float = 0.0  # seconds of building the gradient graphs once, when the run keeps them
    intervals: dict[str, tuple[float, float]] = field(
        default_factory=dict
    )  # "forward", "grad", "hvp" -> (low, high) seconds: the fit's interval (`flatcli.run.prediction.timing`)
    measured: tuple[str, ...] = ()  # quantities replaced by what a run measured (`Fit.learn`)

    def at(self, end: int) -> ProductTimes:
        """These times at the low (``end`` 0) or high (1) end of their intervals: the forward
        pass, the gradient and the products (the block's with the one-vector product's factor)."""
        out = replace(self)
        for name, attr in (("forward", "forward"), ("grad", "grad"), ("hvp", "hvp1")):
            if name in self.intervals:
                setattr(out, attr, self.intervals[name][end])
        if "hvp" in self.intervals and self.hvp1 > 0:
            out.hvp_block = self.hvp_block * out.hvp1 / self.hvp1
        return out

    def hvp_seconds(self, n: float, k: int) -> float:
        """Seconds of ``n`` HVPs in calls of ``k`` vectors (0: the engine's block size)."""
        k = max(1, self.engine_block if k == 0 else k)
        b = (
            max((self.hvp_block - self.hvp1) / (self.block - 1), 0.0)
            if self.block > 1
            else self.hvp1
        )
        a = max(self.hvp1 - b, 0.0)
        return n * (a / k + b)


def _size(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def _clock() -> float:
    """The dry-run's clock (`flatcli.run.prediction.timing._clock`)."""
    return timing._clock()


def _project(Q: torch.Tensor, w: torch.Tensor) -> None:
    """W − Qᵀ(Q w): one reorthogonalization pass against the rows of Q (2 vector ops per row)."""
    w = w - (Q @ w) @ Q
    if w.device.type == "cuda":
        torch.cuda.synchronize(w.device)


def _project_runs(Q: torch.Tensor, W: torch.Tensor) -> None:
    """Each row of W against its own basis Q[r] (SLQ's step, `flatcli.engine.linalg.slq`)."""
    W = W - torch.einsum("rj,rjp->rp", torch.einsum("rjp,rp->rj", Q, W), Q)
    if W.device.type == "cuda":
        torch.cuda.synchronize(W.device)


MICRO_ROWS = 1  # rows of the micro-batch the dry-run times (fewer when the first batch is smaller)


def micro_problem(problem: Problem, rows: int = MICRO_ROWS) -> Problem:
    """The same problem over the first ``rows`` rows of the measurement set, on this rank alone
    (no collectives): what `time_products` times."""
    m = max(1, min(rows, problem.batch_size, problem.rows))
    return Problem(
        problem.model,
        problem.batch.select(slice(0, m)),
        loss=problem.loss_fn,
        batch_size=m,
        device=problem.device,
        dtype=problem.dtype,
        params=problem.selection,
        fused_head=problem.fused_head,
        compute_dtype=problem.compute_dtype,
    )


def _engine(problem: Problem, st: Settings, keep: bool | None = None) -> CurvatureEngine:
    """An engine over ``problem`` as the run builds it: recompute, caps, kept graphs (``keep``:
    the run's choice, `flatcli.run.prediction.memory.keeps_graphs`; None: the settings')."""
    return st.engine(problem, st.graph_policy() if keep is None else keep)


@dataclass
class _Micro:
    """One micro-batch's memory probe (`_probe`): its scored units, the measured peak of one
    product of the engine's block ``k`` (``how``: how the peak was measured) and its vectors."""

    units: int
    peak: int
    how: str
    k: int
    engine: CurvatureEngine
    vectors: torch.Tensor


def _probe(micro: Problem, st: Settings, keep: bool, V: torch.Tensor | None = None) -> _Micro:
    """The measured peak of one product of the engine's block over ``micro``, its gradient graph
    built inside as the run builds it (``keep``: kept, as the run keeps it); with a verified
    precision (bf16, TF32) the larger of it and one fp32 verification product. ``V``: the
    block's vectors (another micro-batch's, shared)."""
    eng = _engine(micro, st, keep)
    H = eng.hessian()
    k = eng.estimator_settings.block()
    if V is None or V.shape[0] != k:
        V = torch.randn(k, micro.num_params, generator=torch.Generator().manual_seed(0))
        V = V.to(st.device, st.dtype)
    device = torch.device(st.device)
    verified = 0
    if eng.precision.verify:  # the fp32 verification product of a converged value (bf16, TF32)
        H32 = eng.hessian(precision="fp32")
        trim_heap()
        verified = measure_peak(lambda: H32(V[:1]), device)[0]
        eng.state.drop_graphs()
    trim_heap()
    peak, how = measure_peak(lambda: H(V), device)
    eng.state.drop_graphs()
    return _Micro(micro.n, max(peak, verified), how, k, eng, V)


def _build(build_at: float, hvp_at: float, hvp: float, grad: float) -> float:
    """Seconds of building the whole set's gradient graphs: what the first product on the
    largest timed micro-batch paid above a warm one (``build_at``, over the warm ``hvp_at``),
    scaled as the product scales to the whole set (``hvp``), and at most two whole-set gradients
    (``grad``: recording the backward's graph costs less than a second backward)."""
    return min(build_at * hvp / max(hvp_at, 1e-12), 2.0 * grad)


class _Grown:
    """The timed calls of one problem on micro-batches of growing rows (`flatcli.run.prediction.timing.grow`),
    each size's engine built once, as the run builds it."""

    def __init__(self, problem: Problem, st: Settings, keep: bool, V: torch.Tensor):
        self.problem, self.st, self.keep, self.V = problem, st, keep, V
        self.engines: dict[int, CurvatureEngine] = {}
        self.rows = problem.batches[0].rows if problem.batches else 1
        self.cold: dict[int, float] = {}  # rows -> the first product's seconds there

    def engine(self, r: int) -> CurvatureEngine:
        """The engine over the first ``r`` rows."""
        if r not in self.engines:
            self.engines[r] = _engine(micro_problem(self.problem, r), self.st, self.keep)
        return self.engines[r]

    def units(self, r: int) -> int:
        """Scored units of the first ``r`` rows."""
        return self.engine(r).problem.n

    def points(self, name: str) -> list[timing.Point]:
        """The grown points of the call ``name`` ("forward", "grad", "hvp")."""
        return timing.grow(
            lambda r: self.time(name, r, False),
            self.units,
            self.rows,
            lambda r: self.time(name, r, True),
        )

    def time(self, name: str, r: int, loop: bool) -> tuple[float, float]:
        """(seconds, noise) of a forward pass, a gradient or a one-vector product over ``r``
        rows, warm (`flatcli.run.prediction.timing.timed`; ``loop``: in loops, `flatcli.run.prediction.timing.autorange`).
        A product's first call, which builds the graphs the run keeps, is timed apart
        (``cold``)."""
        eng = self.engine(r)
        if name == "forward":
            fn = eng.loss
        elif name == "grad":
            fn = eng.loss_grad
        else:
            H = eng.hessian()
            t0 = timing.now()
            H(self.V[:1])
            self.cold[r] = timing.now() - t0

            def fn():
                return H(self.V[:1])

        out = timing.autorange(fn) if loop else timing.timed(fn, warm=name == "hvp")
        eng.state.drop_graphs()
        return out

    def ratio(self, k: int) -> float:
        """A block product's seconds over a one-vector product's, on one row (each timed in loops
        long enough to measure, `flatcli.run.prediction.timing.autorange`), between 1 and the block's ``k``:
        a block costs at least one vector's product and at most k of them."""
        if k <= 1:
            return 1.0
        eng = self.engine(1)
        H = eng.hessian()
        one = timing.autorange(lambda: H(self.V[:1]))[0]
        block = timing.autorange(lambda: H(self.V))[0]
        eng.state.drop_graphs()
        return min(max(block / max(one, 1e-12), 1.0), float(k))

    def rows_of(self, units: int) -> int:
        """The most rows of a grown micro-batch with ``units`` scored units (its product timed)."""
        return max(r for r in self.cold if self.units(r) == units)


def _vector_ops(V: torch.Tensor, k: int, P: int) -> tuple[float, float]:
    """Seconds of one P-length dot product or axpy: in a reorthogonalization pass against a basis
    (`_project`), and in runs of their own bases (`_project_runs`), each timed in loops long
    enough to measure (`flatcli.run.prediction.timing.autorange`)."""
    V = V[: max(2, min(BLOCK, k))]
    if V.shape[0] < 2:
        V = torch.randn(2, P, generator=torch.Generator().manual_seed(1)).to(V)
    vector_op = timing.autorange(lambda: _project(V, V[0]))[0] / (2 * V.shape[0])
    B = V[: 2 * (V.shape[0] // 2)].reshape(2, V.shape[0] // 2, P)  # 2 runs with their bases
    batched = timing.autorange(lambda: _project_runs(B, V[:2]))[0] / (4 * (V.shape[0] // 2))
    return vector_op, batched


def time_products(
    model: torch.nn.Module, data, st: Settings, check=None
) -> tuple[ProductTimes | None, Problem]:
    """Time the products on micro-batches of ``model``'s measurement set (the settings' size,
    seed, device, dtype and precision), as `flatcli.run.measuring.measure_model` builds them:
    a forward pass, a gradient and a one-vector product each on micro-batches of 1, 2, 4, … rows
    until the difference is measured (`flatcli.run.prediction.timing.grow`), fitted as ``c + d·units`` per
    batch to this rank's share of the set with an interval (`flatcli.run.prediction.timing.fit`); a block
    product on the product's largest micro-batch. One product's peak is measured on one and two
    rows and scaled to the first batch's rows, plus the other batches' graphs when the run keeps
    them (`flatcli.run.prediction.memory.product_bytes`, counted). No product or gradient graph over the
    whole set is built, so the dry-run holds less than the run. Returns the times and the
    `Problem` (for the measures' ``applicable`` checks). ``check(problem)``: called before any
    product (the memory check, `flatcli.run.prediction.memory.check_products`); when it returns False
    nothing is timed and the times are None."""
    work = model.to(st.device, st.dtype)
    with st.precision_context(), eval_mode(work):
        problem = Problem(
            work,
            subset(data, st.num_samples, st.data_seed),
            loss=st.loss,
            batch_size=st.batch_size,
            device=st.device,
            dtype=st.dtype,
            params=st.params,
            dist=ranks.current(),
            compute_dtype=st.compute_dtype,  # as the run's engine lowers it: counted in bf16
        )
        if check is not None and not check(problem):
            return None, problem
        resident = resident_bytes(torch.device(st.device))
        rows = problem.batches[0].rows if problem.batches else 1
        keep = keeps_graphs(problem, st)[0]  # as the run will (no measure's vectors yet)
        one = _probe(micro_problem(problem, 1), st, keep)  # both peaks first: timing churns
        two = _probe(micro_problem(problem, 2), st, keep, one.vectors) if rows > 1 else None
        times = _timed_products(problem, st, keep, one)
    # p(1) + (rows − 1)·(p(2) − p(1)): what a row adds (its saved tensors, the backward's
    # transients); the product's own P-vectors are in p(1)
    product = one.peak + (rows - 1) * max((two or one).peak - one.peak, 0)
    times.product_bytes = product + product_bytes(problem, st, one.k).graphs
    times.memory = f"{one.how} of products on one and two rows, extrapolated to {rows}"
    times.resident = max(0, resident)
    return times, problem


def _timed_products(problem: Problem, st: Settings, keep: bool, one: _Micro) -> ProductTimes:
    """The grown and fitted seconds of `time_products` (no memory figures yet)."""
    grown, k = _Grown(problem, st, keep, one.vectors), one.k
    units, batches = problem.local_units, max(len(problem.batches), 1)
    points = {name: grown.points(name) for name in ("forward", "grad", "hvp")}
    fits = {name: timing.fit(p, units, batches) for name, p in points.items()}
    u, hvp_at, _ = max(points["hvp"])  # the product's largest micro-batch: its build
    r = grown.rows_of(u)
    ratio = grown.ratio(k)
    build = _build(
        max(grown.cold[r] - hvp_at, 0.0), hvp_at, fits["hvp"].seconds, fits["grad"].seconds
    )
    vector_op, batched_op = _vector_ops(one.vectors, k, problem.num_params)
    hvp1 = fits["hvp"].seconds
    return ProductTimes(
        fits["forward"].seconds,
        fits["grad"].seconds,
        hvp1,
        2 * hvp1 if k == 1 else hvp1 * ratio,  # a block of one takes two vectors one by one
        2 if k == 1 else k,
        k,
        0,
        "",
        problem.num_params,
        torch.finfo(st.dtype).bits // 8,
        vector_op,
        batched_op,
        0,
        build if keep else 0.0,
        {n: (f.low, f.high) for n, f in fits.items()},
    )


def _quick(fn) -> float:
    """Warm seconds of ``fn()`` over the whole set (`flatcli.run.prediction.timing.timed`: the least of a
    few calls; not looped: the budget's clock runs, and what a plan got wrong it learns,
    `Fit.learn`)."""
    return timing.timed(fn)[0]


def quick_times(engine: CurvatureEngine) -> ProductTimes:
    """Warm seconds (`_quick`) of one forward pass, one gradient and one one-vector HVP on the
    engine's own problem, for `Fit`: under a second on the models whose measures it guards. A
    block product is taken as that many one-vector products (an upper bound: blocks are
    cheaper per vector), and no memory is probed."""
    P = engine.problem.num_params
    v = torch.randn(P, generator=torch.Generator().manual_seed(0)).to(
        engine.problem.device, engine.problem.dtype
    )
    forward = _quick(engine.loss)
    grad = _quick(engine.loss_grad)
    H = engine.hessian()
    hvp1 = _quick(lambda: H(v))
    return ProductTimes(
        forward,
        grad,
        hvp1,
        hvp1,
        1,
        1,
        0,
        "not measured",
        P,
        torch.finfo(engine.problem.dtype).bits // 8,
    )


def _not_applicable(spec, problem: Problem) -> bool:
    """Whether ``spec`` is predicted to end ``not_applicable`` (False when that cannot be told)."""
    try:
        return bool(spec.not_applicable(problem))
    except Exception:  # a check that cannot be made: weigh it like any other measure
        return False


FIRST_UNIT = {"n_hvp": 2, "n_grad": 1, "n_vjp": 1, "n_forward": 1}  # most of each counter


class _FirstUnit:
    """A spec whose estimate is its first unit: each least count at most `FIRST_UNIT`'s, its
    products at least one block of them (a Lanczos block; ``engine_block`` for a declared block
    of 0), no vector operations (they grow with the steps)."""

    def __init__(self, spec, engine_block: int = 1):
        self.spec, self.engine_block = spec, engine_block

    def estimate(self, dims):
        """The spec's least counts, each cut to `FIRST_UNIT` (products: to one block)."""
        est = self.spec.estimate(dims) or {}
        out = {k: (min(v[0], FIRST_UNIT[k]),) * 2 for k, v in est.items() if k in FIRST_UNIT}
        block = est.get("hvp_block", (1, 1))[1] or self.engine_block
        if "n_hvp" in est:
            out["n_hvp"] = (min(est["n_hvp"][0], max(FIRST_UNIT["n_hvp"], block)),) * 2
        if "hvp_block" in est:
            out["hvp_block"] = est["hvp_block"]
        return out

    def not_applicable(self, problem):
        """As the spec's."""
        return self.spec.not_applicable(problem)

    def stops_early(self) -> bool:
        """As the spec's."""
        return self.spec.stops_early()


class Fit:
    """Whether a measure that cannot stop early (`flatcli.measures.MeasureSpec.stops_early`) fits
    its cap, before it starts: the least products its estimate declares against ``max_hvps``, and
    the least predicted seconds (`predict`, from `quick_times`, timed on this checkpoint the first
    time a check needs them) against the smaller of ``max_seconds`` and its share of
    ``runtime.budget``. A measure without a cap, that stops early, or without an estimate always
    starts. ``dims``: computes the checkpoint's `flatcli.measures.Dims` (once, when needed)."""

    def __init__(self, engine: CurvatureEngine, dims):
        self.engine, self._dims_fn = engine, dims
        self._dims = self._times = None

    @property
    def dims(self):
        """The checkpoint's `flatcli.measures.Dims` (computed once)."""
        if self._dims is None:
            self._dims = self._dims_fn()
        return self._dims

    @property
    def times(self) -> ProductTimes | None:
        """`quick_times` on this checkpoint (timed once); None when the products cannot be timed
        (a model without a double backward: its Hessian measures fail on their own)."""
        if self._times is None:
            try:
                self._times = quick_times(self.engine)
            except Exception:  # a prediction never fails a run
                self._times = False
        return self._times or None

    def seconds(self, spec, problem: Problem | None = None) -> float:
        """The least predicted seconds of ``spec`` (`predict`), at least one forward pass; 0 when
        it is predicted to end ``not_applicable`` on ``problem`` (`flatcli.run.prediction.shares.BudgetSplit`'s
        weight)."""
        if problem is not None and _not_applicable(spec, problem):
            return 0.0
        if self.times is None:  # untimed: products in HVP equivalents, the same unit for all
            return least_work(spec, self.dims)
        return max(predict(spec, self.dims, self.times).seconds[0], self.times.forward)

    def cost(self, problem: Problem, reuse=None, among=None):
        """The weights of specs, in order, in `flatcli.run.prediction.shares.BudgetSplit`: each its least
        predicted seconds (`seconds`); in a sweep's unit (``among`` given) its least products in
        HVP equivalents (`flatcli.run.prediction.shares.least_work`), which every worker computes alike; 0 for
        a result reused from ``reuse`` (label → result) or a measure predicted ``not_applicable``.
        Work a spec shares with an earlier one (`flatcli.measures.MeasureSpec.shared_work`: a
        Hessian diagonal's tensors) is weighed once, for the first: the later one's weight loses
        that part's fraction of its least work."""

        def weight(spec) -> float:
            if reuse and spec.label in reuse:
                return 0.0
            if among is None:
                return self.seconds(spec, problem)
            return 0.0 if _not_applicable(spec, problem) else least_work(spec, self.dims)

        def weights(specs) -> list[float]:
            done: set = set()
            out = []
            for spec in specs:
                w = weight(spec)
                parts = spec.shared_work(self.dims) if w > 0 else {}
                if parts:
                    had = sum(hvp_equivalents(v) for k, v in parts.items() if k in done)
                    w *= max(0.0, 1.0 - had / max(least_work(spec, self.dims), 1e-12))
                    done.update(parts)
                out.append(w)
            return out

        return weights

    def minimum(self, spec, problem: Problem | None = None) -> float:
        """Predicted seconds for ``spec`` to return a value at all: its least seconds when it
        cannot stop early; for one that can, its first unit (`FIRST_UNIT`: two products or one
        block of them, one gradient or VJP pass, one forward pass, of its least counts; an
        estimator always does its first unit, `flatcli.engine.linalg.budget`), at least one forward pass; 0 when its
        estimate declares no work that takes time (it always starts, `reason`)."""
        est = spec.estimate(self.dims)
        if est is None or not any(hi for _, hi in est.values()):
            return 0.0  # no declared work that takes time: it always starts (`reason`)
        least = self.seconds(spec, problem)
        if least <= 0.0 or not spec.stops_early() or self.times is None:
            return least
        first = predict(_FirstUnit(spec, self.times.engine_block), self.dims, self.times)
        first = first.seconds[0]
        return min(least, max(first, self.times.forward))

    def minima(self, problem: Problem, reuse=None):
        """The least seconds of specs, in order, to return a value (`minimum`; 0 for a reused
        result): what `flatcli.run.prediction.shares.BudgetSplit` reserves for each before any gets more."""

        def out(specs) -> list[float]:
            return [0.0 if reuse and s.label in reuse else self.minimum(s, problem) for s in specs]

        return out

    def learn(self, result) -> float | None:
        """Replace the predicted seconds per product by those ``result`` measured (its seconds
        less its passes' predicted seconds, over its products; the products' ``hvp1`` and block
        scaled alike, ``measured`` naming them) once a measure has taken products; returns the
        measured seconds per product (None: nothing learned)."""
        t, d = self.times, getattr(result, "diagnostics", {}) or {}
        n = d.get("n_hvp", 0) or 0
        if t is None or n <= 0 or not result.seconds or result.seconds <= 0:
            return None
        passes = (d.get("n_grad", 0) or 0) + (d.get("n_vjp", 0) or 0)
        other = passes * t.grad + (d.get("n_forward", 0) or 0) * t.forward
        per = max(result.seconds - other, 0.0) / n
        predicted = t.hvp_seconds(1, 0)
        if per <= 0.0 or predicted <= 0.0:
            return None
        f = per / predicted
        measured = tuple(dict.fromkeys((*t.measured, "hvp")))
        self._times = replace(t, hvp1=t.hvp1 * f, hvp_block=t.hvp_block * f, measured=measured)
        return per

    def overrun(self, specs) -> list[float]:
        """Seconds each of ``specs`` may pass its share by: a measure that stops early checks its
        budget between products and passes it by about one (a product or a gradient, the
        larger); one that cannot, none (it starts only when its prediction fits)."""
        t = self.times
        step = 0.0 if t is None else max(t.hvp1, t.grad)
        return [step if s.stops_early() else 0.0 for s in specs]

    def reason(self, spec, share: float | None) -> tuple[str, dict[str, Any]] | None:
        """(why not to start, diagnostics) when ``spec`` does not fit its cap; None to start it."""
        secs = [v for v in (spec.max_seconds, share) if v is not None]
        if spec.stops_early() or (not secs and spec.max_hvps is None):
            return None
        est = spec.estimate(self.dims)
        if est is None or not any(hi for _, hi in est.values()):
            return None  # no estimate, or no work that takes time: start it
        least = est.get("n_hvp", (0, 0))[0]
        if spec.max_hvps is not None and least > spec.max_hvps:
            return (
                f"not started: it needs at least {least} HVPs, more than max_hvps = {spec.max_hvps}, and "
                "cannot stop early",
                {"predicted_hvps": list(est["n_hvp"])},
            )
        if not secs:
            return None
        if self.times is None:
            return None
        pred = predict(spec, self.dims, self.times)
        if pred.seconds[0] <= min(secs):
            return None
        return (
            f"not started: predicted {pred.seconds[0]:.3g}–{pred.seconds[1]:.3g} s, more than its "
            f"{min(secs):.3g} s budget, and it cannot stop early",
            {"predicted_seconds": list(pred.seconds), "budget_seconds": min(secs)},
        )


@dataclass
class Prediction:
    """One measure on one checkpoint: HVPs (least, most), seconds (least, most), peak bytes, and
    ``status`` "ok", "not_applicable" or "will_not_fit" (the memory check refused the checkpoint,
    `flatcli.run.prediction.memory`; nothing was timed) (then ``reason``; no cost); ``stops_early``: whether a cap
    stops it with its estimate so far (else it is started under a cap only when it fits: `Fit`)."""

    hvps: tuple[int, int] = (0, 0)
    seconds: tuple[float, float] = (0.0, 0.0)
    interval: tuple[float, float] | None = None  # seconds at the timings' low and high ends
    peak_bytes: int = 0
    status: str = "ok"
    reason: str = ""
    stops_early: bool = False

    def to_json(self, checkpoint: str, label: str) -> dict[str, Any]:
        """The ``--dry-run --format json`` entry."""
        out: dict[str, Any] = {
            "checkpoint": checkpoint,
            "measure": label,
            "status": self.status,
            "stops_early": self.stops_early,
        }
        if self.status != "ok":
            return {
                **out,
                "hvps_low": None,
                "hvps_high": None,
                "seconds_low": None,
                "seconds_high": None,
                "seconds_interval": None,
                "peak_bytes": None,
                "reason": self.reason,
            }
        return {
            **out,
            "hvps_low": self.hvps[0],
            "hvps_high": self.hvps[1],
            "seconds_low": self.seconds[0],
            "seconds_high": self.seconds[1],
            "seconds_interval": list(self.interval or self.seconds),
            "peak_bytes": self.peak_bytes,
        }


def predict(spec, dims, times: ProductTimes, problem: Problem | None = None) -> Prediction:
    """The `Prediction` of one measure spec from its declared estimate and the timed products."""
    reason = spec.not_applicable(problem) if problem is not None else None
    if reason:
        return Prediction(status="not_applicable", reason=reason)
    est = spec.estimate(dims) or {}
    block = est.get("hvp_block", (1, 1))[1]
    hvps = est.get("n_hvp", (0, 0))

    def seconds(i: int, t: ProductTimes = times) -> float:
        passes = est.get("n_grad", (0, 0))[i] + est.get("n_vjp", (0, 0))[i]
        return (
            t.hvp_seconds(hvps[i], block)
            + (t.build if hvps[i] > 0 else 0.0)  # the kept graphs, built at the first
            + passes * t.grad
            + est.get("n_forward", (0, 0))[i] * t.forward
            + est.get("vector_ops", (0, 0))[i] * t.vector_op
            + est.get("batched_vector_ops", (0, 0))[i] * t.batched_vector_op
        )

    declared, inputs = vectors_kept(spec, dims, times.engine_block)
    keeps = declared + inputs
    product = times.product_bytes if hvps[1] > 0 or est.get("n_grad", (0, 0))[1] > 0 else 0
    peak = times.resident + times.element * times.P * (2 + keeps) + product
    return Prediction(
        hvps=(int(hvps[0]), int(hvps[1])),
        seconds=(seconds(0), seconds(1)),
        interval=(seconds(0, times.at(0)), seconds(1, times.at(1))),
        peak_bytes=int(peak),
        stops_early=spec.stops_early(),
    )
