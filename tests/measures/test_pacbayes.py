"""PAC-Bayes flatness against models whose deviation-vs-σ curve is known in closed form."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import norm
from torch import nn

from flatcli.engine import Problem
from flatcli.errors import ConfigError
from flatcli.measures.pacbayes import DEVIATION_TOL, MAGNITUDE_EPS
from tests.oracles import measure_on


def run(p, seed=0, init_params=None, **options):
    return measure_on(
        p, "pacbayes_flatness", label="pb", seed=seed, init_params=init_params, **options
    )


def margin_classifier(a: float, n: int = 600):
    """Bias-free 2-class linear classifier on x_i = e_i with logit margin 2a on every sample.

    With u ~ N(0, σ²I) on both weight rows, sample i's margin becomes 2a + (u_{y,i} − u_{1−y,i}) ~ N(2a, 2σ²),
    independently across samples (distinct coordinates), so E err(θ + u) = Φ(−√2·a/σ) and err(θ) = 0.
    """
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 2, (n,), generator=g)
    W = torch.full((2, n), -a, dtype=torch.float64)
    W[y, torch.arange(n)] = a
    m = nn.Linear(n, 2, bias=False).double()
    with torch.no_grad():
        m.weight.copy_(W)
    return Problem(m, torch.eye(n, dtype=torch.float64), y, loss="cross_entropy", batch_size=256)


def least_squares(d=50, n=200):
    g = torch.Generator().manual_seed(1)
    X = torch.randn(n, d, generator=g, dtype=torch.float64)
    y = torch.randn(n, generator=g, dtype=torch.float64)
    w = torch.linalg.lstsq(X, y[:, None]).solution[:, 0]
    m = nn.Linear(d, 1, bias=False).double()
    with torch.no_grad():
        m.weight.copy_(w[None])
    return Problem(m, X, y, loss="mse", batch_size=32), X, w


def test_error_criterion_matches_gaussian_cdf():
    a, target = 0.3, 0.1
    p = margin_classifier(a)
    r = run(p, target=target)
    d = r.diagnostics
    sigma = d["sigma"]
    assert r.status == "ok" and d["base"] == 0.0
    assert r.value == pytest.approx(1 / sigma**2, rel=1e-12)
    analytic = norm.cdf(-math.sqrt(2) * a / sigma)  # E err(θ + u) − err(θ) at the returned σ
    assert abs(d["deviation"] - analytic) <= 4 * d["deviation_stderr"]
    # σ is the standard deviation: the closed-form deviation at σ lies in the acceptance band
    assert (
        target - DEVIATION_TOL - 4 * d["deviation_stderr"]
        < analytic
        <= target + 4 * d["deviation_stderr"]
    )


def test_loss_criterion_matches_closed_form_quadratic():
    # At the least-squares minimum, E loss(θ + u) − loss(θ) = σ²·mean‖x‖² = σ²·Tr(XᵀX/n).
    p, X, _ = least_squares()
    trM = float((X**2).sum(1).mean())
    target = 1.0
    r = run(p, criterion="loss", target=target, samples=100)
    d = r.diagnostics
    sigma, se = d["sigma"], d["deviation_stderr"]
    assert d["accepted"] and target - DEVIATION_TOL < d["deviation"] <= target
    assert se < 0.03 * target
    assert abs(sigma**2 * trM - d["deviation"]) <= 4 * se
    assert abs(sigma**2 * trM - target) <= DEVIATION_TOL + 4 * se  # σ* = sqrt(target / Tr M)
    assert r.value == pytest.approx(1 / sigma**2, rel=1e-12)


def test_magnitude_aware_noise_closed_form():
    # u_i ~ N(0, σ²θ_i² + ε²): E loss increase = mean_i Σ_j x_ij² (σ²θ_j² + ε²).
    p, X, w = least_squares()
    target = 1.0
    r = run(p, criterion="loss", target=target, samples=100, magnitude_aware=True, sigma_max=50.0)
    d = r.diagnostics
    s = d["sigma"]
    expected = float(((X**2).mean(0) * (s**2 * w**2 + MAGNITUDE_EPS**2)).sum())
    assert r.status == "ok"
    assert abs(expected - d["deviation"]) <= 4 * d["deviation_stderr"]


def test_saturation_at_sigma_max_is_reported():
    p = margin_classifier(100.0, n=50)
    r = run(p, sigma_max=2.0)
    assert r.status == "saturated" and r.diagnostics["saturated"] == "sigma_max"
    assert r.value == pytest.approx(1 / 2.0**2)


def test_saturation_below_is_reported():
    # A vanishing margin: even the smallest σ tried flips half the labels.
    p = margin_classifier(1e-12, n=50)
    r = run(p, depth=6)
    assert r.status == "saturated" and r.diagnostics["saturated"] == "below"
    assert r.value == pytest.approx(1 / (2.0 / 2**6) ** 2)


def test_bound_with_init_parameters():
    p = margin_classifier(0.3, n=200)
    init = {n: torch.zeros_like(t) for n, t in p.params.items()}
    r = run(p, init_params=init)
    s = r.diagnostics["sigma"]
    dist2 = float((p.theta**2).sum())
    assert r.diagnostics["bound"] == pytest.approx(
        dist2 / (4 * s**2) + math.log(p.n / s) + 10, rel=1e-12
    )


def test_seeded_and_reproducible():
    """The noise draws come from the measure's seed alone: the same seed gives the same σ whatever
    the global RNG did in between; another seed gives another σ (the bisection sees other draws)."""
    p = margin_classifier(0.3, n=100)
    torch.manual_seed(0)
    a = run(p, seed=4)
    torch.manual_seed(123)
    torch.rand(17)
    b = run(p, seed=4)
    assert a.value == b.value and a.diagnostics["deviation"] == b.diagnostics["deviation"]
    others = {run(p, seed=s).value for s in (5, 6)}
    assert a.value not in others and len(others) == 2


def test_error_criterion_needs_class_outputs():
    p, _, _ = least_squares()
    with pytest.raises(ConfigError, match="criterion: loss"):
        run(p)


# ---------------------------------------------------------------- BatchNorm folding


def _measure(model, x, y, seed=0, init_state=None, **options):
    from flatcli.api import measure_model

    row = measure_model(
        model,
        (x, y),
        [{"pacbayes_flatness": options}],
        precision="fp64",
        batch_size=32,
        seed=seed,
        init_state=init_state,
    )
    assert not row.errors, row.errors
    return row.results["pacbayes_flatness"]


def test_folded_value_is_invariant_to_conv_bn_rescaling():
    # A function-preserving rescaling of a Conv-BN pair (weights × c, running mean × c, variance × c²)
    # moved 1/σ*² from 16384 (c = 0.2) to 3628 (c = 1, 5) on the raw parameters; folded it is one value.
    from tests.helpers import conv_bn_setup, rescale_conv_bn

    model, x, y = conv_bn_setup()
    vals = []
    for c in (0.2, 1.0, 5.0):
        r = _measure(rescale_conv_bn(model, c), x, y)
        assert r.status == "ok" and r.diagnostics["folded_batchnorm"] == 1
        vals.append(r.value)
    assert vals[0] == pytest.approx(vals[1], rel=1e-9) and vals[2] == pytest.approx(
        vals[1], rel=1e-9
    )


def test_folded_value_equals_the_network_folded_by_hand():
    from tests.helpers import conv_bn_folded_by_hand, conv_bn_setup

    model, x, y = conv_bn_setup()
    plain = conv_bn_folded_by_hand(model)
    with torch.no_grad():
        assert torch.allclose(plain(x), model(x), atol=1e-10)
    a, b = _measure(model, x, y), _measure(plain, x, y)
    assert b.diagnostics["folded_batchnorm"] == 0
    assert a.value == pytest.approx(b.value, rel=1e-12)


def test_fold_batchnorm_false_keeps_the_raw_parameterization():
    from tests.helpers import conv_bn_setup, rescale_conv_bn

    model, x, y = conv_bn_setup()
    raw = [_measure(rescale_conv_bn(model, c), x, y, fold_batchnorm=False) for c in (0.2, 1.0)]
    assert raw[0].diagnostics["unfolded_batchnorm"] == "bn"
    assert raw[0].value != pytest.approx(raw[1].value, rel=0.1)  # the raw form is not invariant


def test_folded_bound_measures_distance_in_folded_parameters():
    # θ⁰ = θ with the same BatchNorm statistics: the folded distance is 0, bound = log(n/σ) + 10.
    from tests.helpers import conv_bn_setup

    model, x, y = conv_bn_setup()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    r = _measure(model, x, y, init_state=state)
    s = r.diagnostics["sigma"]
    assert r.diagnostics["bound"] == pytest.approx(math.log(len(x) / s) + 10, rel=1e-12)
