"""--executor slurm through submitit, run with submitit's debug and local backends."""

from __future__ import annotations

import shutil
import sys

import pytest

from flatcli import api
from flatcli.errors import ConfigError
from tests.sweep.test_sweep import make_sweep, quiet, table

submitit = pytest.importorskip("submitit")


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("submitit")
    cfg = make_sweep(tmp / "proj", n_ckpt=2)
    api.sweep(cfg, tmp / "ref", log=quiet)
    api.collect_report(tmp / "ref")
    return cfg, tmp / "ref" / "results.csv"


def test_debug_backend_runs_the_array_in_process(project, tmp_path):
    cfg, ref = project
    out = tmp_path / "s"
    rep = api.sweep(
        cfg, out, options=api.SweepOptions(executor="slurm", cluster="debug", tasks=3), log=quiet
    )
    assert rep.executor == "slurm" and len(rep.jobs) == len(rep.workers) >= 1
    assert (rep.computed, rep.pending, rep.exit_code) == (4, 0, 0)
    api.collect_report(out)
    assert table(out / "results.csv") == table(ref)
    # resubmitting a finished sweep submits nothing
    again = api.sweep(
        cfg, out, options=api.SweepOptions(executor="slurm", cluster="debug", tasks=3), log=quiet
    )
    assert again.jobs == [] and again.computed == 0 and "nothing to submit" in again.lines[1]


@pytest.mark.slow
def test_local_backend_pickles_and_runs_tasks_in_subprocesses(project, tmp_path, monkeypatch):
    cfg, ref = project
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "s"
    rep = api.sweep(
        cfg,
        out,
        options=api.SweepOptions(
            executor="slurm", cluster="local", tasks=1, wait=True, slurm={"timeout_min": 5}
        ),
        log=quiet,
    )
    assert (rep.computed, rep.pending) == (4, 0)
    logs = list((out / "slurm").rglob("*_log.err"))
    assert logs, "submitit wrote no task log"
    api.collect_report(out)
    assert table(out / "results.csv") == table(ref)


def test_dry_run_prints_the_array_and_submits_nothing(project, tmp_path):
    cfg, _ = project
    out = tmp_path / "s"
    rep = api.sweep(
        cfg,
        out,
        options=api.SweepOptions(
            executor="slurm",
            dry_run=True,
            tasks=2,
            slurm={"slurm_partition": "gpu", "timeout_min": 30},
        ),
        log=quiet,
    )
    text = "\n".join(rep.lines)
    assert (
        "would submit a job array" in text
        and "slurm_partition=gpu" in text
        and "timeout_min=30" in text
    )
    assert "task 1: " in text and "of the predicted cost" in text
    assert rep.jobs == [] and not out.exists()
    with pytest.raises(ConfigError, match="exclusive"):
        api.sweep(cfg, out, options=api.SweepOptions(executor="slurm", shard="0/2"), log=quiet)


def test_clear_errors_without_sbatch_or_submitit(project, tmp_path, monkeypatch):
    cfg, _ = project
    if shutil.which("sbatch") is None:
        with pytest.raises(ConfigError, match="sbatch"):
            api.sweep(cfg, tmp_path / "a", options=api.SweepOptions(executor="slurm"), log=quiet)
    monkeypatch.setitem(sys.modules, "submitit", None)  # import submitit → ImportError
    with pytest.raises(ConfigError, match=r"pip install 'flatcli\[slurm\]'"):
        api.sweep(
            cfg,
            tmp_path / "b",
            options=api.SweepOptions(executor="slurm", cluster="local"),
            log=quiet,
        )
