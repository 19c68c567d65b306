"""Local entropy ½ log det(I + H₊/γ) by SLQ against dense eigenvalues of tiny models."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call, hessian

from flatcli.engine import CurvatureEngine, Problem, linalg
from flatcli.measures import MeasureContext, MeasureSpec, run_measure


def run(p, seed=0, **options):
    return run_measure(
        MeasureSpec("local_entropy", "le", options),
        MeasureContext(p, CurvatureEngine(p), seed=seed),
    )


def f_clipped(evals, gamma):
    return 0.5 * np.log1p(np.maximum(evals, 0) / gamma)


@pytest.fixture(scope="module")
def tanh_net():
    """A tanh MLP away from a minimum: its Hessian has negative eigenvalues."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    g = torch.Generator().manual_seed(0)
    x, y = (
        torch.randn(20, 3, generator=g, dtype=torch.float64),
        torch.randint(0, 3, (20,), generator=g),
    )
    p = Problem(model, x, y, batch_size=20)

    def loss(flat):
        return nn.functional.cross_entropy(functional_call(model, p.unflatten(flat), (x,)), y)

    H = hessian(loss)(p.theta)
    evals, evecs = torch.linalg.eigh(H)
    return p, evals.numpy(), evecs.numpy()


def test_diagonal_hessian_is_exact():
    # Orthogonal design: H = 2XᵀX/n is diagonal, so every Rademacher probe gives Tr f(H) exactly.
    g = torch.Generator().manual_seed(1)
    n, d = 12, 4
    Q, _ = torch.linalg.qr(torch.randn(n, d, generator=g, dtype=torch.float64))
    X = Q * torch.tensor([3.0, 2.0, 1.0, 0.5], dtype=torch.float64) * math.sqrt(n)
    m = nn.Linear(d, 1, bias=False).double()
    p = Problem(m, X, torch.randn(n, generator=g, dtype=torch.float64), loss="mse")
    h = torch.diagonal(2 * X.T @ X / n).numpy()
    gamma = 0.5
    r = run(p, gamma=gamma, slq_runs=2, slq_steps=d)
    assert r.value == pytest.approx(float(f_clipped(h, gamma).sum()), rel=1e-10)
    assert r.stderr == pytest.approx(0.0, abs=1e-10)


def test_probes_reproduce_dense_matrix_function(tanh_net):
    # With as many Lanczos steps as parameters the quadrature is exact, so the estimate is the
    # mean over the seeded Rademacher probes z of zᵀ f(H₊) z: compare with the dense matrix function.
    p, evals, evecs = tanh_net
    assert evals.min() < -1e-6  # clipping of negative curvature matters here
    gamma, runs = 0.1, 4
    fH = evecs @ np.diag(f_clipped(evals, gamma)) @ evecs.T
    gen = MeasureContext(p, None, seed=0).generator()
    forms = []
    for _ in range(runs):
        z = linalg.rademacher(1, p.num_params, gen, dtype=torch.float64)[0].numpy()
        forms.append(float(z @ fH @ z))
    r = run(p, gamma=gamma, slq_runs=runs, slq_steps=p.num_params)
    assert r.value == pytest.approx(float(np.mean(forms)), rel=1e-8)
    assert r.stderr == pytest.approx(float(np.std(forms, ddof=1) / math.sqrt(runs)), rel=1e-6)
    assert r.diagnostics["min_ritz"] < 0 < r.diagnostics["negative_weight"]


def test_converges_to_dense_log_det(tanh_net):
    p, evals, _ = tanh_net
    gamma = 0.1
    ref = float(f_clipped(evals, gamma).sum())
    assert abs(ref - float(0.5 * np.log1p(np.abs(evals) / gamma).sum())) > 1e-3
    few = run(p, gamma=gamma, slq_runs=4, slq_steps=p.num_params)
    many = run(p, gamma=gamma, slq_runs=16, slq_steps=p.num_params)
    assert abs(many.value - ref) <= 4 * many.stderr
    assert many.stderr < few.stderr
