"""`measure -o`: a failed write never turns finished values into errors, and one run holds its
output folder."""

from __future__ import annotations

import errno
import importlib
import json
import logging
import os
import socket
import subprocess
import sys

import pytest

from flatcli import api
from flatcli.cli import app
from flatcli.errors import ConfigError
from flatcli.locks import OUTDIR_LOCK, hold_folder
from tests.helpers import cli_output, write_project
from tests.oracles import runner

api_measure = importlib.import_module("flatcli.api.measure")  # the module, not the function
MEASURES = ["frobenius_norm", "spectral_norm"]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wf")
    cfg = write_project(tmp, n_ckpt=4, measures=MEASURES)
    ref = api.measure(cfg, outdir=tmp / "ref")
    assert ref.exit_code == 0
    return cfg, {r.checkpoint: {k: v.value for k, v in r.results.items()} for r in ref.rows}


def _failing_after(monkeypatch, k: int, err: int):
    """`write_results` of measure's saver works ``k`` times, then fails with ``err``."""
    real, calls = api_measure.write_results, []

    def write(*a, **kw):
        calls.append(1)
        if len(calls) > k:
            raise OSError(err, os.strerror(err))
        return real(*a, **kw)

    monkeypatch.setattr(api_measure, "write_results", write)


@pytest.mark.parametrize("k", [0, 1, 3, 6])
@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS])
def test_a_failed_write_keeps_every_finished_value(project, tmp_path, monkeypatch, k, err):
    """The write after the (k+1)-th finished measure fails: the run stops with exit code 1 and one
    message naming the folder and the error; the k+1 finished measures keep their status and
    value, the rest are `interrupted`, never `error`."""
    cfg, ref = project
    _failing_after(monkeypatch, k, err)
    out = tmp_path / "out"
    rep = api.measure(cfg, outdir=out)
    assert rep.exit_code == 1
    assert rep.write_error.startswith(
        f"could not write {out} ({os.strerror(err)}); the run stopped"
    )
    assert f"{k + 1} finished measure(s)" in rep.write_error
    doc = json.loads((rep.written_to / "results.json").read_text())
    got = [(r["checkpoint"], lab, m) for r in doc["rows"] for lab, m in r["measures"].items()]
    assert [m["status"] for _, _, m in got] == ["ok"] * (k + 1) + ["interrupted"] * (7 - k)
    assert all(r["status"] in ("ok", "interrupted") and not r["error"] for r in doc["rows"])
    for c, lab, m in got[: k + 1]:
        assert m["value"] == ref[c][lab]


def test_the_cli_names_a_stopped_run_once(project, tmp_path, monkeypatch):
    cfg, _ = project
    _failing_after(monkeypatch, 2, errno.ENOSPC)
    res = runner.invoke(app, ["measure", "-c", str(cfg), "-o", str(tmp_path / "o")])
    try:
        text = res.stderr  # the runner keeps stderr apart
    except ValueError:
        text = res.output
    assert res.exit_code == 1
    assert text.count("error:") == 1 and "No space left on device" in text, text


def test_a_second_run_into_a_held_folder_is_refused(project, tmp_path):
    """While a run holds OUTDIR, another is refused with exit code 2 naming the holder."""
    cfg, _ = project
    out = tmp_path / "out"
    out.mkdir()
    with hold_folder(out):
        with pytest.raises(ConfigError) as e:
            api.measure(cfg, outdir=out)
        assert e.value.exit_code == 2
        msg = str(e.value)
        assert f"output directory {out} is in use by another flatcli run" in msg
        assert f"pid {os.getpid()} on {socket.gethostname()}, started 20" in msg
        assert not (out / "results.csv").exists()
        res = runner.invoke(app, ["measure", "-c", str(cfg), "-o", str(out)])
        assert res.exit_code == 2 and "is in use by another flatcli run" in cli_output(res)
    assert api.measure(cfg, outdir=out).exit_code == 0  # released
    assert not (out / OUTDIR_LOCK).exists()


@pytest.mark.parametrize("kind", ["dead", "empty"])
def test_a_stale_measure_lock_is_broken_with_a_reason(project, tmp_path, caplog, kind):
    cfg, _ = project
    out = tmp_path / "out"
    out.mkdir()
    if kind == "dead":
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        info = {"host": socket.gethostname(), "pid": dead.pid, "time": 0}
        (out / OUTDIR_LOCK).write_text(json.dumps(info))
        why = f"its holder, pid {dead.pid} on {socket.gethostname()}, is no longer running"
    else:
        (out / OUTDIR_LOCK).write_text("")
        why = "the lock file is empty or unreadable"
    with caplog.at_level(logging.WARNING, logger="flatcli"):
        assert api.measure(cfg, outdir=out).exit_code == 0
    assert any(
        r.getMessage().startswith(f"broke the lock {out / OUTDIR_LOCK}: {why}")
        for r in caplog.records
    ), caplog.records
