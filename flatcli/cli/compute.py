"""Commands that measure, train and run: measure, measures, config show, demo, experiments,
sweep, collect and the hidden sweep-worker."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ..console import (
    CheckpointProgress,
    as_text,
    console,
    err_console,
    fit_width,
    print_table,
    render_rows,
)
from ..errors import ConfigError, ExitCode
from ._app import (
    BudgetOpt,
    ConfigOpt,
    DebugOpt,
    DeviceOpt,
    Executor,
    FitHelp,
    Format,
    PrecisionOpt,
    ThreadsOpt,
    UnsafePickleOpt,
    WideOpt,
    _value,
    app,
    cli_message,
    config_app,
    experiments_app,
    handle_errors,
    log_line,
    rerun_command,
    run_options,
)


@app.command(cls=FitHelp)
@handle_errors
def measure(
    checkpoints: Annotated[
        list[str] | None,
        typer.Argument(help="Checkpoint files (default: the config's 'checkpoints')."),
    ] = None,
    config: ConfigOpt = ...,
    measures: Annotated[
        str | None,
        typer.Option(
            "--measures",
            "-m",
            help="Comma-separated measure names or labels ('all' for every measure).",
        ),
    ] = None,
    outdir: Annotated[
        Path | None,
        typer.Option(
            "--outdir", "-o", help="Write results.csv and results.json here (default: output.dir)."
        ),
    ] = None,
    device: DeviceOpt = None,
    format: Annotated[
        Format | None,
        typer.Option(
            "--format", help="table, csv or json on stdout (default: output.format, table)."
        ),
    ] = None,
    seed: Annotated[
        int | None, typer.Option("--seed", help="Seed of every stochastic measure.")
    ] = None,
    allow_unsafe_pickle: UnsafePickleOpt = False,
    plots: Annotated[
        bool,
        typer.Option(
            "--plots",
            help="Draw each measure's plots (e.g. spectral densities) in OUTDIR/plots/ (needs matplotlib).",
        ),
    ] = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Print per checkpoint and measure the products (HVPs, gradients, forward passes), predicted seconds and peak memory (from one forward pass, gradient and HVP block timed on the checkpoint), or not_applicable with its reason; measure nothing (--format json: a JSON list).",
        ),
    ] = False,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="Reuse the finished measures of OUTDIR/results.json whose key matches (checkpoint and data file contents, configuration, measure options and revision); compute the rest and say why.",
        ),
    ] = False,
    threads: ThreadsOpt = None,
    precision: PrecisionOpt = None,
    budget: BudgetOpt = None,
    wide: WideOpt = False,
    debug: DebugOpt = False,
):
    """Compute the configured measures for each checkpoint; write OUTDIR/results.csv and results.json
    (after every finished measure: Ctrl-C keeps what finished, exit code 130)."""
    from .. import api  # lazy: CLI start-up (loads torch)

    run = run_options(
        device=device,
        precision=precision,
        seed=seed,
        threads=threads,
        allow_unsafe_pickle=allow_unsafe_pickle,
        budget=budget,
    )
    if dry_run:
        costs = api.estimate_costs(config, checkpoints, measures=measures, run=run)
        if (
            _value(format) == "json"
        ):  # one entry per checkpoint × measure; unloadable checkpoints on stderr
            sys.stdout.write(json.dumps(costs.to_json(), indent=2) + "\n")
            for c, e in costs.errors:
                err_console.print(
                    f"[red]error:[/red] checkpoint {as_text(c)}: cannot be loaded: {as_text(e)}",
                    highlight=False,
                    soft_wrap=True,
                )
        else:
            for line in costs.lines():
                console.print(line, highlight=False, soft_wrap=True, markup=False)
        raise typer.Exit(costs.exit_code)
    cfg = api.load(config, run.changes())
    format = _value(format) or cfg.output.format
    out = cfg.output_dir(outdir)
    shown = CheckpointProgress("measuring", message=cli_message)
    try:
        report = api.measure(
            cfg,
            checkpoints,
            measures=measures,
            outdir=out,
            run=run,
            reporting=api.Reporting(
                on_start=shown.start,
                on_row=shown.row,
                on_progress=shown.detail if shown.is_tty else None,
                on_measure=shown.measure,
                on_note=lambda line: err_console.print(
                    line, highlight=False, soft_wrap=True, markup=False
                ),
                debug=debug,
            ),
            plots=plots,
            resume=resume,
        )
    finally:
        shown.stop()
    if report.rank == 0:  # under torchrun only rank 0 prints; every rank has the exit code
        log_line(report.meta.get("threads"))
        _print_report(report, format, out, wide)
    raise typer.Exit(report.exit_code)


def _print_report(report, format: str, out: Path, wide: bool = False) -> None:
    """``measure``'s stdout (table, csv or json) and its error lines on stderr."""
    from ..run import results  # lazy: CLI start-up (loads torch)

    labels = report.rows[0].labels if report.rows else []
    if format == "table":
        print_table(console, render_rows(report.rows, labels, fit_width(console, wide)), wide)
        where = report.written_to or out
        console.print(
            f"wrote {where / 'results.csv'} and {where / 'results.json'} ({report.seconds:.1f}s)",
            highlight=False,
            markup=False,
        )
    elif format == "csv":
        sys.stdout.write(results.to_csv(report.rows))
    else:
        sys.stdout.write(
            json.dumps(results.jsonable([r.to_json() for r in report.rows]), indent=2) + "\n"
        )
    if report.meta.get("plots"):
        err_console.print(
            f"wrote {len(report.meta['plots'])} plot(s) in {as_text(out / 'plots')}",
            highlight=False,
        )
    for r in report.rows:
        if r.status == "error":  # not `interrupted`: a stopped run names its cause once, below
            err_console.print(
                f"[red]error:[/red] {as_text(r.checkpoint)}: {as_text(r.error)}",
                highlight=False,
                soft_wrap=True,
            )
    if report.write_error:
        err_console.print(
            f"[red]error:[/red] {as_text(report.write_error)}", highlight=False, soft_wrap=True
        )


# ------------------------------------------------------------------ measures
@app.command("measures", cls=FitHelp)
@handle_errors
def measures_cmd(
    pattern: Annotated[str, typer.Argument(help="Shell wildcard over names.")] = "*",
    debug: DebugOpt = False,
):
    """List every measure with a one-line description and its options."""
    from ..measures import list_measures  # lazy: CLI start-up (loads torch)
    from ..measures._options import describe_options  # lazy: CLI start-up (loads torch)

    infos = list_measures(pattern)
    if not infos:
        import difflib

        names = [m.name for m in list_measures()]
        hint = difflib.get_close_matches(pattern, names, n=1)
        raise ConfigError(
            f"no measure matches {pattern!r}."
            + (f" Did you mean '{hint[0]}'?" if hint else " Run 'flatcli measures' for the list.")
        )
    t = Table(show_header=True, header_style="bold", show_lines=True)
    t.add_column("measure")
    t.add_column("description")
    t.add_column("options (default)")
    for info in infos:
        opts = ", ".join(f"{n} ({d})" for n, d, _ in describe_options(info.options)) or "-"
        desc = info.description + (f"\n[dim]{info.reference}[/dim]" if info.reference else "")
        t.add_row(info.name, desc, opts)
    print_table(console, t)


# ------------------------------------------------------------------ config show
@config_app.command("show", cls=FitHelp)
@handle_errors
def config_show(config: ConfigOpt = ..., debug: DebugOpt = False):
    """Print the resolved config and where each value came from."""
    import yaml

    from .. import api  # lazy: CLI start-up (loads torch)

    cfg = api.load(config)
    console.print(f"# {config}  (hash {cfg.hash()})", highlight=False, markup=False)
    console.print(
        yaml.safe_dump(cfg.to_dict(defaults=True), sort_keys=False).rstrip(),
        highlight=False,
        markup=False,
    )
    console.print("\n# where each value came from", highlight=False)
    for k in sorted(cfg.provenance):
        console.print(f"#   {k}: {cfg.provenance[k]}", highlight=False, markup=False)


# ------------------------------------------------------------------ demo
@app.command(cls=FitHelp)
@handle_errors
def demo(
    outdir: Annotated[
        Path, typer.Option("--outdir", "-o", help="Where checkpoints and results go.")
    ] = Path("flatcli-demo"),
    measures: Annotated[
        str | None,
        typer.Option("--measures", "-m", help="Measures to run ('all' for the whole catalogue)."),
    ] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    threads: ThreadsOpt = None,
    wide: WideOpt = False,
    debug: DebugOpt = False,
):
    """Train a small zoo of MLPs on bundled digits to a fixed loss, measure them, rank the measures by granulated Kendall Ψ (ties by Kendall τ-b)."""
    from ..demo import run_demo  # lazy: CLI start-up (loads torch)

    run_demo(outdir, measures=measures, seed=seed, console=console, threads=threads, wide=wide)


# ------------------------------------------------------------------ experiments
@experiments_app.command("list")
@handle_errors
def experiments_list(debug: DebugOpt = False):
    """List the experiments with their studies and the models of each full grid."""
    from ..experiments import list_experiments  # lazy: CLI start-up (loads torch)

    t = Table(show_header=True, header_style="bold")
    for col in ("experiment", "title", "studies (models)"):
        t.add_column(col)
    for e in list_experiments():
        t.add_row(
            e.name,
            f"{e.title}\n[dim]{e.reference}[/dim]",
            ", ".join(f"{s}: {n}" for s, n in e.studies),
        )
    print_table(console, t)


@experiments_app.command("run")
@handle_errors
def experiments_run(
    name: Annotated[
        str,
        typer.Argument(help="An experiment (see 'flatcli experiments list') or a spec YAML file."),
    ],
    quick: Annotated[
        bool,
        typer.Option(
            "--quick",
            help="Tiny grid, tiny models, few steps: a smoke test of the pipeline (seconds), not a result.",
        ),
    ] = False,
    outdir: Annotated[
        Path | None,
        typer.Option(
            "--outdir",
            "-o",
            help="Output folder (default experiments-out/NAME, NAME-quick with --quick).",
        ),
    ] = None,
    jobs: Annotated[
        int | None,
        typer.Option(
            "--jobs",
            min=1,
            help="Models trained and sweep workers in parallel, one thread each; the numbers do not depend on it (default 1 with --quick, else the cores up to 2).",
        ),
    ] = None,
    study: Annotated[
        str | None, typer.Option("--study", help="Run only these studies (comma-separated).")
    ] = None,
    publish: Annotated[
        Path | None,
        typer.Option(
            "--publish",
            metavar="DIR",
            help="Copy the small outputs (tables, summary, figures) into DIR/NAME/, e.g. docs/experiments.",
        ),
    ] = None,
    device: Annotated[
        str | None,
        typer.Option(
            "--device",
            help="auto, cpu or cuda:N for training and measuring (default: the spec's).",
            envvar="FLATCLI_DEVICE",
        ),
    ] = None,
    plots: Annotated[
        bool, typer.Option("--plots/--no-plots", help="Draw the figures (needs matplotlib).")
    ] = True,
    debug: DebugOpt = False,
):
    """Run one experiment: train its grid to the loss target, flatcli sweep, collect, correlate; print summary.md."""
    from .. import experiments  # lazy: CLI start-up (loads torch)

    def log(msg: str) -> None:
        err_console.print(msg, highlight=False, soft_wrap=True, markup=False)

    studies = [s.strip() for s in study.split(",") if s.strip()] if study else None
    rep = experiments.run_experiment(
        name, outdir, quick=quick, jobs=jobs, studies=studies, plots=plots, device=device, log=log
    )
    console.print(rep.summary.read_text(), highlight=False, soft_wrap=True, markup=False)
    console.print(
        f"done in {rep.seconds:.0f}s; outputs in {rep.outdir} (summary.md)",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
    if publish is not None:
        files = experiments.publish(rep, publish)
        console.print(
            f"published {len(files)} files to {publish / rep.spec.name}",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
    raise typer.Exit(rep.exit_code)


# ------------------------------------------------------------------ landscape


@app.command(cls=FitHelp)
@handle_errors
def sweep(
    ctx: typer.Context,
    config: ConfigOpt = ...,
    outdir: Annotated[
        Path,
        typer.Option(
            "--outdir",
            "-o",
            help="Sweep directory: plan.json, units/ (one file per finished unit), locks/.",
        ),
    ] = ...,
    measures: Annotated[
        str | None,
        typer.Option(
            "--measures",
            "-m",
            help="Comma-separated measure names or labels ('all' for every measure).",
        ),
    ] = None,
    gpus: Annotated[
        str | None,
        typer.Option(
            "--gpus",
            help="'all' or indices like 0,1: one worker process per GPU (default: every visible GPU when the device is auto).",
        ),
    ] = None,
    workers: Annotated[
        int | None, typer.Option("--workers", min=1, help="CPU worker processes (default 1).")
    ] = None,
    shard: Annotated[
        str | None,
        typer.Option(
            "--shard",
            help="I/N: run only shard I of N (for array schedulers); shards cover every unit exactly once.",
        ),
    ] = None,
    executor: Annotated[
        Executor,
        typer.Option(
            "--executor",
            help="local (worker processes here), slurm (a job array through submitit; needs the slurm extra of flatcli), or local-array (that job array run on this machine by submitit's local executor, to try it).",
        ),
    ] = Executor.local,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume/--no-resume", help="Skip finished units (--no-resume recomputes them)."
        ),
    ] = True,
    retry_failed: Annotated[
        bool, typer.Option("--retry-failed", help="Rerun units that finished with an error.")
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print what would be run or submitted; run nothing.")
    ] = False,
    device: DeviceOpt = None,
    seed: Annotated[
        int | None, typer.Option("--seed", help="Seed of every stochastic measure.")
    ] = None,
    tasks: Annotated[
        int | None,
        typer.Option(
            "--tasks", min=1, help="slurm: number of array tasks (default: one per checkpoint)."
        ),
    ] = None,
    slurm: Annotated[
        list[str] | None,
        typer.Option(
            "--slurm",
            help="slurm: submitit parameter KEY=VALUE (repeatable), e.g. slurm_partition=gpu, timeout_min=120.",
        ),
    ] = None,
    wait: Annotated[
        bool, typer.Option("--wait", help="slurm: wait for the array to finish.")
    ] = False,
    cluster: Annotated[
        str,
        typer.Option(
            "--submitit-cluster", hidden=True, help="submitit backend: slurm, local or debug."
        ),
    ] = "slurm",
    lock_timeout: Annotated[
        float,
        typer.Option(
            "--lock-timeout",
            min=0.0,
            help="Seconds without a heartbeat after which another worker's lock is stale.",
        ),
    ] = 600.0,
    allow_unsafe_pickle: UnsafePickleOpt = False,
    threads: ThreadsOpt = None,
    precision: PrecisionOpt = None,
    budget: BudgetOpt = None,
    debug: DebugOpt = False,
):
    """Measure a whole sweep as resumable units (checkpoint × measure); merge with 'flatcli collect'."""
    from .. import api  # lazy: CLI start-up (loads torch)
    from ..sweep.runner import parse_slurm_params  # lazy: CLI start-up (loads torch)

    def log(msg: str) -> None:
        err_console.print(msg, highlight=False, soft_wrap=True, markup=False)

    run = run_options(
        device=device,
        precision=precision,
        seed=seed,
        threads=threads,
        allow_unsafe_pickle=allow_unsafe_pickle,
        budget=budget,
    )
    try:
        options = api.SweepOptions(
            gpus=gpus,
            workers=workers,
            shard=shard,
            executor=_value(executor),
            resume=resume,
            retry_failed=retry_failed,
            dry_run=dry_run,
            lock_timeout=lock_timeout,
            tasks=tasks,
            slurm=parse_slurm_params(slurm) if slurm else None,
            cluster=cluster,
            wait=wait,
            debug=debug,
        )
        report = api.sweep(config, outdir, measures=measures, run=run, options=options, log=log)
    except api.SweepInterrupted as e:  # said once, here: the workers stop without a word
        err_console.print(
            f"{e}; resume with: {rerun_command(ctx, drop=('resume',))}",
            highlight=False,
            soft_wrap=True,
            markup=False,
        )
        raise typer.Exit(ExitCode.INTERRUPTED) from None
    for line in report.lines:
        console.print(line, highlight=False, soft_wrap=True)
    if report.dry_run:
        costs = api.estimate_costs(config, measures=measures, run=run)
        for line in costs.lines():
            console.print(line, highlight=False, soft_wrap=True, markup=False)
        raise typer.Exit(max(report.exit_code, costs.exit_code))
    if not report.dry_run:
        msg = report.summary()
        if report.executor == "slurm" and report.jobs and not wait:
            msg = f"submitted; when the array is done: flatcli collect {outdir}"
        else:
            msg += f"; merge with: flatcli collect {outdir}"
        console.print(msg, highlight=False, soft_wrap=True)
    raise typer.Exit(report.exit_code)


@app.command(cls=FitHelp)
@handle_errors
def collect(
    outdir: Annotated[Path, typer.Argument(help="A sweep directory.")],
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            help="Output folder: results.csv and results.json go inside (default OUTDIR). "
            "A CSV path is still accepted, with a warning, until the next release.",
        ),
    ] = None,
    debug: DebugOpt = False,
):
    """Merge a sweep's unit files into results.csv (the columns of 'flatcli measure')."""
    import warnings

    from .. import api  # lazy: CLI start-up (loads torch)

    with warnings.catch_warnings(record=True) as said:  # the old -o form: one line on stderr
        warnings.simplefilter("always", FutureWarning)
        rep = api.collect_report(outdir, output)
    for w in said:
        if issubclass(w.category, FutureWarning):
            err_console.print(
                f"warning: {w.message}", highlight=False, soft_wrap=True, markup=False
            )
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    n_err = sum(r.status == "error" for r in rep.rows)
    console.print(
        f"wrote {rep.csv_path} and {rep.json_path}: {len(rep.rows)} checkpoints × {len(rep.labels)} measures, "
        f"{len(rep.missing)} units not finished, {n_err} rows with errors",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
    if rep.stale:
        err_console.print(
            f"note: {rep.stale} unit files of an earlier plan were ignored", highlight=False
        )
    for p in rep.unreadable:
        why = rep.reasons.get(p)
        err_console.print(
            f"warning: unreadable unit file {p}{f' ({why})' if why else ''}; ignored",
            highlight=False,
            soft_wrap=True,
            markup=False,
        )
    for p, why in rep.reasons.items():
        if p not in rep.unreadable:  # plan.json
            err_console.print(
                f"warning: {why}; units grouped without it",
                highlight=False,
                soft_wrap=True,
                markup=False,
            )
    for c, lab in rep.missing[:10]:
        err_console.print(f"not finished: {c} {lab}", highlight=False, markup=False)
    raise typer.Exit(rep.exit_code)


@app.command("sweep-worker", hidden=True, cls=FitHelp)
@handle_errors
def sweep_worker(
    outdir: Annotated[Path, typer.Argument(help="A planned sweep directory (holds plan.json).")],
    shard: Annotated[str | None, typer.Option("--shard", help="I/N: only shard I of N.")] = None,
    worker: Annotated[
        int, typer.Option("--worker", min=0, help="This worker's index in its pool.")
    ] = 0,
    workers: Annotated[int, typer.Option("--workers", min=1, help="Workers in the pool.")] = 1,
    device: Annotated[str | None, typer.Option("--device", help="auto, cpu or cuda:N.")] = None,
    redo_before: Annotated[
        float | None,
        typer.Option("--redo-before", help="Recompute units finished before this time."),
    ] = None,
    retry_before: Annotated[
        float | None,
        typer.Option("--retry-before", help="Rerun error units finished before this time."),
    ] = None,
    lock_timeout: Annotated[
        float,
        typer.Option("--lock-timeout", min=0.0, help="Seconds after which a silent lock is stale."),
    ] = 600.0,
    threads: ThreadsOpt = None,
    sweep_id: Annotated[
        str | None,
        typer.Option(
            "--sweep-id",
            "--run",
            help="Id of the sweep run this worker belongs to (stored in its unit records).",
        ),
    ] = None,
    progress: Annotated[
        str | None,
        typer.Option(
            "--progress",
            help="K/N: K of the sweep run's N units were finished when it started (the log's count over all workers).",
        ),
    ] = None,
    debug: DebugOpt = False,
):
    """One worker over a planned sweep: what 'flatcli sweep' runs per GPU and array schedulers run per task."""
    from ..sweep.worker import in_pool, run_worker_process  # lazy: CLI start-up (loads torch)

    try:
        line = run_worker_process(
            outdir,
            shard=shard,
            worker=worker,
            workers=workers,
            device=device,
            redo_before=redo_before,
            retry_before=retry_before,
            lock_timeout=lock_timeout,
            threads=threads,
            sweep_id=sweep_id,
            progress=progress,
        )
    except KeyboardInterrupt:
        if in_pool():  # the pool's coordinator says what is finished, once
            raise typer.Exit(ExitCode.INTERRUPTED) from None
        raise
    if line:
        err_console.print(line, highlight=False, markup=False)
