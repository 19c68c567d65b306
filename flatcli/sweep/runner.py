"""Running a sweep: the plan, the worker loop, local worker pools, shards, SLURM via submitit.

``run_sweep`` writes ``OUTDIR/plan.json`` (the resolved config, every checkpoint with
its fingerprint and hyperparameters, every unit) and then runs workers. A worker
(`run_worker`) reads only the plan, so the same worker runs in this process, as a
local subprocess pinned to one GPU (``flatcli sweep-worker OUTDIR ...``, a hidden command),
or as one task of a SLURM array (`run_shard_task`, submitted through submitit).

A worker walks its units (all of them, or those of its ``--shard I/N``), skips
finished ones, claims the next with an ``O_CREAT|O_EXCL`` lock file, measures it
(`flatcli.pipeline.measure_job` with that one measure), writes the unit's row file
atomically and releases the lock. Units locked by a live worker are left to it;
locks of dead workers (same host) or without a heartbeat for ``lock_timeout``
seconds are broken.

Why one unit per checkpoint × measure rather than per checkpoint: adding a measure
or changing one measure's options recomputes only that measure's units; expensive
measures spread over workers instead of one worker holding a whole checkpoint; a
crash loses one measure, not a checkpoint's worth. The price is loading the
checkpoint and evaluating train/test metrics once per unit, which is small next to
any curvature measure (and the seeds make each measure's value independent of the
others, so the collected table equals ``flatcli measure``'s).
"""

from __future__ import annotations

import json
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

from .._version import __version__
from ..errors import ConfigError, exit_code, exit_code_of
from ..jobs import Job, coerce_cell
from ..loading.checkpoints import fingerprint
from ..loading.text import TOKENIZED_DIR
from ..measures import MeasureSpec
from ..results import Row, atomic_write, to_csv
from .store import (
    DEFAULT_LOCK_TIMEOUT,
    PLAN_FILE,
    Heartbeat,
    Lock,
    Store,
    dumps,
    measure_hash,
    row_from_records,
    shard_of,
    unit_id,
    unit_record,
)

DELAY_ENV = "FLATCLI_SWEEP_UNIT_DELAY"  # test hook: seconds to sleep inside every unit


# ------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class Unit:
    """One unit of work, a checkpoint × one measure: its id (the hash of ``key``), the indices of
    its checkpoint and measure in the plan, the measure's label, and ``key`` (fingerprints,
    measure hash, version)."""

    id: str
    checkpoint_index: int
    label: str
    label_index: int
    key: dict[str, Any]


@dataclass
class Plan:
    """What a sweep computes; ``OUTDIR/plan.json`` (no timestamps: every shard writes the same file)."""

    config: dict[str, Any]
    base_dir: str
    config_hash: str
    version: str
    specs: list[dict[str, Any]]  # name, label, options, seed
    checkpoints: list[dict[str, Any]]  # checkpoint, path, fingerprint, init_checkpoint, train_data, hparams
    units: list[Unit]

    @property
    def labels(self) -> list[str]:
        """The measure labels, in the configured order."""
        return [s["label"] for s in self.specs]

    def spec(self, label: str) -> MeasureSpec:
        """The `MeasureSpec` of the measure labelled ``label``."""
        s = next(s for s in self.specs if s["label"] == label)
        return MeasureSpec(name=s["name"], label=s["label"], options=dict(s["options"]), seed=s["seed"],
                           max_seconds=s.get("max_seconds"), max_hvps=s.get("max_hvps"))

    def job(self, i: int) -> Job:
        """The `Job` of checkpoint ``i`` (its resolved paths and hyperparameters)."""
        c = self.checkpoints[i]
        opt = lambda k: Path(c[k]) if c.get(k) else None  # noqa: E731
        return Job(c["checkpoint"], Path(c["path"]), dict(c["hparams"]), opt("init_checkpoint"), opt("train_data"))

    def units_for(self, shard: tuple[int, int] | None) -> list[Unit]:
        """The units of shard ``(i, n)`` (`shard_of`), or every unit for None, in plan order."""
        if shard is None:
            return list(self.units)
        i, n = shard
        return [u for u in self.units if shard_of(u.id, n) == i]

    def cfg(self):
        """The sweep's `flatcli.config.Config`, rebuilt from the plan (no environment overrides)."""
        from ..config import from_dict

        return from_dict(self.config, base_dir=self.base_dir, env={})

    def to_json(self) -> dict[str, Any]:
        """The content of plan.json (format 1)."""
        return {
            "format": 1,
            "version": self.version,
            "config_hash": self.config_hash,
            "base_dir": self.base_dir,
            "config": self.config,
            "measures": self.specs,
            "checkpoints": self.checkpoints,
            "units": [
                {"id": u.id, "checkpoint_index": u.checkpoint_index, "label": u.label,
                 "label_index": u.label_index, "key": u.key}
                for u in self.units
            ],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Plan:
        """The plan from the content of plan.json (`to_json`)."""
        return cls(
            config=d["config"],
            base_dir=d["base_dir"],
            config_hash=d["config_hash"],
            version=d["version"],
            specs=d["measures"],
            checkpoints=d["checkpoints"],
            units=[Unit(u["id"], u["checkpoint_index"], u["label"], u["label_index"], u["key"]) for u in d["units"]],
        )


def build_plan(cfg, specs: list[MeasureSpec], jobs: list[Job]) -> Plan:
    """Fingerprint every checkpoint (and its init checkpoint / training set) and list the units."""
    config = cfg.to_dict()
    fps: dict[str, str] = {}

    def fp(p: Path | None) -> str | None:
        if p is None:
            return None
        k = str(Path(p).resolve())
        if k not in fps:
            try:
                fps[k] = fingerprint(p)
            except FileNotFoundError:
                raise ConfigError(f"file not found: {p}") from None
        return fps[k]

    mh = {s.label: measure_hash(config, s) for s in specs}
    checkpoints, units = [], []
    for ci, job in enumerate(jobs):
        key_fp = {"checkpoint": fp(job.path), "init": fp(job.init_checkpoint), "train_data": fp(job.train_data)}
        checkpoints.append({
            "checkpoint": job.checkpoint,
            "path": str(Path(job.path).resolve()),
            "fingerprint": key_fp["checkpoint"],
            "init_checkpoint": str(Path(job.init_checkpoint).resolve()) if job.init_checkpoint else None,
            "train_data": str(Path(job.train_data).resolve()) if job.train_data else None,
            "hparams": dict(job.hparams),
        })
        for li, s in enumerate(specs):
            key = {"fingerprints": key_fp, "measure_hash": mh[s.label], "version": __version__}
            units.append(Unit(unit_id(key_fp, mh[s.label], __version__), ci, s.label, li, key))
    ids = [u.id for u in units]
    if len(set(ids)) != len(ids):
        dup = sorted({checkpoints[u.checkpoint_index]["checkpoint"] for u in units if ids.count(u.id) > 1})
        raise ConfigError(f"the same checkpoint file is listed more than once: {', '.join(dup[:4])}")
    return Plan(
        config=config,
        base_dir=str(Path(cfg.base_dir).resolve()),
        config_hash=cfg.hash(),
        version=__version__,
        specs=[{"name": s.name, "label": s.label, "options": s.options, "seed": s.seed,
                **{k: getattr(s, k) for k in ("max_seconds", "max_hvps") if getattr(s, k) is not None}}
               for s in specs],
        checkpoints=checkpoints,
        units=units,
    )


def write_plan(outdir: str | os.PathLike, plan: Plan) -> Path:
    """Write ``OUTDIR/plan.json`` atomically; returns its path."""
    path = Path(outdir) / PLAN_FILE
    atomic_write(path, dumps(plan.to_json()))
    return path


def load_plan(outdir: str | os.PathLike) -> Plan:
    """The plan in ``OUTDIR/plan.json``; `ConfigError` when it is missing or not a plan."""
    path = Path(outdir) / PLAN_FILE
    if not path.is_file():
        raise ConfigError(f"{path} not found: run 'flatcli sweep -c CONFIG -o {outdir}' first")
    try:
        return Plan.from_json(json.loads(path.read_text()))
    except (ValueError, KeyError) as e:
        raise ConfigError(f"{path} is not a flatcli sweep plan ({type(e).__name__}: {e})") from None


# ------------------------------------------------------------------ the worker
@dataclass
class WorkerStats:
    """What one worker did: units computed (of them with errors), already finished, left busy."""

    computed: int = 0
    errors: int = 0
    skipped: int = 0  # already finished
    busy: int = 0  # left to another live worker


def _default_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


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
    log: Callable[[str], None] | None = _default_log,
    on_unit: Callable[[dict[str, Any]], None] | None = None,
    data=None,
    debug: bool = False,
    run: str | None = None,
) -> WorkerStats:
    """Compute the unfinished units of ``outdir``'s plan (of one shard), claiming each with a lock.

    ``worker``/``workers`` only rotate the starting point so that workers of one pool
    start on different units. ``redo_before``/``retry_before`` are timestamps: units
    (error units) finished before them count as unfinished (``--no-resume``, ``--retry-failed``).
    ``run`` (the id of the sweep run this worker belongs to) is stored in every unit record it
    writes, so that each sweep counts what it computed itself.
    """
    from ..pipeline import DataCache
    from ..settings import Settings

    store = Store(outdir)
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
        args=WorkerArgs(shard, redo_before, retry_before, lock_timeout, run),
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

    def run(self, order: list[Unit]) -> WorkerStats:
        """Attempt every unit in ``order``, then retry the busy ones while that frees some."""
        a = self.args
        self.todo = sum(not self.store.is_done(u.id, a.redo_before, a.retry_before) for u in order)
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
        if store.is_done(u.id, a.redo_before, a.retry_before):
            store.clear_stale_lock(u.id, a.lock_timeout)  # left by a worker killed after its write
            return "done"
        lock = store.claim(u.id, a.lock_timeout)
        if lock is None:
            return "busy"
        try:
            if store.is_done(u.id, a.redo_before, a.retry_before):  # finished while we claimed
                return "done"
            job, rec = self._compute(u, lock)
        finally:
            lock.release()
        self._count_and_report(u, job, rec)
        return "computed"

    def _compute(self, u: Unit, lock: Lock) -> tuple[Job, dict[str, Any]]:
        """Measure the unit under a heartbeat on its lock and write its record."""
        import torch

        from ..pipeline import measure_job

        with Heartbeat(lock, self.args.lock_timeout / 4):
            t0 = time.perf_counter()
            if self.delay:
                time.sleep(self.delay)
            plan = self.plan
            job = plan.job(u.checkpoint_index)
            row = measure_job(self.cfg, job, [plan.spec(u.label)], self.data, self.settings, self.debug,
                              budget_among=[plan.spec(lab) for lab in plan.labels])
            rec = unit_record(
                uid=u.id, key=u.key, checkpoint=job.checkpoint, checkpoint_index=u.checkpoint_index,
                label=u.label, label_index=u.label_index, labels=plan.labels, row=row,
                device=str(self.settings.device), seconds=time.perf_counter() - t0, run=self.args.run,
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
            self.log(f"[{self.tag}] {job.checkpoint} {u.label} {st} {what} ({self.stats.computed}/{self.todo}){err}")
        if self.on_unit is not None:
            self.on_unit(rec)


def run_shard_task(outdir: str, index: int, count: int, redo_before=None, retry_before=None,
                   lock_timeout: float = DEFAULT_LOCK_TIMEOUT, run: str | None = None) -> dict[str, int]:
    """One task of a job array (what submitit pickles): the worker over shard ``index/count``."""
    st = run_worker(outdir, shard=(index, count), redo_before=redo_before, retry_before=retry_before,
                    lock_timeout=lock_timeout, run=run)
    return {"computed": st.computed, "errors": st.errors, "skipped": st.skipped, "busy": st.busy}


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
        others = [f"{n} {what}" for n, what in ((self.by_others, "finished by another process meanwhile"),
                                                 (self.busy, "still running in another process")) if n]
        if others:
            out += f" ({', '.join(others)})"
        return out + f", {self.errors} with errors, {self.pending} not finished ({self.seconds:.1f}s)"


def _gpu_list(gpus: str) -> list[int]:
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"--gpus {gpus}: no CUDA device is visible; drop --gpus to run on CPU workers")
    n = torch.cuda.device_count()
    if gpus == "all":
        return list(range(n))
    try:
        ids = [int(g) for g in gpus.split(",") if g.strip()]
    except ValueError:
        raise ConfigError(f"--gpus must be 'all' or a comma-separated list of indices like 0,1; got {gpus!r}") from None
    bad = [g for g in ids if not 0 <= g < n]
    if bad or not ids:
        raise ConfigError(f"--gpus {gpus}: {n} CUDA device(s) visible (indices 0..{n - 1})")
    return ids


@dataclass(frozen=True)
class WorkerPlan:
    """One local worker: the device it is told to use, the environment it runs with (e.g.
    ``CUDA_VISIBLE_DEVICES``, ``OMP_NUM_THREADS``), its name in messages and its intra-op threads."""

    device: str
    env: dict[str, str]
    label: str
    threads: int = 1


def plan_workers(device: str, gpus: str | None, workers: int | None, threads: int | str = "auto") -> list[WorkerPlan]:
    """One worker per GPU (``--gpus``, or every visible GPU when the device is auto/cuda), else CPU
    workers; each with the intra-op threads `flatcli.threads.choose_threads` gives ``threads`` for
    that many workers on this machine (W workers on C cores: C // W each with ``auto``)."""
    from ..threads import choose_threads

    if workers is not None and workers < 1:
        raise ConfigError(f"--workers must be ≥ 1; got {workers}")
    ids: list[int] = []
    if gpus is not None:
        if workers is not None:
            raise ConfigError("--workers is for CPU sweeps; with --gpus there is one worker per GPU")
        ids = _gpu_list(gpus)
    elif device in ("auto", "cuda") or device.startswith("cuda"):
        import torch

        if workers is not None and device != "auto":
            raise ConfigError(f"--workers runs CPU workers but runtime.device is {device!r}; use --gpus (or --device cpu)")
        if torch.cuda.is_available() and workers is None:
            if device.startswith("cuda:"):
                ids = [int(device.split(":")[1])]
            else:
                ids = list(range(torch.cuda.device_count()))
        elif device.startswith("cuda"):
            raise ConfigError(f"runtime.device is {device!r} but no CUDA device is visible; use --device cpu")
    if ids:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        phys = [v.strip() for v in visible.split(",")] if visible else None
        k = choose_threads(threads, len(ids))
        out = []
        for i in ids:
            p = phys[i] if phys and i < len(phys) else str(i)
            env = {"CUDA_VISIBLE_DEVICES": p, "OMP_NUM_THREADS": str(k)}
            out.append(WorkerPlan(device="cuda:0", env=env, label=f"cuda:{i}", threads=k))
        return out
    n = workers or 1
    k = choose_threads(threads, n)
    return [WorkerPlan(device="cpu", env={"OMP_NUM_THREADS": str(k)}, label="cpu", threads=k) for _ in range(n)]


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
        from .store import parse_shard

        if isinstance(self.shard, str):
            object.__setattr__(self, "shard", parse_shard(self.shard))
        if self.executor not in ("local", "slurm"):
            raise ConfigError(f"--executor must be local or slurm; got {self.executor!r}")
        if self.lock_timeout <= 0:
            raise ConfigError(f"--lock-timeout must be > 0 seconds; got {self.lock_timeout}")
        if self.executor == "slurm" and self.shard is not None:
            raise ConfigError("--shard and --executor slurm are exclusive: the job array makes its own shards")


@dataclass(frozen=True)
class WorkerArgs:
    """What every worker of one sweep run is told: its shard, the resume cut-offs, the lock timeout.

    ``redo_before``/``retry_before``: units (error units) finished before these times count
    as unfinished (``--no-resume``, ``--retry-failed``)."""

    shard: tuple[int, int] | None
    redo_before: float | None
    retry_before: float | None
    lock_timeout: float
    run: str | None = None  # the sweep run's id, stored in the unit records its workers write

    @classmethod
    def of(cls, opts: SweepOptions, start: float, run: str | None = None) -> WorkerArgs:
        """The arguments for a run ``run`` of ``opts`` that started at time ``start``."""
        return cls(opts.shard, None if opts.resume else start, start if opts.retry_failed else None,
                   opts.lock_timeout, run)

    def argv(self) -> list[str]:
        """These arguments as ``flatcli sweep-worker`` options."""
        out = ["--lock-timeout", repr(float(self.lock_timeout))]
        if self.run is not None:
            out += ["--run", self.run]
        if self.shard is not None:
            out += ["--shard", f"{self.shard[0]}/{self.shard[1]}"]
        if self.redo_before is not None:
            out += ["--redo-before", repr(self.redo_before)]
        if self.retry_before is not None:
            out += ["--retry-before", repr(self.retry_before)]
        return out


def _worker_argv(outdir, w: int, n: int, wp: WorkerPlan, args: WorkerArgs) -> list[str]:
    return [sys.executable, "-m", "flatcli", "sweep-worker", str(outdir), "--worker", str(w), "--workers", str(n),
            "--device", wp.device, "--threads", str(wp.threads), *args.argv()]


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
        if rec is None or not store.is_done(u.id, args.redo_before, args.retry_before):
            if store.is_held(u.id, args.lock_timeout):
                out.busy += 1
            else:
                out.pending += 1
            continue
        if args.run is not None and rec.get("run") == args.run:
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
    log: Callable[[str], None] | None = _default_log,
    on_unit: Callable[[dict[str, Any]], None] | None = None,
    debug: bool = False,
) -> SweepReport:
    """Plan the sweep into ``outdir`` and run (or submit, or describe) its workers."""
    opts = opts or SweepOptions()
    t_start = time.time()
    t0 = time.perf_counter()
    outdir = Path(outdir)
    store = Store(outdir)
    plan = build_plan(cfg, specs, jobs)
    args = WorkerArgs.of(opts, t_start, run=uuid.uuid4().hex[:12])
    selected = plan.units_for(opts.shard)
    already = sum(store.is_done(u.id, args.redo_before, args.retry_before) for u in selected)
    report = SweepReport(outdir=outdir, units=len(plan.units), selected=len(selected), already_done=already,
                         executor=opts.executor, dry_run=opts.dry_run)
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
        report.computed, report.by_others, report.busy, report.pending = n.computed, n.by_others, n.busy, n.pending
        report.errors, report.error_kinds = len(n.kinds), n.kinds
        if opts.executor == "slurm" and not waited:
            report.pending = todo  # the array runs on its own: its units are not finished yet
    report.seconds = time.perf_counter() - t0
    return report


def _run_local(report: SweepReport, cfg, plan: Plan, opts: SweepOptions, args: WorkerArgs, todo: int, *,
               log, on_unit, debug) -> None:
    """Run (or with ``dry_run`` describe) the local workers: in this process, or one process per GPU/worker."""
    from ..pipeline import DataCache
    from ..threads import apply_threads, plan_threads

    outdir = report.outdir
    wps = plan_workers(cfg.runtime.device, opts.gpus, opts.workers, cfg.runtime.threads)
    report.workers = [wp.label for wp in wps]
    report.threads = str(plan_threads(cfg.runtime.threads, len(wps)))
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
    data = DataCache(cfg, Path(outdir) / TOKENIZED_DIR)  # load the data once: a bad data config fails now
    data.get("train")
    data.get("test")
    if len(wps) == 1:
        apply_threads(wps[0].threads)
        run_worker(outdir, shard=args.shard, device=wps[0].label, redo_before=args.redo_before,
                   retry_before=args.retry_before, lock_timeout=args.lock_timeout, log=log, on_unit=on_unit,
                   data=data, debug=debug, run=args.run)
    else:
        _run_pool(outdir, wps, args)


def _run_pool(outdir, wps: list[WorkerPlan], args: WorkerArgs) -> None:
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
        from ..errors import MeasurementError

        raise MeasurementError(
            "sweep worker(s) failed: " + ", ".join(f"worker {w} exited with {c}" for w, c in bad)
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
            raise ConfigError(f"--slurm takes KEY=VALUE (a submitit parameter); got {it!r}")
        k, v = it.split("=", 1)
        out[k.strip()] = _coerce(v.strip())
    return out


def _submit_slurm(report: SweepReport, plan: Plan, store: Store, opts: SweepOptions, args: WorkerArgs) -> bool:
    """Submit the array (or describe it); True when its tasks ran to completion here."""
    outdir, tasks, params, cluster, dry_run = report.outdir, opts.tasks, opts.slurm or {}, opts.cluster, opts.dry_run
    redo_before, retry_before, lock_timeout = args.redo_before, args.retry_before, args.lock_timeout
    pending = [u for u in plan.units if not store.is_done(u.id, redo_before, retry_before)]
    n = tasks if tasks is not None else max(1, min(len(plan.checkpoints), len(pending) or 1))
    if n < 1:
        raise ConfigError(f"--tasks must be ≥ 1; got {n}")
    shards = sorted({shard_of(u.id, n) for u in pending})
    device = plan.config.get("runtime", {}).get("device", "auto")
    p = {**SLURM_DEFAULTS, "gpus_per_node": 0 if device == "cpu" else 1, "name": "flatcli-sweep",
         "slurm_array_parallelism": n, **params}
    report.workers = [f"array task {i}/{n}" for i in shards]
    if dry_run or not pending:
        verb = "would submit" if dry_run else "nothing to submit for"
        report.lines.append(f"{verb} a job array of {len(shards)} task(s) (shards of {n}) to {cluster} "
                            f"via submitit, logs in {outdir / 'slurm'}")
        report.lines.append("parameters: " + ", ".join(f"{k}={v}" for k, v in p.items()))
        for i in shards:
            k = sum(shard_of(u.id, n) == i for u in pending)
            report.lines.append(f"task {i}: flatcli sweep-worker {outdir} --shard {i}/{n}  ({k} units)")
        if not dry_run:
            write_plan(outdir, plan)
        return True
    try:
        import submitit
    except ImportError:
        raise ConfigError("--executor slurm needs submitit: pip install 'flatcli[slurm]'") from None
    if cluster == "slurm" and shutil.which("sbatch") is None:
        raise ConfigError("--executor slurm: 'sbatch' is not on PATH (run on a SLURM login node, or use --dry-run)")
    write_plan(outdir, plan)
    ex = submitit.AutoExecutor(folder=outdir / "slurm" / "%j", cluster=cluster)
    try:
        ex.update_parameters(**p)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"--slurm parameters rejected by submitit: {e}") from None
    out = str(outdir.resolve())
    jobs = ex.map_array(
        run_shard_task, [out] * len(shards), shards, [n] * len(shards), [redo_before] * len(shards),
        [retry_before] * len(shards), [lock_timeout] * len(shards), [args.run] * len(shards),
    )
    report.jobs = [j.job_id for j in jobs]
    report.lines.append(f"submitted {len(jobs)} task(s) to {cluster}: {', '.join(report.jobs[:8])}"
                        + (" ..." if len(jobs) > 8 else ""))
    if opts.wait or cluster == "debug":
        for j in jobs:
            j.result()
        return True
    return False


# ------------------------------------------------------------------ collect
@dataclass
class CollectReport:
    """The collected table: its rows and measure labels, the files written, the units not
    finished, stale and unreadable unit files, run times by label and the devices used."""

    rows: list[Row]
    labels: list[str]
    csv_path: Path
    json_path: Path
    missing: list[tuple[str, str]] = field(default_factory=list)  # (checkpoint, label) not finished
    stale: int = 0  # unit files not in the current plan (older configs)
    unreadable: list[str] = field(default_factory=list)
    seconds_by_label: dict[str, list[float]] = field(default_factory=dict)
    devices: list[str] = field(default_factory=list)

    def to_pandas(self):
        """The collected table as a DataFrame: the columns of results.csv, dtypes as documented
        in `flatcli.results` (equal to ``flatcli.results.read_results(self.csv_path)``)."""
        from ..results import to_frame

        return to_frame(self.rows)

    @property
    def exit_code(self) -> int:
        """`flatcli.errors.exit_code` over the collected rows."""
        return exit_code(self.rows)


def collect(outdir: str | os.PathLike, output: str | os.PathLike | None = None) -> CollectReport:
    """Merge the unit files of ``outdir`` into ``results.csv`` (+ ``results.json`` beside it).

    Rows follow the plan's checkpoint order and have the same columns as ``flatcli measure``'s.
    Units missing from the plan's list are reported; unit files of older plans are ignored.
    """
    from ..pipeline import versions

    outdir = Path(outdir)
    if not outdir.is_dir():
        raise ConfigError(f"collect: {outdir} is not a directory")
    records, unreadable = _read_records(Store(outdir))
    if (outdir / PLAN_FILE).is_file():
        grouped = _group_by_plan(load_plan(outdir), records)
    else:
        grouped = _group_without_plan(outdir, records)
    labels, by_ckpt = grouped.labels, grouped.by_ckpt
    rows = [row_from_records(c, labels, by_ckpt[i], hp) for i, (c, hp) in enumerate(grouped.order)]
    seconds, devices = _seconds_and_devices(by_ckpt, labels)
    csv_path = Path(output) if output is not None else outdir / "results.csv"
    json_path = csv_path.with_suffix(".json")
    meta_cfg = grouped.meta_cfg
    meta = {
        **meta_cfg,
        "labels": labels,
        "versions": versions(),
        "device": ", ".join(sorted(d for d in devices if d)),
        "measure_data": meta_cfg.get("config", {}).get("measure_data"),
        "sweep": {"dir": str(outdir), "missing_units": len(grouped.missing), "stale_unit_files": grouped.stale},
    }
    from ..results import jsonable

    atomic_write(csv_path, to_csv(rows))
    atomic_write(json_path, json.dumps(jsonable({**meta, "rows": [r.to_json() for r in rows]}), indent=2))
    return CollectReport(rows=rows, labels=labels, csv_path=csv_path, json_path=json_path, missing=grouped.missing,
                         stale=grouped.stale, unreadable=unreadable, seconds_by_label=seconds,
                         devices=sorted(d for d in devices if d))


def _read_records(store: Store) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Every readable unit record by unit id, and the paths of the unreadable unit files."""
    records: dict[str, dict[str, Any]] = {}
    unreadable = []
    for p, rec in store.iter_records():
        if rec is None or "unit" not in rec:
            unreadable.append(str(p))
        else:
            records[rec["unit"]] = rec
    return records, unreadable


@dataclass
class _Grouped:
    """Unit records grouped by checkpoint: the measure labels, the checkpoints in order with their
    hyperparameters, each checkpoint's records by label, the (checkpoint, label) pairs without a
    record, the number of stale records (not in the plan) and the plan's config for results.json."""

    labels: list[str]
    order: list[tuple[str, dict[str, Any]]]
    by_ckpt: list[dict[str, dict[str, Any]]]
    missing: list[tuple[str, str]]
    stale: int
    meta_cfg: dict[str, Any]


def _group_by_plan(plan: Plan, records: dict[str, dict[str, Any]]) -> _Grouped:
    """The records of the plan's units, in the plan's order; records of other units are stale."""
    by_ckpt: list[dict[str, dict]] = [{} for _ in plan.checkpoints]
    missing = []
    for u in plan.units:
        rec = records.pop(u.id, None)
        if rec is None:
            missing.append((plan.checkpoints[u.checkpoint_index]["checkpoint"], u.label))
        else:
            by_ckpt[u.checkpoint_index][u.label] = rec
    return _Grouped(
        labels=plan.labels,
        order=[(c["checkpoint"], c["hparams"]) for c in plan.checkpoints],
        by_ckpt=by_ckpt,
        missing=missing,
        stale=len(records),
        meta_cfg={"config": plan.config, "config_hash": plan.config_hash},
    )


def _group_without_plan(outdir: Path, records: dict[str, dict[str, Any]]) -> _Grouped:
    """The records alone (no plan.json): checkpoints and labels in the order the records give
    (their indices); `ConfigError` when there is none."""
    if not records:
        raise ConfigError(f"collect: {outdir} holds no {PLAN_FILE} and no unit files; is it a sweep directory?")
    recs = sorted(records.values(), key=lambda r: (r.get("checkpoint_index", 0), r.get("label_index", 0)))
    labels = list(recs[0].get("labels") or [])
    for r in recs:
        if r["label"] not in labels:
            labels.append(r["label"])
    ckpts: dict[str, dict[str, dict]] = {}
    for r in recs:
        ckpts.setdefault(r["checkpoint"], {})[r["label"]] = r
    return _Grouped(
        labels=labels,
        order=[(c, {}) for c in ckpts],
        by_ckpt=list(ckpts.values()),
        missing=[(c, lab) for c, recs_c in ckpts.items() for lab in labels if lab not in recs_c],
        stale=0,
        meta_cfg={},
    )


def _seconds_and_devices(
    by_ckpt: list[dict[str, dict[str, Any]]], labels: list[str]
) -> tuple[dict[str, list[float]], set[str]]:
    """Each label's unit run times (units with a result) and the devices the units ran on."""
    seconds: dict[str, list[float]] = {lab: [] for lab in labels}
    devices = set()
    for recs_c in by_ckpt:
        for lab, rec in recs_c.items():
            if rec.get("result") is not None:
                seconds.setdefault(lab, []).append(float(rec["result"].get("seconds") or 0.0))
            devices.add(str(rec.get("worker", {}).get("device", "")))
    return seconds, devices


# ------------------------------------------------------------------ worker entry point
def run_worker_process(outdir: str | os.PathLike, *, shard: str | None = None, worker: int = 0, workers: int = 1,
                       device: str | None = None, redo_before: float | None = None,
                       retry_before: float | None = None, lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
                       threads: int | str | None = None, run: str | None = None) -> str:
    """The body of ``flatcli sweep-worker`` (a worker process of a pool or an array task).

    Sets torch's intra-op (and inter-op) threads first: ``threads`` (what the pool's coordinator
    chose), else the plan's ``runtime.threads`` for ``workers`` workers on this machine's cores
    (`flatcli.threads`). Returns the summary line. Error units are results (rows with status
    "error"), not a failure of the worker.
    """
    import torch

    from ..threads import apply_threads, choose_threads
    from .store import parse_shard

    if threads is None:
        threads = load_plan(outdir).config.get("runtime", {}).get("threads", "auto")
    apply_threads(choose_threads(threads, workers), interop=True)
    st = run_worker(outdir, shard=parse_shard(shard), worker=worker, workers=workers, device=device,
                    redo_before=redo_before, retry_before=retry_before, lock_timeout=lock_timeout, run=run)
    return (f"[w{worker}] done: {st.computed} computed ({st.errors} errors), {st.skipped} already finished, "
            f"{st.busy} left to other workers; {torch.get_num_threads()} thread(s)")
