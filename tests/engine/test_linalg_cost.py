"""The costs the estimators declare: the composition rules of `Cost`, and a spy on every product
of each estimator on dense symmetric matrices, which the declared (least, most) must bound."""

import itertools

import pytest
import torch

from flatcli.engine import linalg
from flatcli.engine.linalg import Cost

DT = torch.float64


def gen(seed=0):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def sym(eigs, seed=0):
    """A dense symmetric matrix with the given eigenvalues in a random basis."""
    ev = torch.as_tensor(eigs, dtype=DT)
    U, _ = torch.linalg.qr(torch.randn(len(ev), len(ev), generator=gen(seed + 100), dtype=DT))
    return U @ torch.diag(ev) @ U.T


def spy(A):
    """``A`` as an operator, and the list of rows each product call multiplied."""
    calls = []

    def mv(V):
        calls.append(V.shape[0])
        return V @ A

    return linalg.as_operator(mv, A.shape[0], dtype=DT), calls


def blocks(size):
    """The estimators' settings for ``size`` vectors per product call."""
    return linalg.EstimatorSettings(block_size=size)


SPECTRA = {  # full rank, distinct eigenvalues (no early invariant subspace)
    "decaying": lambda n, g: 1.0 / torch.arange(1, n + 1, dtype=DT) ** 2,
    "flat": lambda n, g: 1.0 + 0.5 * torch.rand(n, generator=g, dtype=DT),
    "indefinite": lambda n, g: torch.rand(n, generator=g, dtype=DT) * 2 - 1,
    "near_zero_trace": lambda n, g: torch.linspace(-1, 1, n, dtype=DT) + 1e-3,
}


def matrices(n=48, seeds=(0, 1)):
    for (name, f), seed in itertools.product(SPECTRA.items(), seeds):
        yield name, seed, sym(f(n, gen(seed)), seed)


def within(cost: Cost, spent: int, what: str):
    lo, hi = cost.hvp
    assert min(lo, hi) <= spent <= hi, (what, spent, (lo, hi))


# ---------------------------------------------------------------------------- composition


def pairs(draw):
    lo = int(torch.randint(0, 50, (1,), generator=draw))
    return lo, lo + int(torch.randint(0, 50, (1,), generator=draw))


def random_cost(draw) -> Cost:
    fields = ("hvp", "grad", "forward", "vjp", "vectors", "vector_ops", "batched_vector_ops")
    kw = {f: pairs(draw) if torch.rand(1, generator=draw) < 0.7 else None for f in fields}
    block = int(torch.randint(-1, 6, (1,), generator=draw))
    return Cost(**kw, block=None if block < 0 else block)


def test_sum_then_and_either_combine_every_quantity_by_its_rule():
    draw = gen(3)
    for _ in range(300):
        a, b = random_cost(draw), random_cost(draw)
        for name in ("hvp", "grad", "forward", "vjp", "vector_ops", "batched_vector_ops"):
            x, y = getattr(a, name), getattr(b, name)
            s, t, e = getattr(a + b, name), getattr(a.then(b), name), getattr(a.either(b), name)
            if x is None and y is None:
                assert s is None and t is None and e is None
                continue
            x, y = x or (0, 0), y or (0, 0)
            assert s == t == (x[0] + y[0], x[1] + y[1])
            assert e == (min(x[0], y[0]), max(x[1], y[1]))
        va, vb = a.vectors, b.vectors
        if va is not None and vb is not None:
            assert (a + b).vectors == (va[0] + vb[0], va[1] + vb[1])
            assert a.then(b).vectors == (max(va[0], vb[0]), max(va[1], vb[1]))
            assert a.either(b).vectors == (min(va[0], vb[0]), max(va[1], vb[1]))
        else:
            assert (a + b).vectors == a.then(b).vectors == (va or vb)
        blocks = [x for x in (a.block, b.block) if x is not None]
        want = None
        if blocks:  # the smaller block; 0 (the engine's) only when no part names one
            nonzero = [x for x in blocks if x != 0]
            want = min(nonzero) if nonzero else 0
        assert (a + b).block == a.then(b).block == a.either(b).block == want
        assert a + b == b + a


def test_optional_products_and_estimate_keep_what_they_promise():
    c = Cost(hvp=(8, 100), grad=3, block=2, vectors=(5, 9), vector_ops=(4, 40))
    o = c.optional()
    assert (o.hvp, o.grad, o.vector_ops, o.vectors, o.block) == (
        (0, 100),
        (0, 3),
        (0, 40),
        (5, 9),
        2,
    )
    p = c.products()
    assert (p.hvp, p.grad, p.block, p.vectors, p.vector_ops) == ((8, 100), (3, 3), None, None, None)
    assert c.estimate() == {
        "n_hvp": (8, 100),
        "n_grad": (3, 3),
        "hvp_block": (2, 2),
        "vectors": (5, 9),
        "vector_ops": (4, 40),
    }
    assert Cost().estimate() == {}


# ---------------------------------------------------------------------------- spies


@pytest.mark.parametrize(
    "k,min_steps,max_steps,tol",
    [
        (1, None, 100, 1e-3),
        (1, 3, 40, 1e-2),
        (1, None, 10, 1e-8),
        (3, None, 60, 1e-3),
        (2, 5, 12, 1e-6),
        (4, None, 2, 1e-3),  # the first block runs whole past max_steps
    ],
)
def test_lanczos_spends_what_it_declares(k, min_steps, max_steps, tol):
    for name, seed, A in matrices():
        op, calls = spy(A)
        stop = linalg.KrylovStop(tol=tol, min_steps=min_steps, max_steps=max_steps)
        r = linalg.lanczos(op, k=k, block=k, stop=stop, generator=gen(seed))
        cost = linalg.lanczos_cost(A.shape[0], stop, k=k, block=k)
        within(cost, sum(calls), (name, seed, r.steps))
        block = min(k, max_steps)  # the start block, cut to max_steps
        assert set(calls) <= {block}, "products in blocks of the Krylov block"
        assert cost.block == block
        assert sum(calls) == r.steps


def test_lanczos_basis_declared_is_the_cap_lanczos_keeps():
    for max_basis, (name, seed, A) in itertools.product((8, 12, 30, None), matrices(n=60)):
        stop = linalg.KrylovStop(tol=1e-10, max_steps=50, max_basis=max_basis)
        r = linalg.lanczos(spy(A)[0], stop=stop, generator=gen(seed))
        cost = linalg.lanczos_cost(A.shape[0], stop)
        assert r.basis_vectors <= cost.vectors[1] - linalg.LANCZOS_WORK_VECTORS, (name, max_basis)


@pytest.mark.parametrize(
    "min_probes,max_probes,tol",
    [(16, 1000, 1e-2), (4, 30, 1e-3), (8, 8, 1e-2), (2, 200, 0.2), (16, 64, 1e-9)],
)
def test_hutchinson_and_hutchpp_spend_what_they_declare(min_probes, max_probes, tol):
    for (name, seed, A), block in itertools.product(matrices(), (1, 4)):
        n = A.shape[0]
        stop = linalg.ProbeStop(tol=tol, min_probes=min_probes, max_probes=max_probes)
        op, calls = spy(A)
        linalg.hutchinson(op, stop=stop, generator=gen(seed), settings=blocks(block))
        within(linalg.hutchinson_cost(n, stop), sum(calls), ("hutchinson", name, seed, block))
        op, calls = spy(A)
        linalg.hutchpp(op, stop=stop, generator=gen(seed), settings=blocks(block))
        within(linalg.hutchpp_cost(n, stop), sum(calls), ("hutchpp", name, seed, block))


def test_the_near_zero_floor_is_declared_where_it_runs():
    A = sym(torch.linspace(-1, 1, 48, dtype=DT), 2)  # trace 0: the floor must run
    stop = linalg.ProbeStop(tol=1e-2, min_probes=16, max_probes=40)
    op, calls = spy(A)
    linalg.hutchinson(op, stop=stop, generator=gen(0))
    assert sum(calls) > stop.max_probes  # the floor's products came on top of the probes
    within(linalg.hutchinson_cost(48, stop), sum(calls), "floor")
    assert linalg.hutchinson_cost(48, stop, floor=False).hvp == (16, 40)


@pytest.mark.parametrize("runs,steps", [(1, 5), (4, 25), (3, 60), (7, 10)])
def test_slq_spends_what_it_declares(runs, steps):
    for name, seed, A in matrices():
        op, calls = spy(A)
        linalg.slq(op, runs=runs, steps=steps, generator=gen(seed))
        cost = linalg.slq_cost(A.shape[0], runs, steps)
        within(cost, sum(calls), (name, seed))
        assert max(calls) <= cost.block


@pytest.mark.parametrize("n,block", [(7, 1), (30, 4), (48, 50)])
def test_diagonal_estimators_spend_what_they_declare(n, block):
    A = sym(torch.linspace(0.1, 2, n, dtype=DT), n)
    op, calls = spy(A)
    linalg.exact_diagonal(op, settings=blocks(block))
    within(linalg.exact_diagonal_cost(n), sum(calls), "exact")
    for samples in (1, 5, 17):
        op, calls = spy(A)
        linalg.hutchinson_diagonal(op, samples=samples, generator=gen(1), settings=blocks(block))
        within(linalg.sampled_diagonal_cost(samples), sum(calls), "hutchinson")
        op, calls = spy(A)
        linalg.scaled_diagonal(
            op, torch.ones(n, dtype=DT), samples=samples, generator=gen(1), settings=blocks(block)
        )
        within(linalg.sampled_diagonal_cost(samples), sum(calls), "scaled")


@pytest.mark.parametrize(
    "check,probes,max_exact,samples",
    [(3, 2, 4096, 64), (3, 2, 5, 16), (1, 1, 0, 8), (25, 3, 30, 4)],
)
def test_the_checked_diagonal_spends_what_it_declares(check, probes, max_exact, samples):
    sizes = {"a": 10, "b": 20, "c": 2}
    n = sum(sizes.values())
    tensors, start = {}, 0
    for name, size in sizes.items():
        tensors[name] = slice(start, start + size)
        start += size
    for seed in range(3):
        g = gen(seed)
        J = torch.randn(n, n, generator=g, dtype=DT)
        G = J.T @ J / n
        R = torch.zeros(n, n, dtype=DT)
        b = tensors["b"]
        Rb = torch.randn(20, 20, generator=g, dtype=DT)
        R[b, b] = Rb + Rb.T  # curvature beyond Gauss-Newton in tensor b only
        hvp, calls = spy(G + R)
        ggn_calls = []

        def ggnvp(V, G=G, ggn_calls=ggn_calls):
            ggn_calls.append(V.shape[0])
            return V @ G

        rules = linalg.DiagonalCheck(
            tol=1e-6, check=check, probes=probes, max_exact=max_exact, samples=samples
        )
        res = linalg.checked_gauss_newton_diagonal(
            hvp,
            ggnvp,
            torch.diagonal(G).clone(),
            torch.randn(n, generator=g, dtype=DT),
            tensors,
            rules=rules,
            generator=gen(seed + 7),
        )
        assert "b" in res.curved
        cost = linalg.checked_diagonal_cost(list(sizes.values()), 10, rules)
        within(cost, sum(calls) + sum(ggn_calls), (seed, res.exact, res.estimated))
        assert cost.vjp == (10, 10)
