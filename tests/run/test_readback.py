"""Readers that survive any bytes: every file flatcli reads back from its folders (unit files, unit
locks, measure.lock, results.json, plan.json) goes through one tolerant reader
(flatcli.readback). Random bytes, non-UTF-8 text, truncations and deep nesting never end a
command with exit 1 or a traceback; a bad unit file is named once, kept beside as ``.bad`` and
recomputed; temp files of killed writers are removed by the next run."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from flatcli import api
from flatcli.cli import app
from flatcli.readback import MAX_DEPTH, Unreadable, parse_json, read_json
from flatcli.sweep.plan import load_plan
from flatcli.sweep.store import Store, check_unit
from flatcli.tempfiles import clean_orphans, temp_prefix
from tests.helpers import cli_output, write_project
from tests.oracles import runner


def corpus(good: bytes, seed: int = 0) -> dict[str, bytes]:
    """Bad contents for a file whose good content is ``good``: random bytes, non-UTF-8, cuts,
    deep nesting, valid JSON of the wrong shape."""
    rng = np.random.default_rng(seed)
    cut = int(rng.integers(1, len(good)))
    return {
        "random": rng.integers(0, 256, 300, dtype=np.uint8).tobytes(),
        "latin1": good.replace(b'"', b'"\xe9', 1),
        "bom_utf16": "{}".encode("utf-16"),
        "truncated": good[:cut],
        "truncated_half": good[: len(good) // 2],
        "deep_list": b"[" * 200_000 + b"]" * 200_000,
        "deep_open": b'{"a":' * 100_000,
        "deep_mixed": b"[{" * 50_000,
        "empty": b"",
        "nul": b"\x00" * 64,
        "null": b"null",
        "number": b"1e999999",
        "wrong_shape": b'{"rows": 5, "units": "x"}',
    }


@pytest.mark.parametrize("seed", range(30))
def test_the_reader_returns_data_or_unreadable_for_any_bytes(seed, tmp_path):
    rng = np.random.default_rng(seed)
    good = json.dumps({"a": [1, 2.5, {"b": "c[\\"}], "n": None}).encode()
    cases = list(corpus(good, seed).values())
    cases += [rng.integers(0, 256, int(rng.integers(1, 5000)), dtype=np.uint8).tobytes()]
    cases += [good[: int(rng.integers(0, len(good)))]]
    depth = int(rng.integers(1, 3 * MAX_DEPTH))
    cases += [b"[" * depth + b"]" * depth]
    for data in cases:
        p = tmp_path / "f.json"
        p.write_bytes(data)
        try:
            value = read_json(p)
        except Unreadable as e:
            assert e.why and "\n" not in e.why
            continue
        assert value == json.loads(data)  # what it returns is what the bytes hold
    # depth: exactly at the limit reads, one more is refused; brackets inside strings don't count
    assert parse_json("[" * MAX_DEPTH + "]" * MAX_DEPTH) is not None
    with pytest.raises(Unreadable, match="nested deeper"):
        parse_json("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1))
    text = json.dumps(["[" * 500, '\\"[' * 100, {"k": "{" * 300}])
    assert parse_json(text) == json.loads(text)
    with pytest.raises(Unreadable, match="larger than"):
        read_json(
            p.with_name("big.json") if p.with_name("big.json").write_bytes(b"[1]" * 100) else p, 10
        )


# ------------------------------------------------------------------ every file kind, end to end
@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("readback")
    cfg = write_project(tmp / "p", measures=["frobenius_norm"], n_ckpt=1)
    out = tmp / "s"
    assert api.sweep(cfg, out, log=None).computed == 1
    return cfg, out


def _fresh(swept, tmp_path):
    cfg, done = swept
    out = tmp_path / "s"
    shutil.copytree(done, out)
    (unit,) = sorted((out / "units").glob("*.json"))
    return cfg, out, unit


def _no_crash(res) -> str:
    text = cli_output(res)
    assert res.exit_code not in (1,) and "Traceback" not in text, text[-2000:]
    return text


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(corpus(b'{"x": 1}')))
def test_a_bad_unit_file_is_named_once_kept_and_recomputed(swept, tmp_path, kind):
    cfg, out, unit = _fresh(swept, tmp_path)
    good = unit.read_bytes()
    bad = corpus(good)[kind]
    unit.write_bytes(bad)
    res = runner.invoke(app, ["collect", str(out)])
    text = _no_crash(res)
    assert res.exit_code == 3 and str(unit) in text, text  # not finished: the unit is missing
    lines: list[str] = []
    rep = api.sweep(cfg, out, log=lines.append)
    assert (rep.computed, rep.exit_code) == (1, 0), rep.summary()
    named = [line for line in lines if str(unit) in line]
    assert len(named) == 1 and "kept beside it as" in named[0], lines
    assert unit.with_name(unit.name + ".bad").read_bytes() == bad  # set aside, not deleted
    assert check_unit(json.loads(unit.read_text()), unit.stem) is None
    res = runner.invoke(app, ["collect", str(out)])
    assert res.exit_code == 0, cli_output(res)


def test_a_unit_with_status_ok_and_no_result_fails_the_schema(swept, tmp_path):
    cfg, out, unit = _fresh(swept, tmp_path)
    rec = json.loads(unit.read_text())
    assert check_unit(rec, unit.stem) is None
    unit.write_text(json.dumps({**rec, "result": None}))
    assert "result is null" in check_unit({**rec, "result": None}, unit.stem)
    assert Store(out, warn=None).read_unit(unit.stem) is None
    failed = {**rec, "status": "error", "result": None, "error": "boom", "error_kind": "X"}
    assert check_unit(failed, unit.stem) is None  # a failed unit has no result


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["random", "latin1", "deep_list", "deep_open", "truncated", "nul"])
def test_bad_lock_files_are_broken_and_the_unit_computed(swept, tmp_path, kind):
    cfg, out, unit = _fresh(swept, tmp_path)
    unit.unlink()
    (out / "locks").mkdir(exist_ok=True)
    lock = out / "locks" / f"{unit.stem}.lock"
    lock.write_bytes(corpus(json.dumps({"host": "h", "pid": 1, "time": 1.0}).encode())[kind])
    lines: list[str] = []
    rep = api.sweep(cfg, out, log=lines.append)
    assert (rep.computed, rep.busy, rep.exit_code) == (1, 0, 0), rep.summary()
    assert any(line.startswith("broke the lock") and "unreadable" in line for line in lines)
    assert not lock.exists()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["random", "latin1", "deep_list", "deep_mixed", "truncated"])
def test_bad_measure_lock_results_and_plan_never_crash(swept, tmp_path, kind):
    cfg, out, _ = _fresh(swept, tmp_path)
    # plan.json: collect goes on from the unit files, naming it; a sweep rewrites it
    good_plan = (out / "plan.json").read_bytes()
    (out / "plan.json").write_bytes(corpus(good_plan)[kind])
    res = runner.invoke(app, ["collect", str(out)])
    text = _no_crash(res)
    assert res.exit_code == 0 and str(out / "plan.json") in text, text
    assert api.sweep(cfg, out, log=None).exit_code == 0
    assert load_plan(out).units
    # measure.lock and results.json of `measure -o`
    mo = tmp_path / "m"
    assert runner.invoke(app, ["measure", "-c", str(cfg), "-o", str(mo)]).exit_code == 0
    good_results = (mo / "results.json").read_bytes()
    (mo / "measure.lock").write_bytes(corpus(b'{"pid": 1}')[kind])
    (mo / "results.json").write_bytes(corpus(good_results)[kind])
    res = runner.invoke(app, ["measure", "-c", str(cfg), "-o", str(mo), "--resume"])
    text = _no_crash(res)
    assert res.exit_code == 0, text
    assert f"{mo / 'results.json'} is unreadable" in " ".join(text.split()), text
    assert (mo / "results.prev.json").read_bytes() == corpus(good_results)[kind]
    assert not (mo / "measure.lock").exists()
    # correlate beside an unreadable results.json: the CSV alone
    (mo / "results.json").write_bytes(corpus(good_results)[kind])
    res = runner.invoke(app, ["correlate", str(mo / "results.csv"), "-m", "frobenius_norm"])
    _no_crash(res)


def test_temp_files_of_killed_writers_are_removed_by_the_next_run(swept, tmp_path):
    cfg, out, unit = _fresh(swept, tmp_path)
    dead = 2**22 + 12345  # above pid_max on this machine's defaults: no such process
    while True:
        try:
            os.kill(dead, 0)
            dead += 1
        except ProcessLookupError:
            break
        except PermissionError:
            dead += 1
    mine = temp_prefix(unit)
    host = mine.rsplit("@", 1)[1]
    orphans = [
        out / "units" / f".{unit.name}.pid{dead}@{host}abc_12.tmp",
        out / f".plan.json.pid{dead}@{host}xyz.tmp",
        out / "locks" / f".{unit.stem}.lock.pid{dead}@{host}{'0' * 32}.new",
        out / "locks" / f".{unit.stem}.lock.pid{dead}@{host}{'1' * 32}.stale",
        out / "tokenized" / f".lm-0123.pt.pid{dead}@{host}k2_x.tmp",
    ]
    (out / "locks").mkdir(exist_ok=True)
    (out / "tokenized").mkdir(exist_ok=True)
    live = out / "units" / f"{mine}live.tmp"  # this process: a write in flight
    other = out / "units" / f".{unit.name}.pid{dead}@otherhost.example.org.abc.tmp"  # fresh
    for p in [*orphans, live, other]:
        p.write_text("partial")
    api.sweep(cfg, out, log=None)
    assert [p for p in orphans if p.exists()] == []
    assert live.exists() and other.exists()
    old = os.stat(other).st_mtime - 7200
    os.utime(other, (old, old))
    assert clean_orphans(out / "units") == [other]
    m = tmp_path / "m"
    m.mkdir()
    orphan = m / f".results.csv.pid{dead}@{host}q1.tmp"
    orphan.write_text("x")
    assert runner.invoke(app, ["measure", "-c", str(cfg), "-o", str(m)]).exit_code == 0
    assert not orphan.exists()
