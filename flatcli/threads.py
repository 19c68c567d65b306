"""Intra-op threads: how many CPU threads torch uses in each flatcli process, chosen in one place.

torch sizes its intra-op pool to the whole machine in every process. W worker processes on C
cores then run W·C threads, and on a loaded machine that oversubscription costs far more than
it saves (a 20-unit sweep on 2 busy cores took 4 s with one thread per worker and 11–63 s with
the defaults). flatcli therefore chooses the count itself:

* ``requested`` an int ≥ 1 (``runtime.threads``, ``--threads``, ``FLATCLI_THREADS``): that many
  threads in each worker;
* ``"auto"`` (the default) with ``OMP_NUM_THREADS`` set in the environment: that many (the user's
  explicit choice, e.g. because other jobs share the machine);
* ``"auto"`` otherwise: ``max(1, F // W)`` for W local workers on F free cores, so that the
  workers together never use more threads than there are cores left to them.

C is the number of CPUs this process may run on (its affinity mask, ``os.sched_getaffinity(0)``,
else ``os.cpu_count()``). F, the free cores, is ``max(1, min(C, round(C − busy)))`` with ``busy``
the cores of C that the machine keeps busy **now**: the busy share of /proc/stat's jiffies
since flatcli was imported (`flatcli._cpu_mark`: the process's start-up, imports, config and
loading, a second or more, with no sleep; at least ``SAMPLE_SECONDS``, 0.2 s, slept up to that),
less the CPU time this process's own threads took meanwhile (/proc/self/stat: its own start-up,
and a pool of threads spinning after a job, are not other work), so it counts only other work
(`busy_cores`). A pool of another process spinning for a moment after its job (an OpenMP busy
wait, a fraction of a second) is a small share of that window, where work that goes on fills it;
a job that ended a second ago costs no thread. A mark older than ``MARK_MAX_AGE`` (a library
session: not "now") or taken in another process (a forked child) gives way to a fresh sample
of ``SAMPLE_SECONDS`` while this process sleeps. Where /proc/stat is missing (macOS), the 1-minute load average less this process stands in. Why: on a loaded machine, more
threads than free cores make λmax several times slower than one thread, and a load average still
counts jobs that ended up to a minute ago. W is ``workers`` when given, else
``LOCAL_WORLD_SIZE`` (set by torchrun for the processes of one machine), else 1. One sample
serves a process for ``SAMPLE_REUSE`` seconds.

>>> choose_threads(2, workers=8)
2
>>> choose_threads("auto", workers=1, cores=2, load=2.0)
1
>>> str(ThreadChoice(n=1, workers=2, cores=2, source="auto"))
'threads: 1 per worker (2 workers on 2 cores)'
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch

from . import _cpu_mark
from .validation import validate

AUTO = "auto"


def available_cores() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS, Windows
        return max(1, os.cpu_count() or 1)


SAMPLE_SECONDS = 0.2  # how long `busy_cores` watches the CPUs, at least
MARK_MAX_AGE = 10.0  # seconds after flatcli's import within which its mark starts the sample
SAMPLE_REUSE = 2.0  # seconds one sample serves this process
_last: dict = {}  # (time, cpus) -> busy: the last sample


def cpu_jiffies(text: str) -> dict[int, tuple[int, int]]:
    """CPU number → (busy, total) jiffies from the text of /proc/stat (its ``cpuN`` lines; idle
    and iowait are not busy)."""
    out = {}
    for line in text.splitlines():
        head, _, rest = line.partition(" ")
        if not head.startswith("cpu") or not head[3:].isdigit():
            continue
        f = [int(x) for x in rest.split()]
        idle = f[3] + (f[4] if len(f) > 4 else 0)
        total = sum(f[:8])  # user nice system idle iowait irq softirq steal (guest is in user)
        out[int(head[3:])] = (total - idle, total)
    return out


def read_proc_stat() -> str | None:
    """The text of /proc/stat, None where there is none."""
    try:
        with open("/proc/stat") as f:
            return f.read()
    except OSError:
        return None


def read_self_stat() -> str | None:
    """The text of /proc/self/stat (this process, all its threads), None where there is none."""
    try:
        with open("/proc/self/stat") as f:
            return f.read()
    except OSError:
        return None


def own_jiffies(text: str | None) -> int | None:
    """User + system jiffies of a process from the text of its /proc/<pid>/stat (fields 14 and
    15, counted after the command name's closing parenthesis); None when unreadable."""
    if not text or ")" not in text:
        return None
    fields = text.rsplit(")", 1)[1].split()
    try:
        return int(fields[11]) + int(fields[12])
    except (IndexError, ValueError):
        return None


def busy_cores(
    cpus: set[int] | None = None,
    seconds: float = SAMPLE_SECONDS,
    read=None,
    sleep=None,
    read_self=None,
    since: tuple[float, str | None, str | None] | None = None,
    clock=None,
) -> float | None:
    """How many of ``cpus`` (default: this process's) other work keeps busy now: the busy share of
    their jiffies over at least ``seconds`` of /proc/stat (``read``: its text), less this process's
    own jiffies over the same time (/proc/self/stat, ``read_self``: its text; by default only
    with the default ``read``): this process sleeps or starts up, and its threads may spin after a
    job (an OpenMP pool waits busy for a while), and that is no other work. ``since``: (time on
    ``clock``, /proc/stat text, /proc/self/stat text) read earlier, the start of the window (the
    sleep is only what is left of ``seconds``); else the window starts now. None when /proc/stat
    cannot be read. ``sleep``: `time.sleep`, ``clock``: `time.monotonic` unless given."""
    if read is None:
        read, read_self = read_proc_stat, read_self or read_self_stat
    sleep, clock = sleep or time.sleep, clock or time.monotonic
    if since is not None and since[1] is not None:
        a, own_a = since[1], own_jiffies(since[2]) if read_self else None
        wait = seconds - (clock() - since[0])
    else:
        a, own_a = read(), own_jiffies(read_self()) if read_self else None
        wait = seconds
    if a is None:
        return None
    if wait > 0:
        sleep(wait)
    b, own_b = read(), own_jiffies(read_self()) if read_self else None
    if b is None:
        return None
    return _busy_between(cpu_jiffies(a), cpu_jiffies(b), cpus, own_a, own_b)


def _busy_between(before, after, cpus, own_a, own_b) -> float | None:
    """`busy_cores` from two `cpu_jiffies` readings and this process's jiffies at each."""
    mine = [c for c in after if c in before and (cpus is None or c in cpus)]
    busy, ticks = 0.0, []
    for c in mine:
        dt = after[c][1] - before[c][1]
        if dt > 0:
            busy += min(1.0, max(0.0, (after[c][0] - before[c][0]) / dt))
            ticks.append(dt)
    if own_a is not None and own_b is not None and own_b >= own_a and ticks:
        busy = max(0.0, busy - (own_b - own_a) / (sum(ticks) / len(ticks)))
    return busy if mine else None


def start_mark(mark=None, now: float | None = None) -> tuple[float, str | None, str | None] | None:
    """The (time, /proc/stat, /proc/self/stat) texts read when flatcli was imported
    (`flatcli._cpu_mark.MARK`, or ``mark``), when they were read in this process at most
    `MARK_MAX_AGE` seconds before ``now`` (default: `time.monotonic`); else None."""
    at, pid, machine, own = mark if mark is not None else _cpu_mark.MARK
    age = (time.monotonic() if now is None else now) - at
    if machine is None or pid != os.getpid() or not 0 <= age <= MARK_MAX_AGE:
        return None
    return at, machine, own


def _affinity() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def machine_load() -> float | None:
    """The cores other work keeps busy now (`busy_cores` since flatcli's import, `start_mark`, or
    over a fresh sample; one result reused for `SAMPLE_REUSE` seconds); where /proc/stat is missing the 1-minute load average less this process; None where
    the OS has neither."""
    cpus = _affinity()
    key = None if cpus is None else tuple(sorted(cpus))
    now = time.monotonic()
    if _last and _last["cpus"] == key and now - _last["at"] < SAMPLE_REUSE:
        return _last["busy"]
    busy = busy_cores(cpus, since=start_mark())
    if busy is None:
        try:
            load = float(os.getloadavg()[0])
        except (AttributeError, OSError):  # Windows
            return None
        busy = max(0.0, load - 1.0)
    _last.update(at=time.monotonic(), cpus=key, busy=busy)
    return busy


def free_cores(cores: int, load: float | None) -> int:
    """Cores left to this process on ``cores`` CPUs when ``load`` of them are busy (module
    docstring): ``max(1, min(cores, round(cores − load)))``; all of them when it is unknown."""
    if load is None or not math.isfinite(load) or load < 0:
        return cores
    return max(1, min(cores, round(cores - load)))


def local_workers(workers: int | None = None) -> int:
    """The number of flatcli processes sharing this machine's cores: ``workers`` when given, else
    ``LOCAL_WORLD_SIZE`` (torchrun), else 1."""
    if workers is not None:
        return max(1, int(workers))
    env = os.environ.get("LOCAL_WORLD_SIZE", "")
    return max(1, int(env)) if env.strip().isdigit() else 1


def check_threads(requested: int | str | None, where: str = "threads") -> int | str:
    """``requested`` validated: an int ≥ 1 (also as text, e.g. from an environment variable) or
    ``"auto"`` (None means auto); a `ConfigError` naming ``where`` otherwise."""
    if requested is None:
        return AUTO
    return validate("threads", requested, where)  # the one rule (flatcli.validation)


@dataclass(frozen=True)
class ThreadChoice:
    """The threads each worker uses, and why: ``source`` is "requested", "OMP_NUM_THREADS" or
    "auto" (free cores // workers; ``load`` the cores it saw busy, ``free`` the cores it left, see
    `free_cores`)."""

    n: int
    workers: int
    cores: int
    source: str
    load: float | None = None
    free: int | None = None

    def __str__(self) -> str:
        ws = f"{self.workers} worker{'s' if self.workers != 1 else ''}"
        why = {"requested": "; requested", "OMP_NUM_THREADS": "; from OMP_NUM_THREADS"}.get(
            self.source, ""
        )
        if self.source == "auto" and self.load is not None:
            why = f"; {self.load:.2f} busy leaves {self.free} free"
        return f"threads: {self.n} per worker ({ws} on {self.cores} cores{why})"


def thread_choice(
    requested: int | str | None = AUTO,
    workers: int | None = None,
    cores: int | None = None,
    load: float | None = None,
) -> ThreadChoice:
    """The thread count per worker for ``workers`` local workers on ``cores`` CPUs of which ``load``
    are busy (defaults: `local_workers`, `available_cores`, `machine_load`), with the reason (see
    the module docstring)."""
    req = check_threads(requested)
    w, c = local_workers(workers), cores or available_cores()
    if req != AUTO:
        return ThreadChoice(int(req), w, c, "requested")
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) >= 1:
        return ThreadChoice(int(omp), w, c, "OMP_NUM_THREADS")
    ld = machine_load() if load is None else float(load)
    free = free_cores(c, ld)
    return ThreadChoice(max(1, free // w), w, c, "auto", ld, free)


def choose_threads(
    requested: int | str | None = AUTO,
    workers: int | None = None,
    cores: int | None = None,
    load: float | None = None,
) -> int:
    """Intra-op threads for each of ``workers`` processes on ``cores`` CPUs: ``requested`` when it is
    an int; for ``"auto"`` ``OMP_NUM_THREADS`` when set, else ``max(1, free // workers)`` with
    ``free`` the cores the machine's ``load`` leaves (`free_cores`). ``workers`` defaults to
    ``LOCAL_WORLD_SIZE`` (torchrun) or 1, ``cores`` to this process's CPUs, ``load`` to the cores
    busy now (`machine_load`)."""
    return thread_choice(requested, workers, cores, load).n


def apply_threads(n: int, interop: bool = False) -> None:
    """Set torch's intra-op threads to ``n``; with ``interop`` also its inter-op pool, which torch
    allows only once, before any parallel work (a fresh worker process): skipped when too late."""
    torch.set_num_threads(max(1, int(n)))
    if interop:
        try:
            torch.set_num_interop_threads(max(1, int(n)))
        except RuntimeError:  # already set, or parallel work has started in this process
            pass


def configure_threads(
    requested: int | str | None = AUTO, workers: int | None = None, cores: int | None = None
) -> ThreadChoice:
    """`thread_choice`, applied to this process (`apply_threads`); returns the choice (its ``str`` is
    the log line, e.g. "threads: 1 per worker (2 workers on 2 cores)")."""
    choice = thread_choice(requested, workers, cores)
    apply_threads(choice.n)
    return choice
