"""``runtime.cache_graphs``: the run keeps its gradient graphs as set, or (``auto``) when the
predicted peak with them fits in `flatcli.run.memory.GRAPH_FRACTION` of the free memory; the
values never depend on it (it is not in the result key)."""

from __future__ import annotations

import logging

import pytest

from flatcli.config import parse_measures
from flatcli.engine import CurvatureEngine, Problem
from flatcli.keys import NOT_IN_KEY
from flatcli.run import memory
from flatcli.run.measuring import measure_model, problem_dims
from flatcli.run.settings import Settings
from tests.run.test_memory_counts import tiny_gpt2

SPECS = [
    {"hessian_lambda_max": {"min_steps": 6, "max_steps": 6, "tol": 1e-12}},
    {"hessian_trace": {"min_probes": 8, "max_probes": 8}},
    {"hessian_spectrum": {}},
]


@pytest.mark.parametrize("layers", [1, 2])
def test_values_are_identical_with_and_without_kept_graphs_in_float64(monkeypatch, layers):
    """λmax, a trace and the spectrum over two batches, float64: the same numbers to the bit."""
    model, batch = tiny_gpt2(16, layers, rows=8)
    states = {}
    build = CurvatureEngine.__init__

    def seen(self, *a, **kw):
        build(self, *a, **kw)
        states.setdefault(kw.get("cache_graphs"), self)

    monkeypatch.setattr(CurvatureEngine, "__init__", seen)
    rows = {
        flag: measure_model(
            model,
            batch,
            SPECS,
            loss="causal_lm",
            batch_size=4,
            precision="fp64",
            cache_graphs=flag,
        )
        for flag in ("true", "false")
    }
    assert set(states) == {True, False}
    assert states[False].state.graphs.state == "off" and states[True].state.graphs.entries
    a, b = rows["true"].results, rows["false"].results
    assert all(r.status != "error" for r in a.values())
    assert {k: (r.value, r.status) for k, r in a.items()} == {
        k: (r.value, r.status) for k, r in b.items()
    }
    assert "runtime.cache_graphs" in NOT_IN_KEY


def _choice(monkeypatch, free: int, setting: str = "auto"):
    model, batch = tiny_gpt2(16, 1, rows=8)
    st = Settings(loss="causal_lm", batch_size=2, cache_graphs=setting)
    p = Problem(model, batch, loss="causal_lm", batch_size=2)
    monkeypatch.setattr(memory, "free_bytes", lambda device: free)
    specs = parse_measures(SPECS[:2])
    dims = problem_dims(model, batch, st)
    need = memory.product_bytes(p, st, keep=True).total
    return memory.graph_choice(p, specs, dims, st), need, p


def test_auto_keeps_the_graphs_only_when_their_peak_fits_the_stated_share(monkeypatch):
    """Four batches: free memory just above / below the predicted peak over GRAPH_FRACTION."""
    (keep, why), need, p = _choice(monkeypatch, 10**12)
    assert keep and "kept" in why and len(p.batches) == 4
    # the graphs of 3 other batches are in the need: dropping them is what auto trades
    assert (
        memory.product_bytes(p, Settings(loss="causal_lm", batch_size=2), keep=False).total < need
    )
    (keep, why), _, _ = _choice(monkeypatch, int(need / memory.GRAPH_FRACTION * 0.9))
    assert not keep and "not kept" in why and "runtime.cache_graphs: auto" in why
    (keep, why), _, _ = _choice(monkeypatch, 1, setting="true")
    assert keep and why == "runtime.cache_graphs: true"


def test_the_run_logs_its_choice(monkeypatch, caplog):
    model, batch = tiny_gpt2(16, 1, rows=8)
    with caplog.at_level(logging.INFO, logger="flatcli"):
        measure_model(model, batch, SPECS[:1], loss="causal_lm", batch_size=2)
    assert any("gradient graphs kept" in r.getMessage() for r in caplog.records)
