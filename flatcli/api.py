"""The Python entry points: `measure`, `sweep`, `collect`, `correlate`, `landscape`, `check_invariance`.

Everything the CLI does goes through here; the CLI only parses and renders.

>>> import flatcli
>>> report = flatcli.measure("configs/digits_mlp.yaml")            # doctest: +SKIP
>>> report.rows[0].results["hessian_trace"].value                  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .config import Config, from_dict, load_config, overrides, parse_measures
from .errors import ConfigError, exit_code
from .jobs import Job, resolve_jobs
from .loading.data import subset
from .loading.text import TOKENIZED_DIR
from .measures import MeasureSpec
from .pipeline import (  # noqa: F401  (re-exported: the Python API)
    DataCache,
    as_specs,
    check_finite_model,
    check_targets,
    load_init_state,
    load_model,
    manifest_train_data,
    measure_job,
    measure_model,
    versions,
)
from .results import Row, ensure_writable_dir, write_results, write_results_or_fallback
from .settings import Settings

__all__ = [
    "MeasureReport", "check_invariance", "collect", "correlate", "landscape", "load", "load_model",
    "measure", "measure_model", "select_measures", "sweep",
]


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
        from .results import to_frame

        return to_frame(self.rows)

    @property
    def exit_code(self) -> int:
        """0 when every row is ok, else the exit code of the failures (`flatcli.errors.exit_code`);
        1 when the results could only be written to the fallback folder."""
        return max(exit_code(self.rows), 1 if self.write_error else 0)


def load(config: Config | str | Path | dict | None, changes: dict[str, Any] | None = None) -> Config:
    """A `Config` from a path, a mapping or a Config; ``changes`` ({"runtime.seed": 3, ...},
    None values ignored; see `flatcli.config.overrides`) win over everything, as CLI flags do."""
    if isinstance(config, Config):
        from .config import _set_path

        for k, v in (changes or {}).items():
            if v is not None:
                _set_path(config, k, v, "cli")
        return config
    if isinstance(config, dict):
        return from_dict(config, overrides=changes)
    return load_config(config, changes)


def use_threads(cfg: Config, workers: int | None = None) -> str:
    """Size torch's intra-op threads for this process from ``runtime.threads`` (`flatcli.threads`:
    ``auto`` is OMP_NUM_THREADS when set, else cores // workers, workers defaulting to
    LOCAL_WORLD_SIZE or 1); returns the choice in words for the log."""
    from .threads import configure_threads

    return str(configure_threads(cfg.runtime.threads, workers))



def _plan(cfg: Config, checkpoints, measures) -> tuple[list[Job], list[MeasureSpec]]:
    """Validate what every pipeline needs; resolve the jobs and the measures to run."""
    if not cfg.model.target and cfg.model.source != "huggingface":
        raise ConfigError("config key 'model.target' is required")
    if cfg.data.train is None:
        raise ConfigError("config key 'data.train' is required")
    jobs = resolve_jobs(cfg, list(checkpoints) if checkpoints else None)
    if not jobs:
        raise ConfigError("no checkpoints: list them under 'checkpoints' or pass paths on the command line")
    specs = select_measures(cfg, measures, has_init=any(j.init_checkpoint is not None for j in jobs))
    return jobs, specs

def select_measures(cfg: Config, names: Sequence[str] | str | None, has_init: bool | None = None) -> list[MeasureSpec]:
    """The config's measures, or those named (``-m``): a configured label or measure name keeps
    its configured options; another registered name runs with defaults; 'all' runs every measure."""
    specs = cfg.measure_specs()
    if names is None:
        if not specs:
            raise ConfigError("no measures configured: add a 'measures' list to the config or pass -m NAME,...")
        return specs
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    if list(names) == ["all"]:
        from .measures import list_measures

        chosen = []
        by_name = {s.name: s for s in specs}
        for info in list_measures():
            if info.needs_init and not (has_init if has_init is not None else cfg.init_checkpoint):
                continue
            chosen.append(by_name.get(info.name, MeasureSpec(info.name, info.name)))
        return chosen
    out = []
    for n in names:
        hit = [s for s in specs if s.label == n] or [s for s in specs if s.name == n]
        out.extend(hit if hit else parse_measures([n], "-m"))
    return out


def measure(
    config: Config | str | Path | dict,
    checkpoints: Sequence[str] | None = None,
    *,
    measures: Sequence[str] | str | None = None,
    device: str | None = None, precision: str | None = None,
    seed: int | None = None,
    outdir: str | Path | None = None,
    allow_unsafe_pickle: bool | None = None,
    on_row: Callable[[int, int, Row], None] | None = None,
    on_start: Callable[[int, int, Job], None] | None = None,
    on_progress: Callable[[str, dict], None] | None = None,
    debug: bool = False,
    plots: bool = False,
    threads: int | str | None = None,
    resume: bool = False,
    on_measure: Callable[[Row, str, bool], None] | None = None,
    budget: float | str | None = None,
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
    position); the paths are in ``report.meta["plots"]``. ``threads`` (``runtime.threads``) sizes
    torch's intra-op threads (`use_threads`; the choice is ``report.meta["threads"]``). ``budget``
    (``runtime.budget``: seconds or "10m") caps each checkpoint's measures together (`flatcli.budget`).

    Returns a `MeasureReport`; its ``exit_code`` is 0 when every row is ok, 2 when a
    checkpoint failed on bad input (file, state dict), 1 when a measurement failed.
    """
    if plots:
        from .landscape.plots import PLOT_HINT, have_matplotlib

        if not have_matplotlib():
            raise ConfigError(f"`plots`: {PLOT_HINT}")
    cfg = load(config, overrides(device=device, seed=seed, allow_unsafe_pickle=allow_unsafe_pickle, threads=threads,
                                 precision=precision, budget=budget))
    write = outdir is not None or cfg.provenance.get("output.dir", "default") != "default"
    if plots and not write:
        raise ConfigError("`plots` needs an output directory (`outdir`)")
    jobs, specs = _plan(cfg, checkpoints, measures)
    out = ensure_writable_dir(cfg.output_dir(outdir), "output directory") if write else None
    st, world = _join_ranks(Settings.from_config(cfg))
    threads_used = use_threads(cfg)
    if not world.is_main:  # only rank 0 prints and writes; every rank computes
        on_row = on_start = on_progress = on_measure = None
    data = DataCache(cfg, None if out is None else out / TOKENIZED_DIR)
    shared = out  # every rank reads OUTDIR/results.json for --resume: they must reuse the same measures
    if not world.is_main:
        out = None
    _check_before_data(cfg, jobs, st)
    data.get("train")
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
    rows = _measure_all(cfg, specs, data, st, saver, debug, on_start, on_row, on_progress, on_measure)
    _leave_ranks(world)
    report = MeasureReport(rows=rows, config=cfg, meta=meta, seconds=time.perf_counter() - t0, rank=world.rank)
    if out is not None:
        report.written_to, report.write_error = write_results_or_fallback(out, rows, {**meta, "complete": True})
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
    from ._version import __version__
    from .loading.checkpoints import fingerprint
    from .sweep.store import measure_hash, unit_id

    try:
        fps = {"checkpoint": fingerprint(job.path),
               "init": None if job.init_checkpoint is None else fingerprint(job.init_checkpoint),
               "train_data": None if job.train_data is None else fingerprint(job.train_data)}
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

    from .sweep.store import _result_from

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

    def __init__(self, cfg: Config, folder: Path | None, write: bool, meta: dict[str, Any], jobs: list[Job],
                 specs: list[MeasureSpec], resume: bool):
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
        from .measures import MeasureResult

        labels = [s.label for s in self.specs]
        running = [self.current] if self.current is not None and (not rows or rows[-1] is not self.current) else []
        out = list(rows) + running
        out += [Row(checkpoint=j.checkpoint, labels=labels, hparams=dict(j.hparams))
                for j in self.jobs[len(out):]]
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
            write_results(self.out, self._rows(rows), self._meta())

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


def _measure_all(cfg: Config, specs: list[MeasureSpec], data: DataCache, st: Settings, saver: _Saver, debug: bool,
                 on_start, on_row, on_progress, on_measure) -> list[Row]:
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
            row = measure_job(cfg, job, specs, data, st, debug, progress=on_progress, on_measure=finished,
                              reuse=reuse)
            row.keys = keys
            rows.append(row)
            if on_row:
                on_row(i, len(jobs), row)
    except KeyboardInterrupt:
        raise MeasureInterrupted(saver.interrupt(rows)) from None
    return rows


def _join_ranks(st: Settings):
    """(settings, ranks): under torchrun (or any launcher setting RANK/WORLD_SIZE/LOCAL_RANK) this
    process joins the others (gloo on the CPU, nccl with GPU ``cuda:LOCAL_RANK``) and measures its
    shard of every measurement set; otherwise rank 0 of 1 and the settings unchanged."""
    from .engine import dist

    world, device = dist.init_from_env(st.device)
    return (st.replace(device=device) if device != st.device else st), world


def _leave_ranks(world) -> None:
    from .engine import dist

    dist.leave(world)


@dataclass
class CostPlan:
    """What a run of the configured measures will cost: per checkpoint and measure label, the
    (least, most) of each engine counter (``n_hvp``, ``n_grad``, ``n_forward``, ``n_vjp``; full-set
    equivalents, ranges for adaptive estimators), and the sizes it was computed from; ``errors``
    holds (checkpoint, message) for every checkpoint that could not be loaded (no costs for it)."""

    checkpoints: list[str]
    labels: list[str]
    costs: list[dict[str, dict[str, tuple[int, int]] | None]]  # per loaded checkpoint: label -> counters
    dims: list[Any]  # per loaded checkpoint
    loaded: list[str] = field(default_factory=list)  # the checkpoints ``costs`` and ``dims`` are of
    errors: list[tuple[str, str]] = field(default_factory=list)
    params: dict[str, Any] | None = None  # the parameter selection on the first loaded model
    predictions: list[dict[str, Any]] = field(default_factory=list)  # per loaded checkpoint: label -> Prediction
    times: list[Any] = field(default_factory=list)  # per loaded checkpoint: its group's ProductTimes

    def to_json(self) -> list[dict[str, Any]]:
        """``--dry-run --format json``: one entry per loaded checkpoint × measure (`flatcli.predict.Prediction`)."""
        return [pred.to_json(ckpt, lab) for ckpt, per in zip(self.loaded, self.predictions, strict=True)
                for lab, pred in per.items()]

    @property
    def exit_code(self) -> int:
        """2 when a checkpoint could not be loaded (bad input), else 0."""
        return 2 if self.errors else 0

    def totals(self) -> dict[str, tuple[int, int]]:
        """(least, most) of each counter summed over every loaded checkpoint and measure."""
        from .pipeline import COUNTERS

        tot = {c: [0, 0] for c in COUNTERS}
        for per in self.costs:
            for est in per.values():
                for c, (lo, hi) in (est or {}).items():
                    tot[c][0] += lo
                    tot[c][1] += hi
        return {c: (lo, hi) for c, (lo, hi) in tot.items()}

    def lines(self) -> list[str]:
        """The plan in words: per group of checkpoints of one size, one line per measure; then a
        line per checkpoint that could not be loaded, and the totals."""
        groups: dict[tuple[int, int], list[int]] = {}
        for k, d in enumerate(self.dims):
            groups.setdefault((d.P, d.n), []).append(k)
        out = [_describe_params(self.params)] if self.params else []
        for (P, _), ks in groups.items():
            which = "" if len(groups) == 1 else f" for {_names([self.loaded[k] for k in ks])}"
            out.append(f"estimated products per checkpoint{which} (P = {P:,} parameters, {_describe_n(self.dims[ks[0]])}; "
                       "gradients and passes over the whole measurement set):")
            if self.times:
                out.append(f"  timed: {_describe_times(self.times[ks[0]])}")
            out += [f"  {lab}: {_describe_plan(self.costs[ks[0]].get(lab), self.predictions[ks[0]].get(lab) if self.predictions else None)}"
                    for lab in self.labels]
        out += [f"checkpoint {c}: cannot be loaded: {e}" for c, e in self.errors]
        loaded = len(self.loaded)
        secs = [sum(p.seconds[i] for per in self.predictions for p in per.values()) for i in (0, 1)]
        out.append(f"total over {loaded} checkpoint(s)" + (f" ({len(self.errors)} could not be loaded)" if self.errors
                   else "") + ": " + _describe_cost(self.totals(), empty="parameters only")
                   + (f"; about {_range(secs, _secs)}" if self.predictions else ""))
        return out


def _describe_n(d) -> str:
    """``n = 40 samples``, or ``n = 64 sequences (728 tokens)`` when the loss scores many units
    (tokens) per row: the count the user set (``measure_data.num_samples``) first."""
    if d.rows and d.rows != d.n:
        return f"n = {d.rows:,} sequences ({d.n:,} scored tokens)"
    return f"n = {d.n:,} samples"


def _secs(x: float) -> str:
    return f"{x:.2g} s" if x < 10 else f"{x:,.0f} s"


def _bytes(x: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if x < 1024 or unit == "GiB":
            return f"{x:.3g} {unit}" if unit != "B" else f"{int(x)} B"
        x /= 1024
    return f"{x:.3g} GiB"


def _range(pair, show) -> str:
    """``1.2 s`` or ``1.2–3.4 s`` (the unit once)."""
    lo, hi = show(pair[0]), show(pair[1])
    if lo == hi:
        return lo
    a, unit = lo.rsplit(" ", 1)
    b, unit2 = hi.rsplit(" ", 1)
    return f"{a}–{b} {unit}" if unit == unit2 else f"{lo}–{hi}"


def _describe_times(t) -> str:
    """The timed products of a size group, in words."""
    return (f"forward {_secs(t.forward)}, gradient {_secs(t.grad)}, HVP {_secs(t.hvp1)} (1 vector), "
            f"{_secs(t.hvp_block)} ({t.block} vectors); one product's memory {_bytes(t.product_bytes)} ({t.memory})")


def _describe_plan(est, pred) -> str:
    """One measure's line: its products, then the predicted seconds and peak memory, or
    ``not_applicable`` with the reason instead of a cost."""
    if pred is not None and pred.status == "not_applicable":
        return f"not_applicable: {pred.reason}"
    text = _describe_cost(est)
    if pred is not None:
        text += f"; {_range(pred.seconds, _secs)}, peak {_bytes(pred.peak_bytes)}"
    return text


def _describe_params(sel: dict[str, Any]) -> str:
    """``params: include head.* → 1 tensor, 28 parameters: head.weight`` (every trainable one when
    no patterns are given)."""
    pats = [f"include {', '.join(sel['include'])}"] if sel["include"] else []
    pats += [f"exclude {', '.join(sel['exclude'])}"] if sel["exclude"] else []
    head = f"params: {'; '.join(pats)} → " if pats else "params: every trainable parameter → "
    return head + f"{sel['tensors']} tensor(s), {sel['count']:,} parameters: {_names(sel['names'], 6)}"


def _names(names: list[str], most: int = 3) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _describe_cost(est: dict[str, tuple[int, int]] | None, empty: str = "parameters only") -> str:
    """``12 HVPs, 3–5 gradients``: the counters with work, each a count or a range."""
    from .pipeline import COUNTERS

    if est is None:
        return "no estimate declared"
    names = {"n_hvp": "HVPs", "n_grad": "gradients", "n_forward": "forward passes", "n_vjp": "VJP passes"}
    parts = [f"{lo}" + ("" if lo == hi else f"–{hi}") + f" {names[c]}" for c in COUNTERS
             for lo, hi in [est.get(c, (0, 0))] if hi > 0]
    return ", ".join(parts) or empty


def plan_costs(config: Config | str | Path | dict, checkpoints: Sequence[str] | None = None, *,
               measures: Sequence[str] | str | None = None, device: str | None = None,
               precision: str | None = None, timed: bool = True) -> CostPlan:
    """The products `measure`/`sweep` would spend (``--dry-run``), from the measures' declared cost
    formulas and each checkpoint's model size; loads every checkpoint's model but measures nothing.
    A checkpoint that cannot be loaded is reported in ``errors`` (the others are still planned).

    With ``timed``, one checkpoint of each size group has its products timed on the measurement
    set (`flatcli.predict.time_products`: a forward pass, a gradient, HVPs of one vector and of
    one block, and one block product's memory), and every measure gets a `flatcli.predict.Prediction`
    (seconds, peak bytes, or ``not_applicable`` with the reason) in ``predictions``."""
    from .errors import FlatcliError
    from .pipeline import estimate_products, problem_dims
    from .predict import predict, time_products

    cfg = load(config, overrides(device=device, precision=precision))
    jobs, specs = _plan(cfg, checkpoints, measures)
    st = Settings.from_config(cfg)
    data = DataCache(cfg)
    plan = CostPlan([j.checkpoint for j in jobs], [s.label for s in specs], [], [])
    groups: dict[tuple[int, int], Any] = {}  # (P, n) -> (ProductTimes, Problem) of its first checkpoint
    for job in jobs:
        try:
            model, _ = load_model(cfg, job.path)
        except FlatcliError as e:
            plan.errors.append((job.checkpoint, str(e)))
            continue
        dims = problem_dims(model, data.get(st.split, job.train_data if st.split == "train" else None), st)
        if plan.params is None:
            plan.params = st.params.describe(model, st.params.select(model))
        plan.dims.append(dims)
        plan.costs.append(estimate_products(specs, dims))
        plan.loaded.append(job.checkpoint)
        if timed:
            key = (dims.P, dims.n)
            if key not in groups:
                with st.precision_context():
                    groups[key] = time_products(model, data.get(st.split, job.train_data if st.split == "train" else None), st)
            times, problem = groups[key]
            plan.times.append(times)
            plan.predictions.append({s.label: predict(s, dims, times, problem) for s in specs})
    return plan


def _check_before_data(cfg, jobs, st) -> None:
    """Cheap checks against the first checkpoint's model before any data is loaded or tokenized:
    the ``params`` selection matches its parameter names, and a text split's ``max_length`` fits its
    positions (Hugging Face ``n_positions``/``max_position_embeddings``). Only when there is
    something to check; a checkpoint that cannot be loaded is left to its row."""
    from .errors import FlatcliError
    from .loading.hf import check_positions
    from .pipeline import load_model

    texts = [(k, s) for k in ("train", "test") if (s := getattr(cfg.data, k)) is not None
             and s.source == "text" and s.max_length is not None]
    if not jobs or (st.params.everything and not (texts and cfg.model.source == "huggingface")):
        return
    try:
        model, _ = load_model(cfg, jobs[0].path)
    except FlatcliError:
        return
    st.params.select(model)
    for k, s in texts:
        check_positions(model, f"data.{k}.max_length", s.max_length, jobs[0].path)


def _artifacts(rows: list[Row], specs, folder: Path) -> list[Path]:
    """Every measure's artifacts (its registry hook), ``NNN_<checkpoint stem>_<label>.*`` in ``folder``."""
    from .measures import get_measure

    hooks = [(s.label, get_measure(s.name).artifacts) for s in specs]
    paths: list[Path] = []
    for i, row in enumerate(rows):
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(row.checkpoint).stem) or "model"
        for lab, hook in hooks:
            res = row.results.get(lab)
            if hook is None or res is None or res.status == "error":
                continue
            paths += hook(res, folder / f"{i:03d}_{stem}_{lab}", f"{Path(row.checkpoint).name}: {lab}")
    return paths


def landscape(
    config: Config | str | Path | dict,
    checkpoint: str | Path,
    *,
    to: str | Path | None = None,
    dims: int = 1,
    steps: int = 25,
    span: str | Sequence[float] | None = None,
    seed: int | None = None,
    device: str | None = None, precision: str | None = None,
    bias_bn: str = "zero",
    points_per_pass: int | None = None,
    outdir: str | Path | None = None,
    plots: bool = True,
    allow_unsafe_pickle: bool | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    threads: int | str | None = None,
):
    """Loss-landscape view of one checkpoint: a 1D/2D filter-normalized slice, or with ``to`` the
    linear interpolation to a second checkpoint. See `flatcli.landscape` for the definitions.

    Train and (when ``data.test`` is configured) test loss and accuracy are evaluated at every grid
    point on ``measure_data.num_samples`` samples of each split (seed ``measure_data.seed``), in eval
    mode, at ``runtime.precision``. When the config's manifest lists ``checkpoint`` with a
    ``train_data`` column, that file is its training set. With ``outdir``, writes landscape.csv,
    landscape.json and PNG plots there. Returns a `flatcli.landscape.LandscapeResult`.
    """
    from .landscape import interpolation_landscape, slice_landscape, write_files

    cfg = load(config, overrides(device=device, seed=seed, allow_unsafe_pickle=allow_unsafe_pickle, threads=threads, precision=precision))
    if cfg.data.train is None:
        raise ConfigError("config key 'data.train' is required")
    if to is not None and dims != 1:
        raise ConfigError("`to` interpolates along one line; `dims` 2 does not apply to it")
    if outdir is not None:
        ensure_writable_dir(outdir, "output directory")
    st = Settings.from_config(cfg)
    ckpt = Path(checkpoint).expanduser()
    model, _ = load_model(cfg, ckpt)
    model_b = load_model(cfg, Path(to).expanduser())[0] if to is not None else None
    threads_used = use_threads(cfg)
    train, test = _landscape_data(cfg, ckpt, model, model_b, st, to)
    common = dict(settings=st, points_per_pass=points_per_pass, on_progress=on_progress)
    with st.precision_context():
        if model_b is not None:
            res = interpolation_landscape(model, model_b, train, test, steps=steps, span=span, **common)
        else:
            res = slice_landscape(model, train, test, dims=dims, steps=steps, span=span, bias_bn=bias_bn, **common)
    res.meta.update(checkpoint=str(checkpoint), to=None if to is None else str(to), loss=cfg.loss,
                    measure_data=cfg.to_dict()["measure_data"], precision=cfg.runtime.precision,
                    config_hash=cfg.hash(), versions=versions(), device=st.describe_device(), threads=threads_used)
    if outdir is not None:
        write_files(res, outdir, plots=plots)
    return res


def _landscape_data(cfg: Config, ckpt: Path, model, model_b, st: Settings, to):
    """The train and test sets of a landscape view (the manifest's train_data for ``ckpt``), checked
    (labels fit the model; the loss at both checkpoints finite) and subsampled as ``measure_data``."""
    data = DataCache(cfg)
    train = data.get("train", manifest_train_data(cfg, ckpt))
    test = data.get("test")
    _check_targets(cfg, model, train, test)
    check_finite_model(model, train, st)
    if model_b is not None:
        check_finite_model(model_b, train, st, f"the checkpoint {to}")
    train = subset(train, st.num_samples, st.data_seed)
    test = subset(test, st.num_samples, st.data_seed) if test is not None else None
    return train, test


def _check_targets(cfg: Config, model, train, test) -> None:
    """Labels fit the model (one forward pass of two rows per split, on the CPU)."""
    first = next(iter(model.parameters()), None)
    cpu_dtype = first.dtype if first is not None else torch.float32
    for name, d in (("train", train), ("test", test)):
        if d is not None:
            check_targets(model, d, cfg.loss, f"data.{name}", torch.device("cpu"), cpu_dtype)


if TYPE_CHECKING:
    from .landscape.connect import ConnectResult
    from .landscape.trajectory import TrajectoryResult


def _view_setup(config, device, seed, allow_unsafe_pickle, outdir=None, threads=None,
                precision=None) -> tuple[Config, Settings]:
    """Config and settings for the trajectory-PCA and mode-connectivity views (torch's threads
    sized from ``runtime.threads``, see `use_threads`)."""
    cfg = load(config, overrides(device=device, seed=seed, allow_unsafe_pickle=allow_unsafe_pickle, threads=threads, precision=precision))
    if cfg.data.train is None:
        raise ConfigError("config key 'data.train' is required")
    if outdir is not None:
        ensure_writable_dir(outdir, "output directory")
    use_threads(cfg)
    return cfg, Settings.from_config(cfg)


def _view_data(cfg: Config, model: torch.nn.Module, train_path: Path | None):
    """(full train split, train measurement set, test measurement set or None), labels checked."""
    data = DataCache(cfg)
    md = cfg.measure_data
    train, test = data.get("train", train_path), data.get("test")
    _check_targets(cfg, model, train, test)
    sub = subset(train, md.num_samples, md.seed)
    return train, sub, (subset(test, md.num_samples, md.seed) if test is not None else None)


def _view_meta(cfg: Config, dev: torch.device) -> dict[str, Any]:
    from .threads import plan_threads

    return {
        "threads": str(plan_threads(cfg.runtime.threads)),
        "loss": cfg.loss,
        "measure_data": cfg.to_dict()["measure_data"],
        "precision": cfg.runtime.precision,
        "config_hash": cfg.hash(),
        "versions": versions(),
        "device": str(dev) + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""),
    }


def landscape_pca(
    config: Config | str | Path | dict,
    checkpoints: str | Path | Sequence[str | Path],
    *,
    steps: int = 25,
    span: str | Sequence[float] | None = None,
    solver: str = "auto",
    sort: bool = True,
    seed: int | None = None,
    device: str | None = None, precision: str | None = None,
    points_per_pass: int | None = None,
    outdir: str | Path | None = None,
    plots: bool = True,
    allow_unsafe_pickle: bool | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    threads: int | str | None = None,
) -> TrajectoryResult:
    """Trajectory PCA (Li et al. 2018, Sec. 7): the top two PCA directions of {θ_t − θ_T} over a
    training run's checkpoints, the path projected on them and the loss over their plane around
    θ_T (the last checkpoint). See `flatcli.landscape.trajectory` for the definitions.

    ``checkpoints``: files and/or globs, sorted naturally (epoch_2 before epoch_10) unless
    ``sort=False``; at least 3. The model, data and measurement sets come from ``config`` as for
    `landscape` (a manifest's ``train_data`` for the last checkpoint is its training set).
    ``seed`` (default ``runtime.seed``) seeds the randomized solver. With ``outdir``, writes
    pca_grid.csv, pca_path.csv, pca.json and pca.png. Returns a
    `flatcli.landscape.trajectory.TrajectoryResult`.
    """
    from .landscape.output import write_trajectory_files
    from .landscape.trajectory import (
        LazyTrajectory,
        trajectory_landscape,
        trajectory_paths,
    )

    paths = trajectory_paths(checkpoints, sort=sort)
    cfg, st = _view_setup(config, device, seed, allow_unsafe_pickle, outdir, threads, precision)
    model, _ = load_model(cfg, paths[-1])
    _, train, test = _view_data(cfg, model, manifest_train_data(cfg, paths[-1]))
    traj = LazyTrajectory(paths[:-1], lambda p: load_model(cfg, p)[0], last=model)
    with st.precision_context():
        res = trajectory_landscape(
            traj, train, test, labels=[str(p) for p in paths], steps=steps, span=span, solver=solver,
            settings=st, points_per_pass=points_per_pass, on_progress=on_progress,
        )
    res.meta.update(_view_meta(cfg, st.device))
    if outdir is not None:
        write_trajectory_files(res, outdir, plots=plots)
    return res


def landscape_connect(
    config: Config | str | Path | dict,
    a: str | Path,
    b: str | Path,
    *,
    steps: int = 25,
    bend_steps: int = 1000,
    bend_lr: float | None = None,
    bend_optimizer: str = "adam",
    bend_batch_size: int = 128,
    seed: int | None = None,
    device: str | None = None, precision: str | None = None,
    points_per_pass: int | None = None,
    outdir: str | Path | None = None,
    plots: bool = True,
    allow_unsafe_pickle: bool | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    threads: int | str | None = None,
) -> ConnectResult:
    """Mode connectivity (Garipov et al. 2018; Draxler et al. 2018): train the bend of a quadratic
    Bezier curve between checkpoints ``a`` and ``b`` on the training split, then evaluate the loss
    and accuracy along the curve and along the straight line, each with its barrier height. See
    `flatcli.landscape.connect` for the definitions.

    The bend trains on the whole training split (``data.train``, or a manifest's ``train_data`` for
    ``a``) with ``bend_steps`` steps of ``bend_optimizer`` (seed ``seed``, default
    ``runtime.seed``); both paths are evaluated on the measurement sets, BatchNorm statistics
    recomputed at every t on the train measurement set. With ``outdir``, writes connect.csv,
    connect_fit.csv, bend.pt, connect.json and connect.png. Returns a
    `flatcli.landscape.connect.ConnectResult`.
    """
    from .landscape import connect_landscape, write_connect_files
    from .loading.checkpoints import check_state

    cfg, st = _view_setup(config, device, seed, allow_unsafe_pickle, outdir, threads, precision)
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    model_a, extras = load_model(cfg, pa)
    model_b, _ = load_model(cfg, pb)
    check_state(model_b.state_dict(), model_a.state_dict(), str(b), str(a), "landscape connect")
    da, db = manifest_train_data(cfg, pa), manifest_train_data(cfg, pb)
    if da is not None and db is not None and da.resolve() != db.resolve():
        raise ConfigError(
            f"`connect`: the manifest gives the two checkpoints different training sets ({da} vs {db}); "
            "the bend is trained on one training set"
        )
    fit, train, test = _view_data(cfg, model_a, da if da is not None else db)
    with st.precision_context():
        res = connect_landscape(
            model_a, model_b, train, test, fit=fit, steps=steps, bend_steps=bend_steps,
            bend_lr=bend_lr, bend_optimizer=bend_optimizer, bend_batch_size=bend_batch_size,
            settings=st, points_per_pass=points_per_pass, labels=(str(a), str(b)), on_progress=on_progress,
        )
    res.meta.update(_view_meta(cfg, st.device))
    if outdir is not None:
        mk = extras.get("model_kwargs")
        write_connect_files(res, outdir, plots=plots, checkpoint_extras={"model_kwargs": mk} if isinstance(mk, dict) else None)
    return res


# ------------------------------------------------------------------ sweeps, collect, correlate
def sweep(
    config: Config | str | Path | dict,
    outdir: str | Path | None = None,
    *,
    checkpoints: Sequence[str] | None = None,
    measures: Sequence[str] | str | None = None,
    device: str | None = None, precision: str | None = None,
    seed: int | None = None,
    allow_unsafe_pickle: bool | None = None,
    log: Callable[[str], None] | None = None,
    on_unit: Callable[[dict[str, Any]], None] | None = None,
    debug: bool = False,
    threads: int | str | None = None,
    budget: float | str | None = None,
    **options: Any,
):
    """Measure every checkpoint of a config as resumable units of work in ``outdir``.

    One unit = one checkpoint × one measure, keyed by (checkpoint fingerprint, resolved
    measure config hash, flatcli version); each finished unit is one atomically written
    file, so rerunning skips finished units. ``options`` are those of
    `flatcli.sweep.runner.SweepOptions` (the flags of ``flatcli sweep``): ``resume=False``
    recomputes, ``retry_failed`` reruns error units, ``gpus`` ("all" or "0,1") runs one worker
    per GPU, ``workers`` N CPU workers, ``shard=(i, n)`` or "i/n" runs one deterministic part of
    the units, ``executor="slurm"`` submits a job array through submitit (``tasks``, ``slurm``
    parameters, ``wait``; ``cluster="local"`` or "debug" run submitit's local backends),
    ``dry_run`` only describes, ``lock_timeout`` makes silent locks stale. ``threads``
    (``runtime.threads``) sizes each local worker's intra-op threads (auto: OMP_NUM_THREADS when
    set, else cores // workers: the workers never oversubscribe the cores; the choice is logged and
    in ``report.threads``). Returns a `flatcli.sweep.SweepReport`; ``computed`` counts the units
    this run's workers computed (``by_others`` those a concurrent sweep finished meanwhile). Merge
    the rows with `collect`. ``budget`` (``runtime.budget``: seconds or "10m") caps each
    checkpoint's measures together, each unit getting its fixed share (`flatcli.budget`).
    """
    from .sweep.runner import SweepOptions, run_sweep
    from .sweep.worker import _default_log

    opts = SweepOptions(**options)
    cfg = load(config, overrides(device=device, seed=seed, allow_unsafe_pickle=allow_unsafe_pickle, threads=threads,
                                 precision=precision, budget=budget))
    jobs, specs = _plan(cfg, checkpoints, measures)
    out = cfg.output_dir(outdir)
    if not opts.dry_run:
        ensure_writable_dir(out, "sweep directory")
    return run_sweep(cfg, specs, jobs, out, opts, log=_default_log if log is None else log, on_unit=on_unit,
                     debug=debug)


def collect(outdir: str | Path, output: str | Path | None = None):
    """Merge a sweep directory's unit files into ``results.csv`` and ``results.json`` (the
    columns of `measure`'s results.csv). Returns a `flatcli.sweep.CollectReport`; its
    ``to_pandas()`` is the table (see `collect_frame`)."""
    from .sweep.collect import collect as _collect

    if output is not None:
        ensure_writable_dir(Path(output).expanduser().parent, "the folder of --output")
    return _collect(outdir, output)


def collect_frame(outdir: str | Path, output: str | Path | None = None):
    """`collect`, returning the collected table as a DataFrame (``flatcli.collect``).

    One row per checkpoint with the columns of results.csv and the dtypes of
    `flatcli.results` (numeric columns float64, ``status`` categorical). The unfinished units,
    unreadable files and exit code are in the `flatcli.sweep.CollectReport` that `collect`
    returns (its ``to_pandas()`` is this table); it is not attached to the DataFrame, whose
    ``attrs`` pandas deep-copies on every operation.
    """
    return collect(outdir, output).to_pandas()


def correlate(
    results,
    *,
    target: str = "gen_gap",
    by: Sequence[str] | str | None = None,
    outdir: str | Path | None = None,
    plots: bool = False,
    sort: str | None = None,
    measures: Sequence[str] | str | None = None,
    color_by: str | None = None,
    marker_by: str | None = None,
    where: str | None = None,
    max_train_loss: float | None = None,
    bootstrap: int | None = None,
    seed: int = 0,
    confidence: float = 0.95,
    progress: Callable[[int, int], None] | None = None,
):
    """Correlate each measure of a table with ``target``: Pearson, Spearman, Kendall τ-b,
    Jiang's τ, granulated Kendall Ψ with every ψ_i over the hyperparameter axes ``by`` and the
    PGDL conditional mutual information (definitions: `flatcli.analysis.correlation`).

    Parameters
    ----------
    results : a CSV path (flatcli's results.csv or any table, one row per checkpoint) or a
        DataFrame (e.g. ``flatcli.measure(...).to_pandas()``).
    target : the column to predict (default ``gen_gap``).
    by : hyperparameter axes, columns of any name (``hp_<name>`` is found by ``<name>``);
        default every ``hp_*`` column that forms a grid axis.
    measures : the measure columns, any numeric columns; default the measures flatcli
        recorded, else every numeric column that is not the target, a metric, an axis,
        ``hp_*`` or a ``<column>_stderr`` (a note names them).
    where : keep the rows matching this ``DataFrame.query`` expression, e.g.
        ``"hp_lr < 0.1"``; the dropped rows are named in ``report.filters`` and the notes.
    max_train_loss : keep the rows with ``train_loss <= max_train_loss`` (needs that column).
    bootstrap, seed, confidence : with ``bootstrap`` N > 0, percentile intervals of Pearson,
        Spearman and Kendall τ-b at level ``confidence`` from N resamples of the checkpoints
        (``scipy.stats.bootstrap``, generator seeded by ``seed``: reproducible).
    outdir, plots, color_by, marker_by : write ``correlations.csv`` (and the plots, coloured by
        ``color_by`` and marked by ``marker_by``, default the first two axes) into ``outdir``.
    sort : rank by psi, kendall_tau_b, jiang_tau, spearman, pearson or cmi (default Ψ with
        axes, else Kendall τ-b); ties go to the larger Kendall τ-b, then by name.
    progress : called as ``progress(done, total)`` after each measure.

    Returns a `flatcli.analysis.CorrelationReport`, best measure first; ``report.to_pandas()``
    is the correlations.csv table, ``report.warnings`` flags rows that are not at a minimum.
    `correlate_frame` (``flatcli.correlate``) returns that DataFrame directly.
    """
    from .analysis.correlation import correlate_table
    from .analysis.report import write_csv
    from .analysis.table import as_table

    if plots and outdir is None:
        raise ConfigError("`plots` needs an output directory (`outdir`)")
    if outdir is not None:
        ensure_writable_dir(outdir, "output directory")
    report = correlate_table(
        as_table(results), target=target, by=by, sort=sort, measures=measures, where=where,
        max_train_loss=max_train_loss, bootstrap=bootstrap, seed=seed, confidence=confidence, progress=progress,
    )
    if outdir is not None:
        out = Path(outdir)
        report.csv_path = write_csv(report, out / "correlations.csv")
        if plots:
            from .analysis.plots import plot_report

            report.plots = plot_report(report, report.table, out / "plots", color_by=color_by, marker_by=marker_by)
    return report


def correlate_frame(results, **kwargs):
    """`correlate`, returning the ranked table as a DataFrame (``flatcli.correlate``).

    Takes the arguments of `correlate`; one row per measure, best first, with the columns of
    correlations.csv. The `flatcli.analysis.CorrelationReport` (notes, warnings, the rows the
    filters dropped, the grid) is ``df.attrs["report"]``, without its copy of the input rows
    (pandas deep-copies attrs on every operation: they stay small).

    >>> df = flatcli.correlate("results.csv", by=["lr", "width"], max_train_loss=0.01)  # doctest: +SKIP
    >>> df[["measure", "kendall_tau_b", "psi"]], df.attrs["report"].dropped            # doctest: +SKIP
    """
    import dataclasses

    report = correlate(results, **kwargs)
    table = report.to_pandas()
    table.attrs["report"] = dataclasses.replace(report, table=None)
    return table


# ------------------------------------------------------------------ check-invariance
def check_invariance(
    config: Any,
    checkpoint: str | Path | None = None,
    measures: Sequence[Any] | str | None = None,
    *,
    transform: str = "both",
    scale: float = 10.0,
    seed: int | None = None,
    tol: float = 1e-6,
    device: str | None = None, precision: str | None = None,
    data: tuple[torch.Tensor, torch.Tensor] | None = None,
    loss: str = "cross_entropy",
    progress: Callable[[str, str, dict], None] | None = None,
    threads: int | str | None = None,
):
    """The invariance check for one checkpoint of a config (path, dict or `Config`), or for a model.

    With a config: the model is built and loaded as ``flatcli measure`` does (``model_kwargs``
    stored in the checkpoint win; a manifest's ``train_data`` applies), the measurement set is
    ``measure_data``, and ``measures`` defaults to the configured measures plus every measure
    that claims invariance. With an ``nn.Module`` as ``config``: pass ``data=(x, y)``; see
    `flatcli.invariance.check_invariance_model`. With a config, ``threads`` (``runtime.threads``)
    sizes torch's threads (`use_threads`; the choice is ``report.threads``). Returns an
    `flatcli.invariance.InvarianceReport`.
    """
    from .invariance import check_invariance_model, needs_init, prepare_specs

    if isinstance(config, torch.nn.Module):
        if data is None:
            raise ConfigError("check_invariance(model, ...) needs data=(x, y)")
        return check_invariance_model(config, data, measures, loss=loss, transform=transform, scale=scale,
                                      seed=seed or 0, tol=tol, device=device or "cpu", progress=progress)
    cfg = load(config, overrides(device=device, seed=seed, threads=threads, precision=precision))
    if cfg.data.train is None:
        raise ConfigError("config key 'data.train' is required")
    threads_used = use_threads(cfg)
    job = _one_job(cfg, checkpoint)
    if measures is None:
        try:
            chosen = select_measures(cfg, None)
        except ConfigError:
            chosen = []
        specs = prepare_specs(chosen, add_invariant=True)
    else:
        specs = prepare_specs(select_measures(cfg, measures), add_invariant=False)
    if job.init_checkpoint is None:
        specs = [s for s in specs if not needs_init(s)]
    model, _ = load_model(cfg, job.path)
    init_state = load_init_state(cfg, job)
    cache = DataCache(cfg)
    report = check_invariance_model(
        model, cache.get("train", job.train_data or manifest_train_data(cfg, job.path)), specs,
        test=cache.get("test"), settings=Settings.from_config(cfg), transform=transform, scale=scale, tol=tol,
        init_state=init_state, checkpoint=job.checkpoint, progress=progress,
    )
    report.threads = threads_used
    return report


def _one_job(cfg: Config, checkpoint: str | Path | None) -> Job:
    if checkpoint is None:
        jobs = resolve_jobs(cfg)
        if len(jobs) != 1:
            raise ConfigError(f"check-invariance takes one checkpoint; the config lists {len(jobs)}: pass one")
        return jobs[0]
    (job,) = resolve_jobs(cfg, [str(checkpoint)])
    return job
