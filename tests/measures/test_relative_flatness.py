"""relative_flatness against Def. 3 of Petzka et al. (2021) with the dense Hessian block of the layer."""

import pytest
import torch
from torch import nn

from flatcli.api import measure_model
from flatcli.engine import Problem
from flatcli.errors import ConfigError
from tests.oracles import dense_hessian


class LeNetish(nn.Module):
    """LeNet-5 shape in miniature: conv → relu → pool → conv → relu → pool → fc1 → fc2 → fc3."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 2, 3)
        self.conv2 = nn.Conv2d(2, 3, 3)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(3 * 2 * 2, 5)
        self.fc2 = nn.Linear(5, 4)
        self.fc3 = nn.Linear(4, 3)

    def forward(self, x):
        x = self.pool(torch.relu(self.conv1(x)))  # 12 → 10 → 5
        x = torch.relu(self.conv2(x))  # 5 → 3
        x = torch.flatten(nn.functional.max_pool2d(x, 2, ceil_mode=True), 1)  # 3 → 2
        x = torch.relu(self.fc1(x))
        x = torch.tanh(self.fc2(x))
        return self.fc3(x)


class Squeezed(nn.Module):
    """f(x) = w·x returned as a (B,) vector: the layer output is not the model output."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, 1, bias=False)

    def forward(self, x):
        return self.lin(x).squeeze(-1) * 1.0


def _mlp(act=nn.Tanh, seed=0, widths=(5, 6, 3, 4)):
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(widths[:-2], widths[1:-1], strict=True):
        layers += [nn.Linear(a, b), act()]
    layers.append(nn.Linear(widths[-2], widths[-1]))
    return nn.Sequential(*layers).double()


def _data(n=25, shape=(5,), c=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=g, dtype=torch.float64), torch.randint(
        0, c, (n,), generator=g
    )


def _features(model, layer, x):
    mod = dict(model.named_modules())[layer]
    got = []
    h = mod.register_forward_hook(lambda m, i, o: got.append(i[0].detach()))
    with torch.no_grad():
        model.eval()
        model(x)
    h.remove()
    return got[0]


def _dense_kappa(model, x, y, layer, loss="cross_entropy", normalize=False):
    """Σ_{s,s'} ⟨w̃_s, w̃_s'⟩ Tr(H̃_{s,s'}) with H̃ the dense Hessian of L in W̃ = W diag(σ) (σ = 1 unless normalized).

    A feature constant over S (σ = 0; here only dead ReLUs, φ = 0) is absorbed into the bias: its
    column of W̃ is 0 and W keeps its value there."""
    prob = Problem(model, x, y, loss=loss, batch_size=len(x), dtype=torch.float64)
    wname = f"{layer}.weight"
    W = prob.params[wname]
    sigma = torch.ones(W.shape[1], dtype=W.dtype)
    if normalize:
        phi = _features(model, layer, x)
        sigma = phi.std(0, unbiased=False)
        assert torch.all(phi[:, sigma == 0] == 0)
    live = sigma > 0
    Wt = torch.where(live, W * sigma, torch.zeros_like(W))

    def loss_of(Wt_):
        return prob.loss(
            {**prob.params, wname: torch.where(live, Wt_ / torch.where(live, sigma, 1.0), W)}
        )

    H = dense_hessian(lambda w: loss_of(w.view(Wt.shape)), Wt.reshape(-1))
    H = H.reshape(*Wt.shape, *Wt.shape)  # (d, m, d, m)
    T = torch.einsum("sjtj->st", H)
    return float(((Wt @ Wt.T) * T).sum())


def _kappa(model, x, y, loss="cross_entropy", batch_size=7, **opts):
    row = measure_model(
        model,
        (x, y),
        [{"relative_flatness": opts}],
        loss=loss,
        precision="fp64",
        batch_size=batch_size,
    )
    assert row.status == "ok", row.errors
    return row.results["relative_flatness"]


@pytest.mark.parametrize("act", [nn.Tanh, nn.ReLU])
@pytest.mark.parametrize("normalize", [False, True])
def test_last_layer_matches_dense_hessian(act, normalize):
    model = _mlp(act)
    x, y = _data()
    res = _kappa(model, x, y, normalize_features=normalize)
    ref = _dense_kappa(model, x, y, "4", normalize=normalize)
    assert res.diagnostics["layer"] == "4" and res.diagnostics["method"] == "closed_form"
    if (
        normalize and act is nn.ReLU
    ):  # this seed has a dead feature: the σ = 0 convention is exercised
        assert res.diagnostics["zero_std_features"] == 1
    assert abs(res.value - ref) <= 1e-8 * abs(ref)


@pytest.mark.parametrize(
    "layer,units", [("2", True), ("0", False)]
)  # d ≤ m: unit vectors; d > m: columns of W
@pytest.mark.parametrize("normalize", [False, True])
def test_middle_layer_uses_hvps_through_the_rest_of_the_network(layer, units, normalize):
    model = _mlp(nn.Tanh, widths=(5, 6, 3, 4))  # Linear 0: 5→6, Linear 2: 6→3, Linear 4: 3→4
    x, y = _data()
    res = _kappa(model, x, y, layer=layer, normalize_features=normalize)
    ref = _dense_kappa(model, x, y, layer, normalize=normalize)
    d, m = model[int(layer)].weight.shape
    assert res.diagnostics["method"] == "hvp"
    assert res.diagnostics["z_hvps"] == (d if units else m) * 4  # 4 batches of ≤ 7
    assert abs(res.value - ref) <= 1e-8 * abs(ref)


@pytest.mark.parametrize("layer", ["fc1", "fc2", "fc3"])
def test_lenet_style_cnn_fc_layers(layer):
    torch.manual_seed(3)
    model = LeNetish().double()
    x, y = _data(n=10, shape=(1, 12, 12), c=3)
    res = _kappa(model, x, y, layer=layer, batch_size=4)
    ref = _dense_kappa(model, x, y, layer)
    assert abs(res.value - ref) <= 1e-8 * abs(ref)
    assert (
        _kappa(model, x, y, batch_size=4).diagnostics["layer"] == "fc3"
    )  # default: the last Linear


def test_mse_on_an_inner_layer_matches_dense_hessian():
    model = _mlp(nn.Tanh)
    x, y = _data()
    res = _kappa(model, x, y, loss="mse", layer="2")
    ref = _dense_kappa(model, x, y, "2", loss="mse")
    assert abs(res.value - ref) <= 1e-8 * abs(ref)


@pytest.mark.parametrize("model_cls", [lambda: nn.Linear(4, 1, bias=False), lambda: Squeezed(4)])
def test_ridge_identity(model_cls):
    # Petzka et al. property (i): f(x) = w·x with L = mean (f − y)² gives κ = 2‖w‖² mean ‖x‖²
    torch.manual_seed(0)
    model = model_cls().double()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(13, 4, generator=g, dtype=torch.float64)
    y = torch.randn(13, generator=g, dtype=torch.float64)
    res = _kappa(model, x, y, loss="mse", batch_size=5)
    w = next(model.parameters()).detach()
    expected = 2 * float((w * w).sum()) * float((x * x).sum(1).mean())
    assert abs(res.value - expected) <= 1e-12 * expected


def test_node_rescaling_of_features_needs_normalization():
    model = _mlp(nn.ReLU, widths=(5, 6, 4))
    x, y = _data()
    scaled = _mlp(nn.ReLU, widths=(5, 6, 4))
    alpha = torch.linspace(0.2, 5.0, 6, dtype=torch.float64)
    with torch.no_grad():
        scaled[0].weight.mul_(alpha[:, None])
        scaled[0].bias.mul_(alpha)
        scaled[2].weight.div_(alpha[None, :])
    torch.testing.assert_close(model(x), scaled(x), rtol=1e-12, atol=1e-12)
    a, b = (
        _kappa(model, x, y, normalize_features=True).value,
        _kappa(scaled, x, y, normalize_features=True).value,
    )
    assert abs(a - b) <= 1e-10 * a
    a, b = _kappa(model, x, y).value, _kappa(scaled, x, y).value
    assert abs(a - b) > 1e-2 * a


def test_layer_errors_name_the_layer():
    model = LeNetish().double()
    x, y = _data(n=4, shape=(1, 12, 12), c=3)
    for layer, expected in (("conv1", "'conv1' is Conv2d"), ("fc_1", "Did you mean 'fc1'")):
        try:  # a ConfigError, raised or recorded as the measure's error of kind ConfigError (exit code 2)
            row = measure_model(
                model, (x, y), [{"relative_flatness": {"layer": layer}}], precision="fp64"
            )
            msg = row.errors["relative_flatness"]
            assert row.error_kinds["relative_flatness"] == "ConfigError"
        except ConfigError as e:
            msg = str(e)
        assert expected in msg and "relative_flatness" in msg


def test_model_is_not_mutated_and_hooks_removed():
    model = _mlp(nn.Tanh)
    x, y = _data()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _kappa(model, x, y, layer="2", normalize_features=True)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    assert all(not m._forward_hooks for m in model.modules())


def _kappa_normalized_by(model, x, y, power):
    """κ of the last layer with features divided by σ^power (σ their std over S) and W's columns
    multiplied by it: power 1 is the measure's normalization, power 2 Theorem 4's literal "variance"
    (cross-entropy, closed form H_z = diag(p) − ppᵀ)."""
    layer = str(len(model) - 1)
    phi = _features(model, layer, x)
    scale = phi.std(0, unbiased=False) ** power
    W = model[-1].weight.detach() * scale
    with torch.no_grad():
        p = torch.softmax(model(x), 1)
    G = W @ W.T
    hz = (p * torch.diagonal(G)).sum(1) - ((p @ G) * p).sum(1)
    return float((((phi / scale) ** 2).sum(1) * hz).mean())


def test_standard_deviation_not_variance_gives_the_invariance():
    # Theorem 4 says "variance"; only σ (not σ²) cancels a node-wise rescaling φ_j → α_j φ_j:
    # φ_j/σ_j is unchanged, φ_j/σ_j² scales by 1/α_j (numbers in relative_flatness's module docstring).
    model = _mlp(nn.ReLU, widths=(5, 6, 4))
    x, y = _data()
    scaled = _mlp(nn.ReLU, widths=(5, 6, 4))
    alpha = torch.linspace(0.2, 5.0, 6, dtype=torch.float64)
    with torch.no_grad():
        scaled[0].weight.mul_(alpha[:, None])
        scaled[0].bias.mul_(alpha)
        scaled[2].weight.div_(alpha[None, :])
    std = [_kappa_normalized_by(m, x, y, 1) for m in (model, scaled)]
    var = [_kappa_normalized_by(m, x, y, 2) for m in (model, scaled)]
    assert std[0] == pytest.approx(_kappa(model, x, y, normalize_features=True).value, rel=1e-10)
    assert std[1] == pytest.approx(std[0], rel=1e-10)
    assert abs(var[1] - var[0]) > 0.1 * var[0]
