"""normalized_sharpness against an independent dense implementation (Tsuzuku et al. 2020, eq. 35)."""

import math

import numpy as np
import pytest
import scipy.optimize
import torch
from torch import nn

from flatcli.api import measure_model
from flatcli.engine import Problem
from flatcli.errors import ConfigError
from flatcli.measures.normalized_sharpness import solve_layer


def _mlp(act, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), act(), nn.Linear(4, 4), act(), nn.Linear(4, 3)).double()


def _data(n=30, d=5, c=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64), torch.randint(0, c, (n,), generator=g)


def _reference_ns(model, x, y, box=20.0, loss="cross_entropy"):
    """Dense Hessian diagonal, M[i,k] = Σ_j max(D_ij, 0) W_kj², γ by scipy on the plain objective."""
    prob = Problem(model, x, y, loss=loss, batch_size=len(x), dtype=torch.float64)
    H = torch.func.hessian(lambda t: prob.loss(prob.unflatten(t)))(prob.theta)
    diag = torch.diagonal(H)
    total = 0.0
    offset = 0
    for name, p in model.named_parameters():
        k = p.numel()
        if name.endswith("weight") and p.ndim >= 2:
            W = p.detach().reshape(p.shape[0], -1).numpy()
            D = diag[offset : offset + k].reshape(p.shape[0], -1).numpy()
            h = W.shape[0]
            M = np.array([[sum(max(D[i, j], 0.0) * W[kk, j] ** 2 for j in range(W.shape[1])) for kk in range(h)] for i in range(h)])

            def f(g, M=M):
                E = M * np.exp(g[:, None] - g[None, :])
                return E.sum(), E.sum(1) - E.sum(0)

            best = scipy.optimize.minimize(
                f, np.zeros(h), jac=True, method="L-BFGS-B", bounds=[(-box, box)] * h,
                options={"ftol": 1e-16, "gtol": 1e-14, "maxiter": 10000},
            )
            total += best.fun
        offset += k
    return math.sqrt(total)


def _ns(model, x, y, seed=0, batch_size=7, **opts):
    row = measure_model(model, (x, y), [{"normalized_sharpness": opts}], precision="fp64", batch_size=batch_size, seed=seed)
    assert row.status == "ok", row.errors
    return row.results["normalized_sharpness"]


@pytest.mark.parametrize("act", [nn.ReLU, nn.Tanh])
def test_exact_diagonal_matches_dense_reference(act):
    model = _mlp(act)
    x, y = _data()
    res = _ns(model, x, y, hessian_diag="exact")
    ref = _reference_ns(model, x, y)
    assert abs(res.value - ref) <= 1e-6 * ref
    assert res.stderr is None
    d = res.diagnostics
    assert set(d["layers"]) == {"0", "2", "4"}
    assert abs(math.sqrt(sum(v * v for v in d["layers"].values())) - res.value) <= 1e-12 * res.value
    assert d["grad_norm"] < 1e-6 and d["converged"] is True
    assert d["n_hvp"] == sum(p.numel() for p in model.parameters())


def test_conv_rows_are_output_channels():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 3)).double()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(12, 1, 6, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (12,), generator=g)
    res = _ns(model, x, y, hessian_diag="exact")
    ref = _reference_ns(model, x, y)
    assert abs(res.value - ref) <= 1e-6 * ref


@pytest.mark.parametrize("act", [nn.ReLU, nn.Tanh])
def test_scaled_estimator_converges_to_exact(act):
    model = _mlp(act)
    x, y = _data()
    exact = _ns(model, x, y, hessian_diag="exact").value
    errs = []
    for samples in (16, 64, 256):
        e = [abs(_ns(model, x, y, seed=s, batch_size=30, samples=samples).value - exact) / exact for s in range(3)]
        errs.append(float(np.mean(e)))
    assert errs[0] > errs[1] > errs[2]
    assert errs[2] < 0.35 * errs[0]


def test_stochastic_estimators_report_stderr_and_cost():
    model = _mlp(nn.Tanh)
    x, y = _data()
    exact = _ns(model, x, y, hessian_diag="exact").value
    sc = _ns(model, x, y, samples=16)
    fd = _ns(model, x, y, samples=16, hessian_diag="finite_difference", radius=1e-4)
    hu = _ns(model, x, y, samples=16, hessian_diag="hutchinson")
    assert sc.diagnostics["n_hvp"] == 16 and fd.diagnostics["n_grad"] == 32 and hu.diagnostics["n_hvp"] == 16
    for r in (sc, fd, hu):
        assert r.stderr is not None and r.stderr > 0
    # on a smooth network the finite-difference estimator is the scaled one up to O(r²) (same probes)
    assert abs(fd.value - sc.value) <= 1e-5 * sc.value
    assert abs(sc.value - exact) < 4 * sc.stderr + 0.05 * exact


def test_solver_closed_form_two_rows():
    # h = 2: min over t of M00 + M11 + M01 e^t + M10 e^-t = M00 + M11 + 2 sqrt(M01 M10)
    M = np.array([[0.3, 2.0], [0.5, 0.7]])
    sol = solve_layer(M, 20.0)
    assert abs(sol.value - (1.0 + 2 * math.sqrt(1.0))) <= 1e-12
    assert not sol.box_hit
    # a zero row pushes its γ to the box; the value stays finite and is reported
    sol = solve_layer(np.array([[1.0, 0.0], [1.0, 0.0]]), 5.0)
    assert sol.box_hit and abs(sol.value - (1.0 + math.exp(-10.0))) <= 1e-12
    assert solve_layer(np.zeros((3, 3)), 20.0).value == 0.0


def test_options_are_validated():
    model = _mlp(nn.Tanh)
    x, y = _data()
    with pytest.raises(ConfigError, match="'hessian_diag' parameter of normalized_sharpness must be one of"):
        measure_model(model, (x, y), [{"normalized_sharpness": {"hessian_diag": "dense"}}], precision="fp64")
    with pytest.raises(ConfigError, match="'box' parameter"):
        measure_model(model, (x, y), [{"normalized_sharpness": {"box": 0}}], precision="fp64")


def test_model_is_not_mutated():
    model = _mlp(nn.ReLU)
    x, y = _data()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _ns(model, x, y, samples=8)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
