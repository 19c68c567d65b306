"""Sweeps that say where they are: one count over all workers, a summary whose counts add up to the
planned units, one Ctrl-C message with the command that resumes; shares of a job array balanced by
predicted cost; the array tried on this machine (``--executor local-array``)."""

from __future__ import annotations

import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import pytest
import typer

from flatcli import api
from flatcli.sweep.plan import balance, build_plan, unit_costs
from flatcli.sweep.store import Store
from flatcli.sweep.worker import DELAY_ENV, Progress
from tests.sweep.test_sweep import make_sweep, quiet, table

UNIT_LINE = re.compile(r"^\[(w\d|task \d+/\d+)\] (\S+) (\S+) \S+ .*\((\d+)/(\d+)\)")
SUMMARY = re.compile(r"^(\d+) units: (.*); (\d+) with errors")
INTERRUPTED = re.compile(
    r"^interrupted: (\d+) of (\d+) units finished \((\d+) by this run\), (\d+) to run; "
    r"resume with: (.*)$"
)


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A config of 4 tiny checkpoints × 2 measures and its uninterrupted sweep's table."""
    tmp = tmp_path_factory.mktemp("progress")
    cfg = make_sweep(tmp / "proj")
    api.sweep(cfg, tmp / "ref", log=quiet)
    api.collect_report(tmp / "ref")
    return cfg, tmp / "ref" / "results.csv"


def _finish_some(cfg, out: Path, k: int) -> None:
    """Finish ``k`` units of the sweep (stopping it after its k-th unit, as a crash would)."""
    seen = []

    def stop(rec):
        seen.append(rec)
        if len(seen) == k:
            raise SystemExit  # not a KeyboardInterrupt: the run just ends here

    with pytest.raises(SystemExit):
        api.sweep(cfg, out, log=quiet, on_unit=stop)


def _parts(summary: str) -> tuple[int, dict[str, int]]:
    m = SUMMARY.match(summary)
    assert m, summary
    parts = {}
    for part in m.group(2).split(", "):
        n, what = part.split(" ", 1)
        parts[what] = int(n)
    return int(m.group(1)), parts


# ------------------------------------------------------------------ one count, a summary that adds up
def test_the_count_is_the_sweeps_and_the_summary_adds_up(project, tmp_path):
    """3 of 8 units finished before: the log counts on from 3 (4/8 ... 8/8), not from 0 per worker,
    and the summary's parts add up to the 8 planned units."""
    cfg, ref = project
    out = tmp_path / "s"
    _finish_some(cfg, out, 3)
    lines: list[str] = []
    rep = api.sweep(cfg, out, log=lines.append)
    counts = [(int(m.group(4)), int(m.group(5))) for m in map(UNIT_LINE.match, lines) if m]
    assert counts == [(k, 8) for k in range(4, 9)], lines
    total, parts = _parts(rep.summary())
    assert total == 8 and sum(parts.values()) == 8, rep.summary()
    assert parts == {"finished before": 3, "computed": 5, "not finished": 0}
    assert not (out / "progress").exists()  # the run's count is removed with the run


def test_progress_counts_every_workers_units_once(tmp_path):
    """Two counters of one run (two workers) add up; the count never passes the planned units."""
    a = Progress(tmp_path / "p" / "run", before=2, planned=6)
    assert a.finished() == 2
    a.add()
    (tmp_path / "p" / "run" / "otherhost-1").write_bytes(b"..")  # another worker's two units
    assert a.finished() == 5
    a.add()
    a.add()
    assert a.finished() == 6  # capped
    a.clear()
    assert not (tmp_path / "p").exists()


def test_a_worker_counts_units_another_finished_during_its_second_pass(project, tmp_path):
    """The first unit is held by another live process on the first pass and finished by it
    meanwhile: the second pass counts it as finished, so the worker's computed + already finished +
    left to others = its 8 units (the issue's workers' summaries added up to 130 of 132)."""
    from flatcli.loading.jobs import resolve_jobs
    from flatcli.sweep.plan import write_plan
    from flatcli.sweep.worker import run_worker

    cfg, ref = project
    c = api.load(cfg)
    out = tmp_path / "s"
    plan = build_plan(c, api.select_measures(c, None), resolve_jobs(c))
    write_plan(out, plan)
    store = Store(out)
    held = plan.units[0]
    lock = store.claim(held.id)  # held by a live process (this one) on the first pass
    seen = []

    def holder_finishes(rec):
        seen.append(rec)
        if len(seen) == 1:
            done = ref.parent / "units" / f"{held.id}.json"  # the same unit, same key
            store.unit_path(held.id).write_text(done.read_text())
            lock.release()

    st = run_worker(out, log=quiet, on_unit=holder_finishes)
    assert (st.computed, st.skipped, st.busy) == (7, 1, 0), st


# ------------------------------------------------------------------ Ctrl-C
def _cli(*args: str, env_extra=None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "flatcli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: the test's Ctrl-C reaches it alone
    )


def _wait_for(units: Path, k: int, proc: subprocess.Popen, limit: float = 240.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if units.is_dir() and len(list(units.glob("*.json"))) >= k:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    pytest.fail("the sweep never wrote its first units")


@pytest.mark.slow
def test_ctrl_c_on_a_two_worker_sweep_says_once_what_is_finished_and_how_to_resume(
    project, tmp_path
):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) on a 2-worker sweep: one
    line with the finished count and the command that resumes; that command finishes the rest,
    its summary adds up to the 8 planned units and its count over both workers reaches 8/8."""
    cfg, ref = project
    out = tmp_path / "s"
    args = ("sweep", "-c", str(cfg), "-o", str(out), "--workers", "2")
    proc = _cli(*args, env_extra={DELAY_ENV: "1.0"})
    _wait_for(out / "units", 2, proc)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    said = [ln for ln in err.splitlines() if "interrupted" in ln.lower()]
    assert len(said) == 1, err  # once, by the coordinator: not once per worker
    m = INTERRUPTED.match(said[0])
    assert m, said[0]
    finished, planned, by_run, left = (int(m.group(i)) for i in range(1, 5))
    on_disk = len(list((out / "units").glob("*.json")))
    assert (finished, planned, left) == (on_disk, 8, 8 - on_disk) and by_run == on_disk
    assert 2 <= on_disk < 8
    assert not list((out / "locks").glob("*.lock"))  # the units in flight were released
    assert "Traceback" not in err
    cmd = shlex.split(m.group(5))
    assert cmd[-6:] == ["--config", str(cfg), "--outdir", str(out), "--workers", "2"], cmd
    assert "--no-resume" not in cmd and "--resume" not in cmd
    # the printed command, run as printed (its program is this CLI): it resumes
    prog = cmd.index("sweep")
    proc = _cli(*cmd[prog:])
    said, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    lines = err.splitlines()
    counts = [int(m.group(4)) for m in map(UNIT_LINE.match, lines) if m]
    assert len(counts) == 8 - on_disk and max(counts) == 8, err  # one count over both workers
    assert all(on_disk < c <= 8 for c in counts), err
    assert {m.group(1) for m in map(UNIT_LINE.match, lines) if m} <= {"w0", "w1"}
    summary = next(ln for ln in said.splitlines() if SUMMARY.match(ln))
    total, parts = _parts(summary)
    assert total == 8 and sum(parts.values()) == 8, summary
    assert parts == {"finished before": on_disk, "computed": 8 - on_disk, "not finished": 0}
    assert not [ln for ln in lines if "done:" in ln]  # no per-worker summaries beside it
    api.collect_report(out)
    assert table(out / "results.csv") == table(ref)


@pytest.mark.slow
def test_ctrl_c_on_a_sweep_in_this_process_says_it_once(project, tmp_path):
    """One worker, in the coordinator's process: the same one line, the unit in flight released."""
    cfg, _ = project
    out = tmp_path / "s"
    proc = _cli("sweep", "-c", str(cfg), "-o", str(out), env_extra={DELAY_ENV: "1.0"})
    _wait_for(out / "units", 1, proc)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    said = [ln for ln in err.splitlines() if "interrupted" in ln.lower()]
    assert len(said) == 1 and INTERRUPTED.match(said[0]), err
    on_disk = len(list((out / "units").glob("*.json")))
    assert int(INTERRUPTED.match(said[0]).group(1)) == on_disk
    assert not list((out / "locks").glob("*.lock")) and "Traceback" not in err


# ------------------------------------------------------------------ shares of a job array
@pytest.mark.parametrize("seed", range(20))
def test_balance_is_deterministic_and_within_the_largest_cost_of_the_mean(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 8)
    costs = [
        rng.choice([1, 4, 16, 64, 256]) * rng.uniform(0.5, 2.0) for _ in range(rng.randint(0, 60))
    ]
    parts = balance(costs, n)
    assert len(parts) == n and sorted(sum(parts, [])) == list(range(len(costs)))  # each once
    assert parts == balance(list(costs), n)  # deterministic
    assert all(p == sorted(p) for p in parts)
    if costs:
        loads = [sum(costs[k] for k in p) for p in parts]
        mean = sum(costs) / n
        assert max(loads) <= mean + max(costs) + 1e-9, (loads, mean)


def test_balance_beats_shares_by_count_on_skewed_costs():
    """Twelve units whose costs grow 16× (checkpoints bs16 ... bs256 of one measure): 4 equal
    counts of 3 put the 3 largest together; by cost the largest share stays within 1.25× the mean."""
    costs = [16.0] * 4 + [64.0] * 4 + [256.0] * 4
    parts = balance(costs, 4)
    loads = [sum(costs[k] for k in p) for p in parts]
    mean = sum(costs) / 4
    by_count = [sum(costs[i : i + 3]) for i in range(0, 12, 3)]
    assert max(by_count) / mean > 1.9
    assert max(loads) / mean <= 1.25, loads


def test_unit_costs_grow_with_the_checkpoint_and_the_measures_products(project, tmp_path):
    """The proxy: a checkpoint twice as large costs twice as much for one measure; a Hessian trace
    (products) costs more than the Frobenius norm (a forward pass) on one checkpoint."""
    import torch

    from flatcli.loading.jobs import resolve_jobs

    cfg, _ = project
    c = api.load(cfg)
    jobs = resolve_jobs(c)
    plan = build_plan(c, api.select_measures(c, None), jobs)
    sizes = {i: Path(ck["path"]).stat().st_size for i, ck in enumerate(plan.checkpoints)}
    costs = unit_costs(plan, plan.units)
    by = {(u.checkpoint_index, u.label): c for u, c in zip(plan.units, costs, strict=True)}
    for i in sizes:
        assert by[(i, "hessian_trace")] > by[(i, "frobenius_norm")]
    small, large = min(sizes, key=sizes.get), max(sizes, key=sizes.get)
    ratio = by[(large, "hessian_trace")] / by[(small, "hessian_trace")]
    assert ratio == pytest.approx((sizes[large] // 4) / (sizes[small] // 4))
    del torch


def test_the_array_shares_pending_units_by_cost(project, tmp_path):
    cfg, _ = project
    rep = api.sweep(
        cfg,
        tmp_path / "s",
        options=api.SweepOptions(executor="slurm", dry_run=True, tasks=3),
        log=quiet,
    )
    tasks = [ln for ln in rep.lines if ln.startswith("task ")]
    got = [int(re.match(r"task \d+: (\d+) units", ln).group(1)) for ln in tasks]
    assert sum(got) == 8 and len(tasks) == 3
    shares = [int(re.search(r"(\d+)% of the predicted cost", ln).group(1)) for ln in tasks]
    assert max(shares) - min(shares) <= 40  # the cheap units fill the shares of the dear ones


# ------------------------------------------------------------------ the array on this machine
@pytest.mark.slow
def test_local_array_runs_a_two_task_array_on_this_machine(tmp_path, monkeypatch):
    """``executor="local-array"``: the job array through submitit's local executor, 2 tasks of one
    unit each; the same table as a local sweep."""
    pytest.importorskip("submitit")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = make_sweep(tmp_path / "proj", n_ckpt=2, measures=["frobenius_norm"])
    api.sweep(cfg, tmp_path / "ref", log=quiet)
    api.collect_report(tmp_path / "ref")
    out = tmp_path / "s"
    rep = api.sweep(cfg, out, options=api.SweepOptions(executor="local-array", tasks=2), log=quiet)
    assert (rep.computed, rep.pending, rep.exit_code) == (2, 0, 0), rep.lines
    assert len(rep.jobs) == 2 and rep.lines[-1].startswith("submitted 2 task(s) to local")
    logs = list((out / "slurm").rglob("*_log.err"))
    assert len(logs) >= 2, logs  # one process per task
    api.collect_report(out)
    assert table(out / "results.csv") == table(tmp_path / "ref" / "results.csv")


# ------------------------------------------------------------------ natural order of checkpoints
def test_globbed_checkpoints_are_in_natural_order(tmp_path):
    """``ck/bs*.pt`` lists bs4, bs16, bs64, bs256 (digit runs by value), in the plan and the table."""
    import yaml

    from flatcli.loading.jobs import resolve_jobs

    cfg = make_sweep(tmp_path, n_ckpt=1)
    for bs in (256, 16, 64, 4):
        (tmp_path / "ck" / f"bs{bs}.pt").write_bytes((tmp_path / "ck" / "m0.pt").read_bytes())
    raw = yaml.safe_load(cfg.read_text())
    raw["checkpoints"] = ["ck/bs*.pt"]
    cfg.write_text(yaml.safe_dump(raw))
    names = [j.checkpoint for j in resolve_jobs(api.load(cfg))]
    assert names == ["ck/bs4.pt", "ck/bs16.pt", "ck/bs64.pt", "ck/bs256.pt"]


@pytest.mark.parametrize("seed", range(10))
def test_natural_key_orders_digit_runs_by_value(seed):
    from flatcli.loading.checkpoints import natural_key

    rng = random.Random(seed)
    names = [
        f"{rng.choice(['bs', 'lr', 'run_'])}{rng.randint(0, 5000)}_s{rng.randint(0, 30)}.pt"
        for _ in range(40)
    ]
    got = sorted(names, key=natural_key)
    prefix = lambda s: re.match(r"\D+", s).group()  # noqa: E731
    num = lambda s: [int(x) for x in re.findall(r"\d+", s)]  # noqa: E731
    assert got == sorted(names, key=lambda s: (prefix(s), num(s))), got


def test_the_resume_command_repeats_the_options_given_and_drops_no_resume():
    """`rerun_command`: the arguments and the options the user gave (their longest names, each
    repeated value, a --no-flag), not the defaults, without the dropped ones; quoted for a shell."""
    from flatcli.cli._app import OneLineErrors, rerun_command
    from tests.oracles import runner

    app = typer.Typer(cls=OneLineErrors)

    @app.command()
    def go(
        ctx: typer.Context,
        path: Annotated[str, typer.Argument()],
        config: Annotated[str, typer.Option("--config", "-c")] = "",
        workers: Annotated[int, typer.Option("--workers")] = 1,
        slurm: Annotated[list[str] | None, typer.Option("--slurm")] = None,
        resume: Annotated[bool, typer.Option("--resume/--no-resume")] = True,
        fast: Annotated[bool, typer.Option("--fast/--slow")] = False,
        seed: Annotated[int | None, typer.Option("--seed")] = None,
    ):
        print(rerun_command(ctx, drop=("resume",)))

    res = runner.invoke(
        app,
        ["my dir", "-c", "a b.yaml", "--no-resume", "--slurm", "x=1", "--slurm", "y=2", "--slow"],
    )
    assert res.exit_code == 0, res.output
    words = shlex.split(res.output.strip())
    assert words[1:] == [
        "my dir",
        "--config",
        "a b.yaml",
        "--slurm",
        "x=1",
        "--slurm",
        "y=2",
        "--slow",
    ]
    res = runner.invoke(app, ["d", "--workers", "3", "--fast"])
    assert shlex.split(res.output.strip())[1:] == ["d", "--workers", "3", "--fast"]
