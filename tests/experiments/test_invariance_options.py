"""`InvarianceOptions`: its defaults are the values `check_invariance_model` used before it took the
object (a call without it gives the same report), each value is checked when built, and every
field reaches the check."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flatcli.demo.models import MLP
from flatcli.errors import ConfigError
from flatcli.invariance import InvarianceOptions, check_invariance_model

TODAY = dict(transform="both", scale=10.0, tol=1e-6, progress=None)
MEASURES = [
    {"normalized_sharpness": {"hessian_diag": "exact"}},
    {"hessian_trace": {"min_probes": 6, "max_probes": 6}},
    "frobenius_norm",
]


def _net_and_data(seed: int):
    torch.manual_seed(seed)
    model = MLP(in_features=5, width=6, depth=2, num_classes=3).double()
    g = torch.Generator().manual_seed(seed + 1)
    return model, (torch.randn(24, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (24,)))


def _report(rep) -> tuple:
    rows = [(r.label, r.original, r.rescaled, r.rel_change, r.held) for r in rep.results]
    return rows, rep.transform, rep.scale, rep.tol, rep.seed, rep.output_rel_change, rep.pairs


def test_defaults_are_todays_values():
    default = InvarianceOptions()
    assert {f.name: getattr(default, f.name) for f in dataclasses.fields(default)} == TODAY
    assert InvarianceOptions(**TODAY) == default


@pytest.mark.parametrize("seed", range(3))
def test_defaults_give_the_report_of_a_call_without_options(seed):
    model, data = _net_and_data(seed)
    kw = dict(seed=seed, batch_size=8)
    bare = check_invariance_model(model, data, MEASURES, **kw)
    spelled = check_invariance_model(
        model, data, MEASURES, options=InvarianceOptions(**TODAY), **kw
    )
    assert _report(bare) == _report(spelled)
    assert (bare.transform, bare.scale, bare.tol) == ("both", 10.0, 1e-6)


def test_every_field_reaches_the_check():
    model, data = _net_and_data(0)
    stages = []
    opts = InvarianceOptions("layer", 3.0, 0.5, progress=lambda s, lab, info: stages.append(s))
    rep = check_invariance_model(model, data, ["frobenius_norm"], options=opts, batch_size=8)
    assert (rep.transform, rep.scale, rep.tol) == ("layer", 3.0, 0.5)
    assert {"original", "rescaled"} <= set(stages)
    held = {r.label: r.held for r in rep.results}
    assert held["frobenius_norm"] is None  # no claim; the tolerance is recorded
    node = check_invariance_model(
        model, data, ["frobenius_norm"], options=InvarianceOptions("node", 3.0), batch_size=8
    )
    assert node.results[0].rescaled != rep.results[0].rescaled  # another rescaling


@pytest.mark.parametrize(
    "field,value,words",
    [
        ("transform", "all", "`transform` must be one of node, layer, both. Got 'all'"),
        ("scale", 0.5, "`scale` must be a float ≥ 1. Got 0.5"),
        ("tol", 0, "`tol` must be a float > 0. Got 0"),
        ("progress", 1, "`progress` must be a callable or null. Got 1"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_field(field, value, words):
    with pytest.raises(ConfigError) as e:
        InvarianceOptions(**{field: value})
    assert words in str(e.value) and "\n" not in str(e.value)
