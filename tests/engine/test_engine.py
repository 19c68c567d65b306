"""CurvatureEngine products against dense float64 references on tiny models."""

import pytest
import torch
from torch import nn

from flatcli.engine import CurvatureEngine, Problem, ggn_diag, linalg
from flatcli.engine.curvatures import Hessian
from flatcli.errors import MeasurementError
from tests.oracles import dense_ggn, problem_hessian

DT = torch.float64
MODES = [("reverse", False), ("reverse", True), ("forward", None)]


def tiny_problem(batch_size=3, n=10, act=nn.ReLU, loss="cross_entropy", seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 6), act(), nn.Linear(6, 3)).to(DT).eval()
    x = torch.randn(n, 5, dtype=DT)
    y = torch.randint(0, 3, (n,))
    return Problem(model, x, y, loss=loss, batch_size=batch_size, dtype=DT)


def vecs(p, k=4, seed=1):
    g = torch.Generator()
    g.manual_seed(seed)
    return torch.randn(k, p.num_params, generator=g, dtype=DT)


@pytest.mark.parametrize("mode,batched", MODES)
def test_hvp_matches_problem_hessian(mode, batched):
    p = tiny_problem()
    H = problem_hessian(p)
    V = vecs(p)
    eng = CurvatureEngine(p, hvp_mode=mode, reverse_batched=batched)
    torch.testing.assert_close(eng.hessian()(V), V @ H, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(eng.hessian()(V[0]), H @ V[0], rtol=1e-10, atol=1e-12)
    assert eng.counters()["n_hvp"] == 5 and eng.counters()["fallbacks"] == 0


@pytest.mark.parametrize("mode,batched", MODES)
@pytest.mark.parametrize("cache", [True, False])
def test_rows_split_over_blocks_and_batches_fill_one_output(mode, batched, cache):
    """7 vectors in blocks of 3 (3 + 3 + 1) over 4 batches: each block writes its rows of one
    preallocated output, the first batch's products written and the later ones added."""
    p = tiny_problem()
    H = problem_hessian(p)
    V = vecs(p, 7)
    eng = CurvatureEngine(
        p, hvp_mode=mode, reverse_batched=batched, block_size=3, cache_graphs=cache
    )
    torch.testing.assert_close(eng.hessian()(V), V @ H, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        eng.hessian()(V), V @ H, rtol=1e-10, atol=1e-12
    )  # again: no stale rows
    torch.testing.assert_close(eng.fd_hessian() @ V[:4].T, (V[:4] @ H).T, rtol=1e-4, atol=1e-6)


def test_hvp_at_another_theta():
    p = tiny_problem(act=nn.Tanh)
    th = p.theta + 0.1 * vecs(p, 1)[0]
    H = problem_hessian(p, th)
    V = vecs(p, 3)
    torch.testing.assert_close(CurvatureEngine(p).hessian(th)(V), V @ H, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_uneven_last_batch_equals_one_full_batch():
    V = vecs(tiny_problem(), 3)
    full = CurvatureEngine(tiny_problem(batch_size=10))
    uneven = CurvatureEngine(tiny_problem(batch_size=4))  # batches 4, 4, 2
    assert [b.rows for b in uneven.state.batches] == [4, 4, 2]
    torch.testing.assert_close(uneven.hessian()(V), full.hessian()(V), rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(uneven.loss_grad()[1], full.loss_grad()[1], rtol=1e-12, atol=1e-13)
    assert uneven.loss() == pytest.approx(full.loss(), rel=1e-13)
    torch.testing.assert_close(uneven.ggn()(V), full.ggn()(V), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_ggnvp_matches_dense_gauss_newton(loss):
    p = tiny_problem(loss=loss, act=nn.Tanh)
    G = dense_ggn(p)
    V = vecs(p)
    eng = CurvatureEngine(p)
    torch.testing.assert_close(eng.ggn()(V), V @ G, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(eng.ggn()(V[2]), G @ V[2], rtol=1e-10, atol=1e-12)
    assert eng.counters()["n_ggnvp"] == 5


@pytest.mark.slow
@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
@pytest.mark.parametrize("act", [nn.ReLU, nn.Tanh])
def test_ggn_diagonal_matches_dense_gauss_newton(loss, act, fast, monkeypatch):
    p = tiny_problem(loss=loss, act=act, batch_size=4)  # batches 4, 4, 2
    eng = CurvatureEngine(p)
    if not fast:  # every parameter through the vmapped per-sample products, 3 samples at a time
        monkeypatch.setattr(ggn_diag, "linear_fast_path", lambda problem, batch: [])
        monkeypatch.setattr(eng.state.memory, "chunk_rows", lambda C, P: 3)
    d = eng.ggn_diagonal()
    assert len(ggn_diag.linear_fast_path(p, p.batches[0])) == (2 if fast else 0)
    torch.testing.assert_close(d, torch.diagonal(dense_ggn(p)), rtol=1e-10, atol=1e-13)
    assert eng.counters()["n_vjp"] == 3 and eng.counters()["n_hvp"] == 0
    diagH = torch.diagonal(problem_hessian(p))
    if act is nn.ReLU:  # piecewise linear in every parameter: the Hessian diagonal itself
        torch.testing.assert_close(d, diagH, rtol=1e-10, atol=1e-13)
    else:
        assert float((d - diagH).abs().max()) > 1e-3


def test_ggn_diagonal_is_the_hessian_diagonal_with_batchnorm_and_pooling_in_eval_mode():
    from tests.experiments.test_invariance import _conv_bn

    model, x, y = _conv_bn()
    p = Problem(model, x, y, batch_size=5, dtype=DT)
    eng = CurvatureEngine(p)
    d = (
        eng.ggn_diagonal()
    )  # fc1, fc2 by the outer-product rule, the convolutions and BatchNorms per sample
    assert [m for m, _, _ in ggn_diag.linear_fast_path(p, p.batches[0])] == [model.fc1, model.fc2]
    torch.testing.assert_close(d, torch.diagonal(problem_hessian(p)), rtol=1e-10, atol=1e-13)


class _TiedInplace(nn.Module):
    """fc1 → in-place ReLU → fc2 applied twice (shared weights) → head."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(5, 4), nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        h = torch.relu_(self.fc1(x))
        return self.head(torch.tanh(self.fc2(torch.relu(self.fc2(h)))))


def test_ggn_diagonal_with_in_place_activations_and_a_layer_called_twice():
    torch.manual_seed(0)
    model = _TiedInplace().to(DT).eval()
    x, y = torch.randn(9, 5, dtype=DT), torch.randint(0, 3, (9,))
    p = Problem(model, x, y, batch_size=4, dtype=DT)
    eng = CurvatureEngine(p)
    d = eng.ggn_diagonal()
    assert [m for m, _, _ in ggn_diag.linear_fast_path(p, p.batches[0])] == [
        model.fc1,
        model.head,
    ]  # fc2 runs twice
    torch.testing.assert_close(d, torch.diagonal(dense_ggn(p)), rtol=1e-10, atol=1e-13)


def test_ggn_diagonal_at_another_theta():
    p = tiny_problem(act=nn.Tanh, batch_size=10)
    th = p.theta + 0.1 * vecs(p, 1)[0]
    q = Problem(p.model, p.batch, batch_size=10, dtype=DT)
    q.params = q.unflatten(th.clone())
    torch.testing.assert_close(
        CurvatureEngine(p).ggn_diagonal(th), torch.diagonal(dense_ggn(q)), rtol=1e-10, atol=1e-13
    )


def test_fd_hvp_second_order_accurate():
    p = tiny_problem(act=nn.Tanh)
    H = problem_hessian(p)
    V = vecs(p, 2)
    V = V / V.norm(dim=1, keepdim=True)
    eng = CurvatureEngine(p)
    ref = V @ H
    err = [float((eng.fd_hessian(eps=eps)(V) - ref).abs().max()) for eps in (1e-2, 1e-3)]
    assert err[1] < err[0] / 50  # O(eps²)
    assert err[1] <= 1e-5 * float(ref.abs().max())
    assert eng.counters()["n_grad"] == 8 and eng.counters()["n_hvp"] == 4
    with pytest.raises(ValueError):
        eng.fd_hessian(eps=0.0)(V)


def test_finite_difference_mode_matches_dense_hessian_and_counts_gradients():
    p = tiny_problem(act=nn.Tanh)
    H = problem_hessian(p)
    V = vecs(p, 3) * torch.tensor([[1.0], [10.0], [0.01]], dtype=DT)  # any scale: steps use v/‖v‖
    V[2] = 0.0
    eng = CurvatureEngine(p, hvp_mode="finite_difference", block_size=2)
    ref = V @ H
    out = eng.hessian()(V)
    for k in range(2):  # truncation error O(h²), h = 1e-3·‖θ‖
        assert float((out[k] - ref[k]).norm()) <= 1e-4 * float(ref[k].norm())
    assert float(out[2].abs().max()) == 0.0
    assert (
        eng.counters()["n_hvp"] == 3 and eng.counters()["n_grad"] == 4
    )  # the zero vector costs nothing
    coarse = CurvatureEngine(p, hvp_mode="finite_difference", fd_eps=1e-2).hessian()(V[0])
    fine = CurvatureEngine(p, hvp_mode="finite_difference", fd_eps=1e-3).hessian()(V[0])
    assert float((fine - ref[0]).norm()) < float((coarse - ref[0]).norm()) / 50  # O(h²)
    with pytest.raises(ValueError, match="fd_eps"):
        CurvatureEngine(p, hvp_mode="finite_difference", fd_eps=-1.0)


def test_finite_difference_mode_through_measures_and_config():
    from flatcli.api import measure_model
    from flatcli.config import from_dict
    from flatcli.errors import ConfigError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
    x, y = torch.randn(20, 5, dtype=DT), torch.randint(0, 3, (20,))
    ms = [
        {"hessian_lambda_max": {"tol": 1e-8}},
        {"hessian_trace": {"min_probes": 8, "max_probes": 8}},
    ]
    rows = {
        m: measure_model(model, (x, y), ms, precision="fp64", hvp_mode=m, batch_size=7)
        for m in ("reverse", "finite_difference")
    }
    for lab in ("hessian_lambda_max", "hessian_trace"):
        a, b = rows["reverse"].results[lab], rows["finite_difference"].results[lab]
        assert b.value == pytest.approx(a.value, rel=1e-6), lab
        assert (
            b.diagnostics["n_grad"] == 2 * b.diagnostics["n_hvp"] and a.diagnostics["n_grad"] == 0
        )
    assert (
        from_dict({"runtime": {"hvp_mode": "finite_difference"}}).runtime.hvp_mode
        == "finite_difference"
    )
    with pytest.raises(ConfigError, match="runtime.hvp_mode"):
        from_dict({"runtime": {"hvp_mode": "fd"}})


def test_loss_and_grad_match_autograd():
    p = tiny_problem()
    eng = CurvatureEngine(p)
    th = p.theta.requires_grad_(True)
    L = p.loss(p.unflatten(th))
    (g,) = torch.autograd.grad(L, th)
    val, gg = eng.loss_grad()
    assert val == pytest.approx(float(L.detach()), rel=1e-13)
    torch.testing.assert_close(gg, g, rtol=1e-12, atol=1e-14)
    assert eng.counters()["n_grad"] == 1


def _patch_product(monkeypatch, eng, fn):
    """Replace the per-batch product of ``eng``'s Hessians (the one method a curvature supplies) by
    ``fn(self, V, θ, j, batch, out, accumulate)``; the others' stay."""
    real = Hessian._matmat_batch

    def patched(self, *args):
        return (fn if self.state is eng.state else real)(self, *args)

    monkeypatch.setattr(Hessian, "_matmat_batch", patched)


def _oom_once(monkeypatch, eng, when):
    real = Hessian._matmat_batch
    state = {"raised": 0}

    def product(self, V, th, j, batch, out, accumulate):
        if state["raised"] == 0 and when(V):
            state["raised"] += 1
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, V, th, j, batch, out, accumulate)

    _patch_product(monkeypatch, eng, product)
    return state


def test_oom_halves_the_probe_block_and_records_the_retry(monkeypatch):
    p = tiny_problem()
    V = vecs(p, 8)
    ref = CurvatureEngine(p).hessian()(V)
    eng = CurvatureEngine(p, block_size=8)
    state = _oom_once(monkeypatch, eng, lambda V: V.shape[0] > 4)
    out = eng.hessian()(V)
    assert state["raised"] == 1
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-14)
    assert eng.counters()["oom_retries"] == 1 and eng.state.route().block_size == 4
    assert eng.counters()["n_hvp"] == 8


def test_oom_at_block_one_halves_the_batch(monkeypatch):
    p = tiny_problem(batch_size=8)
    V = vecs(p, 2)
    ref = CurvatureEngine(p).hessian()(V)
    eng = CurvatureEngine(p, block_size=1)
    _oom_once(monkeypatch, eng, lambda V: True)
    torch.testing.assert_close(eng.hessian()(V), ref, rtol=1e-12, atol=1e-14)
    assert eng.counters()["oom_retries"] == 1 and eng.state.route().batch_size == 4
    assert [b.rows for b in eng.state.batches] == [4, 4, 2]


def test_oom_with_nothing_left_to_halve_is_a_measurement_error(monkeypatch):
    p = tiny_problem(batch_size=1, n=3)
    eng = CurvatureEngine(p, block_size=1)

    def product(*args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    _patch_product(monkeypatch, eng, product)
    with pytest.raises(MeasurementError, match="out of memory"):
        eng.hessian()(vecs(p, 1)[0])


def test_other_errors_are_not_retried(monkeypatch):
    p = tiny_problem()
    eng = CurvatureEngine(p, block_size=4)

    def product(*args):
        raise RuntimeError("shape mismatch")

    _patch_product(monkeypatch, eng, product)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        eng.hessian()(vecs(p, 4))
    assert eng.counters()["oom_retries"] == 0 and eng.state.route().block_size == 4


class _NoForwardSquare(torch.autograd.Function):
    """x² with a backward only (old-style: no jvp, no functorch support)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class SquareNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 4)
        self.b = nn.Linear(4, 3)

    def forward(self, x):
        return self.b(_NoForwardSquare.apply(self.a(x)))


class RefSquareNet(SquareNet):
    def forward(self, x):
        return self.b(self.a(x) ** 2)


def test_forward_mode_falls_back_to_double_backward():
    torch.manual_seed(0)
    model = SquareNet().to(DT).eval()
    ref_model = RefSquareNet().to(DT).eval()
    ref_model.load_state_dict(model.state_dict())
    x = torch.randn(7, 5, dtype=DT)
    y = torch.randint(0, 3, (7,))
    p = Problem(model, x, y, batch_size=3, dtype=DT)
    pr = Problem(ref_model, x, y, batch_size=3, dtype=DT)
    H = problem_hessian(pr)
    V = vecs(p, 3)
    eng = CurvatureEngine(p, hvp_mode="forward")
    op = eng.hessian()  # the route is planned here: the forward-mode probe fails, reverse it is
    assert eng.counters()["fallbacks"] == 1 and op.route.hessian == op.route.single == "reverse"
    torch.testing.assert_close(op(V), V @ H, rtol=1e-10, atol=1e-12)
    assert eng.counters()["fallbacks"] == 1 and eng.state.route() is op.route


def test_block_size_default_and_override(monkeypatch):
    p = tiny_problem()
    assert 1 <= CurvatureEngine(p).state.route().block_size <= 64
    assert CurvatureEngine(p, block_size=3).state.route().block_size == 3
    calls = []
    eng = CurvatureEngine(p, block_size=3)
    real = Hessian._matmat_batch

    def product(self, V, th, j, *rest):
        if j == 0:  # the first batch of each block
            calls.append(V.shape[0])
        return real(self, V, th, j, *rest)

    _patch_product(monkeypatch, eng, product)
    eng.hessian()(vecs(p, 7))
    assert calls == [3, 3, 1]
    with pytest.raises(ValueError):
        CurvatureEngine(p, block_size=0)
    with pytest.raises(ValueError):
        CurvatureEngine(p, hvp_mode="sideways")
    with pytest.raises(ValueError, match="shape"):
        CurvatureEngine(p).hessian()(torch.zeros(3, dtype=DT))


def test_auto_mode_on_cpu():
    from flatcli.engine import routes

    route = CurvatureEngine(tiny_problem()).state.route()
    assert (route.hessian, route.single, route.batched) == (
        "reverse",
        "reverse",
        True,
    )  # small model: one vmapped backward
    big = nn.Linear(routes.CPU_BATCHED_BELOW // 10, 10)
    p = Problem(big, torch.randn(4, big.in_features), torch.randint(0, 10, (4,)))
    assert (
        CurvatureEngine(p).state.route().batched is False
    )  # larger models: a loop over the cached graph


def test_lanczos_on_engine_matches_dense_and_is_deterministic():
    p = tiny_problem(act=nn.Tanh)
    ev = torch.linalg.eigvalsh(problem_hessian(p))
    runs = []
    for _ in range(2):
        g = torch.Generator()
        g.manual_seed(5)
        r = linalg.lanczos(
            linalg.as_operator(CurvatureEngine(p).hessian().matmat_rows, p.num_params, dtype=DT),
            stop=linalg.KrylovStop(tol=1e-6),
            generator=g,
        )
        runs.append(r)
        assert abs(r.eigenvalues[0] - float(ev[-1])) <= 1e-4 * abs(float(ev[-1]))
    assert runs[0].eigenvalues[0] == runs[1].eigenvalues[0]


def test_model_is_not_mutated():
    p = tiny_problem()
    before = {k: v.clone() for k, v in p.model.state_dict().items()}
    eng = CurvatureEngine(p)
    V = vecs(p, 2)
    eng.hessian()(V)
    eng.ggn()(V)
    eng.fd_hessian(eps=1e-3)(V[0])
    for k, v in p.model.state_dict().items():
        assert torch.equal(v, before[k])


@pytest.mark.parametrize("cache", [None, True, False])
def test_graph_cache_reuse_and_invalidation(cache):
    p = tiny_problem(act=nn.Tanh)
    H = problem_hessian(p)
    V = vecs(p, 3)
    eng = CurvatureEngine(p, hvp_mode="reverse", cache_graphs=cache)
    for _ in range(2):  # second call reuses the cached graphs
        torch.testing.assert_close(eng.hessian()(V[0]), H @ V[0], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(eng.hessian()(V), V @ H, rtol=1e-10, atol=1e-12)
    assert (eng.state.graphs.entries is not None) == (cache is not False)
    th = p.theta + 0.05 * V[1]
    H2 = problem_hessian(p, th)
    torch.testing.assert_close(eng.hessian(th)(V), V @ H2, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        eng.hessian()(V), V @ H, rtol=1e-10, atol=1e-12
    )  # back at θ: rebuilt


def test_graph_cache_too_big_is_not_kept(monkeypatch):
    p = tiny_problem()
    eng = CurvatureEngine(p, hvp_mode="reverse")
    monkeypatch.setattr(eng.state.graphs, "budget", lambda: 10.0)  # bytes
    eng.hessian()(vecs(p, 2))
    assert eng.state.graphs.entries is None and eng.state.graphs.state == "too_big"


def test_oom_drops_the_graph_cache_first(monkeypatch):
    p = tiny_problem()
    V = vecs(p, 4)
    eng = CurvatureEngine(p, hvp_mode="reverse", block_size=4)
    ref = eng.hessian()(V)
    assert eng.state.graphs.entries is not None
    _oom_once(monkeypatch, eng, lambda V: True)
    torch.testing.assert_close(eng.hessian()(V), ref, rtol=1e-12, atol=1e-14)
    assert (
        eng.counters()["oom_retries"] == 1
        and eng.state.graphs.entries is None
        and eng.state.route().block_size == 4
    )


def test_map_batches_solves_each_batch_whole_and_forbids_full_set_products():
    """`map_batches` returns fn of every batch in order (equal to calling `batch_loss_grad` on each),
    counts their work, and raises on a full-set product inside fn, on one process as on many."""
    p = tiny_problem(batch_size=4, n=10)
    eng = CurvatureEngine(p)
    parts = [p.batch.select(slice(i, i + 3)) for i in (0, 3, 6)]
    got = eng.map_batches(parts, lambda b: eng.batch_loss_grad(b))
    assert eng.counters()["n_grad"] == pytest.approx(9 / 10)
    for b, (loss, g) in zip(parts, got, strict=True):
        t = p.theta.detach().clone().requires_grad_(True)
        ref = p.batch_loss_sum(p.unflatten(t), b) / b.rows
        (gr,) = torch.autograd.grad(ref, t)
        assert loss == pytest.approx(float(ref.detach()), rel=1e-12)
        torch.testing.assert_close(g, gr, rtol=1e-10, atol=1e-14)
    for full in (lambda b: eng.loss(), lambda b: eng.hessian()(p.theta), lambda b: eng.loss_grad()):
        with pytest.raises(RuntimeError, match="map_batches"):
            eng.map_batches(parts[:1], full)
    assert eng.loss() == pytest.approx(
        float(p.loss(p.unflatten(p.theta))), rel=1e-12
    )  # local mode ended


def test_derive_keeps_every_setting_and_gives_the_other_models_products():
    """`CurvatureEngine.derive(model)`: the settings the caller chose (HVP mode, block size, graph
    caching, finite-difference step, precision, batch size, selection) carry over, and the products
    are the other model's (its dense Hessian), not the first one's."""
    import copy

    p = tiny_problem(batch_size=4)
    eng = CurvatureEngine(
        p,
        hvp_mode="finite_difference",
        block_size=2,
        cache_graphs=False,
        fd_eps=2e-3,
        precision="fp64",
        max_device_vectors=5,
    )
    other = copy.deepcopy(p.model)
    with torch.no_grad():
        for q in other.parameters():
            q.mul_(1.5)
    d = eng.derive(other)
    assert d.problem.model is other and d.problem is not p
    assert (
        d.state.route().hessian,
        d.hessian().relative_eps,
        d.state.route().block_size,
        d.precision.name,
    ) == (
        "finite_difference",
        2e-3,
        2,
        "fp64",
    )
    assert d.problem.batch_size == 4 and d.problem.names == p.names and d.problem.n == p.n
    assert not d.state.graphs.keeping and d.state.max_device_vectors == 5
    exact = d.curvature(
        Hessian
    )  # the exact product, to compare with the other model's dense Hessian
    H = problem_hessian(d.problem)
    V = vecs(d.problem)
    torch.testing.assert_close(exact(V), V @ H, rtol=1e-9, atol=1e-12)
    assert not torch.allclose(V @ H, V @ problem_hessian(p), rtol=1e-3)
    d.merge_counts(d)  # counters add up
    eng.merge_counts(d)
    assert eng.counters()["n_hvp"] == 2 * V.shape[0]
