"""Faults never rewrite finished values: lock files left by killed processes, collect's exit code,
results.csv/json written as a pair that a reader can check."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from flatcli import api
from flatcli.analysis.table import detect_measures
from flatcli.cli import app
from flatcli.locks import create_lock_file
from flatcli.measures import MeasureResult
from flatcli.run.results import Row, json_matches_csv, write_pair
from flatcli.sweep.store import Store
from tests.oracles import runner
from tests.sweep.test_sweep import make_sweep, quiet


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """A finished 2-checkpoint × 2-measure sweep."""
    tmp = tmp_path_factory.mktemp("faults")
    cfg = make_sweep(tmp / "p", n_ckpt=2)
    out = tmp / "s"
    api.sweep(cfg, out, log=quiet)
    return cfg, out


@pytest.mark.parametrize("content", ["", "{", "null", "[]", "{}"])
def test_empty_or_unreadable_lock_is_broken_with_a_reason(swept, tmp_path, content):
    """A lock file that is empty or not a holder's record (a process killed while creating it) is
    broken at once, the reason logged, and its unit computed; none is reported as still running."""
    import shutil

    cfg, done = swept
    out = tmp_path / "s"
    shutil.copytree(done, out)
    unit = sorted((out / "units").glob("*.json"))[0]
    unit.unlink()
    (out / "locks").mkdir(exist_ok=True)
    (out / "locks" / f"{unit.stem}.lock").write_text(content)  # fresh: mtime now
    lines: list[str] = []
    rep = api.sweep(cfg, out, log=lines.append)
    assert (rep.computed, rep.busy, rep.pending) == (1, 0, 0), rep.summary()
    broke = [s for s in lines if s.startswith("broke the lock")]
    assert len(broke) == 1 and unit.stem in broke[0] and "empty or unreadable" in broke[0]
    assert not list((out / "locks").glob("*.lock"))


def test_lock_files_are_created_whole(tmp_path):
    """A reader never sees an empty lock file while many threads race to create it."""
    path = tmp_path / "u.lock"
    seen: list[str] = []
    stop = threading.Event()

    def read():
        while not stop.is_set():
            try:
                seen.append(path.read_text())
            except FileNotFoundError:
                pass

    reader = threading.Thread(target=read)
    reader.start()
    wins = 0
    for i in range(300):
        wins += sum(create_lock_file(path, {"pid": os.getpid(), "n": i}) for _ in range(3))
        path.unlink()
    stop.set()
    reader.join()
    assert wins == 300  # exactly one of three creations wins each round
    assert seen and all(json.loads(s)["pid"] == os.getpid() for s in seen)
    assert not [p for p in tmp_path.iterdir()]  # no temp file left behind


def test_stale_lock_of_a_dead_holder_is_logged(tmp_path):
    import socket
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lines: list[str] = []
    st = Store(tmp_path, log=lines.append)
    st.locks_dir.mkdir(parents=True)
    st.lock_path("a").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid}))
    assert st.claim("a") is not None
    assert lines == [
        f"broke the lock {st.lock_path('a')}: its holder, pid {dead.pid} on "
        f"{socket.gethostname()}, is no longer running"
    ]


def test_collect_exit_code_tells_unfinished_and_failed_units(swept, tmp_path):
    """collect exits 3 when units are not finished and none failed, the failures' code (1, or 2
    for bad input) when one failed, 0 when every unit is ok."""
    import shutil

    cfg, done = swept
    assert api.collect_report(done).exit_code == 0
    out = tmp_path / "s"
    shutil.copytree(done, out)
    units = sorted((out / "units").glob("*.json"))
    units[0].unlink()
    col = api.collect_report(out)
    assert (len(col.missing), col.exit_code) == (1, 3)
    res = runner.invoke(app, ["collect", str(out)])
    assert res.exit_code == 3 and "1 units not finished" in res.output
    rec = json.loads(units[1].read_text())
    rec.update(status="error", error="boom", error_kind="MeasurementError", result=None)
    units[1].write_text(json.dumps(rec))
    assert api.collect_report(out).exit_code == 1  # a failure wins over unfinished units
    rec["error_kind"] = "ConfigError"
    units[1].write_text(json.dumps(rec))
    assert api.collect_report(out).exit_code == 2


def _rows(labels: list[str], k: int) -> list[Row]:
    return [
        Row(
            checkpoint=f"m{i}.pt",
            labels=labels,
            results={lab: MeasureResult(value=float(i + j + k)) for j, lab in enumerate(labels)},
        )
        for i in range(3)
    ]


def test_a_kill_between_the_pair_leaves_the_old_pair_and_a_hand_edit_is_detected(
    tmp_path, monkeypatch
):
    """A kill while the new pair is staged (the JSON not yet written): both files stay old and
    agree (tests/run/test_pair_writes.py walks every step). A CSV replaced by hand beside an old
    JSON is caught by the JSON's hash: correlate infers the measures instead of trusting it."""
    import flatcli.run.results as results

    csv_path = tmp_path / "results.csv"
    write_pair(csv_path, _rows(["a", "b"], 0), {"labels": ["a", "b"]})
    cols = list(_rows(["a", "b"], 0)[0].flat())
    assert detect_measures(cols, csv_path) == (["a", "b"], "results.json")
    real = results.atomic_write

    def killed(path, text):
        if ".json" in str(path):
            raise SystemExit("killed")
        real(path, text)

    monkeypatch.setattr(results, "atomic_write", killed)
    with pytest.raises(SystemExit):
        write_pair(csv_path, _rows(["a", "b", "c"], 1), {"labels": ["a", "b", "c"]})
    monkeypatch.setattr(results, "atomic_write", real)
    old = json.loads((tmp_path / "results.json").read_text())
    assert old["labels"] == ["a", "b"] and json_matches_csv(old, csv_path)
    assert detect_measures(cols, csv_path) == (["a", "b"], "results.json")
    # a CSV written by hand (not through write_pair) beside the old JSON
    new_cols = list(_rows(["a", "b", "c"], 1)[0].flat())
    csv_path.write_text(results.to_csv(_rows(["a", "b", "c"], 1)))
    assert not json_matches_csv(old, csv_path)
    labels, source = detect_measures(new_cols, csv_path)
    assert labels == ["a", "b", "c"]
    assert "results.json ignored: not written with results.csv" in source
    write_pair(csv_path, _rows(["a", "b", "c"], 1), {"labels": ["a", "b", "c"]})
    assert detect_measures(new_cols, csv_path) == (["a", "b", "c"], "results.json")


def test_collect_writes_the_pair(swept):
    """collect's results.json records the sha256 of the results.csv written with it."""
    _, out = swept
    col = api.collect_report(out)
    doc = json.loads(Path(col.json_path).read_text())
    assert "csv_sha256" in doc and json_matches_csv(doc, col.csv_path)
