"""Intra-op threads: the choice (flatcli.threads), the sweep's workers, the --threads flag. The
issue's case (a sweep of 2 worker processes on a 2-core machine runs 1 thread each, observed
inside the workers) is test_sweep.py::test_concurrent_workers_never_duplicate_or_corrupt."""

from __future__ import annotations

import json

import pytest
import torch

from flatcli import api, threads
from flatcli.cli import app
from flatcli.errors import ConfigError
from flatcli.loading.jobs import resolve_jobs
from flatcli.sweep.plan import build_plan, load_plan, write_plan
from flatcli.sweep.runner import worker_slots
from flatcli.sweep.worker import run_worker_process
from flatcli.threads import choose_threads, thread_choice
from tests.helpers import write_project
from tests.oracles import runner

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
        str(thread_choice("auto", cores=16))
        == "threads: 4 per worker (4 workers on 16 cores; 0.00 busy leaves 16 free)"
    )
    for bad in (0, -1, "many", 1.5, True):
        with pytest.raises(ConfigError, match=r"must be an int in \[1, 4096\] or auto"):
            choose_threads(bad, 1, 2)


def fake_proc(busy_then: list[float], busy_now: list[float]):
    """A /proc/stat reader (100 jiffies a second per CPU): its first text after an hour with CPU i
    busy a share ``busy_then[i]`` of the time (the 1-minute average's past), the second a second
    later, that second at ``busy_now[i]``."""

    def text(then: float, now: float) -> str:
        lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
        for i, (a, b) in enumerate(zip(busy_then, busy_now, strict=True)):
            busy, total = round(100 * (a * then + b * now)), round(100 * (then + now))
            user, idle = round(0.7 * busy), total - busy
            lines.append(
                f"cpu{i} {user} 0 {busy - user} {idle - idle // 10} {idle // 10} 0 0 0 0 0"
            )
        return "\n".join(lines + ["intr 1 2 3", "ctxt 5"])

    reads = iter([text(3600, 0), text(3600, 1)])
    return lambda: next(reads)


@pytest.mark.parametrize(
    "cores, busy, workers, expected",
    [
        (2, 0.0, 1, 2),  # idle now: both cores, whatever the last minute was
        (2, 0.08, 1, 2),  # background noise
        (2, 1.0, 1, 1),  # one busy thread elsewhere: one core left
        (2, 2.0, 1, 1),  # both busy: still one thread
        (16, 6.0, 1, 10),
        (16, 6.0, 2, 5),  # the free cores divided among the workers
        (16, 15.5, 4, 1),
    ],
)
def test_auto_counts_the_cores_busy_now_not_the_load_average(
    monkeypatch, cores, busy, workers, expected
):
    """A fake /proc/stat: the CPUs were fully busy for an hour (a 1-minute load of ``cores``,
    which os.getloadavg also reports) and are ``busy`` busy during the 0.2 s sample: the choice
    follows the sample."""
    per_cpu = [min(1.0, max(0.0, busy - i)) for i in range(cores)]
    read = fake_proc([1.0] * cores, per_cpu)
    got = threads.busy_cores(set(range(cores)), read=read, sleep=lambda s: None)
    assert got == pytest.approx(busy, abs=0.02)
    monkeypatch.setattr(threads, "_affinity", lambda: set(range(cores)))
    monkeypatch.setattr(
        threads.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False
    )
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (float(cores),) * 3, raising=False)
    monkeypatch.setattr(threads, "machine_load", REAL_MACHINE_LOAD)
    monkeypatch.setattr(threads, "_last", {})
    monkeypatch.setattr(threads, "start_mark", lambda: None)  # no start-up mark: a fresh sample
    monkeypatch.setattr(threads, "read_proc_stat", fake_proc([1.0] * cores, per_cpu))
    monkeypatch.setattr(threads, "read_self_stat", lambda: None)  # this process: unknown
    monkeypatch.setattr(threads.time, "sleep", lambda s: None)
    choice = thread_choice("auto", workers)
    assert choice.n == expected and choice.cores == cores
    assert choice.load == pytest.approx(busy, abs=0.02)
    assert f"on {cores} cores; {choice.load:.2f} busy leaves {choice.free} free" in str(choice)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's explicit choice, whatever the load
    assert thread_choice("auto", workers).n == 3
    assert thread_choice(7, workers).n == 7


def _self_stat(jiffies: int) -> str:
    """A /proc/self/stat text whose user + system jiffies add up to ``jiffies`` (a command name
    with spaces and a parenthesis, as /proc allows)."""
    user = jiffies // 3
    fields = ["S", "1", "1", "1", "0", "-1", "4194560", "100", "0", "0", "0"]
    return f"4242 (python (x) y) {' '.join(fields)} {user} {jiffies - user} 0 0 20 0 8 0"


@pytest.mark.parametrize(
    "spinning, others",
    [(0.0, 0.0), (0.5, 0.0), (1.0, 0.0), (2.0, 0.0), (0.0, 1.0), (0.5, 1.0), (1.0, 1.0)],
)
def test_auto_tells_its_own_spinning_threads_from_other_work(monkeypatch, spinning, others):
    """A fake /proc on 2 cores: during the sample, ``spinning`` cores' worth of this process's
    own threads spin after a job (an OpenMP pool's busy wait) and ``others`` cores run other
    processes' work. The machine's /proc/stat shows both; /proc/self/stat shows the first, and
    only the other work counts as busy: a process right after its own torch work keeps its
    threads."""
    busy = spinning + others  # at most the 2 cores
    per_cpu = [min(1.0, max(0.0, busy - i)) for i in range(2)]
    selves = iter([_self_stat(5000), _self_stat(5000 + round(100 * spinning))])
    got = threads.busy_cores(
        {0, 1},
        read=fake_proc([1.0, 1.0], per_cpu),
        sleep=lambda s: None,
        read_self=lambda: next(selves),
    )
    assert got == pytest.approx(max(0.0, busy - spinning), abs=0.02), (spinning, others)
    assert threads.free_cores(2, got) == (1 if others else 2)
    monkeypatch.setattr(threads, "read_proc_stat", fake_proc([1.0, 1.0], per_cpu))
    selves2 = iter([_self_stat(5000), _self_stat(5000 + round(100 * spinning))])
    monkeypatch.setattr(threads, "read_self_stat", lambda: next(selves2))
    monkeypatch.setattr(threads.time, "sleep", lambda s: None)
    assert threads.busy_cores({0, 1}) == pytest.approx(got)  # the defaults read both
    assert threads.own_jiffies(_self_stat(1234)) == 1234 and threads.own_jiffies("") is None


def test_without_proc_stat_the_load_average_less_this_process_stands_in(monkeypatch):
    monkeypatch.setattr(threads, "machine_load", REAL_MACHINE_LOAD)
    monkeypatch.setattr(threads, "_last", {})
    monkeypatch.setattr(threads, "start_mark", lambda: None)
    monkeypatch.setattr(threads, "read_proc_stat", lambda: None)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (3.0, 3.0, 3.0), raising=False)
    assert threads.machine_load() == 2.0
    assert threads.cpu_jiffies("cpu  1 2 3 4\ncpu0 5 0 5 80 10 0 0 0\nintr 9") == {0: (10, 100)}


def _timeline(others_on_cpu1, start_up: float = 1.5):
    """A fake /proc on 2 cores at 100 jiffies a second, as functions of the time t since flatcli's
    import: this process starts up on CPU 0 (one core busy until ``start_up``, its own jiffies),
    and CPU 1 runs other processes' work at the share ``others_on_cpu1(t)`` (integrated over
    hundredths of a second)."""

    def busy1(t: float) -> float:
        return sum(others_on_cpu1((k + 0.5) / 100) for k in range(round(100 * t))) / 100

    def stat(t: float) -> str:
        own = min(t, start_up)
        lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
        for i, busy in enumerate((own, busy1(t))):
            b, total = round(100 * busy), round(100 * (3600 + t))
            lines.append(f"cpu{i} {b} 0 0 {total - b} 0 0 0 0 0 0")
        return "\n".join(lines)

    return stat, lambda t: _self_stat(round(100 * min(t, start_up)))


@pytest.mark.parametrize(
    "case, others_on_cpu1, expected",
    [
        ("idle", lambda t: 0.0, 2),
        ("a pool spinning for 0.5 s (another process)", lambda t: float(1.2 <= t < 1.7), 2),
        ("work going on", lambda t: 1.0, 1),
    ],
)
def test_auto_samples_over_the_start_up_without_sleeping(
    monkeypatch, case, others_on_cpu1, expected
):
    """``threads: auto`` reads the machine from flatcli's import to its choice (1.5 s of start-up
    here, on a fake clock) with no sleep: this process's own start-up is subtracted, another
    process's pool spinning for half a second (even right at the choice, where a fresh 0.2 s
    sample would see a busy core) is a third of a core and keeps both threads, and work going on
    over the whole start-up takes one. A mark older than MARK_MAX_AGE, or from another process,
    gives way to a fresh sample, and a window shorter than SAMPLE_SECONDS sleeps the rest."""
    stat, own = _timeline(others_on_cpu1)
    clock, slept = [1.5], []

    def sleep(s):
        slept.append(s)
        clock[0] += s

    monkeypatch.setattr(threads, "machine_load", REAL_MACHINE_LOAD)
    monkeypatch.setattr(threads, "_last", {})
    monkeypatch.setattr(threads, "_affinity", lambda: {0, 1})
    monkeypatch.setattr(threads, "read_proc_stat", lambda: stat(clock[0]))
    monkeypatch.setattr(threads, "read_self_stat", lambda: own(clock[0]))
    monkeypatch.setattr(threads.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(threads.time, "sleep", sleep)
    import os

    mark = (0.0, os.getpid(), stat(0.0), own(0.0))
    monkeypatch.setattr(threads._cpu_mark, "MARK", mark)
    choice = thread_choice("auto", 1, cores=2)
    assert choice.n == expected, (case, choice)
    assert slept == [], case  # the start-up was the sample
    window_busy = sum(others_on_cpu1((k + 0.5) / 100) for k in range(150)) / 150
    assert choice.load == pytest.approx(window_busy, abs=0.02), case

    assert threads.start_mark((0.0, os.getpid() + 1, "cpu0 1", None)) is None  # a forked child
    assert threads.start_mark((1.5 - threads.MARK_MAX_AGE - 1, os.getpid(), "cpu0 1", None)) is None
    assert threads.start_mark((0.0, os.getpid(), None, None)) is None  # no /proc/stat
    clock[0] = 1.55  # a window of 0.05 s: sleeps the 0.15 s left of SAMPLE_SECONDS
    got = threads.busy_cores({0, 1}, since=threads.start_mark((1.5, *mark[1:])))
    assert slept == [pytest.approx(threads.SAMPLE_SECONDS - 0.05)] and got is not None


BUSY = "import sys, time\nend = time.time() + float(sys.argv[1])\nwhile time.time() < end: pass\n"
CHOOSE = "from flatcli.threads import thread_choice\nprint(thread_choice('auto', cores=2).n)\n"


def _auto_in_a_fresh_process() -> int:
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    env.pop("OMP_NUM_THREADS", None)
    out = subprocess.run([sys.executable, "-c", CHOOSE], env=env, capture_output=True, text=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_auto_in_a_subprocess_after_and_during_a_busy_job():
    """On a 2-core machine otherwise idle: while a 1-thread busy job runs, auto chooses 1 thread;
    right after a 2-thread busy job ends (the 1-minute load average still counts it), 2. Skipped
    when the machine has fewer than 2 cores or other work keeps more than 0.3 cores busy (a shared
    machine: the exact cases are in the fake-/proc test above)."""
    import subprocess
    import sys

    cpus = threads._affinity() or set()
    if len(cpus) != 2 or threads.read_proc_stat() is None:
        pytest.skip("needs a 2-core Linux machine")
    if (threads.busy_cores(cpus, seconds=1.0) or 0.0) > 0.3:
        pytest.skip("the machine is busy with other work: the exact cases use a fake /proc/stat")
    jobs = [subprocess.Popen([sys.executable, "-c", BUSY, "3"]) for _ in range(2)]
    for j in jobs:
        j.wait()
    assert _auto_in_a_fresh_process() == 2  # the job ended: its load average no longer counts
    one = subprocess.Popen([sys.executable, "-c", BUSY, "8"])
    try:
        assert _auto_in_a_fresh_process() == 1
    finally:
        one.kill()
        one.wait()


def test_config_key_env_and_hash():
    from flatcli.config import from_dict

    assert from_dict({}).runtime.threads == "auto"
    cfg = from_dict({"runtime": {"threads": 2}}, env={"FLATCLI_THREADS": "3"})
    assert cfg.runtime.threads == 3 and cfg.provenance["runtime.threads"] == "env FLATCLI_THREADS"
    assert cfg.hash() == from_dict({}).hash()  # how fast, not what: units are not recomputed
    with pytest.raises(
        ConfigError,
        match=r"'runtime.threads' must be an int in \[1, 4096\] or auto. Got 0 instead.",
    ):
        from_dict({"runtime": {"threads": 0}})


def test_workers_share_the_cores(monkeypatch):
    monkeypatch.setattr(threads, "available_cores", lambda: 8)
    wps = worker_slots("cpu", None, 2)
    assert [w.threads for w in wps] == [4, 4] and all(w.env["OMP_NUM_THREADS"] == "4" for w in wps)
    assert [w.threads for w in worker_slots("cpu", None, 3, threads=1)] == [1, 1, 1]


def test_sweep_worker_applies_its_threads_and_records_them(tmp_path):
    """The worker process body sets torch's threads before measuring (observed in the unit records
    it writes); without --threads it divides this machine's cores by its pool size."""
    c = api.load(write_project(tmp_path / "p", measures=["frobenius_norm"], n_ckpt=1))
    out = tmp_path / "s"
    write_plan(out, build_plan(c, c.measure_specs(), resolve_jobs(c)))
    line = run_worker_process(out, threads=3, sweep_id="r1")
    rec = json.loads(next((out / "units").glob("*.json")).read_text())
    assert (
        rec["worker"]["threads"] == 3 and rec["sweep_id"] == "r1" and line.endswith("3 thread(s)")
    )
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
