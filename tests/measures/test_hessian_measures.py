"""Hessian measures (λmax, trace, spectrum) against dense float64 Hessians of tiny models."""

import numpy as np
import pytest
import torch
from torch import nn

from flatcli.api import measure_model
from flatcli.engine import CurvatureEngine, Problem
from flatcli.engine.curvatures import Hessian
from flatcli.engine.precision import Precision
from flatcli.errors import ConfigError
from flatcli.measures import MeasureContext, MeasureSpec, get_measure, run_measure
from flatcli.measures.hessian import effective_dimension, plot_esd
from tests.oracles import problem_hessian

DT = torch.float64


class SaddleModel(nn.Module):
    """f(x) = (a·x)² + c·x at a = c = 0 with MSE and targets y ≈ 3:
    H_aa = −4·mean(y x xᵀ) (negative definite, large), H_cc = 2·mean(x xᵀ) (positive, small).
    The most negative eigenvalue dominates in magnitude."""

    def __init__(self, d=4):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(d))
        self.c = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return ((x @ self.a) ** 2 + x @ self.c)[:, None]


def saddle_data(n=13, d=4):
    g = torch.Generator()
    g.manual_seed(0)
    x = torch.randn(n, d, generator=g, dtype=DT)
    y = 3.0 + 0.5 * torch.rand(n, generator=g, dtype=DT)
    return SaddleModel(d).to(DT), x, y


def mlp_data(n=11, seed=0):
    """Tanh MLP with its own predictions as labels (a trace well above its noise)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)
    x = 2 * torch.randn(n, 4, dtype=DT)
    with torch.no_grad():
        y = model(x).argmax(1)
    return model, x, y


def dense_eigs(model, x, y, loss, batch_size=4):
    p = Problem(model, x, y, loss=loss, batch_size=batch_size, dtype=DT)
    H = problem_hessian(p)
    return torch.linalg.eigvalsh(H).numpy()


def context(model, x, y, loss="cross_entropy"):
    p = Problem(model, x, y, loss=loss, batch_size=4, dtype=DT)
    return MeasureContext(problem=p, engine=CurvatureEngine(p))


def run(model, x, y, measures, loss="cross_entropy", seed=0, batch_size=4):
    row = measure_model(
        model, (x, y), measures, loss=loss, precision="fp64", seed=seed, batch_size=batch_size
    )
    assert row.status == "ok", row.errors
    return row.results


# ---------------------------------------------------------------------------- λmax
def test_lambda_max_is_algebraic_max_of_indefinite_hessian():
    model, x, y = saddle_data()
    ev = dense_eigs(model, x, y, "mse")
    assert abs(ev[0]) > 3 * ev[-1] > 0  # power iteration would return ev[0]
    r = run(model, x, y, [{"hessian_lambda_max": {"tol": 1e-6}}], loss="mse")["hessian_lambda_max"]
    assert abs(r.value - ev[-1]) <= 1e-4 * abs(ev[-1])
    assert r.diagnostics["min_ritz"] == pytest.approx(ev[0], rel=1e-6)
    assert r.diagnostics["converged"] and r.diagnostics["residual"] <= 1e-6
    assert r.diagnostics["n_hvp"] == r.diagnostics["steps"]


def test_lambda_max_mlp_and_determinism():
    model, x, y = mlp_data()
    ev = dense_eigs(model, x, y, "cross_entropy")
    a = run(model, x, y, [{"hessian_lambda_max": {"tol": 1e-6}}], seed=3)["hessian_lambda_max"]
    b = run(model, x, y, [{"hessian_lambda_max": {"tol": 1e-6}}], seed=3)["hessian_lambda_max"]
    assert abs(a.value - ev[-1]) <= 1e-4 * abs(ev[-1])
    assert a.value == b.value and a.diagnostics["steps"] == b.diagnostics["steps"]
    from flatcli.engine.linalg import certified_min_steps

    assert a.diagnostics["steps"] >= certified_min_steps(sum(q.numel() for q in model.parameters()))


# ---------------------------------------------------------------------------- trace
def test_trace_exact_and_stochastic():
    model, x, y = mlp_data(seed=1)
    tr = dense_eigs(model, x, y, "cross_entropy").sum()
    res = run(
        model,
        x,
        y,
        [
            {"hessian_trace": {"method": "exact", "label": "exact"}},
            {
                "hessian_trace": {
                    "method": "hutchinson",
                    "tol": 0.05,
                    "max_probes": 500,
                    "label": "hutch",
                }
            },
            {
                "hessian_trace": {
                    "method": "hutchpp",
                    "tol": 0.05,
                    "max_probes": 500,
                    "label": "hpp",
                }
            },
        ],
    )
    assert abs(res["exact"].value - tr) <= 1e-8 * abs(tr)
    for lab in ("hutch", "hpp"):
        r = res[lab]
        assert r.diagnostics["converged"] and r.diagnostics["rel_stderr"] <= 0.05
        assert abs(r.value - tr) <= 3 * r.stderr
        assert r.diagnostics["n_hvp"] == r.diagnostics["probes"]
    assert (
        res["hpp"].diagnostics["method"] == "hutchpp" and res["hpp"].diagnostics["sketch"] >= 5
    )  # starts at min_probes // 3, may grow


def test_trace_fixed_probe_count_and_option_errors():
    model, x, y = mlp_data()
    fixed = {"method": "hutchinson", "min_probes": 24, "max_probes": 24}
    r = run(model, x, y, [{"hessian_trace": fixed}])["hessian_trace"]
    assert r.diagnostics["probes"] == 24
    # a fixed count is ok only when it meets the tolerance (0.01 by default), like an adaptive one
    passed = r.diagnostics["rel_stderr"] <= 0.01
    assert (
        r.status == ("ok" if passed else "not_converged") and r.diagnostics["converged"] == passed
    )
    loose = run(model, x, y, [{"hessian_trace": {**fixed, "tol": 0.9}}])["hessian_trace"]
    assert loose.status == "ok" and loose.diagnostics["rel_stderr"] <= 0.9
    ctx = context(model, x, y)
    with pytest.raises(ConfigError, match="min_probes"):
        run_measure(MeasureSpec("hessian_trace", "t", {"min_probes": 30, "max_probes": 20}), ctx)
    with pytest.raises(ConfigError, match="'method' parameter of hessian_trace"):
        run_measure(MeasureSpec("hessian_trace", "t", {"method": "xtrace"}), ctx)


# ---------------------------------------------------------------------------- spectrum
def test_spectrum_matches_dense_eigenvalues():
    model, x, y = mlp_data(seed=2)
    ev = dense_eigs(model, x, y, "cross_entropy")
    P = len(ev)
    z = 0.05
    r = run(
        model, x, y, [{"hessian_spectrum": {"top_k": 3, "slq_runs": 12, "slq_steps": P, "z": z}}]
    )["hessian_spectrum"]
    d = r.diagnostics
    top = ev[::-1][:3]
    np.testing.assert_allclose(d["top_eigenvalues"], top, rtol=1e-4)
    assert d["condition_number"] == pytest.approx(top[0] / top[2], rel=1e-4)
    assert d["lambda_max"] == d["top_eigenvalues"][0]
    neff = effective_dimension(ev, z).sum()
    assert abs(r.value - neff) <= 3 * r.stderr
    assert 0 <= r.value <= P
    grid, dens = np.asarray(d["density_grid"]), np.asarray(d["density"])
    assert len(grid) == len(dens) == 128
    assert np.trapezoid(dens, grid) == pytest.approx(1.0, abs=0.02)
    assert d["lanczos_steps"] < d["n_hvp"] <= d["lanczos_steps"] + 12 * P


def test_spectrum_deterministic_and_effective_dimension_definition():
    model, x, y = saddle_data()
    opts = [{"hessian_spectrum": {"top_k": 2, "slq_runs": 4, "slq_steps": 8}}]
    a = run(model, x, y, opts, loss="mse", seed=1)["hessian_spectrum"]
    b = run(model, x, y, opts, loss="mse", seed=1)["hessian_spectrum"]
    assert (
        a.value == b.value and a.diagnostics["top_eigenvalues"] == b.diagnostics["top_eigenvalues"]
    )
    assert a.diagnostics["z"] == 1.0  # the documented default
    lam = np.array([-2.0, -0.5, 0.0, 1.0, 3.0])
    np.testing.assert_allclose(effective_dimension(lam, 1.0), [0, 0, 0, 0.5, 0.75])


def test_spectrum_condition_number_none_when_kth_eigenvalue_not_positive():
    model, x, y = saddle_data(d=2)  # 4 parameters: 2 negative, 2 positive eigenvalues
    r = run(
        model, x, y, [{"hessian_spectrum": {"top_k": 4, "slq_runs": 2, "slq_steps": 4}}], loss="mse"
    )
    assert r["hessian_spectrum"].diagnostics["condition_number"] is None


def test_spectrum_options_and_registry():
    info = get_measure("hessian_spectrum")
    assert info.stochastic
    model, x, y = mlp_data()
    with pytest.raises(ConfigError, match="'z' parameter of hessian_spectrum"):
        run_measure(MeasureSpec("hessian_spectrum", "s", {"z": 0}), context(model, x, y))


@pytest.mark.slow
def test_plot_esd_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    model, x, y = mlp_data()
    r = run(model, x, y, [{"hessian_spectrum": {"top_k": 2, "slq_runs": 3, "slq_steps": 10}}])[
        "hessian_spectrum"
    ]
    out = plot_esd(r, tmp_path / "esd.png")
    assert out.exists() and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from flatcli.measures.hessian import esd_figure

    grid = np.linspace(-5, 5, 500)
    dens = np.exp(-(grid**2) * 40)  # Gaussian tails down to e^-1000: the unreadable axis of before
    ax = esd_figure(grid, dens, r.diagnostics).axes[0]
    lo, hi = ax.get_ylim()
    assert (
        lo == pytest.approx(1e-6 * dens.max(), rel=1e-9) and hi <= 2.0 + 1e-12
    )  # 1e-6 of the peak
    assert any("λmax" in t.get_text() for t in ax.texts)
    with pytest.raises(ValueError, match="hessian_spectrum"):
        plot_esd({"value": 1.0}, tmp_path / "x.png")


# ---------------------------------------------------------------------------- TF32 verification
def _simulated_tf32(monkeypatch, model, x, y, bias):
    """An engine whose products are (1 + bias)·H v while TF32 is on (a simulated low-precision
    GPU product), and exact inside its fp32 verification context."""
    p = Problem(model, x, y, batch_size=4, dtype=DT)
    eng = CurvatureEngine(p, precision="auto")
    monkeypatch.setattr(Precision, "low", property(lambda self: True))
    _perturb_hessian(monkeypatch, lambda V, out: out * bias)
    return p, eng


def _perturb_hessian(monkeypatch, extra):
    """Hessian products become H V + ``extra(V, H V)`` while TF32 is on."""
    exact = Hessian._matmat

    def matmat(self, V):
        out = exact(self, V)
        return out + extra(V, out) if torch.backends.cuda.matmul.allow_tf32 else out

    monkeypatch.setattr(Hessian, "_matmat", matmat)


@pytest.fixture
def tf32_on():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def test_lambda_max_is_verified_in_fp32_when_products_run_in_tf32(monkeypatch, tf32_on):
    model, x, y = mlp_data()
    lam = dense_eigs(model, x, y, "cross_entropy")[-1]
    p, eng = _simulated_tf32(monkeypatch, model, x, y, bias=1e-2)
    r = run_measure(
        MeasureSpec("hessian_lambda_max", "l", {"tol": 1e-6}), MeasureContext(problem=p, engine=eng)
    )
    assert r.diagnostics["tf32_value"] == pytest.approx(
        1.01 * lam, rel=1e-6
    )  # the fast, biased one
    assert r.value == pytest.approx(lam, rel=1e-6)  # reported: the fp32 Rayleigh quotient
    assert (
        r.diagnostics["residual"] <= 1e-6
        and r.diagnostics["verified"] == "fp32"
        and r.status == "ok"
    )


def test_lambda_max_finishes_in_fp32_when_tf32_rounding_keeps_the_residual_above_tol(
    monkeypatch, tf32_on
):
    """A simulated TF32 product H + E (E a fixed symmetric perturbation, ‖E‖ = 1% of λmax) has other
    eigenvectors than H: its Ritz vector fails the fp32 check at tol 1e-8, so Lanczos continues in fp32
    from it and reports λmax(H) to the tolerance (dense reference)."""
    model, x, y = mlp_data()
    lam = dense_eigs(model, x, y, "cross_entropy")[-1]
    p, eng = _simulated_tf32(monkeypatch, model, x, y, bias=0.0)
    g = torch.Generator().manual_seed(3)
    E = torch.randn(p.num_params, p.num_params, generator=g, dtype=DT)
    E = (E + E.T) / 2
    E *= 0.01 * lam / torch.linalg.matrix_norm(E, 2)
    _perturb_hessian(monkeypatch, lambda V, out: V @ E)
    r = run_measure(
        MeasureSpec("hessian_lambda_max", "l", {"tol": 1e-8}), MeasureContext(problem=p, engine=eng)
    )
    d = r.diagnostics
    assert abs(d["tf32_value"] - lam) > 1e-4 * lam  # the fast value is off
    assert d["fp32_refine_steps"] >= 1 and d["residual"] <= 1e-8 and r.status == "ok"
    assert r.value == pytest.approx(lam, rel=1e-10)


def test_precision_auto_runs_lanczos_in_tf32_and_verifies_in_fp32_through_the_pipeline(monkeypatch):
    """The CPU twin of test_gpu.py's TF32 test: a tensor-core GPU is simulated (products biased by
    1% while TF32 is on). measure_model with precision auto must turn TF32 on for the Lanczos
    products (observed inside them), off for the fp32 verification, and report λmax within 1e-4 of
    the fp32 run; the biased TF32 value is kept in the diagnostics."""
    from flatcli.engine import precision
    from tests.helpers import record_tf32_flags

    model, x, y = mlp_data()
    model, x = model.float(), x.float()
    monkeypatch.setattr(precision, "has_tensor_cores", lambda device: True)
    monkeypatch.setattr(Precision, "low", property(lambda self: True))
    seen = record_tf32_flags(monkeypatch, bias=1e-2)
    spec = [{"hessian_lambda_max": {"tol": 1e-5}}]
    auto = measure_model(model, (x, y), spec, precision="auto", batch_size=4).results[
        "hessian_lambda_max"
    ]
    in_auto = list(seen)
    seen.clear()
    fp32 = measure_model(model, (x, y), spec, precision="fp32", batch_size=4).results[
        "hessian_lambda_max"
    ]
    assert (
        any(in_auto) and in_auto[-1] is False
    )  # Lanczos in TF32, the last product (verification) fp32
    assert not any(seen)  # precision fp32: TF32 never on
    assert auto.diagnostics["verified"] == "fp32" and auto.status == fp32.status == "ok"
    assert auto.diagnostics["tf32_value"] == pytest.approx(1.01 * fp32.value, rel=1e-4)
    assert auto.value == pytest.approx(fp32.value, rel=1e-4)


@pytest.mark.parametrize("bias, status", [(0.3, "precision_warning"), (1e-9, "ok")])
def test_trace_control_sample_flags_a_tf32_bias_larger_than_the_stderr(
    monkeypatch, tf32_on, bias, status
):
    model, x, y = mlp_data(seed=1)
    tr = dense_eigs(model, x, y, "cross_entropy").sum()
    p, eng = _simulated_tf32(monkeypatch, model, x, y, bias=bias)
    spec = MeasureSpec(
        "hessian_trace",
        "t",
        # a tolerance the 64 probes meet: ok unless the control flags the bias
        {
            "method": "hutchinson",
            "min_probes": 64,
            "max_probes": 64,
            "per_layer": "none",
            "tol": 0.9,
        },
    )
    r = run_measure(spec, MeasureContext(problem=p, engine=eng))
    d = r.diagnostics
    assert d["fp32_control_probes"] == 8 and d["fp32_control_rel_diff"] == pytest.approx(
        bias, rel=1e-6
    )
    assert r.status == status
    assert abs(r.value - (1 + bias) * tr) <= 5 * r.stderr  # the estimate itself is the fast one
