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
