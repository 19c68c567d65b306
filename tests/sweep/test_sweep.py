"""Sweeps: units, resume, kill -9, concurrent workers, shards, collect == measure."""

from __future__ import annotations

import csv
import io
import json
import multiprocessing
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from flatcli import api
from flatcli.cli import app
from flatcli.errors import ConfigError
from flatcli.sweep.plan import build_plan, load_plan, unit_costs
from flatcli.sweep.runner import worker_slots
from flatcli.sweep.store import Store, parse_shard
from flatcli.sweep.worker import DELAY_ENV
from tests.oracles import runner

MEASURES = ["frobenius_norm", {"hessian_trace": {"max_probes": 8, "min_probes": 4, "tol": 0.5}}]


def make_sweep(tmp: Path, n_ckpt: int = 4, measures=None) -> Path:
    """Tiny MLPs (width 4 or 8) on synthetic data, a manifest with hp columns; returns the config path."""
    from flatcli.demo.models import MLP

    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "ck").mkdir(exist_ok=True)
    rows = []
    for i in range(n_ckpt):
        width, lr = (4, 8)[i % 2], (1, 2)[(i // 2) % 2]
        torch.manual_seed(i)
        m = MLP(6, width, 1, 3)
        torch.save(
            {"state_dict": m.state_dict(), "model_kwargs": {"width": width}},
            tmp / "ck" / f"m{i}.pt",
        )
        rows.append({"path": f"ck/m{i}.pt", "width": width, "lr": lr, "seed": i // 4})
    with open(tmp / "manifest.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    syn = {"source": "synthetic", "num_samples": 24, "input_shape": [6], "num_classes": 3}
    cfg = {
        "model": {
            "target": "flatcli.demo.models:MLP",
            "kwargs": {"in_features": 6, "width": 8, "depth": 1, "num_classes": 3},
        },
        "checkpoints": {"manifest": "manifest.csv"},
        "data": {"train": {**syn, "seed": 0}, "test": {**syn, "seed": 1}},
        "measure_data": {"batch_size": 10},
        "measures": measures if measures is not None else MEASURES,
        "runtime": {"device": "cpu", "precision": "fp64", "seed": 0},
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def table(csv_path: Path) -> list[dict[str, str]]:
    """The CSV rows without wall-time columns (the only thing that differs between runs)."""
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    return [{k: v for k, v in r.items() if not k.endswith("_seconds")} for r in rows]


def quiet(msg: str) -> None:
    pass


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A config and the reference table of an uninterrupted in-process sweep."""
    tmp = tmp_path_factory.mktemp("sweep")
    cfg = make_sweep(tmp / "proj")
    rep = api.sweep(cfg, tmp / "ref", log=quiet)
    assert rep.computed == 8 and rep.pending == 0 and rep.exit_code == 0
    api.collect_report(tmp / "ref")
    return cfg, tmp / "ref" / "results.csv"


def cli(*args: str, env_extra=None, **kw) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "flatcli.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


# ------------------------------------------------------------------ collect == measure, resume
def test_sweep_collect_equals_measure_and_resume_skips(project, tmp_path):
    cfg, ref = project
    m = api.measure(cfg, outdir=tmp_path / "m")
    assert table(ref) == table(tmp_path / "m" / "results.csv")
    with open(ref) as f:
        header = next(csv.reader(f))
    with open(tmp_path / "m" / "results.csv") as f:
        assert next(csv.reader(f)) == header  # same columns, same order
    assert {"hp_width", "hp_lr", "gen_gap", "hessian_trace_stderr"} <= set(header)
    assert m.exit_code == 0
    # rerun: nothing recomputed, unit files untouched
    out = ref.parent
    before = {p.name: p.stat().st_mtime_ns for p in (out / "units").iterdir()}
    rep = api.sweep(cfg, out, log=quiet)
    assert (rep.already_done, rep.computed, rep.pending) == (8, 0, 0)
    assert {p.name: p.stat().st_mtime_ns for p in (out / "units").iterdir()} == before


def test_no_resume_recomputes_and_retry_failed_reruns_error_units(project, tmp_path):
    cfg, ref = project
    out = tmp_path / "s"
    api.sweep(cfg, out, log=quiet)
    assert api.sweep(cfg, out, options=api.SweepOptions(resume=False), log=quiet).computed == 8
    # an error unit is a result: kept on resume, rerun with retry_failed
    p = sorted((out / "units").glob("*.json"))[3]
    rec = json.loads(p.read_text())
    rec.update(status="error", error="boom", measure_error=f"{rec['label']}: boom", result=None)
    p.write_text(json.dumps(rec))
    rep = api.sweep(cfg, out, log=quiet)
    assert (rep.computed, rep.errors, rep.exit_code) == (0, 1, 1)
    api.collect_report(out)
    bad = [r for r in table(out / "results.csv") if r["status"] == "error"]
    assert len(bad) == 1 and bad[0]["error"] == "boom"
    rep = api.sweep(cfg, out, options=api.SweepOptions(retry_failed=True), log=quiet)
    assert (rep.computed, rep.errors, rep.exit_code) == (1, 0, 0)
    api.collect_report(out)
    assert table(out / "results.csv") == table(ref)


def test_unreadable_checkpoint_becomes_error_rows(tmp_path):
    cfg = make_sweep(tmp_path / "p", n_ckpt=2)
    (tmp_path / "p" / "ck" / "m1.pt").write_bytes(b"not a checkpoint")
    rep = api.sweep(cfg, tmp_path / "s", log=quiet)
    assert (rep.computed, rep.errors, rep.exit_code) == (4, 2, 2)
    col = api.collect_report(tmp_path / "s")
    assert [r.status for r in col.rows] == ["ok", "error"]
    assert col.rows[1].error.startswith("checkpoint") and col.rows[1].error_kind == "ConfigError"
    assert col.exit_code == 2  # the same failure gets the same exit code in sweep and collect


def test_changing_one_measure_recomputes_only_its_units(tmp_path):
    cfg = make_sweep(tmp_path / "p", n_ckpt=2)
    out = tmp_path / "s"
    api.sweep(cfg, out, log=quiet)
    d = yaml.safe_load(cfg.read_text())
    d["measures"][1]["hessian_trace"]["max_probes"] = 6
    cfg.write_text(yaml.safe_dump(d))
    rep = api.sweep(cfg, out, log=quiet)
    assert (rep.already_done, rep.computed) == (2, 2)  # frobenius_norm units kept
    col = api.collect_report(out)
    assert col.stale == 2 and not col.missing  # the old hessian_trace units are ignored
    # an option set to its default value resolves to the same unit
    d["measures"][1]["hessian_trace"]["method"] = "auto"
    cfg.write_text(yaml.safe_dump(d))
    assert api.sweep(cfg, out, log=quiet).computed == 0


def test_hparams_from_glob_path_regex_and_checkpoint_keys(tmp_path):
    from flatcli.demo.models import MLP

    (tmp_path / "runs").mkdir()
    for i, wd in enumerate((0.0, 1e-4)):
        torch.manual_seed(i)
        sd = MLP(6, 8, 1, 3).state_dict()
        torch.save(
            {"state_dict": sd, "hparams": {"wd": wd, "note": "x"}},
            tmp_path / "runs" / f"w8_seed{i}.pt",
        )
    cfg = yaml.safe_load(make_sweep(tmp_path / "p", n_ckpt=1).read_text())
    cfg.update(
        checkpoints=[str(tmp_path / "runs" / "*.pt")],
        measures=["frobenius_norm"],
        hparams={"from_path": r"w(?P<width>\d+)_seed(?P<seed>\d+)", "from_keys": ["wd"]},
    )
    (tmp_path / "p" / "glob.yaml").write_text(yaml.safe_dump(cfg))
    api.sweep(tmp_path / "p" / "glob.yaml", tmp_path / "s", log=quiet)
    rows = table(api.collect_report(tmp_path / "s").csv_path)
    assert [(r["hp_width"], r["hp_seed"], r["hp_wd"]) for r in rows] == [
        ("8", "0", "0.0"),
        ("8", "1", "0.0001"),
    ]
    assert "hp_note" not in rows[0]


# ------------------------------------------------------------------ shards
def test_shards_partition_units_exactly_once(project, tmp_path):
    cfg, ref = project
    c = api.load(cfg)
    from flatcli.loading.jobs import resolve_jobs

    plan = build_plan(c, api.select_measures(c, None), resolve_jobs(c))
    ids = [u.id for u in plan.units]
    for n in (1, 2, 3, 5):
        parts = [[u.id for u in plan.units_for((i, n))] for i in range(n)]
        assert sorted(sum(parts, [])) == sorted(ids)  # covered once: no overlap, nothing lost
        # balanced by predicted cost, and the same in a task that reads plan.json
        cost = dict(zip(ids, unit_costs(plan, plan.units), strict=True))
        loads = [sum(cost[u] for u in part) for part in parts]
        assert max(loads) <= sum(cost.values()) / n + max(cost.values()) + 1e-9
        read = load_plan(ref.parent)
        assert [[u.id for u in read.units_for((i, n))] for i in range(n)] == parts
    out = tmp_path / "s"
    got = [
        api.sweep(cfg, out, options=api.SweepOptions(shard=f"{i}/3"), log=quiet) for i in range(3)
    ]
    assert sum(r.computed for r in got) == 8
    assert [r.selected for r in got] == [len(plan.units_for((i, 3))) for i in range(3)]
    api.collect_report(out)
    assert table(out / "results.csv") == table(ref)
    assert parse_shard("2/4") == (2, 4)
    for bad in ("4/4", "1", "a/b", "-1/2"):
        with pytest.raises(ConfigError, match="`shard`"):
            parse_shard(bad)


# ------------------------------------------------------------------ locks
def _claim_many(outdir: str, ids: list[str], q, hold) -> None:
    st = Store(outdir)
    q.put([u for u in ids if st.claim(u) is not None])
    hold.wait(60)  # stay alive: a lock whose holder has exited is stale and may be taken again


def test_locks_are_exclusive_across_processes(tmp_path):
    ids = [f"{i:020x}" for i in range(30)]
    ctx = multiprocessing.get_context("fork")
    q, hold = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_claim_many, args=(str(tmp_path), ids, q, hold)) for _ in range(4)]
    for p in procs:
        p.start()
    won = [q.get(timeout=60) for _ in procs]
    hold.set()
    for p in procs:
        p.join()
    assert sorted(sum(won, [])) == ids  # every lock taken exactly once


def test_stale_locks_expire(tmp_path):
    st = Store(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    st.locks_dir.mkdir(parents=True)
    import socket

    here = socket.gethostname()
    st.lock_path("a").write_text(json.dumps({"host": here, "pid": dead.pid, "time": 0}))
    assert st.claim("a") is not None  # dead holder on this host
    st.lock_path("b").write_text(json.dumps({"host": "elsewhere", "pid": 1, "time": 0}))
    assert st.claim("b", timeout=3600) is None  # fresh heartbeat on another host: respected
    old = time.time() - 100
    os.utime(st.lock_path("b"), (old, old))
    assert st.claim("b", timeout=50) is not None  # no heartbeat for longer than the timeout
    st.lock_path("c").write_text("")
    os.utime(st.lock_path("c"), (old, old))
    assert st.claim("c") is not None  # killed between create and write
    lock = st.claim("d")
    assert st.claim("d") is None  # held by a live process (this one)
    lock.release()
    assert not st.lock_path("d").exists() and st.claim("d") is not None


def test_stale_lock_of_a_finished_unit_is_cleared_on_resume(project, tmp_path):
    """A worker killed between writing its unit file and releasing the lock leaves a lock behind."""
    import socket

    cfg, _ = project
    out = tmp_path / "s"
    api.sweep(cfg, out, log=quiet)
    uid = sorted(p.stem for p in (out / "units").glob("*.json"))[0]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    st = Store(out)
    st.lock_path(uid).write_text(
        json.dumps({"host": socket.gethostname(), "pid": dead.pid, "time": 0})
    )
    other = st.lock_path("f" * 20)  # a live holder's lock is never touched
    other.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time": 0}))
    assert api.sweep(cfg, out, log=quiet).computed == 0
    assert [p.name for p in st.held_locks()] == [other.name]


# ------------------------------------------------------------------ kill -9 and concurrency
def _nonempty(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except FileNotFoundError:  # released meanwhile
        return False


def _wait_for_units(units: Path, k: int, proc: subprocess.Popen, limit: float = 120.0) -> None:
    """Wait until ``k`` units are written and the next unit's lock is held (its info written)."""
    locks = units.parent / "locks"
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if units.is_dir() and len(list(units.glob("*.json"))) >= k and locks.is_dir():
            if any(_nonempty(p) for p in locks.glob("*.lock")):
                return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    pytest.fail("the sweep never wrote its first units")


@pytest.mark.slow
def test_kill_9_mid_sweep_then_resume_equals_uninterrupted(project, tmp_path):
    cfg, ref = project
    out = tmp_path / "s"
    proc = cli("sweep", "-c", str(cfg), "-o", str(out), env_extra={DELAY_ENV: "0.5"})
    _wait_for_units(out / "units", 2, proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    done = len(list((out / "units").glob("*.json")))
    assert 2 <= done < 8
    locks = list((out / "locks").glob("*.lock"))
    assert (
        len(locks) == 1 and json.loads(locks[0].read_text())["pid"] == proc.pid
    )  # the unit in flight
    rep = api.sweep(cfg, out, log=quiet)  # the dead holder's lock is broken at once
    assert (rep.already_done, rep.computed, rep.pending) == (done, 8 - done, 0)
    col = api.collect_report(out)
    assert not col.missing and not col.unreadable
    assert table(out / "results.csv") == table(ref)
    assert not list((out / "locks").glob("*.lock"))


@pytest.mark.slow
def test_concurrent_workers_never_duplicate_or_corrupt(project, tmp_path, monkeypatch, capfd):
    """Two worker processes on one directory; on a (mocked) 2-core machine each runs 1 thread,
    observed inside the workers (every unit file records its worker's torch.get_num_threads())."""
    from flatcli import threads

    cfg, ref = project
    out = tmp_path / "s"
    monkeypatch.setenv(
        DELAY_ENV, "0.5"
    )  # inherited by the workers: each unit lasts long enough for both to start under load
    monkeypatch.delenv(
        "OMP_NUM_THREADS", raising=False
    )  # auto: cores // workers, not the caller's choice
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    monkeypatch.setattr(threads, "machine_load", lambda: 0.5)  # an idle machine: both cores free
    lines: list[str] = []
    rep = api.sweep(
        cfg, out, options=api.SweepOptions(workers=2), log=lines.append
    )  # two worker processes on one directory
    assert (rep.computed, rep.pending, rep.workers) == (8, 0, ["cpu", "cpu"])
    assert rep.threads == "threads: 1 per worker (2 workers on 2 cores; 0.50 busy leaves 2 free)"
    assert rep.threads in lines
    assert {json.loads(p.read_text())["worker"]["threads"] for p in (out / "units").iterdir()} == {
        1
    }
    err = capfd.readouterr().err
    computed = [
        ln.split("] ", 1)[1].rsplit(" ", 2)[0]
        for ln in err.splitlines()
        if ln.startswith("[w") and "] ck/" in ln
    ]
    assert len(computed) == 8 and len(set(computed)) == 8, err  # each unit computed exactly once
    assert {ln[:4] for ln in err.splitlines() if ln.startswith("[w")} == {"[w0]", "[w1]"}
    files = list((out / "units").iterdir())
    assert len(files) == 8 and all(json.loads(p.read_text())["unit"] == p.stem for p in files)
    assert not list((out / "locks").glob("*.lock"))
    col = api.collect_report(out)
    assert len(col.rows) == 4 and not col.missing
    assert table(out / "results.csv") == table(ref)


# ------------------------------------------------------------------ workers, CLI
def test_plan_workers_cpu_and_gpu_flags():
    wps = worker_slots("cpu", None, 3)
    assert [w.device for w in wps] == ["cpu"] * 3
    assert len(worker_slots("cpu", None, None)) == 1
    with pytest.raises(ConfigError, match="`workers`"):
        worker_slots("cpu", None, 0)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            worker_slots("auto", "all", None)
        assert [w.device for w in worker_slots("auto", None, None)] == ["cpu"]


@pytest.mark.gpu
def test_one_worker_per_gpu():
    n = torch.cuda.device_count()
    wps = worker_slots("auto", "all", None)
    assert len(wps) == n and all(w.device == "cuda:0" for w in wps)
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in wps] == [
        (
            os.environ["CUDA_VISIBLE_DEVICES"].split(",")[i]
            if os.environ.get("CUDA_VISIBLE_DEVICES")
            else str(i)
        )
        for i in range(n)
    ]


def test_cli_sweep_dry_run_collect(project, tmp_path):
    cfg, ref = project
    out = tmp_path / "s"
    res = runner.invoke(
        app, ["sweep", "-c", str(cfg), "-o", str(out), "--workers", "2", "--dry-run"]
    )
    assert res.exit_code == 0, res.output
    assert "4 checkpoints × 2 measures = 8 units; 0 finished, 8 to run" in res.output
    assert res.output.count("would run:") == 2 and "--worker 1 --workers 2" in res.output
    would = [ln.split("would run: ", 1)[1] for ln in res.output.splitlines() if "would run:" in ln]
    argv = shlex.split(would[1])  # a command that pastes: the environment, then this Python
    assert argv[0].startswith("OMP_NUM_THREADS=") and argv[1] == sys.executable, would
    assert argv[2:6] == ["-m", "flatcli", "sweep-worker", str(out)]
    assert not out.exists()  # a dry run writes nothing
    res = runner.invoke(app, ["sweep", "-c", str(cfg), "-o", str(out), "--shard", "0/2"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["collect", str(out), "-o", str(tmp_path / "part")])
    assert res.exit_code == 3 and "units not finished" in res.output  # incomplete
    part = table(tmp_path / "part" / "results.csv")
    assert (
        all(r["status"] in ("ok", "incomplete") for r in part)
        and (tmp_path / "part" / "results.json").is_file()
    )
    res = runner.invoke(app, ["sweep", "-c", str(cfg), "-o", str(out), "--shard", "2/2"])
    assert res.exit_code == 2 and "--shard" in res.output
    res = runner.invoke(app, ["collect", str(tmp_path / "nothing")])
    assert res.exit_code == 2


def test_collect_output_is_a_folder_like_every_command(project, tmp_path):
    """``collect -o FOLDER`` writes FOLDER/results.csv and results.json, as ``measure -o`` does, without
    a warning; the old form (a path ending in .csv, or an existing file) still writes that file, with
    one deprecation line on stderr naming the new form; a folder named ``x.csv`` is a folder."""
    import warnings

    _, ref = project
    sweep_dir = ref.parent
    for folder in (tmp_path / "new", tmp_path / "made.csv"):
        if folder.suffix:
            folder.mkdir()  # an existing folder is a folder, whatever its name
        res = runner.invoke(app, ["collect", str(sweep_dir), "-o", str(folder)])
        assert res.exit_code == 0, res.output
        assert "deprecated" not in res.output
        assert table(folder / "results.csv") == table(ref)
        assert json.loads((folder / "results.json").read_text())["labels"] == [
            "frobenius_norm",
            "hessian_trace",
        ]
    existing = tmp_path / "table.txt"
    existing.write_text("")
    for old in (tmp_path / "old.csv", existing):
        res = runner.invoke(app, ["collect", str(sweep_dir), "-o", str(old)])
        assert res.exit_code == 0, res.output
        said = [ln for ln in res.stderr.splitlines() if "deprecated" in ln]
        assert len(said) == 1 and said[0].startswith("warning:"), res.stderr
        assert str(old) in said[0] and "-o FOLDER" in said[0] and "results.csv" in said[0]
        assert table(old) == table(ref) and old.with_suffix(".json").is_file()
    with pytest.warns(FutureWarning, match="collect OUTDIR -o FOLDER"):
        col = api.collect_report(sweep_dir, tmp_path / "api.csv")
    assert col.csv_path == tmp_path / "api.csv"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        col = api.collect_report(sweep_dir, tmp_path / "api")
    assert col.csv_path == tmp_path / "api" / "results.csv" and col.json_path.is_file()


def test_plan_is_what_workers_read(project):
    cfg, ref = project
    plan = load_plan(ref.parent)
    assert plan.labels == ["frobenius_norm", "hessian_trace"] and len(plan.checkpoints) == 4
    assert [c["hparams"] for c in plan.checkpoints][1] == {"width": 8, "lr": 1, "seed": 0}
    assert plan.cfg().to_dict() == api.load(cfg).to_dict()
    rows = list(csv.DictReader(io.StringIO(ref.read_text())))
    assert [r["checkpoint"] for r in rows] == [c["checkpoint"] for c in plan.checkpoints]


def test_collect_without_a_plan_rebuilds_rows_from_the_unit_files(project, tmp_path):
    """A sweep folder that lost plan.json: rows, labels and hyperparameters come from the unit
    records, in the plan's order, so the table is the same; a unit without its file is missing."""
    cfg, ref = project
    out = tmp_path / "s"
    (out / "units").mkdir(parents=True)
    units = sorted((ref.parent / "units").glob("*.json"))
    for p in units:
        (out / "units" / p.name).write_bytes(p.read_bytes())
    col = api.collect_report(out)
    assert table(col.csv_path) == table(ref)
    assert (
        col.labels == ["frobenius_norm", "hessian_trace"] and col.missing == [] and col.stale == 0
    )
    gone = json.loads(units[0].read_text())
    (out / "units" / units[0].name).unlink()
    col = api.collect_report(out)
    assert col.missing == [(gone["checkpoint"], gone["label"])]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="holds no plan.json and no unit files"):
        api.collect_report(empty)


def test_each_sweep_counts_what_it_computed_itself(project, tmp_path):
    """Two sweeps sharing a folder: while this one runs, another process finishes one unit and holds
    the lock of another. This run reports only what its own workers computed, and names the rest
    (the issue's "20 units computed" for 10 each came from counting every unit finished since start)."""
    import copy
    import socket

    cfg, ref = project
    out = tmp_path / "s"
    seen: list[dict] = []

    def other_sweep(rec):  # on this run's first unit: the other process finishes one, starts one
        seen.append(rec)
        if len(seen) > 1:
            return
        units = [u for u in load_plan(out).units if u.id != rec["unit"]]
        theirs = copy.deepcopy(rec) | {"unit": units[-1].id, "sweep_id": "another-sweep"}
        Store(out).write_unit(theirs)
        (out / "locks").mkdir(exist_ok=True)
        live = {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time(), "token": "x"}
        (out / "locks" / f"{units[-2].id}.lock").write_text(json.dumps(live))

    rep = api.sweep(cfg, out, log=quiet, on_unit=other_sweep)
    assert (rep.computed, rep.by_others, rep.busy, rep.pending) == (6, 1, 1, 0)
    assert len(seen) == 6
    assert rep.summary().startswith(
        "8 units: 0 finished before, 6 computed, 1 finished by another process meanwhile, "
        "1 still running in another process, 0 not finished; 0 with errors"
    )
