"""A sweep worker: walks its units (all, or a shard's), claims each with a lock file, measures it
(`flatcli.run.checkpoint.measure_job` with that one measure) and writes its row atomically; also the
hidden ``flatcli sweep-worker`` entry point and the SLURM task."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..loading.load import DataCache
from ..loading.text import TOKENIZED_DIR
from ..run import reuse
from ..run.checkpoint import measure_job
from ..run.jobs import Job
from ..run.settings import MeasureOptions, Settings
from ..threads import apply_threads, choose_threads
from .plan import Plan, Unit, load_plan
from .store import (
    DEFAULT_LOCK_TIMEOUT,
    Heartbeat,
    Lock,
    Store,
    parse_shard,
    unit_record,
)

DELAY_ENV = "FLATCLI_SWEEP_UNIT_DELAY"  # test hook: seconds to sleep inside every unit


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
) -> WorkerStats:
    """Compute the unfinished units of ``outdir``'s plan (of one shard), claiming each with a lock.

    ``worker``/``workers`` only rotate the starting point so that workers of one pool
    start on different units. ``redo_before``/``retry_before`` are timestamps: units
    (error units) finished before them count as unfinished (``--no-resume``, ``--retry-failed``).
    ``sweep_id`` (the id of the sweep run this worker belongs to) is stored in every unit record it
    writes, so that each sweep counts what it computed itself.
    """
    store = Store(outdir, warn=log, log=log)
    plan = load_plan(outdir)
    cfg = plan.cfg()
    settings = Settings.from_config(cfg, device)
    data = data if data is not None else DataCache(cfg, Path(outdir) / TOKENIZED_DIR)
    units = plan.units_for(shard)
    k = (len(units) * worker) // max(1, workers)
    loop = _WorkerLoop(
        store=store,
        plan=plan,
        cfg=cfg,
        settings=settings,
        data=data,
        args=WorkerArgs(shard, redo_before, retry_before, lock_timeout, sweep_id),
        delay=float(os.environ.get(DELAY_ENV) or 0.0),
        tag=f"w{worker}" + (f" shard {shard[0]}/{shard[1]}" if shard else ""),
        log=log,
        on_unit=on_unit,
        debug=debug,
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
        # Second passes: a unit whose holder died (dead pid on this host) is claimable now.
        while busy:
            left = [u for u in busy if self.attempt(u) == "busy"]
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
            self.keep = reuse.CheckpointCache()
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
                reuse.Reuse(budget_among=[plan.spec(lab) for lab in plan.labels], keep=self.keep),
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
        if self.log is not None:
            what = f"{res['seconds']:.2f}s" if res else ""
            err = f" {rec['measure_error'] or rec['error']}" if rec["status"] == "error" else ""
            st = res["status"] if res and rec["status"] == "ok" else rec["status"]
            self.log(
                f"[{self.tag}] {job.checkpoint} {u.label} {st} {what} ({self.stats.computed}/{self.todo}){err}"
            )
        if self.on_unit is not None:
            self.on_unit(rec)


def run_shard_task(
    outdir: str,
    index: int,
    count: int,
    redo_before=None,
    retry_before=None,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    sweep_id: str | None = None,
) -> dict[str, int]:
    """One task of a job array (what submitit pickles): the worker over shard ``index/count``."""
    st = run_worker(
        outdir,
        shard=(index, count),
        redo_before=redo_before,
        retry_before=retry_before,
        lock_timeout=lock_timeout,
        sweep_id=sweep_id,
    )
    return {"computed": st.computed, "errors": st.errors, "skipped": st.skipped, "busy": st.busy}


# ------------------------------------------------------------------ worker entry point
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
) -> str:
    """The body of ``flatcli sweep-worker`` (a worker process of a pool or an array task).

    Sets torch's intra-op (and inter-op) threads first: ``threads`` (what the pool's coordinator
    chose), else the plan's ``runtime.threads`` for ``workers`` workers on this machine's cores
    (`flatcli.threads`). Returns the summary line. Error units are results (rows with status
    "error"), not a failure of the worker.
    """
    import torch

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
    )
    return (
        f"[w{worker}] done: {st.computed} computed ({st.errors} errors), {st.skipped} already finished, "
        f"{st.busy} left to other workers; {torch.get_num_threads()} thread(s)"
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
        return out
