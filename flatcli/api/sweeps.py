"""Sweeps and their tables: `sweep` (with `SweepOptions`), `collect_report`, `correlate_report` (and their DataFrame forms)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..config import Config
from ..errors import ConfigError
from ..run.results import ensure_writable_dir
from ..run.settings import RunOptions
from ..sweep import SweepInterrupted as SweepInterrupted
from ..sweep import SweepOptions, default_log, old_output_warning, output_csv, run_sweep
from ..sweep import collect as _collect
from ._setup import _jobs_and_specs, load_run, takes_run


# ------------------------------------------------------------------ sweeps, collect, correlate
@takes_run
def sweep(
    config: Config | str | Path | dict,
    outdir: str | Path | None = None,
    *,
    checkpoints: Sequence[str] | None = None,
    measures: Sequence[str] | str | None = None,
    run: RunOptions | None = None,
    options: SweepOptions | Mapping[str, Any] | None = None,
    log: Callable[[str], None] | None = None,
    on_unit: Callable[[dict[str, Any]], None] | None = None,
    **old_options: Any,
):
    """Measure every checkpoint of a config as resumable units of work in ``outdir``.

    One unit is one checkpoint × one measure, keyed by (checkpoint fingerprint, resolved measure
    config hash, flatcli version); each finished unit is one atomically written file, so a rerun
    skips finished units. Merge the rows with `collect_report`.

    Parameters
    ----------
    config : Config, str, Path or dict
        The config (see `measure`).
    outdir : str or Path, optional
        The sweep folder (default the config's ``output.dir``).
    checkpoints : sequence of str, optional
        Checkpoints instead of the config's.
    measures : str or sequence of str, optional
        Labels or measure names, as in `measure`.
    run : RunOptions, optional
        Overrides of the config's ``runtime.*`` keys (device, precision, seed, threads,
        allow_unsafe_pickle, budget), what the CLI's shared flags build.
        ``run.threads`` sizes each local worker's threads (``auto``: ``OMP_NUM_THREADS`` when
        set, else free cores ÷ workers); ``run.budget`` gives each unit its fixed share of one
        checkpoint's budget.
    options : SweepOptions or mapping, optional
        How the sweep runs, the flags of ``flatcli sweep``: ``SweepOptions(workers=2)``,
        ``SweepOptions(gpus="all")``, ``SweepOptions(shard="0/4")``,
        ``SweepOptions(executor="slurm", tasks=32, slurm={...})``, ``resume``,
        ``retry_failed``, ``dry_run``, ``lock_timeout``, ``debug`` (see `SweepOptions`). A
        mapping of the same fields is accepted; an unknown key is a `ConfigError` naming it.
    log : callable, optional
        ``log(line)`` for progress lines (default: stderr).
    on_unit : callable, optional
        ``on_unit(record)`` after each finished unit.
    **old_options
        The options as keywords of their own (``workers=2``, ``debug=True``): deprecated, with
        a `FutureWarning`, until the next release; use ``options=SweepOptions(...)``.

    Returns
    -------
    flatcli.sweep.SweepReport
        ``computed`` counts the units this run's workers computed, ``by_others`` those a
        concurrent sweep finished meanwhile.

    Raises
    ------
    SweepInterrupted
        On Ctrl-C, once the workers stopped (their units in flight released); its ``report``
        counts the finished units. Rerunning the same sweep resumes.
    """
    opts = _sweep_options(options, old_options)
    cfg = load_run(config, run)
    jobs, specs = _jobs_and_specs(cfg, checkpoints, measures)
    out = cfg.output_dir(outdir)
    if not opts.dry_run:
        ensure_writable_dir(out, "sweep directory")
    return run_sweep(
        cfg,
        specs,
        jobs,
        out,
        opts,
        log=default_log if log is None else log,
        on_unit=on_unit,
    )


def _sweep_options(options, old_options: dict[str, Any]) -> SweepOptions:
    """The `SweepOptions` of ``options``, or of the deprecated keywords (with a `FutureWarning`)."""
    if not old_options:
        return SweepOptions.of(options)
    if options is not None:
        raise ConfigError(
            f"sweep() takes `options` or keywords {', '.join(old_options)}, not both: "
            "put them in options=SweepOptions(...)"
        )
    opts = SweepOptions.of(old_options)  # an unknown keyword is a ConfigError naming it
    given = ", ".join(f"{k}={v!r}" for k, v in old_options.items())
    warnings.warn(
        f"sweep()'s option keywords are deprecated and accepted until the next release: "
        f"use options=SweepOptions({given})",
        FutureWarning,
        stacklevel=3,
    )
    return opts


def collect_report(outdir: str | Path, output: str | Path | None = None):
    """Merge a sweep folder's unit files into one table.

    Parameters
    ----------
    outdir : str or Path
        The sweep folder.
    output : str or Path, optional
        The folder results.csv and results.json go into (created if missing), as every command's
        output folder; default ``outdir``. A CSV path (a name ending in ``.csv``, or an existing
        file) is still accepted, with a `FutureWarning`, until the next release.

    Returns
    -------
    flatcli.sweep.CollectReport
        The rows (the columns of `measure`'s results.csv), the unfinished units, the unreadable
        files and the exit code; ``to_pandas()`` is the table (see `collect_frame`).
    """
    csv_path, old_form = output_csv(outdir, output)
    if old_form:
        warnings.warn(old_output_warning(output), FutureWarning, stacklevel=2)
    if output is not None:
        ensure_writable_dir(csv_path.parent, "output directory")
    return _collect(outdir, csv_path)


def collect_frame(outdir: str | Path, output: str | Path | None = None):
    """`collect_report`, returning the collected table as a DataFrame (this is ``flatcli.collect``).

    Parameters
    ----------
    outdir : str or Path
        The sweep folder.
    output : str or Path, optional
        The folder results.csv goes into, as in `collect_report`.

    Returns
    -------
    pandas.DataFrame
        One row per checkpoint with the columns of results.csv and the dtypes of
        `flatcli.run.results` (numeric columns float64, ``status`` categorical). The unfinished
        units and the exit code are in the report `collect_report` returns.
    """
    return collect_report(outdir, output).to_pandas()


@takes_run
def correlate_report(
    results,
    *,
    outdir: str | Path | None = None,
    plots: bool = False,
    color_by: str | None = None,
    marker_by: str | None = None,
    run: RunOptions | None = None,
    **table_options: Any,
):
    """Correlate each measure of a table with the generalization gap (or another ``target``).

    Pearson, Spearman, Kendall τ-b, Jiang's τ, the granulated Kendall Ψ with every ψ over the
    hyperparameter axes ``by``, and the PGDL conditional mutual information (definitions:
    `flatcli.analysis.correlation`). The statistics are
    `flatcli.analysis.correlation.correlate_table`'s; this function adds the input forms, the
    files and the plots.

    Parameters
    ----------
    results : str, Path or pandas.DataFrame
        A CSV path (flatcli's results.csv or any table, one row per checkpoint) or a DataFrame
        (e.g. ``flatcli.measure(...).to_pandas()``).
    outdir : str or Path, optional
        Write ``correlations.csv`` (and the plots) there.
    plots : bool
        Draw the scatter plots into ``outdir/plots`` (needs ``outdir``).
    color_by, marker_by : str, optional
        Columns that colour and mark the points (default the first two axes).
    run : RunOptions, optional
        Only ``run.seed`` applies: the seed of the bootstrap's generator (default 0).
    **table_options
        ``correlate_table``'s keywords: ``target``, what to predict: a column, a derived gap
        (``loss_gap = test_loss − train_loss``, ``gen_gap = train_acc − test_acc``,
        ``train_ppl``, ``test_ppl``) or an expression of columns (``"test_loss - train_loss"``,
        ``"test_acc / train_acc"``; `flatcli.analysis.targets`), default the loss's gap
        (``gen_gap`` for classifiers, ``loss_gap`` for language models; ``report.caption`` says
        which); ``by``, the
        hyperparameter axes (``hp_<name>`` is found by ``<name>``; default every ``hp_*``
        column that forms a grid axis); ``measures``, the measure columns (default the measures
        flatcli recorded, else every numeric column that is not the target, a metric or an
        axis); ``where``, a condition selecting rows (`flatcli.analysis.expressions`); ``max_train_loss``;
        ``bootstrap`` and ``confidence``, percentile intervals from N resamples of the
        checkpoints; ``sort`` (``psi``, ``kendall_tau_b``, ``jiang_tau``, ``spearman``,
        ``pearson`` or ``cmi``); ``progress``, called as ``progress(done, total)``.

    Returns
    -------
    flatcli.analysis.CorrelationReport
        The measures, best first; ``to_pandas()`` is the correlations.csv table,
        ``warnings`` flags rows that are not at a minimum (classification cross-entropy only:
        train loss above 0.01), ``dropped`` the rows the filters
        left out. `correlate_frame` (``flatcli.correlate``) returns the DataFrame directly.
    """
    from ..analysis import correlation, correlation_plots, rendering, table  # lazy: pandas, scipy

    if plots and outdir is None:
        raise ConfigError("`plots` needs an output directory (`outdir`)")
    if outdir is not None:
        ensure_writable_dir(outdir, "output directory")
    seed = RunOptions.of(run).seed
    report = correlation.correlate_table(
        table.as_table(results), seed=0 if seed is None else seed, **table_options
    )
    if outdir is not None:
        out = Path(outdir)
        report.csv_path = rendering.write_csv(report, out / "correlations.csv")
        if plots:
            report.plots = correlation_plots.plot_report(
                report, report.table, out / "plots", color_by=color_by, marker_by=marker_by
            )
    return report


def correlate_frame(results, **kwargs):
    """`correlate_report`, returning the ranked table as a DataFrame (this is ``flatcli.correlate``).

    Parameters
    ----------
    results : str, Path or pandas.DataFrame
        The table, as in `correlate_report`.
    **kwargs
        The keywords of `correlate_report`.

    Returns
    -------
    pandas.DataFrame
        One row per measure, best first, with the columns of correlations.csv. The
        `flatcli.analysis.CorrelationReport` (notes, warnings, dropped rows, the grid) is
        ``df.attrs["report"]``, without its copy of the input rows.

    Examples
    --------
    >>> df = flatcli.correlate("results.csv", by=["lr", "width"], max_train_loss=0.01)  # doctest: +SKIP
    >>> df[["measure", "kendall_tau_b", "psi"]], df.attrs["report"].dropped            # doctest: +SKIP
    """
    import dataclasses

    report = correlate_report(results, **kwargs)
    table = report.to_pandas()
    table.attrs["report"] = dataclasses.replace(report, table=None)
    return table


# ------------------------------------------------------------------ check-invariance
