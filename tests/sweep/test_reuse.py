"""A sweep worker loads each checkpoint and computes its train/test metrics once, however many
measures (units) it has, and the unit files are the same as with a fresh load per unit."""

from __future__ import annotations

import json

import pytest

import flatcli.loading.load as loading
import flatcli.run.kept as reuse
import flatcli.run.measuring as pipeline
from flatcli import api

from .test_sweep import make_sweep, quiet

MEASURES = [
    "frobenius_norm",
    "spectral_norm",
    {"hessian_trace": {"max_probes": 8, "min_probes": 4, "tol": 0.5}},
    {"hessian_lambda_max": {"tol": 0.1}},
]


def _units(out) -> dict[str, dict]:
    """Unit id → its record without the wall times and run ids (what differs between runs)."""
    recs = {}
    for p in sorted((out / "units").rglob("*.json")):
        r = json.loads(p.read_text())
        for k in ("sweep_id", "finished_at", "seconds", "worker"):
            r.pop(k)
        r["result"].pop("seconds")
        recs[r["unit"]] = r
    return recs


class _Fresh(reuse.CheckpointCache):
    """The behaviour without reuse: every unit loads its checkpoint and computes its metrics."""

    def model(self, cfg, job):
        if self.metrics is not None:  # the previous unit finished: load and evaluate afresh
            self._key = None
        return super().model(cfg, job)


@pytest.mark.slow
def test_each_checkpoint_is_loaded_and_evaluated_once_with_the_same_units(tmp_path, monkeypatch):
    cfg = make_sweep(tmp_path / "p", n_ckpt=3, measures=MEASURES)
    calls = {"load": 0, "metrics": 0}
    real_load, real_metrics = pipeline.load_model, pipeline._metrics

    def load(*a, **k):
        calls["load"] += 1
        return real_load(*a, **k)

    def metrics(*a, **k):
        calls["metrics"] += 1
        return real_metrics(*a, **k)

    monkeypatch.setattr(pipeline, "load_model", load)
    monkeypatch.setattr(loading, "load_model", load)  # the worker's cache loads through it
    monkeypatch.setattr(pipeline, "_metrics", metrics)
    rep = api.sweep(cfg, tmp_path / "kept", log=quiet)
    assert rep.computed == 12 and rep.errors == 0
    # one load for the data-loading check of the first checkpoint, then one per checkpoint
    assert calls == {"load": 1 + 3, "metrics": 3}

    monkeypatch.setattr(reuse, "CheckpointCache", _Fresh)
    calls.update(load=0, metrics=0)
    api.sweep(cfg, tmp_path / "fresh", log=quiet)
    assert calls == {"load": 1 + 12, "metrics": 12}

    kept, fresh = _units(tmp_path / "kept"), _units(tmp_path / "fresh")
    assert kept.keys() == fresh.keys() and len(kept) == 12
    assert kept == fresh  # values, diagnostics, metrics and keys identical


def test_another_checkpoint_replaces_the_kept_one(tmp_path):
    from flatcli.api import load
    from flatcli.loading.jobs import resolve_jobs

    cfg = load(make_sweep(tmp_path, n_ckpt=2, measures=MEASURES[:1]))
    a, b = resolve_jobs(cfg)
    keep = reuse.CheckpointCache()
    ma, _ = keep.model(cfg, a)
    keep.metrics = {"train_loss": 1.0}
    assert keep.model(cfg, a)[0] is ma and keep.metrics == {"train_loss": 1.0}
    mb, _ = keep.model(cfg, b)
    assert mb is not ma and keep.metrics is None


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])
