"""`measure`: every configured measure on every checkpoint, results written after each measure
(Ctrl-C keeps them), ``--resume`` reusing finished ones, ranks joined under torchrun."""

from __future__ import annotations

import copy
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import Config
from ..engine import dist
from ..errors import ConfigError, ExitCode, RankFailure, ResultsWriteError, budget_code, exit_code
from ..extras import PLOT_HINT, have_matplotlib
from ..keys import caps, data_fingerprints
from ..loading.jobs import Job
from ..loading.load import DataCache
from ..loading.text import TOKENIZED_DIR
from ..locks import hold_folder
from ..measures import MeasureResult, MeasureSpec, get_measure
from ..run.kept import Reuse
from ..run.measuring import first_checkpoint, measure_job, versions
from ..run.results import (
    Row,
    check_still_there,
    ensure_writable_dir,
    to_frame,
    write_results,
    write_results_or_fallback,
)
from ..run.settings import MeasureOptions, RunOptions, Settings
from ..validation import Bool, Function, Optional, check_fields, opt
from ._setup import _jobs_and_specs, load_run, takes_run, use_threads
from .previous import REUSABLE as REUSABLE  # re-exported
from .previous import measure_keys, prepare_resume, stored_key
from .previous import previous_results as previous_results


@dataclass
class MeasureReport:
    """What `measure` returns: the rows, the resolved config, metadata, and where results went.

    ``written_to`` is the folder of results.csv/json (a temporary fallback folder when the output
    directory could not be written at the end; ``write_error`` then says why)."""

    rows: list[Row]
    config: Config
    meta: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    written_to: Path | None = None
    write_error: str = ""
    rank: int = 0  # this process's rank under torchrun (only rank 0 writes and prints)

    def to_pandas(self):
        """One row per checkpoint, the columns of results.csv in its order; dtypes as documented
        in `flatcli.run.results` (numeric columns float64, ``status`` categorical). Equal to
        ``flatcli.run.results.read_results("OUTDIR/results.csv")``."""
        return to_frame(self.rows)

    @property
    def exit_code(self) -> int:
        """0 when every row is ok, else the exit code of the failures (`flatcli.errors.exit_code`);
        1 when the results could only be written to the fallback folder; without a failure, 4
        when a budget left a measure without a value (`flatcli.errors.budget_code`)."""
        failed = max(exit_code(self.rows), ExitCode.FAILED if self.write_error else ExitCode.OK)
        return failed or budget_code(self.rows)


_HOOK = Optional(Function())


@dataclass(frozen=True)
class Reporting:
    """How `measure` reports while it runs (``reporting=``), validated at construction (a bad value
    is a `ConfigError` naming the field); the defaults report nothing.

    ``on_start(i, n, job)`` before a checkpoint, ``on_row(i, n, row)`` after it,
    ``on_progress(label, info)`` while a measure runs, ``on_measure(row, label, reused)`` after each
    measure (``reused``: taken from the earlier run), ``on_note(line)`` the line saying how many
    measures are reused and recomputed and why (also ``report.meta["resume"]``), and that finished
    results of another configuration were kept as OUTDIR/results.prev.json and .csv. ``debug``:
    print the traceback of a failed measurement (it is still recorded in its row)."""

    on_start: Callable[[int, int, Job], None] | None = opt(None, _HOOK, "on_start(i, n, job)")
    on_row: Callable[[int, int, Row], None] | None = opt(None, _HOOK, "on_row(i, n, row)")
    on_progress: Callable[[str, dict], None] | None = opt(None, _HOOK, "on_progress(label, info)")
    on_measure: Callable[[Row, str, bool], None] | None = opt(None, _HOOK, "on_measure(...)")
    on_note: Callable[[str], None] | None = opt(None, _HOOK, "on_note(line)")
    debug: bool = opt(False, Bool(), "print a failed measurement's traceback")

    def __post_init__(self):
        check_fields(self)


@takes_run
def measure(
    config: Config | str | Path | dict,
    checkpoints: Sequence[str] | None = None,
    *,
    measures: Sequence[str] | str | None = None,
    run: RunOptions | None = None,
    outdir: str | Path | None = None,
    reporting: Reporting | None = None,
    plots: bool = False,
    resume: bool = False,
) -> MeasureReport:
    """Measure every checkpoint of a config; write the results when an output folder is given.

    Parameters
    ----------
    config : Config, str, Path or dict
        The config: a YAML path, a mapping of its keys or a loaded `flatcli.config.Config`.
    checkpoints : sequence of str, optional
        Checkpoints to measure instead of the config's ``checkpoints`` (paths or globs).
    measures : str or sequence of str, optional
        Labels or measure names (``"hessian_trace,frobenius_norm"``, ``"all"``); default the
        config's ``measures``. A configured label keeps its options, another name runs with
        its defaults.
    run : RunOptions, optional
        Overrides of the config's ``runtime.*`` keys (device, precision, seed, threads,
        allow_unsafe_pickle, budget), what the CLI's shared flags build.
        ``run.threads`` sizes torch's intra-op threads (`use_threads`; the choice is
        ``report.meta["threads"]``); ``run.budget`` (seconds or ``"10m"``) caps each
        checkpoint's measures together (`flatcli.run.shares`).
    outdir : str or Path, optional
        Where results.csv and results.json go (default the config's ``output.dir`` when set,
        else nothing is written). Both are rewritten atomically after every finished measure,
        the measures still to run marked ``interrupted``, so a Ctrl-C or a ``kill -9`` keeps
        every finished measure.
    reporting : Reporting, optional
        The hooks (``on_start``, ``on_row``, ``on_progress``, ``on_measure``, ``on_note``) and
        ``debug`` (`Reporting`; default: no hooks, no tracebacks).
    plots : bool
        Draw each measure's artifacts (e.g. the spectral density) as
        ``OUTDIR/plots/<NNN>_<checkpoint stem>_<label>.png``; needs matplotlib and ``outdir``.
        The paths are in ``report.meta["plots"]``.
    resume : bool
        Reuse the finished measures of ``OUTDIR/results.json`` whose key matches (`measure_keys`,
        `flatcli.keys`: the checkpoint's and data files' fingerprints, the whole resolved
        configuration but a named list of keys, the measure's revision) and whose status is not
        ``interrupted`` or ``error``; compute the rest.

    Returns
    -------
    MeasureReport
        One row per checkpoint; ``exit_code`` is 0 when every row is ok, 2 when a checkpoint
        failed on bad input (file, state dict), 1 when a measurement failed.

    Raises
    ------
    MeasureInterrupted
        On Ctrl-C, after the finished measures were written once more (the CLI exits 130).
    """
    if plots:
        if not have_matplotlib():
            raise ConfigError(f"`plots`: {PLOT_HINT}")
    cfg = load_run(config, run)
    write = outdir is not None or cfg.provenance.get("output.dir", "default") != "default"
    if plots and not write:
        raise ConfigError("`plots` needs an output directory (`outdir`)")
    jobs, specs = _jobs_and_specs(cfg, checkpoints, measures)
    out = ensure_writable_dir(cfg.output_dir(outdir), "output directory") if write else None
    st, world = _join_ranks(Settings.from_config(cfg))
    r = reporting if reporting is not None else Reporting()
    with _hold(out if world.is_main else None):
        return _measure_held(
            cfg,
            jobs,
            specs,
            out,
            st,
            world,
            r.debug,
            plots,
            resume,
            r.on_start,
            r.on_row,
            r.on_progress,
            r.on_measure,
            r.on_note,
        )


def _hold(out: Path | None):
    """Hold OUTDIR's lock while `measure` writes there (`flatcli.locks.hold_folder`): a second
    run into the same folder is refused with exit code 2; nothing to hold without a folder."""
    import contextlib
    import logging

    if out is None:
        return contextlib.nullcontext()
    return hold_folder(out, "output directory", log=logging.getLogger("flatcli").warning)


def _measure_held(
    cfg,
    jobs,
    specs,
    out,
    st,
    world,
    debug,
    plots,
    resume,
    on_start,
    on_row,
    on_progress,
    on_measure,
    on_note,
) -> MeasureReport:
    """`measure` once the ranks are joined and OUTDIR is held."""
    threads_used = use_threads(cfg)
    if not world.is_main:  # only rank 0 prints and writes; every rank computes
        on_row = on_start = on_progress = on_measure = on_note = None
    data = DataCache(cfg, None if out is None else out / TOKENIZED_DIR)
    shared = (
        out  # every rank reads OUTDIR/results.json for --resume: they must reuse the same measures
    )
    if not world.is_main:
        out = None
    first = first_checkpoint(cfg, jobs[0] if jobs else None, specs, st, data)
    meta = {
        "config": cfg.to_dict(),
        "config_hash": cfg.hash(),
        "versions": versions(),
        "device": st.describe_device(),
        "measure_data": cfg.to_dict()["measure_data"],
        "ranks": world.world,
        "threads": threads_used,
    }
    saver = _Saver(cfg, shared, out is not None, meta, jobs, specs, resume)
    if saver.resume.note:
        meta["resume"] = saver.resume.note
        if on_note:
            on_note(saver.resume.note)
    t0 = time.perf_counter()
    failed = None
    try:
        rows = _measure_all(
            cfg, specs, data, st, saver, debug, on_start, on_row, on_progress, on_measure, first
        )
    except ResultsWriteError as e:  # the run stops; every finished measure is kept
        rows, failed = e.rows, e
    if failed is None or world.world == 1:  # the other ranks go on: no barrier with them
        _leave_ranks(world)
    report = MeasureReport(
        rows=rows, config=cfg, meta=meta, seconds=time.perf_counter() - t0, rank=world.rank
    )
    if out is not None:
        report.written_to, report.write_error = write_results_or_fallback(
            out, rows, {**meta, "complete": failed is None}
        )
        if failed is not None:
            n = sum(r.status != "interrupted" for row in rows for r in row.results.values())
            report.write_error = (
                f"{failed}; the run stopped: {n} finished measure(s) written with their "
                f"status to {report.written_to}"
            )
            if world.world > 1:  # end every rank (the CLI exits 1; torchrun stops the others)
                raise RankFailure(report.write_error)
        if plots and not report.write_error:
            report.meta["plots"] = [str(q) for q in _artifacts(rows, specs, out / "plots")]
    return report


class MeasureInterrupted(KeyboardInterrupt):
    """Ctrl-C during `measure`: the finished measures were written (the message says where)."""


class _Saver:
    """results.csv/json after every finished measure of `measure` (nothing without an output
    directory): the rows done, the running row, and the rest ``interrupted``."""

    def __init__(
        self,
        cfg: Config,
        folder: Path | None,
        write: bool,
        meta: dict[str, Any],
        jobs: list[Job],
        specs: list[MeasureSpec],
        resume: bool,
    ):

        self.cfg, self.meta, self.jobs, self.specs = cfg, meta, jobs, specs
        self.folder = folder  # OUTDIR (on every rank: --resume reads it)
        self.out = folder if write else None  # where to write (rank 0)
        self.data = data_fingerprints(cfg) if folder is not None else {}
        meta["data_fingerprints"] = self.data
        self.resume = prepare_resume(
            cfg, jobs, specs, folder, resume, self.data, self.out is not None
        )
        config = cfg.to_dict()
        self.caps = {s.label: caps(config, s) for s in specs}
        self.current: Row | None = None
        self.keys: dict[str, str] = {}
        self.reuse: dict[str, Any] = {}
        self.done = 0  # checkpoints started

    def start(self, job: Job) -> tuple[dict[str, str], dict[str, Any]]:
        """(keys, results to reuse) of the checkpoint that starts."""
        self.current = None
        i, self.done = self.done, self.done + 1
        if self.folder is None:
            self.keys = {}
        elif i < len(self.resume.keys):
            self.keys = self.resume.keys[i]
        else:
            self.keys = measure_keys(self.cfg, job, self.specs, self.data)
        self.reuse = self.resume.reuse(self.keys, self.specs, self.cfg.to_dict())
        return self.keys, self.reuse

    def stored_keys(self, row: Row) -> dict[str, str]:
        """The keys the row's results are stored under (`flatcli.api.previous.stored_key`)."""
        return {
            lab: stored_key(k, r.status if (r := row.results.get(lab)) else "", self.caps[lab])
            for lab, k in self.keys.items()
        }

    def _rows(self, rows: list[Row]) -> list[Row]:
        """Every checkpoint's row: those done, the running one, then the rest, each measure that
        has no result marked ``interrupted``."""
        labels = [s.label for s in self.specs]
        running = (
            [self.current]
            if self.current is not None and (not rows or rows[-1] is not self.current)
            else []
        )
        out = list(rows) + running
        out += [
            Row(checkpoint=j.checkpoint, labels=labels, hparams=dict(j.hparams))
            for j in self.jobs[len(out) :]
        ]
        copies = []
        for r in out:
            c = copy.copy(r)
            c.results = dict(r.results)
            for lab in labels:
                if lab not in c.results and lab not in c.errors:
                    c.results[lab] = MeasureResult(value=float("nan"), status="interrupted")
                    c.status = "interrupted" if c.status == "ok" else c.status
            copies.append(c)
        return copies

    def save(self, rows: list[Row], current: Row) -> None:
        """Write after one finished measure of ``current`` (the row of the running checkpoint)."""
        current.keys = self.stored_keys(current)
        self.current = current
        if self.out is not None:
            try:
                check_still_there(self.out)
                write_results(self.out, self._rows(rows), self._meta())
            except OSError as e:  # stop: every later write would fail and nothing is lost yet
                raise ResultsWriteError(self.out, e) from e

    def _meta(self) -> dict[str, Any]:
        return {**self.meta, "complete": False}

    def interrupt(self, rows: list[Row]) -> str:
        """Write on Ctrl-C; the message for the user."""
        if self.out is None:
            return "interrupted"
        done = self._rows(rows)
        write_results(self.out, done, self._meta())
        n = sum(r.status != "interrupted" for row in done for r in row.results.values())
        return f"interrupted: {n} finished measure(s) kept in {self.out / 'results.csv'}"


def _measure_all(
    cfg: Config,
    specs: list[MeasureSpec],
    data: DataCache,
    st: Settings,
    saver: _Saver,
    debug: bool,
    on_start,
    on_row,
    on_progress,
    on_measure,
    first=None,
) -> list[Row]:
    """Every checkpoint's row (`measure`), the results written after each measure by ``saver``;
    Ctrl-C raises `MeasureInterrupted` once what finished is written. ``first``: the first
    checkpoint's pre-flight (`flatcli.run.measuring.first_checkpoint`): it is not loaded again."""
    rows: list[Row] = []

    def finished(row: Row, label: str) -> None:
        saver.save(rows, row)
        if on_measure:
            on_measure(row, label, label in saver.reuse)

    jobs = saver.jobs
    try:
        for i, job in enumerate(jobs):
            if on_start:
                on_start(i, len(jobs), job)
            reuse = saver.start(job)[1]
            row = measure_job(
                cfg,
                job,
                specs,
                data,
                st,
                MeasureOptions(debug=debug, progress=on_progress, on_measure=finished),
                Reuse(results=reuse, checked=first if i == 0 else None),
            )
            row.keys = saver.stored_keys(row)
            rows.append(row)
            if on_row:
                on_row(i, len(jobs), row)
    except KeyboardInterrupt:
        raise MeasureInterrupted(saver.interrupt(rows)) from None
    except ResultsWriteError as e:
        e.rows = saver._rows(rows)
        raise
    return rows


def _join_ranks(st: Settings):
    """(settings, ranks): under torchrun (or any launcher setting RANK/WORLD_SIZE/LOCAL_RANK) this
    process joins the others (gloo on the CPU, nccl with GPU ``cuda:LOCAL_RANK``) and measures its
    shard of every measurement set; otherwise rank 0 of 1 and the settings unchanged."""
    world, device = dist.init_from_env(st.device)
    return (st.replace(device=device) if device != st.device else st), world


def _leave_ranks(world) -> None:

    dist.leave(world)


def _artifacts(rows: list[Row], specs, folder: Path) -> list[Path]:
    """Every measure's artifacts (its registry hook), ``NNN_<checkpoint stem>_<label>.*`` in ``folder``."""
    hooks = [(s.label, get_measure(s.name).artifacts) for s in specs]
    paths: list[Path] = []
    for i, row in enumerate(rows):
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(row.checkpoint).stem) or "model"
        for lab, hook in hooks:
            res = row.results.get(lab)
            if hook is None or res is None or res.status == "error":
                continue
            paths += hook(
                res, folder / f"{i:03d}_{stem}_{lab}", f"{Path(row.checkpoint).name}: {lab}"
            )
    return paths
