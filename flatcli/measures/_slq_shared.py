"""Stochastic Lanczos quadrature runs shared by one checkpoint's measures.

``hessian_spectrum`` (N_eff, the density) and ``local_entropy`` (log det) are both expectations
over the same kind of SLQ runs of the Hessian: Rademacher starts, ``slq_steps`` Lanczos steps
each. Within one checkpoint's run they draw their starts from one stream (seeded from the
measure's seed with offset `STREAM`; run i is the i-th Rademacher probe of that stream,
`flatcli.engine.linalg.rademacher` draws row by row), and the runs already done are kept in
``ctx.cache``: a measure that needs n runs takes the first n, computing only those not yet done.
So the second measure spends no products on the runs the first one did, and its value is the one
it computes alone with the same seed (the runs are the same runs: same start, same operator,
same steps; equal to rounding, since a run's products may be batched with other runs).

Kept apart (a different key): another seed, another number of steps, another problem or engine,
another precision (a bf16 problem's products inside `flatcli.engine.CurvatureEngine.full_precision`
are not the bf16 products). Runs a time cap cut short (fewer nodes than steps) are given to the
measure that ran them but are not kept: they are not the runs another measure would compute.
"""

from __future__ import annotations

import numpy as np
import torch

from ..engine import linalg
from . import MeasureResult

STREAM = 1  # generator offset of the shared SLQ starts (hessian_spectrum's since it has had SLQ)


class SharedSLQ:
    """The SLQ runs of one probe stream of one operator, computed on demand and kept."""

    def __init__(
        self,
        op,
        steps: int,
        generator: torch.Generator,
        settings: linalg.EstimatorSettings | None = None,
    ):
        self.op, self.settings = linalg.as_operator(op), settings
        self.steps = int(min(steps, self.op.dim))
        self.generator = generator
        self.nodes: list = []
        self.weights: list = []
        self.pending = torch.zeros(0, self.op.dim, dtype=torch.float64)  # drawn starts not yet run

    def runs(self, n: int, budget=None) -> linalg.SLQResult:
        """The first ``n`` runs of the stream (fewer when ``budget`` stops the missing ones; their
        products are charged to it, ``n_hvp`` of the result; runs already kept cost nothing)."""
        missing = n - len(self.nodes)
        if missing <= 0:
            return linalg.SLQResult(
                self.nodes[:n], self.weights[:n], self.op.dim, n_hvp=0, steps=self.steps
            )
        draw = missing - len(self.pending)
        if draw > 0:
            fresh = linalg.rademacher(draw, self.op.dim, self.generator, dtype=torch.float64)
            self.pending = torch.cat([self.pending, fresh])
        r = linalg.slq(
            self.op,
            steps=self.steps,
            starts=self.pending[:missing],
            budget=budget,
            settings=self.settings,
        )
        done = len(r.nodes)
        cut = r.stopped_by_budget and any(len(t) < self.steps for t in r.nodes)
        nodes, weights = self.nodes + r.nodes, self.weights + r.weights
        if not cut:  # complete runs: keep them for the next measure
            self.nodes, self.weights = nodes, weights
            self.pending = self.pending[done:]
        return linalg.SLQResult(
            nodes,
            weights,
            self.op.dim,
            n_hvp=r.n_hvp,
            steps=self.steps,
            stopped_by_budget=r.stopped_by_budget,
        )


NO_RUN = "no SLQ run completed within its share"
ONE_RUN = "one SLQ run completed within its share: no standard error"
ONE_RUN_ASKED = "one SLQ run (slq_runs: 1) gives no standard error: ask for at least 2"


def no_slq_run(res: linalg.SLQResult, fn):
    """The result of an SLQ measure left with fewer than 2 runs of at least `linalg.MIN_NODES`
    Gauss nodes: no estimate with an error, so NaN with the reason (a single run's value is kept
    as the diagnostic ``one_run_value``); status ``budget`` when a cap cut the runs short,
    ``not_converged`` when one run was all the options asked for (no cap was involved)."""
    if res.stopped_by_budget:
        reason, status = (NO_RUN if not res.nodes else ONE_RUN), "budget"
    else:
        reason, status = ONE_RUN_ASKED, "not_converged"
    diag = {"reason": reason, "slq_runs": len(res.nodes)}
    if res.nodes:
        diag["one_run_value"] = res.expect(fn)[0]
    return MeasureResult(value=float("nan"), diagnostics=diag, status=status)


def shared_slq(ctx, steps: int) -> SharedSLQ:
    """The checkpoint's shared SLQ runs of the Hessian for this measure's seed and ``steps``."""
    p, eng = ctx.problem, ctx.engine
    precision = (str(p.compute_dtype), bool(torch.backends.cuda.matmul.allow_tf32))
    key = (id(p), id(eng), ctx.seed, int(steps), precision)
    cache = ctx.cache.slq_runs
    if key not in cache:
        cache[key] = SharedSLQ(eng.hessian(), steps, ctx.generator(STREAM), eng.estimator_settings)
    return cache[key]


def kept_abs_trace(ctx, runs: int = 4) -> tuple[float, float] | None:
    """(Tr|H|, its standard error: runs and quadrature, `flatcli.engine.linalg.SLQResult.stderr`)
    from SLQ runs this checkpoint's measures already computed for this measure's problem, engine,
    seed and precision (at least ``runs`` complete runs, any steps; the most steps first), or
    None: the near-zero floor of `hessian_trace` then computes its own (40 products)."""
    p, eng = ctx.problem, ctx.engine
    precision = (str(p.compute_dtype), bool(torch.backends.cuda.matmul.allow_tf32))
    found = [
        (k[3], v)
        for k, v in ctx.cache.slq_runs.items()
        if k[:3] == (id(p), id(eng), ctx.seed) and k[4] == precision and len(v.nodes) >= runs
    ]
    if not found:
        return None
    shared = max(found, key=lambda kv: kv[0])[1]
    r = linalg.SLQResult(shared.nodes, shared.weights, shared.op.dim, n_hvp=0, steps=shared.steps)
    value, err = r.stderr(np.abs)[:2]
    return float(value), float(err)
