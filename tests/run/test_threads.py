"""Intra-op threads: the choice (flatcli.threads), the sweep's workers, the --threads flag. The
issue's case (a sweep of 2 worker processes on a 2-core machine runs 1 thread each, observed
inside the workers) is test_sweep.py::test_concurrent_workers_never_duplicate_or_corrupt."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from flatcli import api, threads
from flatcli.cli import app
from flatcli.errors import ConfigError
from flatcli.jobs import resolve_jobs
from flatcli.sweep.plan import build_plan, load_plan, write_plan
from flatcli.sweep.runner import plan_workers
from flatcli.sweep.worker import run_worker_process
from flatcli.threads import choose_threads, plan_threads
from tests.helpers import write_project

runner = CliRunner()
REAL_MACHINE_LOAD = threads.machine_load  # before the autouse fixture replaces it


@pytest.fixture(autouse=True)
def _restore_threads(monkeypatch):
    """No OMP_NUM_THREADS or LOCAL_WORLD_SIZE from the caller; torch's thread count restored."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("FLATCLI_THREADS", raising=False)
    monkeypatch.setattr(
        threads, "machine_load", lambda: 0.0
    )  # an idle machine unless a test says otherwise
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


@pytest.mark.parametrize(
    "workers, cores, expected", [(1, 2, 2), (2, 2, 1), (3, 2, 1), (3, 16, 5), (4, 16, 4)]
)
def test_auto_divides_the_cores_among_the_workers(workers, cores, expected):
    assert choose_threads("auto", workers, cores) == expected
    assert choose_threads(None, workers, cores) == expected


def test_requested_counts_win_then_omp_num_threads_then_local_world_size(monkeypatch):
    assert choose_threads(3, workers=4, cores=2) == 3  # an explicit request is taken as is
    assert choose_threads("3", workers=4, cores=2) == 3  # as text, e.g. from FLATCLI_THREADS
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert (
        choose_threads("auto", workers=1, cores=16) == 2
    )  # the user's OMP_NUM_THREADS, for auto only
    assert choose_threads(5, workers=1, cores=16) == 5
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun: 4 ranks on this machine
    assert choose_threads("auto", cores=16) == 4
    assert choose_threads("auto", workers=2, cores=16) == 8  # explicit workers win
    assert (
        str(plan_threads("auto", cores=16))
        == "threads: 4 per worker (4 workers on 16 cores; load 0.00 leaves 16 free)"
    )
    for bad in (0, -1, "many", 1.5, True):
        with pytest.raises(ConfigError, match="must be an int ≥ 1 or auto"):
            choose_threads(bad, 1, 2)


@pytest.mark.parametrize(
    "cores, load, workers, expected",
    [
        (2, 8.0, 1, 1),  # the machine: 2 cores at load ≈ 8 -> one thread, not two
        (2, 0.1, 1, 2),  # idle: every core (this process counts in the load for at most itself)
        (2, 1.0, 1, 2),  # the load is this process alone
        (2, 2.0, 1, 1),  # one other busy task: one core left (and this process)
        (16, 6.0, 1, 11),  # 16 − 6 + 1
        (16, 6.0, 2, 5),  # the free cores divided among the workers
        (16, 40.0, 4, 1),
    ],
)
def test_auto_counts_the_free_cores_from_affinity_and_load(
    monkeypatch, cores, load, workers, expected
):
    monkeypatch.setattr(
        threads.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False
    )
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (load, load, load), raising=False)
    monkeypatch.setattr(threads, "machine_load", REAL_MACHINE_LOAD)
    choice = plan_threads("auto", workers)
    assert choice.n == expected and choice.cores == cores and choice.load == load
    assert f"on {cores} cores; load {load:.2f} leaves {choice.free} free" in str(choice)
    monkeypatch.setenv(
        "OMP_NUM_THREADS", "3"
    )  # the user's explicit choice is kept whatever the load
    assert plan_threads("auto", workers).n == 3


def test_config_key_env_and_hash():
    from flatcli.config import from_dict

    assert from_dict({}).runtime.threads == "auto"
    cfg = from_dict({"runtime": {"threads": 2}}, env={"FLATCLI_THREADS": "3"})
    assert cfg.runtime.threads == 3 and cfg.provenance["runtime.threads"] == "env FLATCLI_THREADS"
    assert cfg.hash() == from_dict({}).hash()  # how fast, not what: units are not recomputed
    with pytest.raises(ConfigError, match="'runtime.threads' must be an int ≥ 1 or auto; got 0"):
        from_dict({"runtime": {"threads": 0}})


def test_workers_share_the_cores(monkeypatch):
    monkeypatch.setattr(threads, "available_cores", lambda: 8)
    wps = plan_workers("cpu", None, 2)
    assert [w.threads for w in wps] == [4, 4] and all(w.env["OMP_NUM_THREADS"] == "4" for w in wps)
    assert [w.threads for w in plan_workers("cpu", None, 3, threads=1)] == [1, 1, 1]


def test_sweep_worker_applies_its_threads_and_records_them(tmp_path):
    """The worker process body sets torch's threads before measuring (observed in the unit records
    it writes); without --threads it divides this machine's cores by its pool size."""
    c = api.load(write_project(tmp_path / "p", measures=["frobenius_norm"], n_ckpt=1))
    out = tmp_path / "s"
    write_plan(out, build_plan(c, c.measure_specs(), resolve_jobs(c)))
    line = run_worker_process(out, threads=3, run="r1")
    rec = json.loads(next((out / "units").glob("*.json")).read_text())
    assert rec["worker"]["threads"] == 3 and rec["run"] == "r1" and line.endswith("3 thread(s)")
    assert load_plan(out).units[0].id == rec["unit"]


def test_cli_threads_flag_is_applied_and_logged(tmp_path):
    cfg = write_project(tmp_path / "p", measures=["frobenius_norm"], n_ckpt=1)
    res = runner.invoke(
        app, ["measure", "-c", str(cfg), "-o", str(tmp_path / "o"), "--threads", "1"]
    )
    assert res.exit_code == 0, res.output
    assert "threads: 1 per worker (1 worker on" in res.output and "requested" in res.output
    assert torch.get_num_threads() == 1
    assert json.loads((tmp_path / "o" / "results.json").read_text())["threads"].startswith(
        "threads: 1 per"
    )
    res = runner.invoke(
        app,
        [
            "sweep",
            "-c",
            str(cfg),
            "-o",
            str(tmp_path / "s"),
            "--workers",
            "2",
            "--threads",
            "2",
            "--dry-run",
        ],
    )
    assert res.exit_code == 0 and "threads: 2 per worker (2 workers on" in res.output
    assert res.output.count("--threads 2") == 2  # each worker process is told
    res = runner.invoke(app, ["measure", "-c", str(cfg), "--threads", "0"])
    assert res.exit_code == 2 and "runtime.threads" in res.output
