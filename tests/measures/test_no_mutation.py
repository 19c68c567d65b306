"""Every registered measure leaves the model bit-identical: parameters, BatchNorm buffers,
gradients and each module's train/eval mode.

Iterates over whatever `list_measures()` holds, so measures added later are covered too.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from flatcli.api import measure_model
from flatcli.measures import MeasureSpec, list_measures
from flatcli.measures._options import option_fields

# Small settings for options that exist on some measures (applied only where the option exists).
SMALL = {
    "steps": 3,
    "samples": 4,
    "min_probes": 2,
    "max_probes": 4,
    "slq_runs": 2,
    "slq_steps": 6,
    "max_steps": 25,
    "top_k": 2,
    "depth": 4,
    "min_evals": 3,
}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


def tiny_setup():
    torch.manual_seed(0)
    model = Net().double()
    init_state = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    x, y = (
        torch.randn(24, 4, generator=g, dtype=torch.float64),
        torch.randint(0, 3, (24,), generator=g),
    )
    xt, yt = (
        torch.randn(12, 4, generator=g, dtype=torch.float64),
        torch.randint(0, 3, (12,), generator=g),
    )
    with torch.no_grad():  # non-trivial running statistics
        model.train()
        for _ in range(3):
            model(x)
            model.fc1.weight.add_(0.1)
    model.train()
    model.drop.eval()  # a mixed mode that must come back exactly
    return model, init_state, (x, y), (xt, yt)


def small_options(info) -> dict:
    names = (
        {f.name for f in option_fields(info.options)}
        if dataclasses.is_dataclass(info.options)
        else set()
    )
    return {k: v for k, v in SMALL.items() if k in names}


@pytest.mark.parametrize("name", [m.name for m in list_measures()])
def test_measure_leaves_model_untouched(name):
    info = next(m for m in list_measures() if m.name == name)
    model, init_state, train, test = tiny_setup()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modes = {n: m.training for n, m in model.named_modules()}
    row = measure_model(
        model,
        train,
        [{name: small_options(info)}],
        test=test,
        precision="fp64",  # the model is float64 already: measured in place, not on a copy
        batch_size=8,
        init_state=init_state,
    )
    assert not row.errors, row.errors
    assert name in row.results
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert after[k].dtype == v.dtype and torch.equal(after[k], v), f"{name} changed {k}"
    assert {n: m.training for n, m in model.named_modules()} == modes
    assert all(p.grad is None for p in model.parameters())


# ---------------------------------------------------------------------------- cost estimates
FIXED = {  # options that fix every adaptive count, so that the estimate is exact
    "hessian_lambda_max": {"min_steps": 9, "max_steps": 9, "tol": 1e-300},
    "hessian_trace": {"min_probes": 12, "max_probes": 12},
    "pacbayes_flatness": {"samples": 2, "depth": 3, "sigma_max": 100.0},
    "first_order_flatness": {"steps": 3},
    "keskar_sharpness": {"steps": 3},
    "sharpness_worst": {"steps": 3, "eigen_starts": 0, "batch_size": 8},
    "weightwatcher_alpha": {"min_evals": 3},
}


def test_every_measure_declares_its_cost_and_the_estimate_matches_the_counted_products():
    from flatcli.run.measuring import COUNTERS, estimate_products, measure_model, problem_dims
    from flatcli.run.settings import Settings

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 4)).double()
    x = torch.randn(30, 5, dtype=torch.float64)
    y = torch.randint(0, 4, (30,))
    init = {k: v + 0.1 for k, v in model.state_dict().items()}
    st = Settings(precision="fp64", batch_size=8)
    dims = problem_dims(model, (x, y), st)
    assert (dims.P, dims.n, dims.C, dims.matrices) == (64, 30, 4, (30, 24))
    for info in list_measures():
        assert info.estimate is not None, f"{info.name} declares no cost estimate"
        spec = MeasureSpec(info.name, info.name, dict(FIXED.get(info.name, {})))
        est = estimate_products([spec], dims)[info.name]
        row = measure_model(model, (x, y), [spec], settings=st, init_state=init)
        d = row.results[info.name].diagnostics
        for c in COUNTERS:
            lo, hi = est[c]
            assert lo <= d.get(c, 0) <= hi, (info.name, c, d.get(c, 0), (lo, hi))
        exact = [c for c in COUNTERS if est[c][0] == est[c][1]]
        assert all(d.get(c, 0) == est[c][0] for c in exact), info.name
