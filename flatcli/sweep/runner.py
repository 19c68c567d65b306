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
(`flatcli.run.measuring.measure_job` with that one measure), writes the unit's row file
atomically and releases the lock. Units locked by a live worker are left to it;
locks of dead workers (same host) or without a heartbeat for ``lock_timeout``
seconds are broken.

Why one unit per checkpoint × measure rather than per checkpoint: adding a measure
or changing one measure's options recomputes only that measure's units; expensive
measures spread over workers instead of one worker holding a whole checkpoint; a
crash loses one measure, not a checkpoint's worth. A worker keeps the checkpoint of its
last unit (`flatcli.run.kept.CheckpointCache`): consecutive units of one checkpoint load it and
evaluate its train/test metrics once (and the seeds make each measure's value independent of
the others, so the collected table equals ``flatcli measure``'s).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError, ExitCode, MeasurementError, exit_code_of
from ..loading.jobs import Job, coerce_cell
from ..loading.load import DataCache
from ..loading.text import TOKENIZED_DIR
from ..locks import DEFAULT_LOCK_TIMEOUT
from ..measures import MeasureSpec
from ..run.measuring import first_checkpoint
from ..run.settings import Settings
from ..threads import apply_threads, choose_threads, thread_choice
from ..validation import (
    EXECUTORS,
    Bool,
    Either,
    Integral,
    Kind,
    OneOf,
    Optional,
    Real,
    Str,
    check_fields,
    message,
    opt,
)
from .plan import Plan, Unit, balance, build_plan, unit_costs, write_plan
from .store import Store, parse_shard
from .worker import POOL_ENV, Progress, WorkerArgs, default_log, run_shard_task, run_worker


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
        return max((exit_code_of(k) for k in self.error_kinds), default=ExitCode.OK)

    @property
    def finished(self) -> int:
        """Units of this shard finished now: before the run, by it, and by other processes."""
        return self.already_done + self.computed + self.by_others

    def parts(self) -> list[tuple[int, str]]:
        """Where every unit of this shard stands after the run, in words; the counts add up to
        ``selected`` (finished before, computed by this run, finished or held by another process,
        not finished). Those of other processes only when there are any."""
        out = [
            (self.already_done, "finished before"),
            (self.computed, "computed"),
            (self.by_others, "finished by another process meanwhile"),
            (self.busy, "still running in another process"),
            (self.pending, "not finished"),
        ]
        return [(n, what) for i, (n, what) in enumerate(out) if n or i in (0, 1, 4)]

    def summary(self) -> str:
        """What this run did, in one line whose counts add up to the units of this shard (`parts`),
        then the units with errors among them."""
        of = f"{self.selected} units" + (" of this shard" if self.selected != self.units else "")
        parts = ", ".join(f"{n} {what}" for n, what in self.parts())
        return f"{of}: {parts}; {self.errors} with errors ({self.seconds:.1f}s)"


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C during `run_sweep`: its workers were stopped (the units in flight released, nothing
    half-written); ``report`` counts what is finished. The message says so; the command line adds
    the command that resumes."""

    def __init__(self, report: SweepReport):
        self.report = report
        r = report
        super().__init__(
            f"interrupted: {r.finished} of {r.selected} units finished ({r.computed} by this run), "
            f"{r.selected - r.finished} to run"
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
            f"`gpus` must be 'all' or a comma-separated list of indices like 0,1. Got {gpus!r} instead."
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
        raise ConfigError(f"`workers` must be ≥ 1. Got {workers} instead.")
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


_FLAG = Bool()


@dataclass(frozen=True)
class SweepOptions:
    """How a sweep runs: the options of ``flatcli sweep`` (``flatcli.api.sweep(..., options=)``),
    validated at construction (a bad value is a `ConfigError` naming the field; `of` also names an
    unknown key of a mapping).

    ``gpus``: ``"all"`` or GPU indices ``"0,1"``, one worker process per GPU; ``workers``: CPU
    worker processes (default 1); ``shard``: ``(i, n)`` or ``"i/n"``, only shard i of n;
    ``executor``: ``local`` (worker processes here), ``slurm`` (a job array through submitit,
    with ``tasks``, ``slurm`` parameters, ``wait`` and ``cluster``) or ``local-array`` (that array
    run on this machine by submitit's local executor); ``resume``: skip finished units;
    ``retry_failed``: rerun units that finished with an error; ``dry_run``: say what would run,
    run nothing; ``lock_timeout``: seconds without a heartbeat after which another worker's lock
    is stale; ``debug``: print a failed measurement's traceback (its unit still records the
    error)."""

    gpus: str | None = opt(None, Optional(Str()), "'all' or GPU indices like '0,1'")
    workers: int | None = opt(None, Optional(Integral(1)), "CPU worker processes")
    shard: tuple[int, int] | str | None = opt(
        None,
        Optional(Either(Str(), Kind(tuple, list, words="a pair (i, n)"))),
        "only shard i of n: (i, n) or 'i/n'",
    )
    executor: str = opt("local", OneOf(*EXECUTORS), "where the workers run")
    resume: bool = opt(True, _FLAG, "skip finished units")
    retry_failed: bool = opt(False, _FLAG, "rerun units that finished with an error")
    dry_run: bool = opt(False, _FLAG, "say what would run; run nothing")
    lock_timeout: float = opt(
        DEFAULT_LOCK_TIMEOUT, Real(0, None, "neither"), "seconds before a silent lock is stale"
    )
    tasks: int | None = opt(None, Optional(Integral(1)), "slurm: array tasks")
    slurm: dict[str, Any] | None = opt(
        None, Optional(Kind(dict, words="a mapping of submitit parameters")), "slurm: parameters"
    )
    cluster: str = opt("slurm", Str(), "submitit backend: slurm, local or debug")
    wait: bool = opt(False, _FLAG, "slurm: wait for the array to finish")
    debug: bool = opt(False, _FLAG, "print a failed measurement's traceback")

    def __post_init__(self):
        check_fields(self)
        if self.shard is not None:
            shard = self.shard if isinstance(self.shard, str) else "/".join(map(str, self.shard))
            object.__setattr__(self, "shard", parse_shard(shard))
        if self.executor != "local" and self.shard is not None:
            raise ConfigError(
                f"`shard` and `executor` {self.executor} are exclusive: the job array makes its "
                "own shards"
            )

    @classmethod
    def of(cls, options: SweepOptions | Mapping[str, Any] | None) -> SweepOptions:
        """``options`` as a `SweepOptions`: itself, the defaults for None, or built from a mapping
        of its fields (an unknown key is a one-line `ConfigError` naming it)."""
        if options is None:
            return cls()
        if isinstance(options, cls):
            return options
        if not isinstance(options, Mapping):
            raise ConfigError(
                message("`options`", Kind(cls, dict, words="a SweepOptions or a mapping"), options)
            )
        names = [f.name for f in dataclasses.fields(cls)]
        for key in options:
            if key not in names:
                hint = difflib.get_close_matches(str(key), names, n=1)
                raise ConfigError(
                    f"Unknown sweep option {key!r}. "
                    + (
                        f"Did you mean {hint[0]!r}?"
                        if hint
                        else f"Valid options: {', '.join(names)}."
                    )
                )
        return cls(**options)


def _worker_args(opts: SweepOptions, start: float, sweep_id: str | None = None) -> WorkerArgs:
    """The arguments for a sweep run ``sweep_id`` of ``opts`` that started at time ``start`` (its
    progress counts are added once known: `dataclasses.replace`)."""
    return WorkerArgs(
        opts.shard,
        None if opts.resume else start,
        start if opts.retry_failed else None,
        opts.lock_timeout,
        sweep_id,
    )


def _worker_argv(outdir, w: int, n: int, wp: WorkerSlot, args: WorkerArgs) -> list[str]:
    """The command line of local worker ``w`` of ``n`` (run with this Python)."""
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

    before: int = 0
    computed: int = 0
    by_others: int = 0
    busy: int = 0
    pending: int = 0
    kinds: list[str] = field(default_factory=list)


def _status_counts(store: Store, units: list[Unit], since: float, args: WorkerArgs) -> _Counts:
    """Count the units finished before the run, those it computed (its id in their records), those
    other processes finished meanwhile, those still held by a live worker, and the unfinished rest;
    the error kinds."""
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
        else:
            out.before += 1
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
) -> SweepReport:
    """Plan the sweep into ``outdir`` and run (or submit, or describe) its workers."""
    opts = opts or SweepOptions()
    debug = opts.debug
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
    args = dataclasses.replace(args, progress=(already, len(selected)))
    progress = Progress.of(outdir, args.sweep_id, already, len(selected))
    waited = True
    try:
        if opts.executor != "local":
            waited = _submit_array(report, plan, store, opts, args)
        else:
            _run_local(report, cfg, plan, opts, args, todo, log=log, on_unit=on_unit, debug=debug)
    except KeyboardInterrupt:
        _count(report, store, selected, t_start, args, opts.lock_timeout)
        report.seconds = time.perf_counter() - t0
        raise SweepInterrupted(report) from None
    finally:
        if waited and progress is not None:  # an array left running keeps counting in it
            progress.clear()
    if not opts.dry_run:
        _count(report, store, selected, t_start, args, opts.lock_timeout)
        if not waited:  # the array runs on its own: its units are not finished yet
            report.pending, report.computed, report.busy = todo, 0, 0
    report.seconds = time.perf_counter() - t0
    return report


def _count(report: SweepReport, store: Store, selected, since: float, args, lock_timeout) -> None:
    """Fill ``report``'s counts from the store after the run (`_status_counts`)."""
    store.clear_stale_locks_of_finished(lock_timeout)
    n = _status_counts(store, selected, since, args)
    report.already_done, report.computed, report.by_others = n.before, n.computed, n.by_others
    report.busy, report.pending = n.busy, n.pending
    report.errors, report.error_kinds = len(n.kinds), n.kinds


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
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in wp.env.items())
            argv = _worker_argv(outdir, w, len(wps), wp, args)
            report.lines.append(f"would run: {env + ' ' if env else ''}{shlex.join(argv)}")
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
            progress=args.progress,
        )
    else:
        _run_pool(outdir, wps, args)


def _ignore_sigint() -> None:  # pragma: no cover (runs in the child before exec)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run_pool(outdir, wps: list[WorkerSlot], args: WorkerArgs) -> None:
    """Run the local workers as processes and wait for them. They ignore SIGINT (a Ctrl-C reaches
    the whole process group, and Python leaves an ignored SIGINT ignored), so that the coordinator
    alone answers it: it stops them with SIGTERM, which a worker takes as Ctrl-C (its unit in
    flight released), and then says once what is finished (`SweepInterrupted`)."""
    procs = []
    try:
        for w, wp in enumerate(wps):
            argv = _worker_argv(outdir, w, len(wps), wp, args)
            env = {**os.environ, **wp.env, POOL_ENV: "1"}
            procs.append(subprocess.Popen(argv, env=env, preexec_fn=_ignore_sigint))
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
                p.wait()
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
            raise ConfigError(
                f"`slurm` takes KEY=VALUE (a submitit parameter). Got {it!r} instead."
            )
        k, v = it.split("=", 1)
        out[k.strip()] = _coerce(v.strip())
    return out


def _default_tasks(opts: SweepOptions, plan: Plan, pending: int, cpus: int) -> int:
    """Array tasks when ``tasks`` is not given: one per checkpoint (at most one per unfinished
    unit); on this machine (``local-array``) also at most its cores ÷ ``cpus_per_task``."""
    n = max(1, min(len(plan.checkpoints), pending or 1))
    if opts.executor == "local-array":
        n = min(n, max(1, (os.cpu_count() or 1) // max(1, cpus)))
    return n


def _submit_array(
    report: SweepReport, plan: Plan, store: Store, opts: SweepOptions, args: WorkerArgs
) -> bool:
    """Submit the job array (or describe it); True when its tasks ran to completion here.

    ``slurm`` submits to SLURM; ``local-array`` runs the same array with submitit's local executor,
    one process per task on this machine, and waits for it. Each task gets its share of the
    unfinished units, balanced by predicted cost (`flatcli.sweep.plan.balance`)."""
    outdir, params, dry_run = report.outdir, opts.slurm or {}, opts.dry_run
    cluster = "local" if opts.executor == "local-array" else opts.cluster
    rb, tb = args.redo_before, args.retry_before
    pending = [u for u in plan.units if not store.is_done(u.id, rb, tb, u.key)]
    cpus = int(params.get("cpus_per_task", SLURM_DEFAULTS["cpus_per_task"]))
    n = opts.tasks if opts.tasks is not None else _default_tasks(opts, plan, len(pending), cpus)
    if n < 1:
        raise ConfigError(message("`tasks`", Integral(1), n))
    costs = unit_costs(plan, pending)
    shards = [s for s in balance(costs, n) if s]
    task_units = [[pending[k].id for k in s] for s in shards]
    device = plan.config.get("runtime", {}).get("device", "auto")
    p = {
        **SLURM_DEFAULTS,
        "gpus_per_node": 0 if device == "cpu" else 1,
        "name": "flatcli-sweep",
        "slurm_array_parallelism": n,
        **params,
    }
    report.workers = [f"array task {i}/{len(shards)}" for i in range(len(shards))]
    if dry_run or not pending:
        _describe_array(report, cluster, p, costs, shards, dry_run)
        if not dry_run:
            write_plan(outdir, plan)
        return True
    ex = _executor(outdir, cluster, p)
    write_plan(outdir, plan)
    out = str(outdir.resolve())
    k = len(shards)
    targs = dataclasses.replace(args, progress=(len(plan.units) - len(pending), len(plan.units)))
    jobs = ex.map_array(run_shard_task, [out] * k, list(range(k)), [k] * k, [targs] * k, task_units)
    report.jobs = [j.job_id for j in jobs]
    report.lines.append(
        f"submitted {len(jobs)} task(s) to {cluster}: {', '.join(report.jobs[:8])}"
        + (" ..." if len(jobs) > 8 else "")
    )
    if opts.wait or cluster in ("debug", "local"):
        for j in jobs:
            j.result()
        return True
    return False


def _describe_array(report, cluster: str, params, costs, shards, dry_run: bool) -> None:
    """The array's lines: what is (or would be) submitted, its parameters, each task's units and
    its share of the predicted cost."""
    verb = "would submit" if dry_run else "nothing to submit for"
    report.lines.append(
        f"{verb} a job array of {len(shards)} task(s) to {cluster} via submitit, "
        f"logs in {report.outdir / 'slurm'}"
    )
    report.lines.append("parameters: " + ", ".join(f"{k}={v}" for k, v in params.items()))
    total = sum(costs) or 1.0
    for i, s in enumerate(shards):
        share = sum(costs[k] for k in s) / total
        report.lines.append(f"task {i}: {len(s)} units, {share:.0%} of the predicted cost")


def _executor(outdir: Path, cluster: str, params: dict[str, Any]):
    """The submitit executor for ``cluster`` with ``params``; `ConfigError` without submitit, without
    sbatch for SLURM, or for parameters submitit rejects."""
    try:
        import submitit
    except ImportError:
        raise ConfigError("`executor` slurm needs submitit: pip install 'flatcli[slurm]'") from None
    if cluster == "slurm" and shutil.which("sbatch") is None:
        raise ConfigError(
            "`executor` slurm: 'sbatch' is not on PATH (run on a SLURM login node, or use "
            "`dry_run`, or `executor` local-array to try the array on this machine)"
        )
    ex = submitit.AutoExecutor(folder=outdir / "slurm" / "%j", cluster=cluster)
    try:
        ex.update_parameters(**params)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"`slurm` parameters rejected by submitit: {e}") from None
    return ex
