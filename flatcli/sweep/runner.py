"""Running a sweep: the coordinator (local worker pools, shards, SLURM via submitit).

The pieces: `flatcli.sweep.plan` (units and plan.json), `flatcli.sweep.worker` (the worker
loop), `flatcli.sweep.collect` (rows back into one table), `flatcli.sweep.store` (keys, row
files, locks).

``run_sweep`` writes ``OUTDIR/plan.json`` (the resolved config, every checkpoint with
its fingerprint and hyperparameters, every unit) and then runs workers. A worker
(`run_worker`) reads only the plan, so the same worker runs in this process, as a
local subprocess pinned to one GPU (``flatcli sweep-worker OUTDIR ...``, a hidden command),
or as one task of a SLURM array (`run_shard_task`, submitted through submitit).

A worker walks its units (all of them, or those of its ``--shard I/N``), skips
finished ones, claims the next with a lock file (created whole: `create_lock_file`), measures it
(`flatcli.run.checkpoint.measure_job` with that one measure), writes the unit's row file
atomically and releases the lock. Units locked by a live worker are left to it;
locks of dead workers (same host) or without a heartbeat for ``lock_timeout``
seconds are broken.

Why one unit per checkpoint × measure rather than per checkpoint: adding a measure
or changing one measure's options recomputes only that measure's units; expensive
measures spread over workers instead of one worker holding a whole checkpoint; a
crash loses one measure, not a checkpoint's worth. A worker keeps the checkpoint of its
last unit (`flatcli.run.reuse.CheckpointCache`): consecutive units of one checkpoint load it and
evaluate its train/test metrics once (and the seeds make each measure's value independent of
the others, so the collected table equals ``flatcli measure``'s).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError, MeasurementError, exit_code_of
from ..loading.load import DataCache
from ..loading.text import TOKENIZED_DIR
from ..measures import MeasureSpec
from ..run.checkpoint import first_checkpoint
from ..run.jobs import Job, coerce_cell
from ..run.settings import Settings
from ..threads import apply_threads, choose_threads, thread_choice
from ..validation import EXECUTORS
from .plan import Plan, Unit, build_plan, write_plan
from .store import (
    DEFAULT_LOCK_TIMEOUT,
    Store,
    parse_shard,
    shard_of,
)
from .worker import WorkerArgs, default_log, run_shard_task, run_worker


# ------------------------------------------------------------------ the coordinator
@dataclass
class SweepReport:
    """What a sweep run did (or with ``dry_run`` would do): unit counts, workers, submitted jobs,
    the lines it printed, and the kinds of the error units (for `exit_code`)."""

    outdir: Path
    units: int  # in the plan
    selected: int  # in this shard (= units without --shard)
    already_done: int  # finished before this run (and kept)
    computed: int = 0  # by this run's workers
    errors: int = 0  # error units of this shard (whenever computed)
    pending: int = 0  # unfinished units of this shard after the run, not held by a live worker
    by_others: int = 0  # finished during this run by other processes (e.g. a concurrent sweep)
    busy: int = 0  # held by another live worker when this run ended (still being computed there)
    seconds: float = 0.0
    executor: str = "local"
    workers: list[str] = field(default_factory=list)
    jobs: list[str] = field(default_factory=list)  # submitted job ids (slurm)
    lines: list[str] = field(default_factory=list)  # what --dry-run would do / did
    dry_run: bool = False
    error_kinds: list[str] = field(default_factory=list)  # kinds of the error units
    threads: str = ""  # the intra-op threads chosen per local worker, in words (flatcli.threads)

    @property
    def exit_code(self) -> int:
        """`flatcli.errors.exit_code` over the error units of this shard."""
        return max((exit_code_of(k) for k in self.error_kinds), default=0)

    def summary(self) -> str:
        """What this run did, in one line: the units its own workers computed, then what other
        processes sharing the folder finished meanwhile or still hold, the errors, the rest."""
        out = f"{self.computed} units computed"
        others = [
            f"{n} {what}"
            for n, what in (
                (self.by_others, "finished by another process meanwhile"),
                (self.busy, "still running in another process"),
            )
            if n
        ]
        if others:
            out += f" ({', '.join(others)})"
        return (
            out + f", {self.errors} with errors, {self.pending} not finished ({self.seconds:.1f}s)"
        )


def _gpu_list(gpus: str) -> list[int]:
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            f"`gpus` {gpus}: no CUDA device is visible; drop `gpus` to run on CPU workers"
        )
    n = torch.cuda.device_count()
    if gpus == "all":
        return list(range(n))
    try:
        ids = [int(g) for g in gpus.split(",") if g.strip()]
    except ValueError:
        raise ConfigError(
            f"`gpus` must be 'all' or a comma-separated list of indices like 0,1; got {gpus!r}"
        ) from None
    bad = [g for g in ids if not 0 <= g < n]
    if bad or not ids:
        raise ConfigError(f"`gpus` {gpus}: {n} CUDA device(s) visible (indices 0..{n - 1})")
    return ids


@dataclass(frozen=True)
class WorkerSlot:
    """One local worker: the device it is told to use, the environment it runs with (e.g.
    ``CUDA_VISIBLE_DEVICES``, ``OMP_NUM_THREADS``), its name in messages and its intra-op threads."""

    device: str
    env: dict[str, str]
    label: str
    threads: int = 1


def worker_slots(
    device: str, gpus: str | None, workers: int | None, threads: int | str = "auto"
) -> list[WorkerSlot]:
    """One worker per GPU (``--gpus``, or every visible GPU when the device is auto/cuda), else CPU
    workers; each with the intra-op threads `flatcli.threads.choose_threads` gives ``threads`` for
    that many workers on this machine (W workers on C cores: C // W each with ``auto``)."""
    if workers is not None and workers < 1:
        raise ConfigError(f"`workers` must be ≥ 1; got {workers}")
    ids: list[int] = []
    if gpus is not None:
        if workers is not None:
            raise ConfigError(
                "`workers` is for CPU sweeps; with `gpus` there is one worker per GPU"
            )
        ids = _gpu_list(gpus)
    elif device in ("auto", "cuda") or device.startswith("cuda"):
        import torch

        if workers is not None and device != "auto":
            raise ConfigError(
                f"`workers` runs CPU workers but runtime.device is {device!r}; use `gpus` (or `device` cpu)"
            )
        if torch.cuda.is_available() and workers is None:
            if device.startswith("cuda:"):
                ids = [int(device.split(":")[1])]
            else:
                ids = list(range(torch.cuda.device_count()))
        elif device.startswith("cuda"):
            raise ConfigError(
                f"runtime.device is {device!r} but no CUDA device is visible; use `device` cpu"
            )
    if ids:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        phys = [v.strip() for v in visible.split(",")] if visible else None
        k = choose_threads(threads, len(ids))
        out = []
        for i in ids:
            p = phys[i] if phys and i < len(phys) else str(i)
            env = {"CUDA_VISIBLE_DEVICES": p, "OMP_NUM_THREADS": str(k)}
            out.append(WorkerSlot(device="cuda:0", env=env, label=f"cuda:{i}", threads=k))
        return out
    n = workers or 1
    k = choose_threads(threads, n)
    return [
        WorkerSlot(device="cpu", env={"OMP_NUM_THREADS": str(k)}, label="cpu", threads=k)
        for _ in range(n)
    ]


@dataclass(frozen=True)
class SweepOptions:
    """How a sweep runs: the options of ``flatcli sweep`` (see `flatcli.api.sweep`)."""

    gpus: str | None = None
    workers: int | None = None
    shard: tuple[int, int] | str | None = None
    executor: str = "local"
    resume: bool = True
    retry_failed: bool = False
    dry_run: bool = False
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT
    tasks: int | None = None
    slurm: dict[str, Any] | None = None
    cluster: str = "slurm"
    wait: bool = False

    def __post_init__(self):

        if isinstance(self.shard, str):
            object.__setattr__(self, "shard", parse_shard(self.shard))
        if self.executor not in EXECUTORS:
            raise ConfigError(f"`executor` must be local or slurm; got {self.executor!r}")
        if self.lock_timeout <= 0:
            raise ConfigError(f"`lock_timeout` must be > 0 seconds; got {self.lock_timeout}")
        if self.executor == "slurm" and self.shard is not None:
            raise ConfigError(
                "`shard` and `executor` slurm are exclusive: the job array makes its own shards"
            )


def _worker_args(opts: SweepOptions, start: float, sweep_id: str | None = None) -> WorkerArgs:
    """The arguments for a sweep run ``sweep_id`` of ``opts`` that started at time ``start``."""
    return WorkerArgs(
        opts.shard,
        None if opts.resume else start,
        start if opts.retry_failed else None,
        opts.lock_timeout,
        sweep_id,
    )


def _worker_argv(outdir, w: int, n: int, wp: WorkerSlot, args: WorkerArgs) -> list[str]:
    return [
        sys.executable,
        "-m",
        "flatcli",
        "sweep-worker",
        str(outdir),
        "--worker",
        str(w),
        "--workers",
        str(n),
        "--device",
        wp.device,
        "--threads",
        str(wp.threads),
        *args.argv(),
    ]


@dataclass
class _Counts:
    """The units of one sweep run's selection after it ran (see `SweepReport`)."""

    computed: int = 0
    by_others: int = 0
    busy: int = 0
    pending: int = 0
    kinds: list[str] = field(default_factory=list)


def _status_counts(store: Store, units: list[Unit], since: float, args: WorkerArgs) -> _Counts:
    """Count the units this run computed (its id in their records), those other processes finished
    meanwhile, those still held by a live worker, and the unfinished rest; the error kinds."""
    out = _Counts()
    for u in units:
        rec = store.read_unit(u.id)
        if rec is None or not store.is_done(u.id, args.redo_before, args.retry_before, u.key):
            if store.is_held(u.id, args.lock_timeout):
                out.busy += 1
            else:
                out.pending += 1
            continue
        if args.sweep_id is not None and rec.get("sweep_id") == args.sweep_id:
            out.computed += 1
        elif float(rec.get("finished_at", 0)) >= since:
            out.by_others += 1
        if rec.get("status") == "error":
            out.kinds.append(rec.get("error_kind") or "")
    return out


def run_sweep(
    cfg,
    specs: list[MeasureSpec],
    jobs: list[Job],
    outdir: str | os.PathLike,
    opts: SweepOptions | None = None,
    *,
    log: Callable[[str], None] | None = default_log,
    on_unit: Callable[[dict[str, Any]], None] | None = None,
    debug: bool = False,
) -> SweepReport:
    """Plan the sweep into ``outdir`` and run (or submit, or describe) its workers."""
    opts = opts or SweepOptions()
    t_start = time.time()
    t0 = time.perf_counter()
    outdir = Path(outdir)
    store = Store(outdir, warn=log, log=log)
    plan = build_plan(cfg, specs, jobs)
    args = _worker_args(opts, t_start, sweep_id=uuid.uuid4().hex[:12])
    selected = plan.units_for(opts.shard)
    already = sum(store.is_done(u.id, args.redo_before, args.retry_before, u.key) for u in selected)
    report = SweepReport(
        outdir=outdir,
        units=len(plan.units),
        selected=len(selected),
        already_done=already,
        executor=opts.executor,
        dry_run=opts.dry_run,
    )
    todo = len(selected) - already
    shard = opts.shard
    report.lines.append(
        f"{len(plan.checkpoints)} checkpoints × {len(plan.specs)} measures = {len(plan.units)} units"
        + (f"; shard {shard[0]}/{shard[1]} holds {len(selected)}" if shard else "")
        + f"; {already} finished, {todo} to run"
    )
    waited = True
    if opts.executor == "slurm":
        waited = _submit_slurm(report, plan, store, opts, args)
    else:
        _run_local(report, cfg, plan, opts, args, todo, log=log, on_unit=on_unit, debug=debug)
    if not opts.dry_run:
        store.clear_stale_locks_of_finished(opts.lock_timeout)
        n = _status_counts(store, selected, t_start, args)
        report.computed, report.by_others, report.busy, report.pending = (
            n.computed,
            n.by_others,
            n.busy,
            n.pending,
        )
        report.errors, report.error_kinds = len(n.kinds), n.kinds
        if opts.executor == "slurm" and not waited:
            report.pending = todo  # the array runs on its own: its units are not finished yet
    report.seconds = time.perf_counter() - t0
    return report


def _run_local(
    report: SweepReport,
    cfg,
    plan: Plan,
    opts: SweepOptions,
    args: WorkerArgs,
    todo: int,
    *,
    log,
    on_unit,
    debug,
) -> None:
    """Run (or with ``dry_run`` describe) the local workers: in this process, or one process per GPU/worker."""
    outdir = report.outdir
    wps = worker_slots(cfg.runtime.device, opts.gpus, opts.workers, cfg.runtime.threads)
    report.workers = [wp.label for wp in wps]
    report.threads = str(thread_choice(cfg.runtime.threads, len(wps)))
    if opts.dry_run:
        report.lines.append(report.threads)
        if len(wps) == 1:
            report.lines.append(f"would run 1 worker in this process on {wps[0].label}")
        for w, wp in enumerate(wps if len(wps) > 1 else []):
            env = " ".join(f"{k}={v}" for k, v in wp.env.items())
            argv = _worker_argv(outdir, w, len(wps), wp, args)
            report.lines.append(f"would run: {env + ' ' if env else ''}{' '.join(argv[1:])}")
        return
    write_plan(outdir, plan)
    if todo == 0:
        return
    if log is not None:
        log(report.threads)
    data = DataCache(cfg, Path(outdir) / TOKENIZED_DIR)
    first_checkpoint(  # the first checkpoint's pre-flight, then the data loaded once
        cfg,
        plan.job(0) if plan.checkpoints else None,
        [plan.spec(lab) for lab in plan.labels],
        Settings.from_config(cfg, wps[0].label),
        data,
    )
    if len(wps) == 1:
        apply_threads(wps[0].threads)
        run_worker(
            outdir,
            shard=args.shard,
            device=wps[0].label,
            redo_before=args.redo_before,
            retry_before=args.retry_before,
            lock_timeout=args.lock_timeout,
            log=log,
            on_unit=on_unit,
            data=data,
            debug=debug,
            sweep_id=args.sweep_id,
        )
    else:
        _run_pool(outdir, wps, args)


def _run_pool(outdir, wps: list[WorkerSlot], args: WorkerArgs) -> None:
    procs = []
    try:
        for w, wp in enumerate(wps):
            argv = _worker_argv(outdir, w, len(wps), wp, args)
            procs.append(subprocess.Popen(argv, env={**os.environ, **wp.env}))
        codes = [p.wait() for p in procs]
    except BaseException:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        raise
    bad = [(w, c) for w, c in enumerate(codes) if c != 0]
    if bad:
        raise MeasurementError(
            "sweep worker(s) failed: "
            + ", ".join(f"worker {w} exited with {c}" for w, c in bad)
            + "; rerun the same command to resume"
        )


SLURM_DEFAULTS = {"timeout_min": 240, "cpus_per_task": 4}


def _coerce(v: str) -> Any:
    out = coerce_cell(v)
    return {"true": True, "false": False}.get(out.lower(), out) if isinstance(out, str) else out


def parse_slurm_params(items: list[str] | None) -> dict[str, Any]:
    """``["slurm_partition=gpu", "timeout_min=60"]`` → dict (values coerced to int/float/bool)."""
    out: dict[str, Any] = {}
    for it in items or []:
        if "=" not in it:
            raise ConfigError(f"`slurm` takes KEY=VALUE (a submitit parameter); got {it!r}")
        k, v = it.split("=", 1)
        out[k.strip()] = _coerce(v.strip())
    return out


def _submit_slurm(
    report: SweepReport, plan: Plan, store: Store, opts: SweepOptions, args: WorkerArgs
) -> bool:
    """Submit the array (or describe it); True when its tasks ran to completion here."""
    outdir, tasks, params, cluster, dry_run = (
        report.outdir,
        opts.tasks,
        opts.slurm or {},
        opts.cluster,
        opts.dry_run,
    )
    redo_before, retry_before, lock_timeout = args.redo_before, args.retry_before, args.lock_timeout
    pending = [u for u in plan.units if not store.is_done(u.id, redo_before, retry_before, u.key)]
    n = tasks if tasks is not None else max(1, min(len(plan.checkpoints), len(pending) or 1))
    if n < 1:
        raise ConfigError(f"`tasks` must be ≥ 1; got {n}")
    shards = sorted({shard_of(u.id, n) for u in pending})
    device = plan.config.get("runtime", {}).get("device", "auto")
    p = {
        **SLURM_DEFAULTS,
        "gpus_per_node": 0 if device == "cpu" else 1,
        "name": "flatcli-sweep",
        "slurm_array_parallelism": n,
        **params,
    }
    report.workers = [f"array task {i}/{n}" for i in shards]
    if dry_run or not pending:
        verb = "would submit" if dry_run else "nothing to submit for"
        report.lines.append(
            f"{verb} a job array of {len(shards)} task(s) (shards of {n}) to {cluster} "
            f"via submitit, logs in {outdir / 'slurm'}"
        )
        report.lines.append("parameters: " + ", ".join(f"{k}={v}" for k, v in p.items()))
        for i in shards:
            k = sum(shard_of(u.id, n) == i for u in pending)
            report.lines.append(
                f"task {i}: flatcli sweep-worker {outdir} --shard {i}/{n}  ({k} units)"
            )
        if not dry_run:
            write_plan(outdir, plan)
        return True
    try:
        import submitit
    except ImportError:
        raise ConfigError("`executor` slurm needs submitit: pip install 'flatcli[slurm]'") from None
    if cluster == "slurm" and shutil.which("sbatch") is None:
        raise ConfigError(
            "`executor` slurm: 'sbatch' is not on PATH (run on a SLURM login node, or use `dry_run`)"
        )
    write_plan(outdir, plan)
    ex = submitit.AutoExecutor(folder=outdir / "slurm" / "%j", cluster=cluster)
    try:
        ex.update_parameters(**p)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"`slurm` parameters rejected by submitit: {e}") from None
    out = str(outdir.resolve())
    jobs = ex.map_array(
        run_shard_task,
        [out] * len(shards),
        shards,
        [n] * len(shards),
        [redo_before] * len(shards),
        [retry_before] * len(shards),
        [lock_timeout] * len(shards),
        [args.sweep_id] * len(shards),
    )
    report.jobs = [j.job_id for j in jobs]
    report.lines.append(
        f"submitted {len(jobs)} task(s) to {cluster}: {', '.join(report.jobs[:8])}"
        + (" ..." if len(jobs) > 8 else "")
    )
    if opts.wait or cluster == "debug":
        for j in jobs:
            j.result()
        return True
    return False
