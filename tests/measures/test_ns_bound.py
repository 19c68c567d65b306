"""ns_bound (Tsuzuku et al. 2020, Thm. 6.1) against closed forms and independent references."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from flatcli.api import measure_model
from flatcli.engine import Problem
from flatcli.errors import ConfigError
from flatcli.measures.normalized_sharpness import solve_layer
from flatcli.measures.ns_bound import posterior_std
from tests.measures.test_normalized_sharpness import _data, _dense_diag, _mlp, _reference_ns


def _bound(model, x, y, batch_size=7, loss="cross_entropy", seed=0, **opts):
    row = measure_model(
        model,
        (x, y),
        [{"ns_bound": opts}],
        loss=loss,
        precision="fp64",
        batch_size=batch_size,
        seed=seed,
    )
    assert row.status == "ok", row.errors
    return row.results["ns_bound"]


def test_posterior_identities_and_equivariance():
    """½ΣFσ² = ½η²NS_l², ½ΣU/σ² = h_l/(2η²), and σ moves with the weights under row/column rescaling."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(4, 6, generator=g, dtype=torch.float64)
    F = torch.rand(4, 6, generator=g, dtype=torch.float64)
    M = (F @ (W * W).T).numpy()
    sol = solve_layer(M, 20.0)
    eta2 = 0.37
    s = posterior_std(W, F, sol.gamma, eta2)
    assert float((F * s * s).sum()) == pytest.approx(eta2 * sol.value, rel=1e-10)
    assert float((W * W / (s * s)).sum()) == pytest.approx(6 / eta2, rel=1e-12)
    # rows by α, columns by 1/β (a node-wise rescaling seen from this layer): F by 1/α², β²; γ shifts by 2 ln α
    a = torch.exp(torch.randn(4, 1, generator=g, dtype=torch.float64))
    b = torch.exp(torch.randn(1, 6, generator=g, dtype=torch.float64))
    W2, F2 = W * a / b, F * b * b / (a * a)
    sol2 = solve_layer((F2 @ (W2 * W2).T).numpy(), 20.0)
    torch.testing.assert_close(
        posterior_std(W2, F2, sol2.gamma, eta2), s * a / b, rtol=1e-7, atol=0
    )


@pytest.mark.slow
def test_quadratic_loss_second_order_is_exact():
    """Linear least squares: E_Q L = L(θ̄) + ½ Σ H_ii σ_i² = L(θ̄) + ½ √(h/λ) NS₂(R) exactly."""
    torch.manual_seed(0)
    model = nn.Linear(5, 3, bias=False).double()
    x, y = _data(n=40)
    ns = _reference_ns(model, x, y, loss="mse")
    r = _bound(
        model, x, y, loss="mse", mc_loss="clipped_loss", loss_clip=1e6, mc_samples=2000, lam=9.0
    )
    d = r.diagnostics
    assert d["ns_r"] == pytest.approx(ns, rel=1e-9) and d["h"] == 5 and d["lam"] == 9.0
    gap = 0.5 * math.sqrt(5 / 9.0) * ns
    assert d["second_order_gap"] == pytest.approx(gap, rel=1e-10)
    assert d["kl_over_lam"] == pytest.approx(gap, rel=1e-10)
    base = float(Problem(model.eval(), x, y, loss="mse", dtype=torch.float64).loss())
    assert d["ls_theta"] == pytest.approx(base, rel=1e-12)  # the clip is inactive
    assert abs(d["ls_q"] - (base + gap)) <= 4 * d["ls_q_stderr"]
    assert d["ls_q_stderr"] < 0.05 * gap


def test_error_mode_terms_and_cost():
    model = _mlp(nn.ReLU)
    x, y = _data()
    r = _bound(model, x, y, mc_samples=40, confidence=0.1)
    d = r.diagnostics
    ns = _reference_ns(model, x, y)
    m = 30
    assert d["m"] == m and d["lam"] == pytest.approx(math.sqrt(m))
    assert d["ns_r"] == pytest.approx(ns, rel=1e-8)
    # the sampled posterior's KL/λ = ½√(h/λ)·NS₂(R) (h = 5 + 4 + 4 columns); the former value NS₂(R)/√λ
    # was the printed eq. 32 term, √h/2 = 1.80 times smaller than KL/λ here
    h = 13
    assert d["h"] == h and d["ns_over_sqrt_lam"] == pytest.approx(ns / m**0.25, rel=1e-8)
    assert d["curvature_term"] == pytest.approx(0.5 * math.sqrt(h / math.sqrt(m)) * ns, rel=1e-8)
    assert d["curvature_term"] == pytest.approx(d["kl_over_lam"], rel=1e-12)
    assert d["lam_term"] == pytest.approx(math.sqrt(m) / (2 * m))
    width = math.sqrt(math.log(2 / 0.1) / (2 * 40))
    assert d["hoeffding_width"] == pytest.approx(width, rel=1e-12)
    assert d["ls_q_hoeffding"] == pytest.approx([d["ls_q"] - width, d["ls_q"] + width])
    assert 0.0 <= d["ls_q"] <= 1.0 and d["loss_range"] == 1.0
    assert r.value == pytest.approx(
        d["ls_q"] + width + d["curvature_term"] + d["lam_term"], rel=1e-12
    )
    assert d["n_forward"] == 41 and d["n_hvp"] == 3 * (3 + 2 * 2) and d["n_vjp"] == 3
    assert r.stderr == pytest.approx(d["ls_q_stderr"])  # exact diagonal: only the Monte-Carlo error
    assert "Ξ₃/λ" in d["symbolic"]
    assert r.value >= 1.0 and d["vacuous"] and d["vacuous_by"] == pytest.approx(r.value - 1.0)
    assert r.status == "vacuous"  # an error bound ≥ 1 says nothing, and the output says so
    assert _bound(model, x, y, mc_samples=40, confidence=0.1).value == r.value  # seeded
    assert _bound(model, x, y, mc_samples=40, confidence=0.1, seed=1).value != r.value


def test_equivariant_without_box_hits_not_with_a_dead_node():
    from flatcli.demo.models import MLP
    from flatcli.invariance import find_rescalable_pairs, node_wise_rescale

    torch.manual_seed(0)
    model = MLP(in_features=5, width=6, depth=2, num_classes=3).double().eval()
    x, y = _data(n=24)
    pairs = find_rescalable_pairs(model, x)
    a = _bound(model, x, y, batch_size=24, mc_samples=16, mc_loss="clipped_loss", loss_clip=5.0)
    b = _bound(
        node_wise_rescale(model, pairs, 10.0, seed=0),
        x,
        y,
        batch_size=24,
        mc_samples=16,
        mc_loss="clipped_loss",
        loss_clip=5.0,
    )
    assert not a.diagnostics["box_hit"] and abs(a.value - b.value) <= 1e-9 * a.value
    with torch.no_grad():  # kill node 0 of the first layer on this data: its γ goes to the box
        model.features[0].bias[0] = -20.0
    assert _bound(model, x, y, batch_size=24, mc_samples=2).diagnostics["box_hit_layers"] == [
        "features.0"
    ]
    # a dead row (zero row of F) is pinned at γ = +box: its posterior noise does not follow its scale
    g = torch.Generator().manual_seed(1)
    W = torch.randn(3, 4, generator=g, dtype=torch.float64)
    F = torch.rand(3, 4, generator=g, dtype=torch.float64)
    F[0] = 0.0
    a = torch.tensor([[10.0], [1.0], [1.0]], dtype=torch.float64)
    s1 = posterior_std(W, F, solve_layer((F @ (W * W).T).numpy(), 20.0).gamma, 1.0)
    s2 = posterior_std(
        W * a, F / a**2, solve_layer(((F / a**2) @ (W * W * a**2).T).numpy(), 20.0).gamma, 1.0
    )
    torch.testing.assert_close(
        s2[1:], s1[1:], rtol=1e-6, atol=0
    )  # live rows: unchanged, as their weights
    assert (
        float((s2[0] / s1[0] - 10.0).abs().min()) > 1.0
    )  # the dead row's weights grew 10×, its noise did not


def test_bad_input():
    model = _mlp(nn.ReLU)
    x, y = _data()
    for opts, msg in [
        ({"confidence": 1.5}, "'confidence' parameter of ns_bound must be a float in \\(0, 1\\)"),
        ({"mc_samples": 1}, "'mc_samples' parameter of ns_bound must be an int ≥ 2"),
        ({"mc_loss": "loss"}, "'mc_loss' parameter of ns_bound must be one of error, clipped_loss"),
        ({"lam": -1}, "'lam' parameter of ns_bound"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            measure_model(model, (x, y), [{"ns_bound": opts}], precision="fp64")
    reg = nn.Linear(5, 1).double()
    row = measure_model(
        reg,
        (x, torch.randn(30, 1, dtype=torch.float64)),
        ["ns_bound"],
        loss="mse",
        precision="fp64",
    )
    assert row.results.get("ns_bound") is None and "mc_loss: clipped_loss" in str(row.errors)


def test_dense_diagonal_reference_for_its_ns_term():
    model = _mlp(nn.Tanh, seed=3)  # curved and at a non-minimum: the exact diagonal by unit vectors
    x, y = _data(seed=4)
    theta, diag = _dense_diag(model, x, y)
    assert bool((diag < 0).any())
    r = _bound(model, x, y, mc_samples=4)
    assert r.diagnostics["ns_r"] == pytest.approx(_reference_ns(model, x, y), rel=1e-8)
    assert np.isfinite(r.value)


def test_a_bound_below_the_loss_range_is_not_flagged_vacuous():
    model = _mlp(nn.ReLU)
    x, y = _data()
    r = _bound(model, x, y, mc_samples=40, mc_loss="clipped_loss", loss_clip=50.0)
    d = r.diagnostics
    assert d["loss_range"] == 50.0 and r.value < 50.0
    assert (
        r.status == "ok" and not d["vacuous"] and d["vacuous_by"] == pytest.approx(r.value - 50.0)
    )
