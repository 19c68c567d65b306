"""A budget's weights count work two measures share once (`flatcli.run.prediction.predict.Fit.cost`,
`flatcli.measures.MeasureSpec.shared_work`): the Hessian-diagonal measures, in every order, are
weighed at what each then spends. References: the products each run counts (its diagnostics)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from flatcli import api
from flatcli.run.prediction import predict, shares
from flatcli.run.prediction.shares import least_work
from tests.helpers import tiny_data

DIAGONAL = ["normalized_sharpness", "ns_bound", "fisher_rao_term"]


def relu_mlp(seed: int) -> nn.Module:
    """Piecewise linear: its Hessian diagonal is the Gauss-Newton one, so every tensor's check
    passes and each measure spends exactly its least declared work."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 7), nn.ReLU(), nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3))


def spent(diag: dict) -> float:
    """Products a result's diagnostics count, in HVP equivalents (`least_work`'s weights)."""
    w = shares.WEIGHTS
    return sum(w.get(k, 0.0) * float(diag.get(k, 0) or 0) for k in w)


@pytest.mark.parametrize("seed", range(3))
def test_the_diagonal_measures_are_weighed_at_what_each_spends_in_every_order(monkeypatch, seed):
    """Over the 6 orders of the three Hessian-diagonal measures (and λmax between them): each
    one's weight in the budget's split is within 5% (and 1 HVP) of the products it spends in that
    order, so the diagonal, computed once, is weighed once (weighing each measure alone would
    count it three times). Seconds are taken as the least products (`least_work`) so the weights
    do not depend on timings; the budget is large enough to change nothing."""
    monkeypatch.setattr(
        predict.Fit, "seconds", lambda self, spec, problem=None: least_work(spec, self.dims)
    )
    weights: list[dict[str, float]] = []
    split_of = shares.BudgetSplit.of

    def record(total, specs, *a, **k):  # the weights by label, in the order the run takes
        split = split_of(total, specs, *a, **k)
        weights.append(dict(zip([s.label for s in specs], split.costs, strict=True)))
        return split

    monkeypatch.setattr(shares.BudgetSplit, "of", staticmethod(record))
    model, (x, y) = relu_mlp(seed).double(), tiny_data(n=30, seed=seed)
    for order in itertools.permutations(DIAGONAL):
        measures = [order[0], "hessian_lambda_max", *order[1:]]
        row = api.measure_model(
            model,
            (x, y),
            measures,
            loss="cross_entropy",
            batch_size=8,
            precision="fp64",
            budget=1e6,
        )
        got = weights[-1]
        for name in order:
            res = row.results[name]
            assert res.status in ("ok", "vacuous"), (name, res.status, res.diagnostics)
            work = spent(res.diagnostics)
            assert abs(got[name] - work) <= 0.05 * work + 1.0, (order, name, got[name], work)
