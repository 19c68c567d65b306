"""Sweeps and their tables: `sweep`, `collect`, `correlate` (and their DataFrame forms)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..config import Config
from ..errors import ConfigError
from ..results import ensure_writable_dir
from ..settings import RunOptions
from ._common import _plan, load_run, takes_run


# ------------------------------------------------------------------ sweeps, collect, correlate
@takes_run
def sweep(
    config: Config | str | Path | dict,
    outdir: str | Path | None = None,
    *,
    checkpoints: Sequence[str] | None = None,
    measures: Sequence[str] | str | None = None,
    run: RunOptions | None = None,
    log: Callable[[str], None] | None = None,
    on_unit: Callable[[dict[str, Any]], None] | None = None,
    debug: bool = False,
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
    ``dry_run`` only describes, ``lock_timeout`` makes silent locks stale. ``run``
    (`flatcli.api.RunOptions`) overrides the config's ``runtime.*`` keys: ``run.threads`` sizes
    each local worker's intra-op threads (auto: OMP_NUM_THREADS when set, else cores // workers:
    the workers never oversubscribe the cores; the choice is logged and in ``report.threads``),
    ``run.budget`` (seconds or "10m") caps each checkpoint's measures together, each unit getting
    its fixed share (`flatcli.budget`). Returns a `flatcli.sweep.SweepReport`; ``computed``
    counts the units this run's workers computed (``by_others`` those a concurrent sweep finished
    meanwhile). Merge the rows with `collect`.
    """
    from ..sweep.runner import SweepOptions, run_sweep
    from ..sweep.worker import _default_log

    opts = SweepOptions(**options)
    cfg = load_run(config, run)
    jobs, specs = _plan(cfg, checkpoints, measures)
    out = cfg.output_dir(outdir)
    if not opts.dry_run:
        ensure_writable_dir(out, "sweep directory")
    return run_sweep(
        cfg,
        specs,
        jobs,
        out,
        opts,
        log=_default_log if log is None else log,
        on_unit=on_unit,
        debug=debug,
    )


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


@takes_run
def correlate(
    results,
    *,
    outdir: str | Path | None = None,
    plots: bool = False,
    color_by: str | None = None,
    marker_by: str | None = None,
    run: RunOptions | None = None,
    **table_options: Any,
):
    """Correlate each measure of a table with ``target``: Pearson, Spearman, Kendall τ-b,
    Jiang's τ, granulated Kendall Ψ with every ψ_i over the hyperparameter axes ``by`` and the
    PGDL conditional mutual information (definitions: `flatcli.analysis.correlation`).

    The statistics are `flatcli.analysis.correlation.correlate_table`'s: ``table_options`` are
    its keywords, passed through as they are (one list of them, its signature; an unknown one is
    its TypeError). This function adds the input forms, the files and the plots.

    Parameters
    ----------
    results : a CSV path (flatcli's results.csv or any table, one row per checkpoint) or a
        DataFrame (e.g. ``flatcli.measure(...).to_pandas()``).
    outdir, plots, color_by, marker_by : write ``correlations.csv`` (and the plots, coloured by
        ``color_by`` and marked by ``marker_by``, default the first two axes) into ``outdir``.
    run : `flatcli.api.RunOptions`; only ``run.seed`` applies: the seed of the bootstrap's
        generator (default 0). A ``seed=`` keyword raises a TypeError naming ``run=RunOptions(seed=...)``.
    table_options : ``correlate_table``'s keywords:

        - ``target``: what to predict: a column, a derived gap (``loss_gap = test_loss −
          train_loss``, ``gen_gap = train_acc − test_acc``, ``train_ppl``, ``test_ppl``) or an
          expression of columns (``"test_loss - train_loss"``, ``"test_acc / train_acc"``;
          `flatcli.analysis.targets`). Default: the loss's gap, ``gen_gap`` for classifiers and
          ``loss_gap`` for language models (``report.caption`` says which).
        - ``by``: hyperparameter axes, columns of any name (``hp_<name>`` is found by ``<name>``);
          default every ``hp_*`` column that forms a grid axis.
        - ``measures``: the measure columns, any numeric columns; default the measures flatcli
          recorded, else every numeric column that is not the target, a metric, an axis,
          ``hp_*`` or a ``<column>_stderr`` (a note names them).
        - ``where``: keep the rows matching this ``DataFrame.query`` expression, e.g.
          ``"hp_lr < 0.1"``; the dropped rows are named in ``report.filters`` and the notes.
        - ``max_train_loss``: keep the rows with ``train_loss <= max_train_loss`` (needs that column).
        - ``bootstrap``, ``confidence``: with ``bootstrap`` N > 0, percentile intervals of Pearson,
          Spearman and Kendall τ-b at level ``confidence`` from N resamples of the checkpoints
          (``scipy.stats.bootstrap``, generator seeded by ``run.seed``: reproducible).
        - ``sort``: rank by psi, kendall_tau_b, jiang_tau, spearman, pearson or cmi (default Ψ
          with axes, else Kendall τ-b); ties go to the larger Kendall τ-b, then by name.
        - ``progress``: called as ``progress(done, total)`` after each measure.

    Returns a `flatcli.analysis.CorrelationReport`, best measure first; ``report.to_pandas()``
    is the correlations.csv table, ``report.warnings`` flags rows that are not at a minimum
    (classification cross-entropy only: train loss above 0.01).
    `correlate_frame` (``flatcli.correlate``) returns that DataFrame directly.
    """
    from ..analysis.correlation import correlate_table
    from ..analysis.report import write_csv
    from ..analysis.table import as_table

    if plots and outdir is None:
        raise ConfigError("`plots` needs an output directory (`outdir`)")
    if outdir is not None:
        ensure_writable_dir(outdir, "output directory")
    seed = RunOptions.of(run).seed
    report = correlate_table(as_table(results), seed=0 if seed is None else seed, **table_options)
    if outdir is not None:
        out = Path(outdir)
        report.csv_path = write_csv(report, out / "correlations.csv")
        if plots:
            from ..analysis.plots import plot_report

            report.plots = plot_report(
                report, report.table, out / "plots", color_by=color_by, marker_by=marker_by
            )
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
