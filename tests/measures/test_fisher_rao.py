"""Fisher-Rao norm against the homogeneity identity and direct per-sample gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flatcli.engine import Problem
from flatcli.errors import ConfigError
from tests.oracles import measure_on


def run(p, seed=0, **options):
    return measure_on(p, "fisher_rao_norm", label="fr", seed=seed, **options)


def relu_net(bias: bool, hidden: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    layers, d = [], 5
    for _ in range(hidden):
        layers += [nn.Linear(d, 7, bias=bias), nn.ReLU()]
        d = 7
    layers.append(nn.Linear(d, 3, bias=bias))
    return nn.Sequential(*layers).double()


def data(n=41, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (n,), generator=g
    )


def test_bias_free_relu_equals_homogeneity_oracle():
    # f is (L+1)-homogeneous: ⟨θ, ∇ℓ⟩ = (L+1)⟨∂ℓ/∂f, f⟩, with ∂ℓ/∂f = softmax(f) − onehot(y).
    L = 2
    model = relu_net(bias=False, hidden=L)
    x, y = data()
    p = Problem(model, x, y, batch_size=16)
    with torch.no_grad():
        f = model(x)
    dl_df = torch.softmax(f, 1) - nn.functional.one_hot(y, 3).double()
    oracle = float(((L + 1) ** 2 * (dl_df * f).sum(1) ** 2).mean())
    r = run(p)
    assert r.value == pytest.approx(oracle, rel=1e-12)
    assert r.stderr is None


def direct(p, y):
    """mean_i ⟨θ, ∇ℓ_i⟩² from one reverse-mode gradient per sample."""
    theta = p.theta
    vals = []
    for i in range(p.n):
        t = theta.clone().requires_grad_(True)
        row = p.batch.select([i]).replace(y=y[i : i + 1])
        (g,) = torch.autograd.grad(p.batch_loss_sum(p.unflatten(t), row), t)
        vals.append(float(theta @ g) ** 2)
    return sum(vals) / len(vals)


def test_general_network_with_biases_matches_per_sample_gradients():
    model = relu_net(bias=True)
    x, y = data()
    p = Problem(model, x, y, batch_size=16)
    assert run(p).value == pytest.approx(direct(p, y), rel=1e-12)


def test_double_backward_fallback_matches(monkeypatch):
    model = relu_net(bias=True)
    x, y = data()
    p = Problem(model, x, y, batch_size=16)

    def no_forward_mode(*a, **k):
        raise NotImplementedError("no forward-mode rule")

    import flatcli.engine.facade as products

    monkeypatch.setattr(
        products, "jvp", no_forward_mode
    )  # the engine's per-sample product falls back
    assert run(p).value == pytest.approx(direct(p, y), rel=1e-12)


def test_model_labels_match_their_expectation_within_stderr():
    # E over ŷ ~ softmax of (L+1)²⟨p − e_ŷ, f⟩² = (L+1)² Σ_k p_k (⟨p, f⟩ − f_k)².
    L = 1
    model = relu_net(bias=False, hidden=L, seed=1)
    x, y = data(n=400, seed=2)
    p = Problem(model, x, y, batch_size=128)
    with torch.no_grad():
        f = model(x)
    prob = torch.softmax(f, 1)
    pf = (prob * f).sum(1, keepdim=True)
    expected = float(((L + 1) ** 2 * (prob * (pf - f) ** 2).sum(1)).mean())
    r = run(p, labels="model", seed=3)
    assert r.stderr is not None and r.stderr < 0.15 * expected
    assert abs(r.value - expected) <= 4 * r.stderr
    assert r.value == run(p, labels="model", seed=3).value


def test_model_labels_need_cross_entropy():
    x = torch.randn(6, 5, dtype=torch.float64)
    p = Problem(relu_net(bias=True), x, torch.randn(6, 3, dtype=torch.float64), loss="mse")
    with pytest.raises(ConfigError, match="labels"):
        run(p, labels="model")


# ---------------------------------------------------------------- BatchNorm folding


def _fr(model, x, y, **options):
    from flatcli.api import measure_model

    row = measure_model(
        model, (x, y), [{"fisher_rao_norm": options}], precision="fp64", batch_size=32
    )
    assert not row.errors, row.errors
    return row.results["fisher_rao_norm"]


def test_folded_norm_equals_the_network_folded_by_hand():
    # Raw parameters gave 0.652 here, the same eval-mode function without BatchNorm 0.257.
    from tests.helpers import conv_bn_folded_by_hand, conv_bn_setup

    model, x, y = conv_bn_setup()
    plain = conv_bn_folded_by_hand(model)
    a, b = _fr(model, x, y), _fr(plain, x, y)
    assert a.diagnostics["folded_batchnorm"] == 1
    assert a.value == pytest.approx(b.value, rel=1e-9)
    p = Problem(plain, x, y, batch_size=16)
    assert b.value == pytest.approx(direct(p, y), rel=1e-12)


@pytest.mark.parametrize("c", [0.2, 5.0])
def test_folded_norm_is_invariant_to_conv_bn_rescaling(c):
    from tests.helpers import conv_bn_setup, rescale_conv_bn

    model, x, y = conv_bn_setup()
    assert _fr(rescale_conv_bn(model, c), x, y).value == pytest.approx(
        _fr(model, x, y).value, rel=1e-9
    )


def test_fold_batchnorm_false_differentiates_the_raw_parameters():
    from tests.helpers import conv_bn_setup

    model, x, y = conv_bn_setup()
    r = _fr(model, x, y, fold_batchnorm=False)
    assert r.diagnostics["unfolded_batchnorm"] == "bn"
    assert r.value == pytest.approx(
        direct(Problem(model.eval(), x, y, batch_size=16), y), rel=1e-12
    )


def test_eval_mode_batchnorm_leaves_the_layer_before_it_active_and_the_default_is_folded():
    """The former docstring said weights before a BatchNorm add nothing to ⟨θ, ∇ℓ⟩ in the raw
    parameterization; in eval mode (running statistics) they do: per sample ⟨W, ∇_Wℓ⟩ = ⟨s∘z, ∇_yℓ⟩
    (z the conv output, y the BatchNorm output, s = γ/√(σ²+ε)), here nonzero on average. The raw and the
    folded values differ (0.652 vs 0.257) and the default reports the folded one."""
    from tests.helpers import conv_bn_folded_by_hand, conv_bn_setup

    model, x, y = conv_bn_setup()
    bn = model.bn
    s = (bn.weight / torch.sqrt(bn.running_var + bn.eps)).detach()
    dirs = []
    for i in range(len(x)):
        z = model.conv(x[i : i + 1])
        out = bn(z)
        out.retain_grad()
        loss = nn.functional.cross_entropy(model.fc(torch.relu(out).flatten(1)), y[i : i + 1])
        (gw,) = torch.autograd.grad(loss, model.conv.weight, retain_graph=True)
        (gy,) = torch.autograd.grad(loss, out)
        wdir = float((model.conv.weight.detach() * gw).sum())
        assert wdir == pytest.approx(
            float((s[None, :, None, None] * z.detach() * gy).sum()), rel=1e-9, abs=1e-15
        )
        dirs.append(wdir)
    assert abs(sum(dirs) / len(dirs)) > 1e-3  # not "nothing"
    raw = direct(Problem(model.eval(), x, y, batch_size=16), y)
    folded = direct(Problem(conv_bn_folded_by_hand(model), x, y, batch_size=16), y)
    assert raw == pytest.approx(0.652, abs=5e-4) and folded == pytest.approx(0.257, abs=5e-4)
    r = _fr(model, x, y)  # default: fold_batchnorm true
    assert r.value == pytest.approx(folded, rel=1e-12)
    assert r.diagnostics["raw_parameterization_value"] == pytest.approx(raw, rel=1e-12)
    assert r.diagnostics["n_jvp"] == 2
    assert "raw_parameterization_value" not in _fr(model, x, y, fold_batchnorm=False).diagnostics


def test_raw_parameterization_value_only_when_something_was_folded():
    # A BatchNorm after a ReLU cannot be folded into a layer: nothing is folded, the measured form is
    # the raw one, and no second "raw" value is reported (issue 29); the value is the raw direct one.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.BatchNorm1d(6), nn.Linear(6, 3)).double()
    with torch.no_grad():
        model[2].running_mean.uniform_(-0.5, 0.5)
        model[2].running_var.uniform_(0.5, 2.0)
    g = torch.Generator().manual_seed(1)
    x, y = (
        torch.randn(16, 4, generator=g, dtype=torch.float64),
        torch.randint(0, 3, (16,), generator=g),
    )
    r = _fr(model, x, y)
    assert r.diagnostics["folded_batchnorm"] == 0 and r.diagnostics["unfolded_batchnorm"] == "2"
    assert "raw_parameterization_value" not in r.diagnostics and "_labels" not in r.diagnostics
    assert r.value == pytest.approx(
        direct(Problem(model.eval(), x, y, batch_size=16), y), rel=1e-12
    )
