"""Norm baselines against direct computation; BatchNorm folding preserves the function."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from flatcli.engine import Problem
from flatcli.errors import ConfigError
from flatcli.measures._bn import fold_batchnorm
from tests.oracles import measure_on as run


def mlp(bias=True, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(4, 6, bias=bias),
        nn.ReLU(),
        nn.Linear(6, 5, bias=bias),
        nn.ReLU(),
        nn.Linear(5, 3, bias=bias),
    ).double()


def data(n=30, d=4, c=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64), torch.randint(
        0, c, (n,), generator=g
    )


def randomize_bn(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.copy_(torch.randn(m.num_features, generator=g, dtype=torch.float64))
                m.running_var.copy_(
                    torch.rand(m.num_features, generator=g, dtype=torch.float64) + 0.5
                )
                m.weight.copy_(torch.randn(m.num_features, generator=g, dtype=torch.float64))
                m.bias.copy_(torch.randn(m.num_features, generator=g, dtype=torch.float64))
    return model


class BNNet(nn.Module):
    """Conv → BN2d → ReLU → flatten → Linear(no bias) → BN1d → ReLU → BN1d (unfoldable) → Linear."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(3)
        self.fc1 = nn.Linear(3 * 4 * 4, 5, bias=False)
        self.bn2 = nn.BatchNorm1d(5)
        self.bn3 = nn.BatchNorm1d(5)
        self.fc2 = nn.Linear(5, 3)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv(x))).flatten(1)
        return self.fc2(self.bn3(torch.relu(self.bn2(self.fc1(h)))))


class Untraceable(nn.Module):
    """Data-dependent control flow defeats torch.fx: the nn.Sequential scan is used."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 3))

    def forward(self, x):
        if x.sum() > 1e9:
            return self.body(-x)
        return self.body(x)


# ---------------------------------------------------------------- BatchNorm folding


def test_folding_preserves_outputs_and_leaves_the_model_alone():
    model = randomize_bn(BNNet().double())
    x = torch.randn(7, 2, 4, 4, dtype=torch.float64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    f = fold_batchnorm(model)
    assert sorted(f.pairs) == [("conv", "bn1"), ("fc1", "bn2")]
    assert f.unfolded == ["bn3"]
    model.eval()
    with torch.no_grad():
        assert torch.allclose(f.module(x), model(x), rtol=1e-12, atol=1e-12)
    assert f.module.fc1.bias is not None and model.fc1.bias is None
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_folding_falls_back_to_sequential_scan():
    model = randomize_bn(Untraceable().double())
    f = fold_batchnorm(model)
    assert f.pairs == [("body.0", "body.1")] and f.unfolded == []
    x = torch.randn(6, 4, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        assert torch.allclose(f.module(x), model(x), rtol=1e-12, atol=1e-12)


def test_folded_weights_are_scaled_rows():
    torch.manual_seed(0)
    model = randomize_bn(
        nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 3)).double()
    )
    x, y = data()
    p = Problem(model, x, y)
    bn = model[1]
    s = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    w1 = (model[0].weight * s[:, None]).detach()
    expected = float((w1**2).sum() + (model[3].weight.detach() ** 2).sum())
    r = run(p, "frobenius_norm")
    assert r.value == pytest.approx(expected, rel=1e-12)
    assert r.diagnostics["folded_batchnorm"] == 1


# ---------------------------------------------------------------- norms on a plain MLP


def weights(model):
    return [m.weight.detach() for m in model if isinstance(m, nn.Linear)]


def test_frobenius_and_spectral_norms():
    model = mlp()
    x, y = data()
    p = Problem(model, x, y)
    ws = weights(model)
    assert run(p, "frobenius_norm").value == pytest.approx(
        sum(float((w**2).sum()) for w in ws), rel=1e-12
    )
    spec = sum(2 * math.log(float(np.linalg.svd(w.numpy(), compute_uv=False)[0])) for w in ws)
    assert run(p, "spectral_norm").value == pytest.approx(spec, rel=1e-12)


def test_spectral_norm_of_conv_uses_reshaped_kernel():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 2 * 2, 2)
    ).double()
    x = torch.randn(5, 2, 4, 4, dtype=torch.float64)
    p = Problem(model, x, torch.randint(0, 2, (5,)))
    mats = [model[0].weight.detach().reshape(3, -1), model[3].weight.detach()]
    spec = sum(2 * math.log(float(torch.linalg.svdvals(w)[0])) for w in mats)
    assert run(p, "spectral_norm").value == pytest.approx(spec, rel=1e-12)


def test_path_norm_bias_free_is_sum_over_paths():
    model = mlp(bias=False)
    x, y = data()
    p = Problem(model, x, y)
    W1, W2, W3 = (w**2 for w in weights(model))
    expected = float((W3 @ W2 @ W1 @ torch.ones(4, dtype=torch.float64)).sum())
    assert run(p, "path_norm").value == pytest.approx(expected, rel=1e-12)


def test_path_norm_with_biases_squares_them_too():
    model = mlp(bias=True)
    x, y = data()
    p = Problem(model, x, y)
    lin = [m for m in model if isinstance(m, nn.Linear)]
    h = torch.ones(4, dtype=torch.float64)
    for i, m in enumerate(lin):
        h = m.weight.detach() ** 2 @ h + m.bias.detach() ** 2
        if i < len(lin) - 1:
            h = torch.relu(h)
    assert run(p, "path_norm").value == pytest.approx(float(h.sum()), rel=1e-12)


def test_distance_from_init():
    model, init = mlp(seed=0), mlp(seed=1)
    x, y = data()
    p = Problem(model, x, y)
    init_params = {n: t.detach() for n, t in init.named_parameters()}
    expected = sum(
        float(((a - b) ** 2).sum()) for a, b in zip(weights(model), weights(init), strict=True)
    )
    assert run(p, "distance_from_init", init_params=init_params).value == pytest.approx(
        expected, rel=1e-12
    )


def test_distance_from_init_folds_each_side_with_its_own_statistics():
    def net(seed):
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Linear(4, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 3)
        ).double()

    model, init = randomize_bn(net(0), seed=1), net(2)  # init: fresh BatchNorm statistics (0, 1)
    x, y = data()
    p = Problem(model, x, y)
    init_state = init.state_dict()
    init_params = {n: t.detach() for n, t in init.named_parameters()}

    def folded_first(m):
        bn = m[1]
        return (m[0].weight * (bn.weight / torch.sqrt(bn.running_var + bn.eps))[:, None]).detach()

    expected = float(
        ((folded_first(model) - folded_first(init)) ** 2).sum()
        + ((model[3].weight - init[3].weight).detach() ** 2).sum()
    )
    r = run(p, "distance_from_init", init_params=init_params, init_state=init_state)
    assert r.value == pytest.approx(expected, rel=1e-12)
    # without the init state dict, a fresh BatchNorm's statistics (0, 1) are assumed: the same here
    assert run(p, "distance_from_init", init_params=init_params).value == pytest.approx(
        expected, rel=1e-12
    )


def test_distance_from_init_without_init_is_a_clear_config_error():
    x, y = data()
    with pytest.raises(ConfigError, match="init_checkpoint"):
        run(Problem(mlp(), x, y), "distance_from_init")


def test_inverse_margin_is_tenth_percentile():
    model = mlp()
    x, y = data(n=200)
    # Make the model mostly right so the 10th-percentile margin is positive.
    torch.manual_seed(0)
    lin = nn.Linear(4, 3, bias=False).double()
    y = lin(x).argmax(1).detach()
    with torch.no_grad():
        lin.weight.mul_(5)
    p = Problem(lin, x, y)
    f = lin(x).detach()
    fy = f[torch.arange(200), y]
    other = f.clone()
    other[torch.arange(200), y] = -math.inf
    gamma = float(np.percentile((fy - other.max(1).values).numpy(), 10))
    r = run(p, "inverse_margin")
    assert gamma > 0 and r.status == "ok"
    assert r.value == pytest.approx(1 / gamma**2, rel=1e-12)
    # A model wrong on most samples: non-positive margin → inf, reported in the status.
    q = Problem(model, x, (y + 1) % 3)
    bad = run(q, "inverse_margin")
    assert (
        bad.value == math.inf
        and bad.status == "non_positive_margin"
        and bad.diagnostics["margin"] <= 0
    )


def test_inverse_margin_is_not_applicable_without_class_outputs():
    x = torch.randn(12, 4, dtype=torch.float64)
    p = Problem(nn.Linear(4, 1).double(), x, torch.randn(12, 1, dtype=torch.float64), loss="mse")
    res = run(p, "inverse_margin")
    assert res.status == "not_applicable" and math.isnan(res.value)
    assert res.diagnostics["reason"] == (
        "needs class scores and integer labels; loss 'mse' on outputs of shape (12, 1) gives none"
    )


def test_a_model_without_batchnorm_is_not_traced(monkeypatch):
    """Folding a model without BatchNorm finds nothing to fold and skips torch.fx's trace (which
    cost more per sweep unit than the norm measures themselves); the fold is the model as it was."""
    import torch

    from flatcli.measures import _bn

    traced = []
    real = torch.fx.symbolic_trace
    monkeypatch.setattr(torch.fx, "symbolic_trace", lambda m, *a, **k: traced.append(m) or real(m))
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    folded = _bn.fold_batchnorm(model)
    assert traced == [] and folded.pairs == [] and folded.unfolded == []
    x = torch.randn(5, 4)
    assert torch.equal(folded.module(x), model(x))
    bn = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)).eval()
    assert _bn.fold_batchnorm(bn).pairs == [("0", "1")] and len(traced) == 1
