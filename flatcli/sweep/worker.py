"""A sweep worker: walks its units (all, or a shard's), claims each with a lock file, measures it
(`flatcli.run.measuring.measure_job` with that one measure) and writes its row atomically; also the
hidden ``flatcli sweep-worker`` entry point and the SLURM task."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..loading.jobs import Job
from ..loading.load import DataCache
from ..loading.text import TOKENIZED_DIR
from ..locks import DEFAULT_LOCK_TIMEOUT, Heartbeat, Lock
from ..run import kept
from ..run.measuring import measure_job
from ..run.settings import MeasureOptions, Settings
from ..threads import apply_threads, choose_threads
from .plan import Plan, Unit, load_plan
from .store import Store, parse_shard, unit_record

DELAY_ENV = "FLATCLI_SWEEP_UNIT_DELAY"  # test hook: seconds to sleep inside every unit
POOL_ENV = "FLATCLI_SWEEP_POOL_WORKER"  # set by a local pool's coordinator in its workers
PROGRESS_DIR = "progress"  # OUTDIR/progress/<sweep id>/<host>-<pid>: one byte per finished unit


# ------------------------------------------------------------------ the sweep's count
@dataclass(frozen=True)
class Progress:
    """One sweep run's count of finished units over all its workers (``(95/132)`` in the log).

    ``planned``: the units the run covers; ``before``: those finished when it started. Each worker
    appends one byte per unit it finishes to a file of its own under
    ``OUTDIR/progress/<sweep id>/`` (one writer per file, so it holds on a shared file system too);
    the count is ``before`` plus the sizes of those files."""

    folder: Path
    before: int
    planned: int

    @classmethod
    def of(cls, outdir, sweep_id: str | None, before: int | None, planned: int | None):
        """The run's progress, or None without a sweep id or counts (a worker started by hand)."""
        if sweep_id is None or before is None or planned is None:
            return None
        return cls(Path(outdir) / PROGRESS_DIR / sweep_id, before, planned)

    def add(self) -> None:
        """Count one finished unit of this process."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / f"{socket.gethostname()}-{os.getpid()}", "ab") as f:
            f.write(b".")

    def finished(self) -> int:
        """Units finished so far: before the run, and by any of its workers since."""
        try:
            sizes = sum(e.stat().st_size for e in os.scandir(self.folder) if e.is_file())
        except FileNotFoundError:
            sizes = 0
        return min(self.planned, self.before + sizes)

    def clear(self) -> None:
        """Remove the run's count (when the run is over)."""
        shutil.rmtree(self.folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.folder.parent.rmdir()  # only when no other run's count is left


# ------------------------------------------------------------------ the worker
@dataclass
class WorkerStats:
    """What one worker did: units computed (of them with errors), already finished, left busy."""

    computed: int = 0
    errors: int = 0
    skipped: int = 0  # already finished
    busy: int = 0  # left to another live worker


def default_log(msg: str) -> None:
    """Write ``msg`` as one line on stderr (a worker's log when none is given), in one write
    call: `print` writes the text and the newline apart, so two workers sharing stderr could
    interleave their lines."""
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def run_worker(
    outdir: str | os.PathLike,
    *,
    shard: tuple[int, int] | None = None,
    worker: int = 0,
    workers: int = 1,
    device: str | None = None,
    redo_before: float | None = None,
    retry_before: float | None = None,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    log: Callable[[str], None] | None = default_log,
    on_unit: Callable[[dict[str, Any]], None] | None = None,
    data=None,
    debug: bool = False,
    sweep_id: str | None = None,
    progress: tuple[int, int] | None = None,
    only: Sequence[str] | None = None,
    tag: str | None = None,
) -> WorkerStats:
    """Compute the unfinished units of ``outdir``'s plan (of one shard), claiming each with a lock.

    ``worker``/``workers`` only rotate the starting point so that workers of one pool
    start on different units. ``redo_before``/``retry_before`` are timestamps: units
    (error units) finished before them count as unfinished (``--no-resume``, ``--retry-failed``).
    ``sweep_id`` (the id of the sweep run this worker belongs to) is stored in every unit record it
    writes, so that each sweep counts what it computed itself. ``progress``: (units finished when
    the run started, units it covers), for the run's count over all its workers in the log lines
    (`Progress`; without it each worker counts its own units). ``only``: only these unit ids
    (a job array's task, `flatcli.sweep.plan.Plan.balanced`); ``tag``: the worker in log lines.
    """
    store = Store(outdir, warn=log, log=log)
    plan = load_plan(outdir)
    cfg = plan.cfg()
    settings = Settings.from_config(cfg, device)
    data = data if data is not None else DataCache(cfg, Path(outdir) / TOKENIZED_DIR)
    if only is not None:
        wanted = set(only)
        units = [u for u in plan.units if u.id in wanted]
    else:
        units = plan.units_for(shard)
    k = (len(units) * worker) // max(1, workers)
    loop = _WorkerLoop(
        store=store,
        plan=plan,
        cfg=cfg,
        settings=settings,
        data=data,
        args=WorkerArgs(shard, redo_before, retry_before, lock_timeout, sweep_id, progress),
        delay=float(os.environ.get(DELAY_ENV) or 0.0),
        tag=tag or f"w{worker}" + (f" shard {shard[0]}/{shard[1]}" if shard else ""),
        log=log,
        on_unit=on_unit,
        debug=debug,
        progress=Progress.of(outdir, sweep_id, *(progress or (None, None))),
    )
    return loop.run(units[k:] + units[:k])


@dataclass
class _WorkerLoop:
    """One worker's walk over its units (see `run_worker`): each unit is skipped when finished,
    left when another worker holds its lock, else claimed, measured, written and reported."""

    store: Store
    plan: Plan
    cfg: Any
    settings: Any
    data: Any  # the DataCache the units are measured on
    args: WorkerArgs
    delay: float  # seconds to sleep in every unit (the `DELAY_ENV` test hook)
    tag: str  # the worker in log lines: "w0", "w1 shard 0/2"
    log: Callable[[str], None] | None
    on_unit: Callable[[dict[str, Any]], None] | None
    debug: bool
    progress: Progress | None = None  # the sweep run's count over all its workers
    stats: WorkerStats = field(default_factory=WorkerStats)
    todo: int = 0  # units unfinished when the walk began: "k/N" in the log lines
    # the checkpoint of the last unit: its model and metrics, reused by the next unit of it
    keep: Any = None

    def run(self, order: list[Unit]) -> WorkerStats:
        """Attempt every unit in ``order``, then retry the busy ones while that frees some."""
        a = self.args
        self.todo = sum(
            not self.store.is_done(u.id, a.redo_before, a.retry_before, u.key) for u in order
        )
        busy: list[Unit] = []
        for u in order:
            r = self.attempt(u)
            if r == "done":
                self.stats.skipped += 1
            elif r == "busy":
                busy.append(u)
        # Second passes: a unit whose holder died (dead pid on this host) is claimable now; one its
        # holder finished meanwhile is counted as finished (computed + skipped + busy = the units).
        while busy:
            again = {u.id: self.attempt(u) for u in busy}
            self.stats.skipped += sum(r == "done" for r in again.values())
            left = [u for u in busy if again[u.id] == "busy"]
            if len(left) == len(busy):
                break
            busy = left
        self.stats.busy = len(busy)
        return self.stats

    def attempt(self, u: Unit) -> str:
        """Compute unit ``u`` unless finished or held: "done", "busy" or "computed"."""
        store, a = self.store, self.args
        if store.is_done(u.id, a.redo_before, a.retry_before, u.key):
            store.clear_stale_lock(u.id, a.lock_timeout)  # left by a worker killed after its write
            return "done"
        lock = store.claim(u.id, a.lock_timeout)
        if lock is None:
            return "busy"
        try:
            if store.is_done(
                u.id, a.redo_before, a.retry_before, u.key
            ):  # finished while we claimed
                return "done"
            job, rec = self._compute(u, lock)
        finally:
            lock.release()
        self._count_and_report(u, job, rec)
        return "computed"

    def _compute(self, u: Unit, lock: Lock) -> tuple[Job, dict[str, Any]]:
        """Measure the unit under a heartbeat on its lock and write its record."""
        import torch

        if self.keep is None:
            self.keep = kept.CheckpointCache()
        with Heartbeat(lock, self.args.lock_timeout / 4):
            t0 = time.perf_counter()
            if self.delay:
                time.sleep(self.delay)
            plan = self.plan
            job = plan.job(u.checkpoint_index)
            row = measure_job(
                self.cfg,
                job,
                [plan.spec(u.label)],
                self.data,
                self.settings,
                MeasureOptions(debug=self.debug),
                kept.Reuse(budget_among=[plan.spec(lab) for lab in plan.labels], keep=self.keep),
            )
            rec = unit_record(
                uid=u.id,
                key=u.key,
                checkpoint=job.checkpoint,
                checkpoint_index=u.checkpoint_index,
                label=u.label,
                label_index=u.label_index,
                labels=plan.labels,
                row=row,
                device=str(self.settings.device),
                seconds=time.perf_counter() - t0,
                sweep_id=self.args.sweep_id,
                threads=torch.get_num_threads(),
            )
            self.store.write_unit(rec)
        return job, rec

    def _count_and_report(self, u: Unit, job: Job, rec: dict[str, Any]) -> None:
        """Count a computed unit (and an error), log its line and pass its record to ``on_unit``."""
        self.stats.computed += 1
        res = rec["result"]
        if rec["status"] == "error":
            self.stats.errors += 1
        if self.progress is not None:
            self.progress.add()
        if self.log is not None:
            what = f"{res['seconds']:.2f}s" if res else ""
            err = f" {rec['measure_error'] or rec['error']}" if rec["status"] == "error" else ""
            st = res["status"] if res and rec["status"] == "ok" else rec["status"]
            count = (
                f"{self.stats.computed}/{self.todo}"
                if self.progress is None
                else f"{self.progress.finished()}/{self.progress.planned}"
            )
            self.log(f"[{self.tag}] {job.checkpoint} {u.label} {st} {what} ({count}){err}")
        if self.on_unit is not None:
            self.on_unit(rec)


def run_shard_task(
    outdir: str, index: int, count: int, args: WorkerArgs, units: list[str] | None = None
) -> dict[str, int]:
    """One task of a job array (what submitit pickles): the worker over shard ``index/count``, or
    over ``units`` (unit ids: the coordinator's share of the unfinished units, balanced by cost);
    ``args`` what every worker of the sweep run is told. Torch's threads are the plan's
    ``runtime.threads`` for one worker on the task's cores (put back after: submitit's debug
    backend runs the task in the caller's process)."""
    import torch

    before = torch.get_num_threads()
    threads = load_plan(outdir).config.get("runtime", {}).get("threads", "auto")
    apply_threads(choose_threads(threads, 1))
    try:
        st = run_worker(
            outdir,
            shard=None if units is not None else (index, count),
            only=units,
            redo_before=args.redo_before,
            retry_before=args.retry_before,
            lock_timeout=args.lock_timeout,
            sweep_id=args.sweep_id,
            progress=args.progress,
            tag=f"task {index}/{count}",
        )
    finally:
        torch.set_num_threads(before)
    return {"computed": st.computed, "errors": st.errors, "skipped": st.skipped, "busy": st.busy}


# ------------------------------------------------------------------ worker entry point
def _stop_on_sigterm() -> None:
    """SIGTERM (how a pool's coordinator stops its workers) ends the unit in flight as Ctrl-C
    would: its lock is released and nothing is written for it."""

    def stop(signum, frame):
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop)


def parse_progress(text: str | None) -> tuple[int, int] | None:
    """``"K/N"`` (K of a run's N units finished when it started) → (K, N)."""
    if text is None:
        return None
    try:
        k, n = (int(p) for p in str(text).split("/"))
    except ValueError:
        k = n = -1
    if not 0 <= k <= n:
        raise ConfigError(f"`progress` must look like K/N with 0 ≤ K ≤ N. Got {text!r} instead.")
    return k, n


def in_pool() -> bool:
    """Whether this process is a worker of a local pool (its coordinator speaks for it)."""
    return os.environ.get(POOL_ENV) == "1"


def run_worker_process(
    outdir: str | os.PathLike,
    *,
    shard: str | None = None,
    worker: int = 0,
    workers: int = 1,
    device: str | None = None,
    redo_before: float | None = None,
    retry_before: float | None = None,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    threads: int | str | None = None,
    sweep_id: str | None = None,
    progress: str | None = None,
) -> str | None:
    """The body of ``flatcli sweep-worker`` (a worker process of a pool or an array task).

    Sets torch's intra-op (and inter-op) threads first: ``threads`` (what the pool's coordinator
    chose), else the plan's ``runtime.threads`` for ``workers`` workers on this machine's cores
    (`flatcli.threads`). ``progress``: "K/N", K of the run's N units finished when it started.
    Returns the summary line (its counts add up to the worker's units), or None in a local pool,
    whose coordinator prints the run's one summary. Error units are results (rows with status
    "error"), not a failure of the worker. SIGTERM stops it as Ctrl-C does.
    """
    import torch

    _stop_on_sigterm()
    if threads is None:
        threads = load_plan(outdir).config.get("runtime", {}).get("threads", "auto")
    apply_threads(choose_threads(threads, workers), interop=True)
    st = run_worker(
        outdir,
        shard=parse_shard(shard),
        worker=worker,
        workers=workers,
        device=device,
        redo_before=redo_before,
        retry_before=retry_before,
        lock_timeout=lock_timeout,
        sweep_id=sweep_id,
        progress=parse_progress(progress),
    )
    if in_pool():
        return None
    total = st.computed + st.skipped + st.busy
    return (
        f"[w{worker}] done: {total} units: {st.computed} computed ({st.errors} with errors), "
        f"{st.skipped} already finished, {st.busy} left to other workers; "
        f"{torch.get_num_threads()} thread(s)"
    )


@dataclass(frozen=True)
class WorkerArgs:
    """What every worker of one sweep run is told: its shard, the resume cut-offs, the lock timeout.

    ``redo_before``/``retry_before``: units (error units) finished before these times count
    as unfinished (``--no-resume``, ``--retry-failed``)."""

    shard: tuple[int, int] | None
    redo_before: float | None
    retry_before: float | None
    lock_timeout: float
    sweep_id: str | None = None  # the sweep run's id, stored in the unit records its workers write
    progress: tuple[int, int] | None = None  # (finished at the run's start, planned): `Progress`

    def argv(self) -> list[str]:
        """These arguments as ``flatcli sweep-worker`` options."""
        out = ["--lock-timeout", repr(float(self.lock_timeout))]
        if self.sweep_id is not None:
            out += ["--sweep-id", self.sweep_id]
        if self.shard is not None:
            out += ["--shard", f"{self.shard[0]}/{self.shard[1]}"]
        if self.redo_before is not None:
            out += ["--redo-before", repr(self.redo_before)]
        if self.retry_before is not None:
            out += ["--retry-before", repr(self.retry_before)]
        if self.progress is not None:
            out += ["--progress", f"{self.progress[0]}/{self.progress[1]}"]
        return out
