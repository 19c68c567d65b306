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
from ..errors import ConfigError, ResultsWriteError, exit_code
from ..jobs import Job
from ..loading.text import TOKENIZED_DIR
from ..measures import MeasureSpec
from ..pipeline import (
    DataCache,
    measure_job,
    versions,
)
from ..results import Row, ensure_writable_dir, write_results, write_results_or_fallback
from ..settings import RunOptions, Settings
from ._common import _plan, load_run, takes_run, use_threads


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
        in `flatcli.results` (numeric columns float64, ``status`` categorical). Equal to
        ``flatcli.results.read_results("OUTDIR/results.csv")``."""
        from ..results import to_frame

        return to_frame(self.rows)

    @property
    def exit_code(self) -> int:
        """0 when every row is ok, else the exit code of the failures (`flatcli.errors.exit_code`);
        1 when the results could only be written to the fallback folder."""
        return max(exit_code(self.rows), 1 if self.write_error else 0)


@takes_run
def measure(
    config: Config | str | Path | dict,
    checkpoints: Sequence[str] | None = None,
    *,
    measures: Sequence[str] | str | None = None,
    run: RunOptions | None = None,
    outdir: str | Path | None = None,
    on_row: Callable[[int, int, Row], None] | None = None,
    on_start: Callable[[int, int, Job], None] | None = None,
    on_progress: Callable[[str, dict], None] | None = None,
    debug: bool = False,
    plots: bool = False,
    resume: bool = False,
    on_measure: Callable[[Row, str, bool], None] | None = None,
) -> MeasureReport:
    """Measure every checkpoint of a config; write results when ``outdir`` is given.

    Results that survive: with an output directory, results.csv and results.json are rewritten
    (atomically: temp file + ``os.replace``) after every finished measure, the measures still to
    run marked ``interrupted``, so a Ctrl-C or a ``kill -9`` keeps every finished measure. On
    Ctrl-C (KeyboardInterrupt) the files are written once more and `MeasureInterrupted` (a
    KeyboardInterrupt; the CLI exits 130) is raised. Every measure in results.json carries its
    key (``rows[i].keys``: the sweep's unit id of checkpoint fingerprint, resolved measure config
    and flatcli version, `measure_keys`); with ``resume`` the measures of OUTDIR/results.json
    whose key matches and whose status is not ``interrupted`` or ``error`` are reused, not run.
    ``on_measure(row, label, reused)`` is called after each measure (``reused``: taken from the
    earlier run).

    With ``plots`` (needs matplotlib and an output directory), every measure that
    draws artifacts (e.g. a spectral-density plot) writes them as
    ``OUTDIR/plots/<NNN>_<checkpoint stem>_<label>.png`` (NNN the checkpoint's
    position); the paths are in ``report.meta["plots"]``. ``run`` (`flatcli.api.RunOptions`:
    device, precision, seed, threads, allow_unsafe_pickle, budget) overrides the config's
    ``runtime.*`` keys: ``run.threads`` sizes torch's intra-op threads (`use_threads`; the choice
    is ``report.meta["threads"]``), ``run.budget`` (seconds or "10m") caps each checkpoint's
    measures together (`flatcli.budget`). The old separate keywords (``device=`` ...) raise a
    TypeError naming ``run=RunOptions(...)``.

    Returns a `MeasureReport`; its ``exit_code`` is 0 when every row is ok, 2 when a
    checkpoint failed on bad input (file, state dict), 1 when a measurement failed.
    """
    if plots:
        from ..landscape.plots import PLOT_HINT, have_matplotlib

        if not have_matplotlib():
            raise ConfigError(f"`plots`: {PLOT_HINT}")
    cfg = load_run(config, run)
    write = outdir is not None or cfg.provenance.get("output.dir", "default") != "default"
    if plots and not write:
        raise ConfigError("`plots` needs an output directory (`outdir`)")
    jobs, specs = _plan(cfg, checkpoints, measures)
    out = ensure_writable_dir(cfg.output_dir(outdir), "output directory") if write else None
    st, world = _join_ranks(Settings.from_config(cfg))
    with _hold(out if world.is_main else None):
        return _measure_held(
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
        )


def _hold(out: Path | None):
    """Hold OUTDIR's lock while `measure` writes there (`flatcli.sweep.store.hold_folder`): a second
    run into the same folder is refused with exit code 2; nothing to hold without a folder."""
    import contextlib
    import logging

    from ..sweep.store import hold_folder

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
) -> MeasureReport:
    """`measure` once the ranks are joined and OUTDIR is held."""
    threads_used = use_threads(cfg)
    if not world.is_main:  # only rank 0 prints and writes; every rank computes
        on_row = on_start = on_progress = on_measure = None
    data = DataCache(cfg, None if out is None else out / TOKENIZED_DIR)
    shared = (
        out  # every rank reads OUTDIR/results.json for --resume: they must reuse the same measures
    )
    if not world.is_main:
        out = None
    if _check_before_data(cfg, jobs, st, specs):  # the first checkpoint fits (or is not checked)
        data.get("train")  # load the data once: a bad data config fails now
        data.get("test")
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
    t0 = time.perf_counter()
    failed = None
    try:
        rows = _measure_all(
            cfg, specs, data, st, saver, debug, on_start, on_row, on_progress, on_measure
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
                from ..errors import RankFailure

                raise RankFailure(report.write_error)
        if plots and not report.write_error:
            report.meta["plots"] = [str(q) for q in _artifacts(rows, specs, out / "plots")]
    return report


class MeasureInterrupted(KeyboardInterrupt):
    """Ctrl-C during `measure`: the finished measures were written (the message says where)."""


def measure_keys(cfg: Config, job: Job, specs: Sequence[MeasureSpec]) -> dict[str, str]:
    """Label → the key of one checkpoint × measure: the sweep's unit id (`flatcli.sweep.store`:
    sha256 fingerprints of the checkpoint, its init checkpoint and training set, the resolved
    measure configuration with defaults filled in, the flatcli version). Empty when a file cannot
    be read (nothing is reused then)."""
    from .._version import __version__
    from ..loading.checkpoints import fingerprint
    from ..sweep.store import measure_hash, unit_id

    try:
        fps = {
            "checkpoint": fingerprint(job.path),
            "init": None if job.init_checkpoint is None else fingerprint(job.init_checkpoint),
            "train_data": None if job.train_data is None else fingerprint(job.train_data),
        }
    except OSError:
        return {}
    config = cfg.to_dict()
    return {s.label: unit_id(fps, measure_hash(config, s), __version__) for s in specs}


REUSABLE = frozenset({"ok", "not_converged", "saturated", "not_applicable", "near_zero", "budget"})


def previous_results(outdir: Path) -> dict[str, Any]:
    """Key → `MeasureResult` of every finished measure in OUTDIR/results.json (``measure
    --resume``); measures ``interrupted`` or in ``error`` are not finished. An unreadable or
    missing file gives nothing (everything is computed)."""
    import json

    from ..sweep.store import _result_from

    try:
        rows = json.loads((Path(outdir) / "results.json").read_text()).get("rows") or []
    except (OSError, ValueError, AttributeError):
        return {}
    out = {}
    for r in rows:
        for lab, key in (r.get("keys") or {}).items():
            m = (r.get("measures") or {}).get(lab)
            if isinstance(m, dict) and m.get("status") in REUSABLE:
                out[key] = _result_from({**m, "value": _json_float(m.get("value"))})
    return out


def _json_float(v: Any) -> float:
    """A value as results.json writes it (null for NaN, "inf"/"-inf") back as a float."""
    return float("nan") if v is None else float(v)


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
        self.old = previous_results(folder) if resume and folder is not None else {}
        self.current: Row | None = None
        self.keys: dict[str, str] = {}
        self.reuse: dict[str, Any] = {}

    def start(self, job: Job) -> tuple[dict[str, str], dict[str, Any]]:
        """(keys, results to reuse) of the checkpoint that starts."""
        self.current = None
        self.keys = measure_keys(self.cfg, job, self.specs) if self.folder is not None else {}
        self.reuse = {lab: self.old[k] for lab, k in self.keys.items() if k in self.old}
        return self.keys, self.reuse

    def _rows(self, rows: list[Row]) -> list[Row]:
        """Every checkpoint's row: those done, the running one, then the rest, each measure that
        has no result marked ``interrupted``."""
        from ..measures import MeasureResult

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
        current.keys = self.keys
        self.current = current
        if self.out is not None:
            try:
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
) -> list[Row]:
    """Every checkpoint's row (`measure`), the results written after each measure by ``saver``;
    Ctrl-C raises `MeasureInterrupted` once what finished is written."""
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
            keys, reuse = saver.start(job)
            row = measure_job(
                cfg,
                job,
                specs,
                data,
                st,
                debug,
                progress=on_progress,
                on_measure=finished,
                reuse=reuse,
            )
            row.keys = keys
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
    from ..engine import dist

    world, device = dist.init_from_env(st.device)
    return (st.replace(device=device) if device != st.device else st), world


def _leave_ranks(world) -> None:
    from ..engine import dist

    dist.leave(world)


def _check_before_data(cfg, jobs, st, specs) -> bool:
    """Cheap checks against the first checkpoint's model before any data is loaded or tokenized:
    the ``params`` selection matches its parameter names, and a text split's ``max_length`` fits its
    positions (Hugging Face ``n_positions``/``max_position_embeddings``). Only when there is
    something to check; a checkpoint that cannot be loaded is left to its row.

    Returns whether the data is to be loaded now: False when ``runtime.check_memory`` finds that the
    first checkpoint will not fit (`flatcli.memory.check_model`); then each checkpoint loads the
    data when it gets there, after its own check, and one that will not fit never loads it. (The
    check loads the first checkpoint's model once more, as the selection check does.)"""
    from ..errors import FlatcliError
    from ..loading.hf import check_positions
    from ..memory import check_model
    from ..pipeline import load_model

    texts = [
        (k, s)
        for k in ("train", "test")
        if (s := getattr(cfg.data, k)) is not None
        and s.source == "text"
        and s.max_length is not None
    ]
    if not jobs or (
        st.params.everything
        and not (texts and cfg.model.source == "huggingface")
        and not st.check_memory
    ):
        return True
    try:
        model, _ = load_model(cfg, jobs[0].path)
    except FlatcliError:
        return True
    st.params.select(model)
    for k, s in texts:
        check_positions(model, f"data.{k}.max_length", s.max_length, jobs[0].path)
    return not st.check_memory or check_model(model, specs, st).fits


def _artifacts(rows: list[Row], specs, folder: Path) -> list[Path]:
    """Every measure's artifacts (its registry hook), ``NNN_<checkpoint stem>_<label>.*`` in ``folder``."""
    from ..measures import get_measure

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
