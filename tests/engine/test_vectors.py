"""The estimators' vector backend (`flatcli.engine.linalg.vectors`): vectors kept one block per
parameter, each in its parameter's dtype, give the flat estimators' values; on a model whose
parameters sit in a float64 and a float32 group the estimators run unchanged and agree with the
dense float64 Hessian within each dtype's tolerance."""

import copy

import numpy as np
import pytest
import torch
from torch import nn

from flatcli.engine import linalg
from flatcli.engine.linalg.vectors import FlatSpace, ParamSpace
from tests.oracles import call, model_hessian, parameter_products

DT = torch.float64


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def sym(n, seed):
    A = torch.randn(n, n, generator=gen(seed), dtype=DT)
    return 0.5 * (A + A.T) + torch.diag(torch.linspace(0, 6, n, dtype=DT))


SIZES = (7, 13, 20)  # offsets 0, 7, 20: not multiples of the probes' 24-coordinate chunks


def split_op(A, sizes=SIZES, seen=None):
    """``A`` as a per-parameter operator whose parts are float64 CPU blocks of ``sizes``."""
    space = ParamSpace((n, "cpu", DT) for n in sizes)

    def product(V):
        if seen is not None:
            seen.append([(v.dtype, v.device.type) for v in V])
        return space.from_flat(space.to_flat(V) @ A)

    return linalg.as_operator(product, space=space)


@pytest.mark.parametrize("k", [1, 5, 30])
@pytest.mark.parametrize("seed", range(3))
def test_per_parameter_probes_are_the_flat_probes(k, seed):
    space = ParamSpace((n, "cpu", DT) for n in SIZES)
    parts = space.probes(k, gen(seed))
    assert [p.shape for p in parts] == [(k, n) for n in SIZES]
    flat = linalg.rademacher(k, sum(SIZES), gen(seed), dtype=DT)
    assert torch.equal(space.to_flat(parts), flat)


@pytest.mark.parametrize("seed", range(3))
def test_per_parameter_estimators_equal_the_flat_ones(seed):
    """Same probes and starts, the same arithmetic up to summation order: Lanczos (single, block,
    thick-restarted, offloaded), SLQ, Hutchinson and the Hutchinson diagonal agree to 1e-10."""
    n = sum(SIZES)
    A = sym(n, seed)
    flat = linalg.as_operator(lambda V: V @ A, n, dtype=DT)
    seen = []
    parts = split_op(A, seen=seen)
    cases = [
        dict(k=1, stop=linalg.KrylovStop(tol=1e-10, max_steps=n)),
        dict(k=3, block=3, stop=linalg.KrylovStop(tol=1e-8, max_steps=n)),
        dict(k=2, stop=linalg.KrylovStop(tol=1e-8, max_steps=200, max_basis=14)),
    ]
    offload = linalg.EstimatorSettings(max_device_vectors=3)
    for kw in cases:
        for settings in (None, offload):
            a = linalg.lanczos(
                flat, generator=gen(seed), return_vectors=True, settings=settings, **kw
            )
            b = linalg.lanczos(
                parts, generator=gen(seed), return_vectors=True, settings=settings, **kw
            )
            k = kw["k"]
            assert a.steps == b.steps and a.restarts == b.restarts
            np.testing.assert_allclose(b.eigenvalues[:k], a.eigenvalues[:k], rtol=0, atol=1e-10)
            np.testing.assert_allclose(b.residuals[:k], a.residuals[:k], rtol=0, atol=1e-8)
            flat_b = ParamSpace((m, "cpu", DT) for m in SIZES).to_flat(b.ritz_vectors)
            sign = torch.sign((flat_b * a.ritz_vectors).sum(1, keepdim=True))  # QR's sign choice
            torch.testing.assert_close(sign * flat_b, a.ritz_vectors, rtol=0, atol=1e-7)
    assert b.restarts > 0 and b.device_vectors <= 3
    s_a = linalg.slq(flat, runs=4, steps=12, generator=gen(seed))
    s_b = linalg.slq(parts, runs=4, steps=12, generator=gen(seed))
    for x, y in zip(s_a.nodes + s_a.weights, s_b.nodes + s_b.weights, strict=True):
        np.testing.assert_allclose(y, x, rtol=0, atol=1e-10)
    stop = linalg.ProbeStop(tol=1e-3, min_probes=8, max_probes=40)
    h_a = linalg.hutchinson(flat, stop=stop, generator=gen(seed))
    h_b = linalg.hutchinson(parts, stop=stop, generator=gen(seed))
    assert h_b.probes == h_a.probes
    np.testing.assert_allclose(h_b.samples, h_a.samples, rtol=1e-12, atol=1e-10)
    stop = linalg.ProbeStop(tol=1e-3, min_probes=12, max_probes=90)
    for sketch in (None, 4):  # grown while it pays, and Alg. 1's fixed split
        p_a = linalg.hutchpp(flat, stop=stop, sketch=sketch, generator=gen(seed), settings=offload)
        p_b = linalg.hutchpp(parts, stop=stop, sketch=sketch, generator=gen(seed), settings=offload)
        assert (p_b.sketch, p_b.probes) == (p_a.sketch, p_a.probes)
        assert p_b.estimate == pytest.approx(p_a.estimate, rel=1e-10)
        assert p_b.stderr == pytest.approx(p_a.stderr, rel=1e-7)
    torch.testing.assert_close(
        linalg.exact_diagonal(parts), linalg.exact_diagonal(flat), rtol=0, atol=1e-12
    )
    d_a = linalg.hutchinson_diagonal(flat, samples=20, generator=gen(seed))
    d_b = linalg.hutchinson_diagonal(parts, samples=20, generator=gen(seed))
    for x, y in zip(d_a, d_b, strict=True):
        torch.testing.assert_close(y, x.cpu(), rtol=0, atol=1e-12)
    assert all(p == [(DT, "cpu")] * len(SIZES) for p in seen)  # the product got the parts


def test_per_parameter_qr_is_an_orthonormal_factorization_with_rank_deficiency():
    space = ParamSpace((n, "cpu", DT) for n in SIZES)
    X = torch.randn(4, sum(SIZES), generator=gen(1), dtype=DT)
    X[2] = 2 * X[0] - X[1]  # a dependent row
    Q, R = space.qr(space.from_flat(X))
    Qf = space.to_flat(Q)
    torch.testing.assert_close(torch.as_tensor(R).T @ Qf, X, rtol=0, atol=1e-12)
    assert abs(R[2, 2]) < 1e-12 * abs(R[0, 0])  # the dependence shows on R's diagonal
    keep = [0, 1, 3]
    torch.testing.assert_close(Qf[keep] @ Qf[keep].T, torch.eye(3, dtype=DT), rtol=0, atol=1e-12)
    ref = FlatSpace(sum(SIZES), "cpu", DT).qr(X)[1]
    # before the dependent row, R's diagonal is Householder QR's up to sign
    np.testing.assert_allclose(np.abs(np.diag(R))[:2], np.abs(np.diag(ref))[:2], rtol=1e-12)


# ------------------------------------------------------------------ two dtypes in one model
class TwoDtypes(nn.Module):
    """A float64 layer feeding a float32 layer; the activations are cast to the next layer's
    dtype (as a model split in precision would be)."""

    def __init__(self, device_a="cpu"):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 6).double().to(device_a)
        self.b = nn.Linear(6, 3).float()

    def forward(self, x):
        h = torch.tanh(self.a(x.to(self.a.weight)))  # the layer's device and dtype
        return self.b(h.to(self.b.weight))


def data():
    g = gen(3)
    return torch.randn(16, 4, generator=g, dtype=DT), torch.randint(0, 3, (16,), generator=g)


def parameter_operator(model, x, y, seen=None):
    """The loss Hessian of ``model`` over its parameters, vectors one block per parameter (each in
    its parameter's dtype, on its device; `tests.oracles.parameter_products`)."""
    params = list(model.parameters())
    space = ParamSpace.of(params)
    product = parameter_products(params, nn.functional.cross_entropy(model(x), y))

    def spied(V):
        if seen is not None:
            seen.append([(v.dtype, v.device.type) for v in V])
        return product(V)

    return linalg.as_operator(spied, space=space)


def dense_hessian64(model, x, y):
    """The Hessian of the same loss with every parameter in float64 on the CPU (the reference)."""
    m64 = copy.deepcopy(model).double().cpu()
    return model_hessian(m64, lambda ps: nn.functional.cross_entropy(call(m64, ps, x), y))


PLACEMENTS = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]


@pytest.mark.parametrize("device_a", PLACEMENTS)
def test_two_dtype_model_runs_the_estimators_unchanged_against_the_dense_hessian(device_a):
    """Parameters of float64 (layer a) and float32 (layer b): every estimator keeps each part in its
    dtype (and, with layer a on the GPU and b on the CPU, a device_map-style split, on its
    device); values agree with the dense float64 Hessian within float32's tolerance (products in
    float32 for layer b), and the same probes' quadratic forms match the dense ones."""
    model = TwoDtypes(device_a)
    x, y = data()
    H = dense_hessian64(model, x, y)
    P = H.shape[0]
    seen = []
    op = parameter_operator(model, x, y, seen)
    V = torch.randn(3, P, generator=gen(8), dtype=DT)  # the product itself: H v per row
    HV = op.space.to_flat(op.matmat_rows(op.space.native(op.space.from_flat(V))))
    torch.testing.assert_close(HV, V @ H, rtol=1e-5, atol=1e-6)
    ev = torch.linalg.eigvalsh(H).numpy()
    tol = 1e-4  # float32 products of one layer: ~1e-7 rounding, amplified by the conditioning
    r = linalg.lanczos(op, k=1, generator=gen(1), stop=linalg.KrylovStop(tol=1e-5, max_steps=P))
    assert r.converged
    assert r.eigenvalues[0] == pytest.approx(ev[-1], rel=tol)
    r2 = linalg.lanczos(
        op, k=2, block=2, generator=gen(2), stop=linalg.KrylovStop(tol=1e-4, max_steps=P)
    )
    np.testing.assert_allclose(r2.eigenvalues[:2], ev[::-1][:2], rtol=tol)
    s = linalg.slq(op, runs=3, steps=P, generator=gen(4))  # full Krylov space: exact quadrature
    Z = linalg.rademacher(3, P, gen(4), dtype=DT)
    exact = float(((Z @ H) * Z).sum(1).mean())
    assert s.expect(lambda t: t)[0] == pytest.approx(exact, rel=tol)
    stop = linalg.ProbeStop(tol=1e-9, min_probes=12, max_probes=12)
    t = linalg.hutchinson(op, stop=stop, generator=gen(5))
    Z = linalg.rademacher(12, P, gen(5), dtype=DT)
    np.testing.assert_allclose(t.samples, ((Z @ H) * Z).sum(1).numpy(), rtol=tol, atol=1e-6)
    p = linalg.hutchpp(op, stop=linalg.ProbeStop(tol=1e-3, max_probes=400), generator=gen(7))
    assert p.sketch > 1 and p.converged
    assert abs(p.estimate - float(H.trace())) <= 4 * p.stderr + tol * abs(float(H.trace()))
    mean, _ = linalg.hutchinson_diagonal(op, samples=12, generator=gen(6))
    torch.testing.assert_close(mean, _diag_ref(H, 12, 6), rtol=tol, atol=1e-6)
    torch.testing.assert_close(linalg.exact_diagonal(op), H.diagonal(), rtol=tol, atol=1e-6)
    placed = {tuple(d) for d in seen}  # each part in its parameter's dtype, on its device
    a, b = (DT, torch.device(device_a).type), (torch.float32, "cpu")
    assert placed == {(a, a, b, b)}


def _diag_ref(H, m, seed):
    Z = linalg.rademacher(m, H.shape[0], gen(seed), dtype=DT)
    return (Z * (Z @ H)).mean(0)


def test_blocks_of_a_flat_vector_are_refused_for_a_per_parameter_space():
    op = split_op(sym(sum(SIZES), 0))
    with pytest.raises(ValueError, match="hutchpp: blocks"):
        linalg.hutchpp(op, generator=gen(), blocks=[slice(0, 7)])
    with pytest.raises(ValueError, match="hutchinson: blocks"):
        linalg.hutchinson(op, generator=gen(), blocks=[slice(0, 7)])
