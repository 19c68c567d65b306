"""Function-preserving rescalings, the invariance check, and `flatcli check-invariance` end to end."""

import re

import pytest
import torch
from torch import nn

from flatcli.api import check_invariance
from flatcli.cli import app
from flatcli.demo.models import MLP
from flatcli.errors import ConfigError, MeasurementError
from flatcli.invariance import (
    InvarianceOptions,
    RescalePair,
    check_invariance_model,
    claims_invariance,
    find_rescalable_pairs,
    layer_wise_rescale,
    node_wise_rescale,
)
from flatcli.measures import MeasureSpec
from tests.helpers import write_project
from tests.oracles import runner

EXACT = [
    {"normalized_sharpness": {"hessian_diag": "exact"}},
    {"relative_flatness": {"normalize_features": True}},
    {"hessian_trace": {"method": "exact"}},
]


class ConvBN(nn.Module):
    """conv → BN → ReLU → pool → conv → BN → ReLU → flatten → fc → ReLU → fc."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 3, 3)
        self.bn1 = nn.BatchNorm2d(3)
        self.conv2 = nn.Conv2d(3, 2, 3)
        self.bn2 = nn.BatchNorm2d(2)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(2 * 2 * 2, 5)
        self.fc2 = nn.Linear(5, 3)

    def forward(self, x):
        x = self.pool(torch.relu(self.bn1(self.conv1(x))))  # 10 → 8 → 4
        x = torch.relu(self.bn2(self.conv2(x))).flatten(1)  # 4 → 2
        return self.fc2(torch.relu(self.fc1(x)))


def _mlp(seed=0):
    torch.manual_seed(seed)
    return MLP(in_features=5, width=6, depth=2, num_classes=3).double()


def _data(n=24, shape=(5,), c=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=g, dtype=torch.float64), torch.randint(
        0, c, (n,), generator=g
    )


def _conv_bn():
    torch.manual_seed(0)
    model = ConvBN().double()
    x, y = _data(n=12, shape=(1, 10, 10))
    with torch.no_grad():  # non-trivial running statistics and BN affine parameters
        model.train()
        model(x * 2 + 0.5)
        for bn in (model.bn1, model.bn2):
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.2, 0.2)
    model.eval()
    return model, x, y


def test_pairs_of_the_demo_mlp():
    model = _mlp().eval()
    x, _ = _data()
    pairs = find_rescalable_pairs(model, x)
    assert [(p.producer, p.consumer) for p in pairs] == [
        ("features.0", "features.2"),
        ("features.2", "classifier"),
    ]


@pytest.mark.parametrize("rescale", [node_wise_rescale, layer_wise_rescale])
def test_rescalings_preserve_the_function_and_not_the_parameters(rescale):
    model = _mlp().eval()
    x, _ = _data()
    pairs = find_rescalable_pairs(model, x)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = rescale(model, pairs, scale=10.0, seed=3)
    torch.testing.assert_close(out(x), model(x), rtol=1e-12, atol=1e-13)
    assert not torch.allclose(out.features[0].weight, model.features[0].weight)
    for k, v in model.state_dict().items():  # the original is untouched
        assert torch.equal(v, before[k])


@pytest.mark.parametrize("transform", ["node", "layer", "both"])
def test_ns_and_normalized_relative_flatness_are_invariant_the_trace_is_not(transform):
    model = _mlp()
    x, y = _data()
    rep = check_invariance_model(
        model, (x, y), EXACT, options=InvarianceOptions(transform, 10.0), seed=0, batch_size=24
    )
    by = {r.name: r for r in rep.results}
    assert rep.output_rel_change <= 1e-12
    for name in ("normalized_sharpness", "relative_flatness"):
        assert by[name].claims_invariance and by[name].held
        assert by[name].rel_change <= 1e-6
    tr = by["hessian_trace"]
    assert not tr.claims_invariance and tr.held is None and rep.reference == tr.label
    assert max(tr.rescaled / tr.original, tr.original / tr.rescaled) > 5.0
    assert rep.passed and rep.exit_code == 0


def test_scaled_diagonal_is_invariant_at_equal_seeds():
    model = _mlp()
    x, y = _data()
    measures = ["normalized_sharpness", {"hessian_trace": {"min_probes": 8, "max_probes": 8}}]
    rep = check_invariance_model(model, (x, y), measures, seed=4, batch_size=24)
    ns = next(r for r in rep.results if r.name == "normalized_sharpness")
    assert ns.held and ns.rel_change <= 1e-6


def test_relative_flatness_without_normalization_changes_and_claims_nothing():
    model = _mlp()
    x, y = _data()
    rep = check_invariance_model(
        model,
        (x, y),
        [
            {"relative_flatness": {"normalize_features": False}},
            {"hessian_trace": {"min_probes": 8, "max_probes": 8}},
        ],
        options=InvarianceOptions("node"),
        seed=1,
        batch_size=24,
    )
    rf = rep.results[0]
    assert not rf.claims_invariance and rf.held is None and rf.rel_change > 1e-3
    assert rep.exit_code == 0


def test_batchnorm_aware_rescaling_of_a_cnn():
    model, x, y = _conv_bn()
    pairs = find_rescalable_pairs(model, x)
    assert pairs == [
        RescalePair("bn1", "conv2", 3, 1),
        RescalePair("bn2", "fc1", 2, 4),  # flatten: each channel feeds 2×2 inputs
        RescalePair("fc1", "fc2", 5, 1),
    ]
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    out = node_wise_rescale(model, pairs, scale=10.0, seed=0)
    out.eval()
    torch.testing.assert_close(out(x), model(x), rtol=1e-12, atol=1e-13)
    for k, v in out.named_buffers():
        assert torch.equal(v, buffers[k])  # running statistics untouched
    fast = [
        {"normalized_sharpness": {"samples": 16}},
        EXACT[1],
        {"hessian_trace": {"min_probes": 8, "max_probes": 8}},
    ]
    rep = check_invariance_model(
        model, (x, y), fast, options=InvarianceOptions("both"), batch_size=12
    )
    assert rep.passed, rep.results
    assert all(r.rel_change <= 1e-6 for r in rep.results if r.claims_invariance)


def test_no_homogeneous_structure_is_an_error():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x, y = _data()
    assert find_rescalable_pairs(model.eval(), x) == []
    with pytest.raises(MeasurementError, match="no function-preserving rescaling"):
        check_invariance_model(model, (x, y), ["frobenius_norm"])


def test_claims():
    assert claims_invariance(MeasureSpec("normalized_sharpness", "ns"))
    assert not claims_invariance(
        MeasureSpec("normalized_sharpness", "ns", {"hessian_diag": "hutchinson"})
    )
    assert claims_invariance(MeasureSpec("relative_flatness", "rf", {"normalize_features": True}))
    assert not claims_invariance(MeasureSpec("relative_flatness", "rf"))
    assert not claims_invariance(MeasureSpec("hessian_trace", "tr"))


# ------------------------------------------------------------------ the command
MEASURES = [
    {"normalized_sharpness": {"samples": 16}},  # the scaled estimator is invariant at equal seeds
    {"hessian_trace": {"min_probes": 8, "max_probes": 8}},
    "frobenius_norm",
]


@pytest.fixture
def project(tmp_path):
    cfg = write_project(tmp_path, width=6, n_ckpt=1, measures=MEASURES)
    return cfg, tmp_path / "m0.pt"


def test_cli_end_to_end(project):
    cfg, ckpt = project
    res = runner.invoke(
        app,
        [
            "check-invariance",
            "-c",
            str(cfg),
            str(ckpt),
            "-m",
            "normalized_sharpness,relative_flatness,hessian_trace,frobenius_norm",
        ],
    )
    assert res.exit_code == 0, res.output
    out = res.output
    for col in (
        "measure",
        "claims",
        "invariance",
        "original",
        "rescaled",
        "rel.",
        "change",
        "held?",
    ):
        assert col in out
    assert "features.0→classifier" in out
    assert re.search(r"normalized_sharpness\s.*yes.*yes", out)
    assert "relative_flatness*" in out and "normalize_features: true" in out
    assert "all 2 measure(s) claiming invariance held it within 1e-06" in out
    # API equivalent: the configured trace options are kept
    rep = check_invariance(cfg, ckpt, "normalized_sharpness,hessian_trace")
    assert [r.label for r in rep.results] == ["normalized_sharpness", "hessian_trace"]
    assert rep.passed


def test_cli_exit_codes(project):
    cfg, ckpt = project
    # factors up to 1e10 need γ beyond the box [-20, 20]: normalized sharpness changes, and says why
    args = [
        "check-invariance",
        "-c",
        str(cfg),
        str(ckpt),
        "-m",
        "normalized_sharpness,hessian_trace",
    ]
    res = runner.invoke(app, [*args, "--transform", "node", "--scale", "1e10"])
    assert res.exit_code == 1, res.output
    assert (
        "invariance violated (tolerance 1e-06): normalized_sharpness" in res.output
        and "NO" in res.output
    )
    assert "γ hit the box" in res.output
    res = runner.invoke(
        app, [*args, "--transform", "layer", "--scale", "1e10"]
    )  # one α per layer: absorbed by shifts
    assert res.exit_code == 0, res.output
    res = runner.invoke(
        app, ["check-invariance", "-c", str(cfg), str(ckpt), "--transform", "channel"]
    )
    assert (
        res.exit_code == 2
        and "--transform must be one of node, layer, both. Got 'channel' instead." in res.output
    )
    res = runner.invoke(
        app, ["check-invariance", "-c", str(cfg), str(ckpt.with_name("missing.pt"))]
    )
    assert res.exit_code == 2 and "checkpoint not found" in res.output


def test_bad_measure_input_is_a_config_error():
    model = _mlp()
    x, y = _data()
    with pytest.raises(ConfigError, match="'features.1' is ReLU"):
        check_invariance_model(model, (x, y), [{"relative_flatness": {"layer": "features.1"}}])


@pytest.mark.parametrize("transform", ["node", "layer", "both"])
def test_fisher_rao_path_norm_and_margin_are_invariant_and_claim_it(transform):
    model = _mlp()
    x, y = _data()
    measures = [
        "fisher_rao_norm",
        "path_norm",
        "inverse_margin",
        "fisher_rao_term",
        "frobenius_norm",
    ]
    rep = check_invariance_model(
        model, (x, y), measures, options=InvarianceOptions(transform, 10.0), seed=0, batch_size=24
    )
    by = {r.name: r for r in rep.results}
    for name in ("fisher_rao_norm", "path_norm", "inverse_margin", "fisher_rao_term"):
        assert by[name].claims_invariance and by[name].held and by[name].rel_change <= 1e-9, name
    assert not by["frobenius_norm"].claims_invariance and by["frobenius_norm"].rel_change > 1e-2
