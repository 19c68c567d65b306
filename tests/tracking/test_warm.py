"""Warm starts: λmax and the top-k eigenvalues started from the previous evaluation's Ritz vectors
agree with cold starts and with the dense float64 eigenvalues at every tracked step, for fewer
products; the residual test still decides (a start at an eigenvector stops at the floor)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call

from flatcli.engine import linalg
from flatcli.tracking import Tracker, TrackOptions
from tests.oracles import model_hessian

TOL = 1e-3


def _run(seed: int, steps: int = 16, lr: float = 0.05):
    """Full-batch GD on a tanh MLP under MSE (float64), a warm and a cold tracker side by side;
    yields (step, warm row, cold row, dense eigenvalues)."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(3, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 1)
    )
    model = model.double()
    x = torch.randn(40, 3, dtype=torch.float64)
    y = torch.sin(x.sum(1, keepdim=True))
    measures = [{"hessian_lambda_max": {"tol": TOL}}, {"hessian_top_eigenvalues": {"top_k": 3}}]
    opts = dict(precision="fp64", seed=seed, cold_every=1000)
    warm = Tracker(model, (x, y), "mse", measures, options=TrackOptions(**opts))
    cold = Tracker(model, (x, y), "mse", measures, options=TrackOptions(warm=False, **opts))
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def loss_of(ps):
        return ((functional_call(model, ps, (x,)) - y) ** 2).sum(1).mean()

    for s in range(steps):
        opt.zero_grad()
        loss_of(dict(model.named_parameters())).backward()
        opt.step()
        w, c = warm.step(s, optimizer=opt), cold.step(s, optimizer=opt)
        evals = torch.linalg.eigvalsh(model_hessian(model, loss_of)).flip(0).numpy()
        yield s, w, c, evals


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_warm_agrees_with_cold_and_the_dense_reference_at_every_step(seed):
    warm_n, cold_n, warm_k, cold_k = [], [], [], []
    for s, w, c, evals in _run(seed):
        lam = evals[0]
        assert w["hessian_lambda_max_status"] == "ok" and c["hessian_lambda_max_status"] == "ok"
        assert w["hessian_lambda_max_warm_start"] is (s > 0)
        assert abs(w["hessian_lambda_max"] - c["hessian_lambda_max"]) <= TOL * abs(lam), s
        assert abs(w["hessian_lambda_max"] - lam) <= TOL * abs(lam), s
        for i in range(3):
            got = w[f"hessian_top_eigenvalues_lambda_{i + 1}"]
            assert abs(got - c[f"hessian_top_eigenvalues_lambda_{i + 1}"]) <= TOL * abs(lam), (s, i)
            assert abs(got - evals[i]) <= TOL * abs(lam), (s, i)
        if s > 0:
            warm_n.append(w["hessian_lambda_max_n_hvp"])
            cold_n.append(c["hessian_lambda_max_n_hvp"])
            warm_k.append(w["hessian_top_eigenvalues_n_hvp"])
            cold_k.append(c["hessian_top_eigenvalues_n_hvp"])
    assert np.mean(warm_n) <= 0.5 * np.mean(cold_n), (warm_n, cold_n)
    assert np.mean(warm_k) <= 0.75 * np.mean(cold_k), (warm_k, cold_k)  # blocks of 3: coarser


def test_every_cold_every_th_evaluation_starts_cold():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 1))
    x, y = torch.randn(12, 3), torch.randn(12, 1)
    t = Tracker(model, (x, y), "mse", ["hessian_lambda_max"], options=TrackOptions(cold_every=3))
    flags = [t.step(s)["hessian_lambda_max_warm_start"] for s in range(7)]
    assert flags == [False, True, True, False, True, True, False]


@pytest.mark.parametrize("seed", range(4))
def test_the_residual_test_decides_from_a_warm_start(seed):
    """A start at an exact eigenvector stops after the fewest steps with that eigenvalue; a start
    near it reaches the same tolerance as a cold start, in fewer products."""
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(60, 60, generator=g, dtype=torch.float64))
    lam = torch.linspace(-3.0, 2.0, 60, dtype=torch.float64)
    lam[-1] = 2.5
    A = (Q * lam) @ Q.T
    op = linalg.as_operator(lambda V: V @ A, 60, dtype=torch.float64)
    top = Q[:, -1]
    exact = linalg.lanczos(op, v0=top, stop=linalg.KrylovStop(tol=1e-8, min_steps=1))
    assert exact.steps == 1 and exact.eigenvalues[0] == pytest.approx(2.5, rel=1e-12)
    near = top + 1e-3 * torch.randn(60, generator=g, dtype=torch.float64)
    w = linalg.lanczos(op, v0=near, stop=linalg.KrylovStop(tol=1e-8, min_steps=1))
    c = linalg.lanczos(op, generator=g, stop=linalg.KrylovStop(tol=1e-8))
    assert w.converged and c.converged
    assert w.eigenvalues[0] == pytest.approx(2.5, rel=1e-12)
    assert w.steps < c.steps
    assert w.residuals[0] <= 1e-8 * 2.5
