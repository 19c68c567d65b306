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
from flatcli.measures import list_measures
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
