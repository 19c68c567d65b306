"""Matrix-free algorithms against dense float64 references on explicit symmetric matrices."""

import math

import numpy as np
import pytest
import torch

from flatcli.engine import linalg
from flatcli.engine.operators import CurvatureOperator

DT = torch.float64


def gen(seed=0):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def sym(eigs, seed=0):
    """A dense symmetric matrix with the given eigenvalues in a random basis."""
    g = gen(seed + 100)
    ev = torch.as_tensor(eigs, dtype=DT)
    U, _ = torch.linalg.qr(torch.randn(len(ev), len(ev), generator=g, dtype=DT))
    return U @ torch.diag(ev) @ U.T


def mv_of(A, counter=None):
    def mv(V):
        if counter is not None:
            counter.append(V.shape[0])
        return V @ A  # A symmetric: rows of V A = (A vᵢ)ᵀ

    return mv


def op_of(A, counter=None, n=None, **kw):
    """``A`` as an estimator's operator (float64 vectors, a bare mat-vec through `linalg.as_operator`)."""
    return linalg.as_operator(mv_of(A, counter), A.shape[0] if n is None else n, dtype=DT, **kw)


def indefinite(n=80, seed=0):
    """Most negative eigenvalue has the largest magnitude: power iteration picks it."""
    g = gen(seed)
    ev = torch.rand(n - 2, generator=g, dtype=DT) * 2 - 1  # bulk in [-1, 1]
    ev = torch.cat([torch.tensor([-10.0, 3.0], dtype=DT), ev])
    return sym(ev, seed)


def power_iteration(A, iters=300, seed=0):
    v = torch.randn(A.shape[0], generator=gen(seed), dtype=DT)
    for _ in range(iters):
        v = A @ v
        v = v / v.norm()
    return float(v @ A @ v)


# ---------------------------------------------------------------------------- Lanczos
def test_lanczos_algebraic_max_of_indefinite_matrix():
    A = indefinite()
    ev = torch.linalg.eigvalsh(A)
    lam_max, lam_min = float(ev[-1]), float(ev[0])
    assert abs(lam_min) > lam_max  # the case power iteration gets wrong
    assert power_iteration(A) == pytest.approx(lam_min, rel=1e-6)
    r = linalg.lanczos(op_of(A), stop=linalg.KrylovStop(tol=1e-6), generator=gen())
    assert r.converged
    assert abs(r.eigenvalues[0] - lam_max) / abs(lam_max) <= 1e-4
    assert r.residuals[0] <= 1e-6 * abs(r.eigenvalues[0])
    assert r.eigenvalues[-1] == pytest.approx(lam_min, rel=1e-6)
    assert r.steps >= linalg.certified_min_steps(
        A.shape[0]
    )  # a small residual alone only finds *an* eigenvalue


def test_lanczos_smallest():
    A = indefinite(seed=3)
    ev = torch.linalg.eigvalsh(A)
    r = linalg.lanczos(
        -CurvatureOperator(mv_of(A), A.shape[0], dtype=DT),
        stop=linalg.KrylovStop(tol=1e-8),
        generator=gen(),
    )  # the smallest: the largest of −A
    assert -r.eigenvalues[0] == pytest.approx(float(ev[0]), rel=1e-6)


def test_lanczos_residuals_are_true_ritz_residuals():
    A = indefinite(seed=1)
    r = linalg.lanczos(
        op_of(A),
        stop=linalg.KrylovStop(tol=1e-3),
        k=3,
        block=1,
        generator=gen(),
        return_vectors=True,
    )
    X = r.ritz_vectors
    for i in range(3):
        x = X[i]
        assert float(x.norm()) == pytest.approx(1.0, abs=1e-10)
        true_res = float((A @ x - r.eigenvalues[i] * x).norm())
        assert true_res == pytest.approx(r.residuals[i], rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("block", [None, 2, 4])
def test_block_lanczos_topk_with_multiplicity(block):
    n = 90
    g = gen(7)
    bulk = torch.rand(n - 5, generator=g, dtype=DT) * 2 - 1
    top = torch.tensor([5.0, 5.0, 5.0, 4.0, -9.0], dtype=DT)  # a triple top eigenvalue
    A = sym(torch.cat([top, bulk]), seed=7)
    ref = torch.linalg.eigvalsh(A).flip(0)[:4].numpy()
    calls = []
    r = linalg.lanczos(
        op_of(A, calls, n),
        k=4,
        block=block or 4,
        stop=linalg.KrylovStop(tol=1e-8, max_steps=n),
        generator=gen(),
    )
    assert r.converged
    np.testing.assert_allclose(r.eigenvalues[:4], ref, rtol=1e-8)
    assert max(calls) == (block or 4)  # products come in blocks
    assert sum(calls) == r.n_hvp == r.steps


def test_lanczos_exhausts_small_space_exactly():
    A = sym([3.0, -1.0, 0.5, 2.0, 0.1])
    r = linalg.lanczos(op_of(A, n=5), stop=linalg.KrylovStop(tol=1e-12), generator=gen())
    assert r.converged and r.steps <= 5
    np.testing.assert_allclose(
        np.sort(r.eigenvalues), np.sort(torch.linalg.eigvalsh(A).numpy()), atol=1e-12
    )


def test_lanczos_min_steps_and_max_steps():
    A = indefinite(seed=2)
    r = linalg.lanczos(op_of(A), stop=linalg.KrylovStop(tol=0.5, min_steps=20), generator=gen())
    assert r.steps >= linalg.certified_min_steps(
        A.shape[0]
    )  # a small residual alone only finds *an* eigenvalue
    r = linalg.lanczos(op_of(A), stop=linalg.KrylovStop(tol=1e-14, max_steps=7), generator=gen())
    assert r.steps == 7 and not r.converged


def test_lanczos_deterministic_under_seed():
    A = indefinite(seed=4)
    a = linalg.lanczos(op_of(A), stop=linalg.KrylovStop(tol=1e-4), generator=gen(11))
    b = linalg.lanczos(op_of(A), stop=linalg.KrylovStop(tol=1e-4), generator=gen(11))
    np.testing.assert_array_equal(a.eigenvalues, b.eigenvalues)
    assert a.steps == b.steps


# ---------------------------------------------------------------------------- traces
def psd(n=120, seed=0, decay=False):
    g = gen(seed)
    ev = torch.rand(n, generator=g, dtype=DT)
    if decay:
        ev = ev + 50.0 * (torch.arange(n, dtype=DT) < 6)  # a few large outliers carry the trace
    return sym(ev, seed)


@pytest.mark.parametrize("method", ["hutchinson", "hutchpp"])
def test_trace_within_three_stderr(method):
    # coverage over 20 seeds (one seed is 3.1σ off under Hutchinson: a one-seed check is chance)
    A = psd()
    f = getattr(linalg, method)
    z = []
    for seed in range(20):
        r = f(op_of(A), stop=linalg.ProbeStop(tol=0.01), generator=gen(seed))
        assert r.converged and r.stderr <= 0.01 * abs(r.estimate)
        z.append(abs(r.estimate - float(A.trace())) / r.stderr)
    assert sum(v <= 2 for v in z) >= 17 and max(z) <= 4


@pytest.mark.parametrize("method", ["hutchinson", "hutchpp"])
def test_trace_converges_as_probes_grow(method):
    A = psd(seed=5, decay=True)
    tr = float(A.trace())
    f = getattr(linalg, method)
    errs = []
    for m in (12, 96, 768):
        e = [
            abs(
                f(
                    op_of(A),
                    stop=linalg.ProbeStop(tol=1e-9, min_probes=m, max_probes=m),
                    generator=gen(s),
                ).estimate
                - tr
            )
            for s in range(6)
        ]
        errs.append(float(np.mean(e)))
    assert errs[0] > errs[1] > errs[2]


def test_hutchpp_beats_hutchinson_on_decaying_spectrum():
    A = psd(seed=6, decay=True)
    h = linalg.hutchinson(op_of(A), stop=linalg.ProbeStop(tol=0.01), generator=gen())
    hp = linalg.hutchpp(op_of(A), stop=linalg.ProbeStop(tol=0.01, min_probes=24), generator=gen())
    assert hp.probes < h.probes


def test_hutchpp_sketch_grows_when_it_pays():
    n = 300
    g = gen(11)
    ev = torch.rand(n, generator=g, dtype=DT) * 0.02 + 20.0 / (1 + torch.arange(n, dtype=DT))
    A = sym(ev, 11)  # decaying spectrum: the top of it carries most of the trace
    tr = float(A.trace())
    calls_a, calls_f = [], []
    a = linalg.hutchpp(
        op_of(A, calls_a, n), stop=linalg.ProbeStop(tol=0.01, max_probes=2000), generator=gen(1)
    )
    f = linalg.hutchpp(
        op_of(A, calls_f, n),
        stop=linalg.ProbeStop(tol=0.01, max_probes=2000),
        sketch=5,
        generator=gen(1),
    )
    assert a.sketch > 5 and f.sketch == 5  # an explicit sketch is kept fixed
    assert a.converged and f.converged and a.probes < 0.7 * f.probes  # 74 vs 122
    assert a.probes == sum(calls_a) and f.probes == sum(calls_f)
    for r in (a, f):
        assert abs(r.estimate - tr) <= 3 * r.stderr
        assert len(r.samples) >= 16


def test_hutchpp_exact_for_low_rank():
    n = 50
    g = gen(8)
    B = torch.randn(n, 3, generator=g, dtype=DT)
    A = B @ B.T  # rank 3
    r = linalg.hutchpp(
        op_of(A, n=n), stop=linalg.ProbeStop(min_probes=12, max_probes=12), generator=gen()
    )
    assert r.sketch == 4
    assert r.estimate == pytest.approx(float(A.trace()), rel=1e-10)
    assert r.stderr <= 1e-10 * abs(r.estimate)
    assert r.probes == 12


def test_hutchinson_fixed_count_and_probe_accounting():
    A = psd(n=40)
    calls = []
    r = linalg.hutchinson(
        op_of(A, calls, 40),
        stop=linalg.ProbeStop(min_probes=20, max_probes=20),
        generator=gen(),
        settings=linalg.EstimatorSettings(block_size=8),
    )
    assert r.probes == 20 == sum(calls) == len(r.samples)


def test_trace_deterministic_and_independent_of_block():
    A = psd(n=60, seed=9)
    a = linalg.hutchinson(
        op_of(A, n=60),
        stop=linalg.ProbeStop(min_probes=32, max_probes=32),
        generator=gen(3),
        settings=linalg.EstimatorSettings(block_size=4),
    )
    b = linalg.hutchinson(
        op_of(A, n=60),
        stop=linalg.ProbeStop(min_probes=32, max_probes=32),
        generator=gen(3),
        settings=linalg.EstimatorSettings(block_size=32),
    )
    assert a.estimate == b.estimate


# ---------------------------------------------------------------------------- diagonals
def test_exact_diagonal():
    A = indefinite(n=30)
    d = linalg.exact_diagonal(op_of(A, n=30), settings=linalg.EstimatorSettings(block_size=7))
    torch.testing.assert_close(d, torch.diagonal(A), rtol=0, atol=1e-12)


def test_hutchinson_diagonal_converges():
    A = psd(n=30, seed=2)
    errs = []
    for m in (8, 128, 2048):
        mean, se = linalg.hutchinson_diagonal(
            op_of(A, n=30),
            samples=m,
            generator=gen(),
            settings=linalg.EstimatorSettings(block_size=64),
        )
        errs.append(float((mean - torch.diagonal(A)).abs().mean()))
    assert errs[0] > errs[1] > errs[2]
    assert float(((mean - torch.diagonal(A)).abs() <= 4 * se + 1e-12).float().mean()) > 0.9


def test_scaled_diagonal_is_unbiased_and_exact_for_diagonal_matrices():
    n = 25
    theta = torch.randn(n, generator=gen(1), dtype=DT)
    theta[3] = 0.0
    D = torch.diag(torch.rand(n, generator=gen(2), dtype=DT))
    mean, se = linalg.scaled_diagonal(mv_of(D), theta, samples=4, generator=gen())
    torch.testing.assert_close(
        mean, torch.diagonal(D), rtol=1e-12, atol=1e-12
    )  # zero variance for diagonal H
    A = psd(n=n, seed=3)
    mean, se = linalg.scaled_diagonal(
        op_of(A),
        theta,
        samples=4096,
        generator=gen(),
        settings=linalg.EstimatorSettings(block_size=512),
    )
    z = ((mean - torch.diagonal(A)) / se).abs()
    assert float((z <= 4).float().mean()) > 0.9


def _gn_plus_residual(seed=0):
    """H = G + R on three tensors a (0:6), b (6:10), c (10:20): the block R_aa is zero (a "piecewise-linear"
    tensor), R couples a to the others."""
    n = 20
    G = psd(n=n, seed=seed + 4)
    g = gen(seed + 5)
    R = torch.randn(n, n, generator=g, dtype=DT) * 0.3
    R = R + R.T
    R[:6, :6] = 0.0
    theta = torch.randn(n, generator=gen(seed + 6), dtype=DT)
    return G, R, theta, {"a": slice(0, 6), "b": slice(6, 10), "c": slice(10, 20)}


def test_checked_gauss_newton_diagonal_exact_where_verified_and_for_curved_tensors():
    G, R, theta, tensors = _gn_plus_residual()
    H = G + R
    calls = []
    res = linalg.checked_gauss_newton_diagonal(
        op_of(H, calls),
        mv_of(G),
        torch.diagonal(G),
        theta,
        tensors,
        rules=linalg.DiagonalCheck(tol=1e-8, check=3),
        generator=gen(),
        settings=linalg.EstimatorSettings(block_size=4),
    )
    assert res.curved == ["b", "c"] and res.exact == ["b", "c"] and res.estimated == []
    assert res.checked["a"] <= 1e-12 and res.residual_groups == []
    torch.testing.assert_close(res.diag, torch.diagonal(H), rtol=0, atol=1e-12)
    # 3 coordinates and 2 block probes per tensor; b (4 entries) needs one more pass, c all 10 unit vectors
    assert res.n_hvp == sum(calls) == 9 + 6 + 4 + 10 and res.n_ggnvp == 6
    # only the tensors asked for are checked
    res = linalg.checked_gauss_newton_diagonal(
        mv_of(H),
        mv_of(G),
        torch.diagonal(G),
        theta,
        {"a": tensors["a"]},
        rules=linalg.DiagonalCheck(1e-8),
        generator=gen(),
    )
    assert res.curved == [] and res.n_hvp == 3 + 2
    torch.testing.assert_close(res.diag, torch.diagonal(G), rtol=0, atol=0)


def _confined_residual(rows_curved, seed):
    """A tensor of 16 rows × 5 columns (80 entries) whose remainder R is nonzero only on ``rows_curved`` rows,
    as for a layer with 2 tanh rows and 14 ReLU rows; G a random PSD matrix, θ random."""
    n = 80
    G = psd(n=n, seed=seed)
    g = gen(seed + 1)
    R = torch.zeros(n, n, dtype=DT)
    k = 5 * rows_curved
    B = torch.randn(k, k, generator=g, dtype=DT)
    R[:k, :k] = 0.05 * (B + B.T)
    return G, R, torch.randn(n, generator=g, dtype=DT)


@pytest.mark.parametrize("seed", range(6))
def test_checked_diagonal_finds_curvature_confined_to_a_few_rows(seed):
    G, R, theta = _confined_residual(2, seed)
    H = G + R
    t = {"w": slice(0, 80)}
    res = linalg.checked_gauss_newton_diagonal(
        mv_of(H),
        mv_of(G),
        torch.diagonal(G),
        theta,
        t,
        rules=linalg.DiagonalCheck(1e-8),
        generator=gen(seed),
    )
    assert res.curved == ["w"] and res.exact == ["w"]
    torch.testing.assert_close(res.diag, torch.diagonal(H), rtol=0, atol=1e-12)
    # the coordinate check alone (largest G_ii, largest |θ_i|, one random entry) misses it on some seeds
    coords = linalg._check_coordinates(torch.diagonal(G), theta, 3, gen(seed))
    if bool((coords >= 10).all()):
        assert float(torch.diagonal(R)[coords].abs().max()) == 0.0


def test_checked_diagonal_flags_a_zero_diagonal_bilinear_block_and_stays_exact():
    G, R, theta, tensors = _gn_plus_residual()
    R[:6, :6] = torch.randn(6, 6, generator=gen(9), dtype=DT)
    R[:6, :6] = R[:6, :6] + R[:6, :6].T
    R[torch.arange(6), torch.arange(6)] = 0.0  # diag(R_aa) = 0, R_aa ≠ 0
    H = G + R
    res = linalg.checked_gauss_newton_diagonal(
        mv_of(H),
        mv_of(G),
        torch.diagonal(G),
        theta,
        tensors,
        rules=linalg.DiagonalCheck(1e-8),
        generator=gen(),
    )
    assert res.curved == [
        "a",
        "b",
        "c",
    ]  # conservative: a costs its unit vectors, the result stays exact
    torch.testing.assert_close(res.diag, torch.diagonal(H), rtol=0, atol=1e-12)


def test_remainder_block_false_pass_rate_is_within_the_stated_bound():
    """The least favourable case of the docstring's bound: R = δ e_0e_0ᵀ and G = T e_1e_1ᵀ (all of Tr G on
    another coordinate), one probe. Here ‖Hz‖ ≥ ‖Gz‖, so it passes iff δ|z_0| ≤ tol·‖Hz‖, i.e.
    |z_0/z_1| ≤ tol·T/(δ√(1 − tol²)): probability (2/π) arctan of that, exactly; that rate is observed over
    2000 seeded probes and lies below the stated bound p₁ = 5.6 τ T/δ + 1.6e-8."""
    n, T, delta = 6, 2.0, 1.0
    G = torch.zeros(n, n, dtype=DT)
    G[1, 1] = T
    R = torch.zeros(n, n, dtype=DT)
    R[0, 0] = delta
    tol = 0.05
    exact = 2 / math.pi * math.atan(tol * T / (delta * math.sqrt(1 - tol * tol)))
    bound = 5.6 * tol / (1 - tol) * T / delta + 1.6e-8
    g = gen(11)
    N = 2000
    gaps = linalg.remainder_block_gaps(
        linalg.as_operator(mv_of(G + R), n, device="cpu", dtype=DT),
        mv_of(G),
        {f"t{k}": slice(0, n) for k in range(N)},
        probes=1,
        generator=g,
        settings=linalg.EstimatorSettings(block_size=500),
    )
    rate = sum(v <= tol for v in gaps.values()) / N
    assert abs(rate - exact) <= 4 * math.sqrt(exact * (1 - exact) / N)
    assert exact <= bound


# ---------------------------------------------------------------------------- SLQ
def test_slq_exact_quadrature_with_full_krylov_space():
    """With steps = dim the quadrature is exact per probe: P·vᵀf(A)v/‖v‖² for each Rademacher v."""
    n = 24
    A = indefinite(n=n, seed=5)
    ev, U = torch.linalg.eigh(A)
    runs = 5
    s = linalg.slq(op_of(A, n=n), runs=runs, steps=n, generator=gen(4))
    V = linalg.rademacher(runs, n, gen(4), dtype=DT)
    fA = U @ torch.diag(torch.exp(ev / 10)) @ U.T
    per_run = n * (torch.einsum("rp,pq,rq->r", V, fA, V) / (V * V).sum(1))
    est, se = s.expect(lambda t: np.exp(t / 10))
    assert est == pytest.approx(float(per_run.mean()), rel=1e-9)
    assert se == pytest.approx(float(per_run.std() / math.sqrt(runs)), rel=1e-6)
    for w in s.weights:
        assert w.sum() == pytest.approx(1.0, abs=1e-12)


def test_slq_estimates_trace_functions():
    A = psd(n=100, seed=7)
    ev = torch.linalg.eigvalsh(A).numpy()
    s = linalg.slq(op_of(A, n=100), runs=30, steps=40, generator=gen())
    for fn in (np.log1p, lambda t: t / (t + 0.1)):
        est, se = s.expect(fn)
        assert abs(est - fn(ev).sum()) <= 4 * se


def test_slq_independent_of_grouping_and_density_integrates():
    A = indefinite(n=40, seed=6)
    a = linalg.slq(op_of(A, n=40), runs=6, steps=15, generator=gen(2), block=1)
    calls = []
    b = linalg.slq(op_of(A, calls, 40), runs=6, steps=15, generator=gen(2), block=6)
    assert max(calls) == 6 and b.n_hvp == 6 * 15
    for x, y in zip(a.nodes, b.nodes, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-10, atol=1e-10)
    grid = np.linspace(-15, 8, 4000)
    dens = b.density(grid, 0.2)
    assert np.trapezoid(dens, grid) == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("cap", ["none", "seconds", "products"])
def test_slq_never_runs_more_runs_in_lockstep_than_its_group_allows(cap):
    """Over groups of 1 to 6 runs (the memory rule, `slq_group_size`, or ``block``) and budgets
    with no cap, a time cap and a product cap: no product call holds more runs than the group,
    the first group included (which always runs), and the nodes are those of one run at a time."""
    A = indefinite(n=40, seed=6)
    alone = linalg.slq(op_of(A, n=40), runs=6, steps=15, generator=gen(2), block=1)
    for group in range(1, 7):
        calls = []
        budget = {
            "none": None,
            "seconds": linalg.Budget(max_seconds=3600.0),
            "products": linalg.Budget(max_products=10_000),
        }[cap]
        s = linalg.slq(
            op_of(A, calls, 40), runs=6, steps=15, generator=gen(2), block=group, budget=budget
        )
        assert max(calls) <= group and s.n_hvp == 6 * 15, (group, max(calls))
        assert cap == "seconds" or max(calls) == group  # a time cap may start fewer at once
        for x, y in zip(alone.nodes, s.nodes, strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-10, atol=1e-10)


def test_rademacher_signs_are_balanced_uncorrelated_and_blocking_invariant():
    Z = linalg.rademacher(256, 3000, gen(1), dtype=DT)
    assert set(Z.unique().tolist()) == {-1.0, 1.0}
    n = Z.numel()
    assert abs(float(Z.mean())) <= 4 / math.sqrt(n)
    rows = (Z @ Z.T / Z.shape[1]) - torch.eye(256, dtype=DT)
    assert float(rows.abs().max()) <= 6 / math.sqrt(Z.shape[1])
    for lag in (1, 8, 23, 24, 25):
        assert abs(float((Z[:, :-lag] * Z[:, lag:]).mean())) <= 4 / math.sqrt(n)
    a = linalg.rademacher(5, 100, gen(2))
    g = gen(2)
    b = torch.cat([linalg.rademacher(2, 100, g), linalg.rademacher(3, 100, g)])
    assert torch.equal(a, b)


def test_certified_floor_finds_the_top_where_a_bare_residual_test_stops_early():
    # H = 0.9 I + 0.1 u uᵀ: a random start is an almost-eigenvector of the 0.9 cluster (relative
    # residual ~ 0.1/√n), so a residual test alone accepts θ ≈ 0.9 at once; λmax = 1.
    n = 40_000
    u = torch.randn(n, generator=gen(5), dtype=DT)
    u /= u.norm()

    def mv(V):
        return 0.9 * V + 0.1 * (V @ u)[:, None] * u[None, :]

    bare = linalg.lanczos(
        linalg.as_operator(mv, n, dtype=DT), stop=linalg.KrylovStop(1e-3, 1), generator=gen(1)
    )
    assert bare.steps == 1 and bare.eigenvalues[0] < 0.91  # stopped on the cluster
    r = linalg.lanczos(
        linalg.as_operator(mv, n, dtype=DT), stop=linalg.KrylovStop(tol=1e-3), generator=gen(1)
    )
    assert r.steps >= linalg.certified_min_steps(n) or r.converged
    assert r.eigenvalues[0] == pytest.approx(1.0, rel=1e-9)


def test_certified_min_steps_matches_the_bound():
    for n in (10, 1000, 10**6, 10**8):
        k = linalg.certified_min_steps(n, eps=0.25, delta=0.01)
        bound = lambda k, n=n: 1.648 * math.sqrt(n) * math.exp(-0.5 * (2 * k - 1))  # noqa: E731
        assert bound(k) <= 0.01 and (k == 1 or bound(k - 1) > 0.01 or k == n)
