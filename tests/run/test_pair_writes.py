"""results.csv and results.json are written as one unit: a kill at any step of `write_pair`
leaves, once a reader has looked (`settle_pair`), both files old or both new, never a mixed pair."""

from __future__ import annotations

import json
import os

import pytest

from flatcli.analysis.table import load_results
from flatcli.measures import MeasureResult
from flatcli.run import results as R


class Killed(BaseException):
    """What a SIGKILL looks like to the code under test: nothing after it runs."""


def _rows(value: float) -> list[R.Row]:
    row = R.Row(checkpoint="m.pt", labels=["frobenius_norm"], hparams={})
    row.results["frobenius_norm"] = MeasureResult(value=value)
    row.metrics.update(train_loss=0.1)
    return [row]


def _pair(folder):
    csv = (folder / "results.csv").read_text()
    doc = json.loads((folder / "results.json").read_text())
    return csv, doc["rows"][0]["measures"]["frobenius_norm"]["value"]


def _write_killed_at(monkeypatch, folder, value: float, step: int) -> bool:
    """Write the pair for ``value``, killed at the ``step``-th file operation (os.replace or
    unlink); True when the write ran to its end."""
    calls = [0]
    real_replace, real_unlink = os.replace, os.unlink

    def counted(real):
        def op(*a, **k):
            calls[0] += 1
            if calls[0] == step:
                raise Killed
            return real(*a, **k)

        return op

    monkeypatch.setattr(os, "replace", counted(real_replace))
    monkeypatch.setattr(os, "unlink", counted(real_unlink))
    monkeypatch.setattr(R.Path, "unlink", lambda self, missing_ok=False: os.unlink(self))
    try:
        R.write_results(folder, _rows(value), {"config": {}})
        return True
    except Killed:
        return False
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("step", range(1, 12))
def test_a_kill_at_any_step_leaves_both_old_or_both_new(tmp_path, monkeypatch, step):
    R.write_results(tmp_path, _rows(1.0), {"config": {}})
    old = _pair(tmp_path)
    finished = _write_killed_at(monkeypatch, tmp_path, 2.0, step)
    R.settle_pair(tmp_path / "results.csv")  # what every reader does first
    got = _pair(tmp_path)
    assert got[1] in (1.0, 2.0)
    assert got == old or (got[1] == 2.0 and "2.0" in got[0] and "1.0" not in got[0])
    if finished:
        assert got[1] == 2.0
    # and the next write always lands, whatever was left behind
    R.write_results(tmp_path, _rows(3.0), {"config": {}})
    assert _pair(tmp_path)[1] == 3.0 and R.json_matches_csv(
        json.loads((tmp_path / "results.json").read_text()), tmp_path / "results.csv"
    )


def test_a_reader_finishes_a_committed_write(tmp_path, monkeypatch):
    """Killed after the commit marker, before the files moved: load_results rolls forward."""
    R.write_results(tmp_path, _rows(1.0), {"config": {}})
    # the 3 atomic writes (CSV, JSON, marker) take one os.replace each: step 4 is the first move
    assert not _write_killed_at(monkeypatch, tmp_path, 2.0, 4)
    assert (
        json.loads((tmp_path / "results.json").read_text())["rows"][0]["measures"][
            "frobenius_norm"
        ]["value"]
        == 1.0
    )  # nothing moved yet
    table = load_results(tmp_path / "results.csv")
    assert float(table.frame["frobenius_norm"].iloc[0]) == 2.0
    assert _pair(tmp_path)[1] == 2.0
