"""Sweeps and their tables: `sweep`, `collect`, `correlate` (and their DataFrame forms)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..config import Config, overrides
from ..errors import ConfigError
from ..results import ensure_writable_dir
from ._common import _plan, load


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
    from ..sweep.runner import SweepOptions, run_sweep
    from ..sweep.worker import _default_log

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
    from ..sweep.collect import collect as _collect

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
    from ..analysis.correlation import correlate_table
    from ..analysis.report import write_csv
    from ..analysis.table import as_table

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
            from ..analysis.plots import plot_report

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
