"""Curvature operators and the engine's first-order and per-sample products, against dense references."""

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from flatcli.engine import CurvatureEngine, Problem
from flatcli.errors import MeasurementError
from tests.oracles import dense_ggn, dense_hessian, problem_hessian
from tests.oracles import mlp_problem as problem

DT = torch.float64


def rows_loss(p, out, rows):
    """Per-sample losses of outputs ``out`` on the rows ``rows`` of the measurement set."""
    return p.loss_fn.per_unit(out, rows)


def test_operator_algebra_matches_the_dense_matrix():
    p = problem()
    eng = CurvatureEngine(p)
    H = problem_hessian(p)
    op = eng.hessian()
    assert op.shape == (p.num_params, p.num_params)
    g = torch.Generator().manual_seed(1)
    v = torch.randn(p.num_params, generator=g, dtype=DT)
    X = torch.randn(p.num_params, 3, generator=g, dtype=DT)
    torch.testing.assert_close(op @ v, H @ v, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        op @ X, H @ X, rtol=1e-10, atol=1e-12
    )  # columns, like a dense matrix
    torch.testing.assert_close(op.matmat_rows(X.T), (H @ X).T, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(op.dense(block=7), H, rtol=1e-10, atol=1e-12)
    assert op.n_products == 1 + 3 + 3 + p.num_params
    S = op.to_scipy()
    np.testing.assert_allclose(S @ v.numpy(), (H @ v).numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(S.matmat(X.numpy()), (H @ X).numpy(), rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="shape"):
        op @ torch.zeros(p.num_params + 1, dtype=DT)


def test_scipy_eigsh_on_the_operator_finds_the_dense_top_eigenvalue():
    from scipy.sparse.linalg import eigsh

    p = problem()
    H = problem_hessian(p)
    top = float(eigsh(CurvatureEngine(p).hessian().to_scipy(), k=1, which="LA", tol=1e-10)[0][0])
    assert top == pytest.approx(float(torch.linalg.eigvalsh(H)[-1]), rel=1e-8)


def test_restrict_gives_the_block_and_its_trace():
    p = problem()
    H = problem_hessian(p)
    sl = p.param_slices()["2.weight"]
    B = CurvatureEngine(p).hessian().restrict(sl).dense()
    ref = torch.zeros_like(H)
    ref[sl, sl] = H[sl, sl]
    torch.testing.assert_close(B, ref, rtol=1e-10, atol=1e-12)


def test_ggn_and_fd_operators_and_another_theta():
    p = problem(loss="mse")
    eng = CurvatureEngine(p)
    torch.testing.assert_close(eng.ggn().dense(), dense_ggn(p), rtol=1e-9, atol=1e-11)
    th = p.theta + 0.05
    H = problem_hessian(p, th)
    torch.testing.assert_close(eng.hessian(th).dense(), H, rtol=1e-9, atol=1e-11)
    fd = eng.fd_hessian(th, eps=1e-4).dense()
    torch.testing.assert_close(fd, H, rtol=1e-5, atol=1e-6)


def test_full_precision_view_turns_tf32_off_only_during_its_products(monkeypatch):
    p = problem()
    eng = CurvatureEngine(p, precision="tf32")
    assert not eng.precision.low  # on a CPU a tf32 engine has nothing to verify
    from flatcli.engine.curvatures import Curvature
    from flatcli.engine.precision import Precision

    monkeypatch.setattr(Precision, "low", property(lambda self: True))
    seen = []
    monkeypatch.setattr(
        Curvature,
        "_matmat",
        lambda self, V: (seen.append(torch.backends.cuda.matmul.allow_tf32), V)[1],
    )
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        ones = torch.ones(1, p.num_params, dtype=DT)
        eng.hessian()(ones)
        eng.hessian(precision="fp32")(ones)
        assert seen == [True, False] and torch.backends.cuda.matmul.allow_tf32 is True
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def test_loss_grad_with_kept_graph_is_reused_by_the_hvp_at_the_same_point():
    p = problem()
    eng = CurvatureEngine(p, cache_graphs=True)
    th = p.theta + 0.01
    loss, g = eng.loss_grad(th, keep_graph=True)
    ref_loss = float(p.loss(p.unflatten(th)))
    ref_g = torch.func.grad(lambda t: p.loss(p.unflatten(t)))(th)
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    torch.testing.assert_close(g, ref_g, rtol=1e-12, atol=1e-14)
    built = eng.state.graphs.entries
    hv = eng.hessian(th)(g)
    assert eng.state.graphs.entries is built  # no rebuild: the gradient's graphs served the product
    torch.testing.assert_close(hv, problem_hessian(p, th) @ g, rtol=1e-10, atol=1e-12)
    assert eng.counters()["n_grad"] == 1 and eng.counters()["n_hvp"] == 1


def test_batch_loss_grad_is_the_mean_over_the_given_samples_and_counts_fractions():
    p = problem(n=12, batch_size=5)
    eng = CurvatureEngine(p)
    rows = p.batch.select(slice(2, 9))
    loss, g = eng.batch_loss_grad(rows)
    f = lambda t: rows_loss(p, p.forward(t, rows), rows).mean()  # noqa: E731
    assert loss == pytest.approx(float(f(p.theta)), rel=1e-12)
    torch.testing.assert_close(g, torch.func.grad(f)(p.theta), rtol=1e-12, atol=1e-14)
    assert eng.counters()["n_grad"] == pytest.approx(7 / 12, abs=1e-6)
    loss2, none = eng.batch_loss_grad(rows, need_grad=False)
    assert (
        none is None
        and loss2 == pytest.approx(loss, rel=1e-12)
        and eng.counters()["n_forward"] == pytest.approx(7 / 12, abs=1e-6)
    )


def test_per_sample_directional_derivatives_match_per_sample_gradients():
    p = problem(n=9, batch_size=4)
    eng = CurvatureEngine(p)
    v = torch.randn(p.num_params, generator=torch.Generator().manual_seed(3), dtype=DT)
    G = torch.func.jacrev(lambda t: rows_loss(p, p.forward(t, p.batch), p.batch))(p.theta)  # (n, P)
    torch.testing.assert_close(eng.per_unit_directional(v), G @ v, rtol=1e-10, atol=1e-12)
    y2 = (p.batch["y"] + 1) % 3
    other = p.batch.replace(y=y2)
    G2 = torch.func.jacrev(lambda t: rows_loss(p, p.forward(t, other), other))(p.theta)
    torch.testing.assert_close(
        eng.per_unit_directional(v, labels=y2), G2 @ v, rtol=1e-10, atol=1e-12
    )


def test_module_output_hvp_matches_the_dense_per_sample_hessian():
    p = problem(n=6, batch_size=6)
    eng = CurvatureEngine(p)
    layer = p.model[0]  # Linear(4, 5): its output goes through tanh and the head
    ((rows, phi, z, out),) = list(eng.module_io(layer))
    torch.testing.assert_close(phi, rows["x"])
    V = torch.eye(5, dtype=DT)
    hv = eng.module_output_hvp(layer, rows, z, V)  # (5, B, 5)
    head = p.model[2]
    for n in range(6):

        def ell(zn, n=n):
            return rows_loss(p, head(torch.tanh(zn))[None], rows.select([n])).sum()

        Hn = dense_hessian(ell, z[n])
        torch.testing.assert_close(hv[:, n, :], Hn, rtol=1e-10, atol=1e-12)


def test_a_layer_that_runs_twice_is_an_error():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            return self.fc(self.fc(x))

    m = Twice().to(DT).eval()
    p = Problem(m, torch.randn(4, 3, dtype=DT), torch.randint(0, 3, (4,)), dtype=DT)
    with pytest.raises(MeasurementError, match="ran 2 times"):
        list(CurvatureEngine(p).module_io(m.fc))


def test_loss_and_error_in_one_pass():
    p = problem(n=10)
    eng = CurvatureEngine(p)
    loss, err = eng.loss_and_error()
    out = p.forward(p.params, p.batch)
    assert loss == pytest.approx(float(rows_loss(p, out, p.batch).mean()), rel=1e-12)
    assert err == pytest.approx(float((out.argmax(1) != p.batch["y"]).double().mean()))
    assert eng.counters()["n_forward"] == 1


def test_the_engine_gives_its_settings_to_the_estimators_not_to_its_operators():
    """An operator holds shape, device and dtype (and its product) only; the engine's block size
    (followed when the engine lowers it), basis caps and progress hook reach the estimators as their
    `linalg.EstimatorSettings`; a bare mat-vec needs its dimension and takes the defaults."""
    from flatcli.engine import linalg
    from flatcli.engine.operators import CurvatureOperator, identity

    p = problem()
    eng = CurvatureEngine(p, block_size=3, max_device_vectors=5, max_basis_vectors=7)
    H = eng.hessian()
    for op in (H, H + identity(H), H.restrict(slice(0, 3)), 2.0 * H):
        for name in ("block_size", "max_device_vectors", "max_basis_vectors", "report"):
            assert not hasattr(op, name), (op, name)
    op = linalg.as_operator(H)
    assert (op.dim, op.device, op.dtype) == (p.num_params, H.device, DT)
    V = torch.randn(2, p.num_params, dtype=DT, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(op.matmat_rows(V), V @ problem_hessian(p), rtol=1e-10, atol=1e-12)
    s = eng.estimator_settings
    assert (s.block(), s.max_device_vectors, s.max_basis_vectors) == (3, 5, 7)
    assert s.basis_rows(p.num_params // 2, p.num_params) == 14  # a block's cap in its own vectors
    # what an out-of-memory back-off gives: a new current route with a smaller block
    eng.state.replan(dataclasses.replace(eng.state.route(), block_size=2))
    assert s.block() == 2  # the settings follow
    with pytest.raises(TypeError, match="dim"):
        linalg.as_operator(lambda V: V)
    n = 30
    A = 10 * torch.eye(n, dtype=DT) + 0.1 * torch.randn(
        n, n, dtype=DT, generator=torch.Generator().manual_seed(2)
    )
    A = 0.5 * (A + A.T)
    calls, seen = [], []

    def mv(V):
        calls.append(V.shape[0])
        return V @ A

    bare = linalg.as_operator(mv, n, dtype=DT)
    assert (bare.dim, bare.dtype) == (n, DT)
    assert linalg.EstimatorSettings().block() == 16
    stop = linalg.ProbeStop(tol=1e-12, min_probes=2, max_probes=12)
    known = linalg.ProbeStop(
        tol=1e-12,
        min_probes=2,
        max_probes=12,
        abs_trace=lambda: float(torch.linalg.eigvalsh(A).abs().sum()),
    )
    # tol out of reach: the near-zero floor wants Tr|A| (= Tr A here: not near 0); given, it costs no products
    settings = linalg.EstimatorSettings(block_size=5)
    linalg.hutchinson(bare, stop=known, generator=torch.Generator(), settings=settings)
    assert calls == [5, 5, 2]  # the estimator's block size
    hooked = linalg.EstimatorSettings(block_size=4, report=lambda **info: seen.append(info))
    op = CurvatureOperator(lambda V: V @ A, n, dtype=DT)
    r = linalg.hutchinson(op, stop=stop, generator=torch.Generator(), settings=hooked)
    assert [s["probes"] for s in seen] == [4, 8, 12] and seen[-1]["value"] == r.estimate
    seen.clear()
    eng.on_progress = seen.append  # the engine's hook, through its settings (block 2 now)
    linalg.hutchinson(H, stop=stop, generator=torch.Generator(), settings=eng.estimator_settings)
    assert [s["probes"] for s in seen if "probes" in s] == [4, 6, 8, 10, 12]


def test_an_operator_without_a_product_cannot_be_made():
    """Neither a ``product`` nor an override of ``_matmat``: refused when made, naming both;
    a product callable or an override is enough."""
    from flatcli.engine.operators import CurvatureOperator

    with pytest.raises(TypeError, match="give a product or override _matmat"):
        CurvatureOperator(None, 3)

    class Doubling(CurvatureOperator):
        def _matmat(self, V):
            return 2 * V

    v = torch.ones(3)
    assert torch.equal(Doubling(None, 3) @ v, 2 * v)
    assert torch.equal(CurvatureOperator(lambda V: 3 * V, 3) @ v, 3 * v)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_operator_sums_and_scales_equal_the_dense_matrices(seed, loss):
    """H + λI (weight decay) and H − G (the part of the Hessian the Gauss-Newton matrix leaves
    out) against the dense float64 Hessian and GGN; ReLU under MSE makes H strongly indefinite."""
    from flatcli.engine.operators import identity

    p = problem(act=nn.ReLU if loss == "mse" else None, seed=seed, loss=loss)
    eng = CurvatureEngine(p)
    H, G = problem_hessian(p), dense_ggn(p)
    eye = torch.eye(p.num_params, dtype=DT)
    lam = 0.1 * (seed + 1)
    Hop, Gop = eng.hessian(), eng.ggn()
    cases = {
        "H + lam I": (Hop + lam * identity(Hop), H + lam * eye),
        "H - G": (Hop - Gop, H - G),
        "-(2 H) + G": (-(2.0 * Hop) + Gop, -2.0 * H + G),
        "H * 3": (Hop * 3, 3.0 * H),
    }
    for name, (op, ref) in cases.items():
        torch.testing.assert_close(op.dense(block=5), ref, rtol=1e-9, atol=1e-11, msg=name)
        assert op.shape == Hop.shape and op.dtype == DT
    # each operand counts its own products: H's counter grew by one per column of each dense()
    P = p.num_params
    assert Hop.n_products == 4 * P and Gop.n_products == 2 * P
    # the eigenvalues of the damped Hessian are the Hessian's shifted by λ
    from scipy.sparse.linalg import eigsh

    top = eigsh((Hop + lam * identity(Hop)).to_scipy(), k=1, which="LA", tol=1e-10)[0][0]
    assert top == pytest.approx(float(torch.linalg.eigvalsh(H)[-1]) + lam, rel=1e-8)


def test_operator_algebra_refuses_what_is_not_an_operator_of_its_shape():
    p, q = problem(), problem(n=5)
    Hop = CurvatureEngine(p).hessian()
    with pytest.raises(TypeError, match="both sides must be operators"):
        Hop + 1.0
    with pytest.raises(TypeError):
        Hop * torch.ones(3)
    with pytest.raises(ValueError, match="finite"):
        Hop * float("nan")
    small = CurvatureEngine(
        Problem(
            nn.Linear(2, 1).double(),
            torch.zeros(3, 2, dtype=DT),
            torch.zeros(3, 1, dtype=DT),
            loss="mse",
            dtype=DT,
        )
    ).hessian()
    with pytest.raises(ValueError, match="shapes differ"):
        Hop - small
    assert (CurvatureEngine(q).hessian() + Hop).shape == Hop.shape
