"""The dry-run times and counts one micro-batch (`flatcli.run.predict.time_products`,
`flatcli.run.memory.product_bytes`): it never builds a graph over the whole set, and its counted
product, scaled from micro-batches, matches the count over the whole batch."""

from __future__ import annotations

import pytest
import torch

from flatcli.engine import Problem
from flatcli.engine.recompute import _count_saved, predicted_product_bytes
from flatcli.run.memory import product_bytes
from flatcli.run.predict import time_products
from flatcli.run.settings import Settings
from tests.run.test_memory_counts import tiny_gpt2


def test_the_dry_run_builds_no_graph_over_more_than_two_rows(monkeypatch):
    """Forward passes, gradients and products of the dry-run see at most two rows of a 16-row
    set (one to time, two to count), and the times are still those of the whole set's units."""
    model, batch = tiny_gpt2(16, 1, rows=16)
    seen = []
    loss_sum = Problem.batch_loss_sum

    def counted(self, params, b):
        seen.append(b.rows)
        return loss_sum(self, params, b)

    monkeypatch.setattr(Problem, "batch_loss_sum", counted)
    times, problem = time_products(model, batch, Settings(loss="causal_lm", batch_size=16))
    assert problem.rows == 16 and seen and max(seen) <= 2, seen
    assert times.forward > 0 and times.hvp1 > 0 and times.product_bytes > 0


@pytest.mark.parametrize("width,layers", [(16, 1), (24, 2)])
def test_a_counted_product_scaled_from_micro_batches_matches_the_whole_batchs_count(width, layers):
    """Over batch sizes of 2 to 16 rows and blocks of 1 to 4 vectors: the product's bytes counted
    on micro-batches and scaled to the batch are within 5% of the same rule with the saved tensors
    counted on the whole batch's graph."""
    for rows in (2, 4, 8, 16):
        model, batch = tiny_gpt2(width, layers, rows=rows)
        st = Settings(loss="causal_lm", batch_size=rows, cache_graphs="false")
        p = Problem(model, batch, loss="causal_lm", batch_size=rows)
        P, elt, b = p.num_params, 4, p.batches[0]
        for k in (1, 4):
            scaled = product_bytes(p, st, k).bytes
            counted = _count_saved(p, b)  # the whole batch's graph, built and counted
            one, _ = predicted_product_bytes(p, b, 1, torch.device("cpu"), saved=counted)
            whole = one + (k - 1) * P * elt
            assert abs(scaled - whole) <= 0.05 * whole, (rows, k, scaled, whole)


@pytest.mark.parametrize("rows,batch_size", [(8, 4), (12, 4), (16, 8), (6, 6)])
def test_the_dry_runs_seconds_fit_a_per_call_and_a_per_unit_cost(monkeypatch, rows, batch_size):
    """Each batch's loss costs ``c + d·units`` seconds on a fake clock (``c`` the share a call
    pays whatever its rows, the parameters'; ``d`` per scored token), over random c and d: the
    dry-run, timing micro-batches of one and two rows, predicts the whole set's forward pass,
    gradient and one-vector product at ``B·c + d·U`` (B batches, U tokens), to rounding.
    Scaling the one-row timing by the units instead predicts ``(c + d·u₁)·U/u₁``."""
    import flatcli.run.predict as predict_module

    model, batch = tiny_gpt2(16, 1, rows=rows)
    now = [0.0]
    cost = {"c": 0.0, "d": 0.0}
    loss_sum = Problem.batch_loss_sum

    def charged(self, params, b):
        now[0] += cost["c"] + cost["d"] * self.units(b)
        return loss_sum(self, params, b)

    monkeypatch.setattr(Problem, "batch_loss_sum", charged)
    monkeypatch.setattr(predict_module, "_clock", lambda: now[0])
    g = torch.Generator().manual_seed(rows)
    for block in (1, 2):
        for _ in range(3):
            cost["c"], cost["d"] = torch.rand(2, generator=g, dtype=torch.float64).tolist()
            st = Settings(
                loss="causal_lm", batch_size=batch_size, cache_graphs="false", block_size=block
            )
            times, problem = time_products(model, batch, st)
            B, U = len(problem.batches), problem.local_units
            whole = B * cost["c"] + cost["d"] * U
            for name in ("forward", "grad", "hvp1"):
                assert getattr(times, name) == pytest.approx(whole, rel=1e-9), (name, block)
            assert times.hvp_seconds(1, 1) == pytest.approx(whole, rel=1e-9)
