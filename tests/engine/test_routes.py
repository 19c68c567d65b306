"""Product routes: planned once per engine, kept by each curvature for all its products, and
replaced (never changed in place) by an out-of-memory back-off or a route failure."""

import dataclasses
import math

import pytest
import torch
from torch import nn

from flatcli.api import measure_model
from flatcli.engine import CurvatureEngine, Problem
from flatcli.engine.curvatures import GGN, Curvature, FiniteDifferenceHessian, Hessian
from flatcli.engine.products import ProductContext
from flatcli.engine.routes import Route, RouteFailed
from tests.oracles import problem_hessian

DT = torch.float64
THREE = [
    {"hessian_lambda_max": {}},
    {"hessian_trace": {"min_probes": 6, "max_probes": 6}},
    {"hessian_spectrum": {"slq_runs": 2, "slq_steps": 5}},
]


def tiny(seed=0, n=10, batch_size=3):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT).eval()
    x, y = torch.randn(n, 5, dtype=DT), torch.randint(0, 3, (n,))
    return model, x, y


def vecs(p, k=4, seed=1):
    return torch.randn(k, p.num_params, generator=torch.Generator().manual_seed(seed), dtype=DT)


def spy_on_products(monkeypatch):
    """Record, for every per-batch product of every curvature, (operator, its route, K, batch),
    and count the plans."""
    seen, plans = [], []
    for cls in (Hessian, GGN, FiniteDifferenceHessian):
        real = cls._matmat_batch

        def product(self, V, th, j, batch, out, accumulate, real=real):
            seen.append((self, self.route, V.shape[0], batch))
            return real(self, V, th, j, batch, out, accumulate)

        monkeypatch.setattr(cls, "_matmat_batch", product)
    real_plan = ProductContext.plan

    def plan(self):
        plans.append(self)
        return real_plan(self)

    monkeypatch.setattr(ProductContext, "plan", plan)
    return seen, plans


@pytest.mark.parametrize(
    ("hvp_mode", "block_size", "expected"),
    [
        ("auto", None, "reverse"),
        ("reverse", 2, "reverse"),
        ("forward", 3, "forward"),
        ("finite_difference", None, "finite_difference"),
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_a_three_measure_run_takes_one_route_per_operator(
    monkeypatch, hvp_mode, block_size, expected, seed
):
    """λmax, trace and spectrum through `flatcli.api.measure_model`: every product of an operator
    runs on the one route it was built with (the same object, its block size and batches), every
    operator of the run has the same route, planned once, in the mode the settings ask for."""
    seen, plans = spy_on_products(monkeypatch)
    model, x, y = tiny(seed)
    row = measure_model(
        model,
        (x, y),
        THREE,
        precision="fp64",
        batch_size=3,
        seed=seed,
        hvp_mode=hvp_mode,
        block_size=block_size,
    )
    assert len(row.results) == 3, row.results
    for r in row.results.values():  # measured, on whatever route
        assert r.status in ("ok", "not_converged") and math.isfinite(r.value), r
    operators = {}
    for op, route, k, batch in seen:
        operators.setdefault(op, []).append(route)
        assert k <= route.block_size
        assert any(batch is b for b in route.batches)  # the route's batches, not another cut
    assert len(operators) >= 3  # at least one per measure
    for op, routes in operators.items():
        assert all(r is op.route for r in routes), f"{op.name}: {set(routes)}"
    routes = {op.route for op in operators}
    assert len(routes) == 1 and len(plans) == 1  # decided once, for the whole run
    (route,) = routes
    assert route.hessian == expected and route.recompute is False
    assert route.block_size == (block_size or route.block_size) and route.batch_size == 3
    kinds = {type(op) for op in operators}
    assert kinds == ({FiniteDifferenceHessian} if expected == "finite_difference" else {Hessian})


def _oom_once_on(monkeypatch, target):
    real = Hessian._matmat_batch
    raised = []

    def product(self, V, th, j, batch, out, accumulate):
        if self is target and not raised and V.shape[0] > 1:
            raised.append(V.shape[0])
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, V, th, j, batch, out, accumulate)

    monkeypatch.setattr(Hessian, "_matmat_batch", product)
    return raised


@pytest.mark.parametrize(("block", "batch"), [(8, 3), (1, 4)])
def test_out_of_memory_gives_a_new_route_and_leaves_the_old_one_alone(monkeypatch, block, batch):
    """A back-off makes a new route (half the block, else half the batch) that the failing operator
    retries on and the engine builds later operators on; an operator built before keeps its route,
    and the old route object is unchanged (frozen)."""
    model, x, y = tiny(n=8)
    p = Problem(model, x, y, batch_size=batch, dtype=DT, loss="cross_entropy")
    H = problem_hessian(p)
    V = vecs(p, 8)
    eng = CurvatureEngine(p, block_size=block, cache_graphs=False)
    before, failing = eng.hessian(), eng.hessian()
    old = failing.route
    assert before.route is old and eng.state.route() is old
    if block == 1:  # nothing to halve but the batch: fail on any block
        real = Hessian._matmat_batch
        raised = []

        def product(self, V, th, j, b, out, accumulate):
            if self is failing and not raised:
                raised.append(1)
                raise torch.cuda.OutOfMemoryError("CUDA out of memory")
            return real(self, V, th, j, b, out, accumulate)

        monkeypatch.setattr(Hessian, "_matmat_batch", product)
    else:
        raised = _oom_once_on(monkeypatch, failing)
    torch.testing.assert_close(failing(V), V @ H, rtol=1e-10, atol=1e-12)
    assert raised and eng.counters()["oom_retries"] == 1
    new = failing.route
    assert new is not old and (old.block_size, old.batch_size) == (block, batch)
    if block > 1:
        assert (new.block_size, new.batch_size) == (block // 2, batch)
    else:
        assert (new.block_size, new.batch_size) == (1, batch // 2)
        assert [b.rows for b in new.batches] == [batch // 2] * (8 // (batch // 2))
    assert eng.state.route() is new and eng.hessian().route is new
    assert before.route is old  # built before the back-off: its own route, as it was
    torch.testing.assert_close(before(V), V @ H, rtol=1e-10, atol=1e-12)
    assert eng.counters()["oom_retries"] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        old.block_size = 2


def test_a_missing_batched_rule_is_a_new_route_counted_once(monkeypatch):
    """A batched pull-back that fails (an op without a batched backward rule) gives the route
    with a loop of pull-backs: the operator retries on it, later operators are built on it, and
    the fallback is counted once."""
    model, x, y = tiny()
    p = Problem(model, x, y, batch_size=3, dtype=DT, loss="cross_entropy")
    H = problem_hessian(p)
    V = vecs(p, 4)
    eng = CurvatureEngine(p, hvp_mode="reverse", reverse_batched=True)
    op = eng.hessian()
    old = op.route
    real = ProductContext.pullback
    calls = []

    def pullback(g, t, V, retain, out=None, accumulate=False, *, batched):
        calls.append(batched)
        if batched and V.shape[0] > 1:
            raise RouteFailed("batched", "no batched rule for this op")
        return real(g, t, V, retain, out, accumulate, batched=batched)

    monkeypatch.setattr(ProductContext, "pullback", staticmethod(pullback))
    torch.testing.assert_close(op(V), V @ H, rtol=1e-10, atol=1e-12)
    assert old.batched is True and op.route.batched is False and op.route is not old
    assert eng.counters()["fallbacks"] == 1 and eng.state.route() is op.route
    later = eng.hessian()
    torch.testing.assert_close(later(V), V @ H, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(op(V), V @ H, rtol=1e-10, atol=1e-12)
    assert later.route is op.route and eng.counters()["fallbacks"] == 1
    assert calls.count(True) == 1  # one batched try, then loops only


def test_a_forward_failure_after_the_probe_is_a_reverse_route(monkeypatch):
    """A forward-mode product that fails although the one-row probe ran (an op that fails on
    larger inputs) turns into the reverse route, explicitly and counted; the values are exact."""
    model, x, y = tiny()
    p = Problem(model, x, y, batch_size=3, dtype=DT, loss="cross_entropy")
    H = problem_hessian(p)
    V = vecs(p, 4)
    eng = CurvatureEngine(p, hvp_mode="forward")
    op = eng.hessian()
    assert op.route.hessian == "forward" and eng.counters()["fallbacks"] == 0

    def forward(self, V, th, batch):
        raise NotImplementedError("no forward-mode rule for this op")

    monkeypatch.setattr(Hessian, "_forward", forward)
    torch.testing.assert_close(op(V), V @ H, rtol=1e-10, atol=1e-12)
    assert (op.route.hessian, op.route.single) == ("reverse", "reverse")
    assert eng.counters()["fallbacks"] == 1 and eng.hessian().route is op.route


def test_route_failures_and_back_off_rules():
    """`Route.without` and `Route.backed_off` on their own: reverse keeps the other modes, the
    back-off halves the block before the batch and gives None at 1 and 1."""
    r = Route("forward", "reverse", True, False, block_size=4, batch_size=2)
    assert r.without("forward") == dataclasses.replace(r, hessian="reverse")
    assert r.without("batched") == dataclasses.replace(r, batched=False)
    chain = dataclasses.replace(r, hessian="chain", single="chain")
    assert chain.without("forward") == chain
    with pytest.raises(ValueError, match="unknown"):
        r.without("sideways")
    cuts = []
    steps = [r]
    while (nxt := steps[-1].backed_off(lambda bs: cuts.append(bs) or ())) is not None:
        steps.append(nxt)
    assert [(s.block_size, s.batch_size) for s in steps] == [(4, 2), (2, 2), (1, 2), (1, 1)]
    assert cuts == [1] and r.mode(1) == "reverse" and r.mode(2) == "forward"
    assert isinstance(RouteFailed("batched", "x"), RuntimeError)
    assert issubclass(Hessian, Curvature)


def test_a_layers_output_products_take_the_loop_route_after_a_missing_batched_rule(monkeypatch):
    """`module_output_hvp` pulls its K vectors back on the engine's route; a batched pull-back that
    fails gives the looped route, explicitly: the same products, one fallback, and the curvatures
    built afterwards on the new route."""
    model, x, y = tiny(n=6)
    p = Problem(model, x, y, batch_size=6, dtype=DT, loss="cross_entropy")
    layer = model[0]
    V = torch.eye(6, dtype=DT)
    ref_eng = CurvatureEngine(p, reverse_batched=True)
    ((rows, _, z, _),) = list(ref_eng.module_io(layer))
    ref = ref_eng.module_output_hvp(layer, rows, z, V)
    eng = CurvatureEngine(p, reverse_batched=True)
    old = eng.state.route()
    real = ProductContext.pullback

    def pullback(g, t, V, retain, out=None, accumulate=False, *, batched):
        if batched and V.shape[0] > 1:
            raise RouteFailed("batched", "no batched rule for this op")
        return real(g, t, V, retain, out, accumulate, batched=batched)

    monkeypatch.setattr(ProductContext, "pullback", staticmethod(pullback))
    torch.testing.assert_close(eng.module_output_hvp(layer, rows, z, V), ref, rtol=0, atol=1e-14)
    assert old.batched and eng.state.route().batched is False and eng.counters()["fallbacks"] == 1
    assert eng.hessian().route is eng.state.route()
    eng.module_output_hvp(layer, rows, z, V)
    assert eng.counters()["fallbacks"] == 1
