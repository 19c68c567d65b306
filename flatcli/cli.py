"""The flatcli command line: parsing and rendering only; the work is in `flatcli.api`.

Exit codes: 0 success, 1 a measurement failed, 2 bad usage or config. Errors are
one line on stderr; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import traceback
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperCommand, TyperGroup

try:  # typer ≥ 0.2x vendors click and raises its own copies of click's exceptions
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover - older typer on top of click
    from click import exceptions as click_exceptions
from rich.table import Table

from .console import (
    CheckpointProgress,
    GridProgress,
    StageProgress,
    console,
    err_console,
    fit_width,
    fmt,
    print_table,
    quiet_torch_warnings,
    render_rows,
)
from .errors import ConfigError, FlatcliError, RankFailure, is_peer_gone

WIDE_HELP = 100  # columns from which --help uses typer's rich panels (narrower ones cut option names)


def _fitting_help(cmd, format_help, ctx, formatter) -> None:
    """``format_help`` of a command or group with typer's rich panels on a terminal of at least
    `WIDE_HELP` columns, else with click's plain layout (option names whole, help text wrapped to
    the width; also what a pipe gets)."""
    if console.width >= WIDE_HELP:
        return format_help(ctx, formatter)
    mode, cmd.rich_markup_mode = cmd.rich_markup_mode, None
    try:
        return format_help(ctx, formatter)
    finally:
        cmd.rich_markup_mode = mode


class FitHelp(TyperCommand):
    """A command whose ``--help`` fits the terminal (see `_fitting_help`)."""

    def format_help(self, ctx, formatter):
        """The help in the layout that fits the width."""
        return _fitting_help(self, super().format_help, ctx, formatter)


class OneLineErrors(TyperGroup):
    """Usage errors (a bad option value, a missing argument) as one line on stderr, exit code 2."""

    def format_help(self, ctx, formatter):
        """The help in the layout that fits the width (see `_fitting_help`)."""
        return _fitting_help(self, super().format_help, ctx, formatter)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """Run the command; a usage error prints ``error: <message> (see '<command> --help')``."""
        try:
            rv = super().main(args=args, prog_name=prog_name, complete_var=complete_var,
                              standalone_mode=False, **extra)
        except click_exceptions.NoArgsIsHelpError as e:  # a bare command group: its help
            print(e.ctx.get_help() if e.ctx is not None else e.format_message())
            if not standalone_mode:
                return 0
            sys.exit(0)
        except click_exceptions.UsageError as e:
            where = e.ctx.command_path if e.ctx is not None else "flatcli"
            err_console.print(f"[red]error:[/red] {e.format_message()} (see '{where} --help')",
                              highlight=False, soft_wrap=True)
            if not standalone_mode:
                raise
            sys.exit(2)
        except typer.Abort:
            err_console.print("interrupted")
            if not standalone_mode:
                raise
            sys.exit(130)
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0)


def _version(value: bool) -> None:
    if value:
        from ._version import __version__

        console.print(f"flatcli {__version__}", highlight=False)
        raise typer.Exit(0)


app = typer.Typer(
    name="flatcli",
    cls=OneLineErrors,
    help="Measure how flat or sharp trained networks are, and how well each measure predicts generalization.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
config_app = typer.Typer(cls=OneLineErrors, help="Inspect configs.", no_args_is_help=True)
experiments_app = typer.Typer(
    cls=OneLineErrors, no_args_is_help=True,
    help="Reproduce the seed papers' experiments: train a grid of models to a loss target, then sweep, collect, correlate.",
)  # fmt: skip


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
):
    """Measure how flat or sharp trained networks are, and how well each measure predicts generalization."""


class Format(str, Enum):
    """Output formats of ``measure`` on stdout."""

    table = "table"
    csv = "csv"
    json = "json"


class BiasBN(str, Enum):
    """How landscape directions treat biases and normalization layers."""

    zero = "zero"
    keep = "keep"


class Transform(str, Enum):
    """Rescalings of ``check-invariance``."""

    node = "node"
    layer = "layer"
    both = "both"


class Executor(str, Enum):
    """Where ``sweep`` runs its workers."""

    local = "local"
    slurm = "slurm"


class SortBy(str, Enum):
    """Statistics ``correlate`` can rank by."""

    psi = "psi"
    kendall_tau_b = "kendall_tau_b"
    jiang_tau = "jiang_tau"
    spearman = "spearman"
    pearson = "pearson"
    cmi = "cmi"


def _value(v):
    """An Enum option's string (None stays None)."""
    return v.value if isinstance(v, Enum) else v
app.add_typer(config_app, name="config")
app.add_typer(experiments_app, name="experiments")


ConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="YAML config file.", envvar="FLATCLI_CONFIG")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show full tracebacks.")]
WideOpt = Annotated[bool, typer.Option(
    "--wide", help="Print every table column even when the terminal is narrow (a pipe or a file always gets them all).")]
ThreadsOpt = Annotated[str | None, typer.Option(
    "--threads", envvar="FLATCLI_THREADS", show_default=False,
    help="Intra-op CPU threads per worker process: N or auto (default runtime.threads, auto: OMP_NUM_THREADS "
         "when set, else cores // workers).")]


class Precision(str, Enum):
    """``runtime.precision`` (`flatcli.engine.precision`)."""

    auto = "auto"
    fp32 = "fp32"
    tf32 = "tf32"
    bf16 = "bf16"
    fp64 = "fp64"


PrecisionOpt = Annotated[Precision | None, typer.Option(
    "--precision", envvar="FLATCLI_PRECISION", show_default=False,
    help="auto (TF32 products on a tensor-core GPU, verified in fp32; fp32 elsewhere), fp32, tf32, bf16 "
         "(bfloat16 forward and products, float32 vectors and sums, verified in fp32) or fp64 "
         "(default runtime.precision).")]


def _fail(e: BaseException, code: int, message: str, debug: bool):
    """End a command on an error: with ``debug`` its traceback first, then the one-line message;
    the exit code is the same with and without ``--debug``."""
    if debug:
        import traceback

        traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
    err_console.print(message, highlight=False, soft_wrap=True)
    raise typer.Exit(code) from None


def log_line(text: str | None) -> None:
    """One informational line on stderr (e.g. the threads chosen), nothing when empty."""
    if text:
        err_console.print(text, highlight=False, markup=False, soft_wrap=True, style="dim")


def handle_errors(fn):
    """Turn FlatcliError into a one-line message and its exit code (``--debug`` adds the traceback
    and keeps the exit code)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        debug = kwargs.get("debug", False)
        try:
            return fn(*args, **kwargs)
        except FlatcliError as e:
            _fail(e, e.exit_code, f"[red]error:[/red] {e}", debug)
        except KeyboardInterrupt:
            err_console.print("interrupted")
            raise typer.Exit(130) from None
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except RankFailure as e:
            _end_all_ranks(e, debug)
        except Exception as e:
            hint = "" if debug else " (run with --debug for the traceback)"
            _fail(e, 1, f"[red]error:[/red] {type(e).__name__}: {e}{hint}", debug)

    return wrapper


def _end_all_ranks(e: BaseException, debug: bool) -> None:
    """A failure on one rank of a distributed run: the other ranks may wait in a collective this one
    never reaches, so the process ends at once (torchrun then stops the others; exit code 1). A rank
    that fails only because a peer went away says nothing: the peer's message is the one error."""
    if debug:
        traceback.print_exception(e)
    if not is_peer_gone(e):
        err_console.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


# ------------------------------------------------------------------ measure
@app.command(cls=FitHelp)
@handle_errors
def measure(
    checkpoints: Annotated[list[str] | None, typer.Argument(help="Checkpoint files (default: the config's 'checkpoints').")] = None,
    config: ConfigOpt = ...,
    measures: Annotated[str | None, typer.Option("--measures", "-m", help="Comma-separated measure names or labels ('all' for every measure).")] = None,
    outdir: Annotated[Path | None, typer.Option("--outdir", "-o", help="Write results.csv and results.json here (default: output.dir).")] = None,
    device: Annotated[str | None, typer.Option("--device", help="auto, cpu or cuda:N.", envvar="FLATCLI_DEVICE")] = None,
    format: Annotated[Format | None, typer.Option("--format", help="table, csv or json on stdout (default: output.format, table).")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Seed of every stochastic measure.")] = None,
    allow_unsafe_pickle: Annotated[bool, typer.Option("--allow-unsafe-pickle", help="Load full pickled checkpoints (runs code from the file: trusted files only).")] = False,
    plots: Annotated[bool, typer.Option("--plots", help="Draw each measure's plots (e.g. spectral densities) in OUTDIR/plots/ (needs matplotlib).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the products (HVPs, gradients, forward passes) each measure will spend per checkpoint; measure nothing.")] = False,
    threads: ThreadsOpt = None,
    precision: PrecisionOpt = None,
    wide: WideOpt = False,
    debug: DebugOpt = False,
):
    """Compute the configured measures for each checkpoint; write OUTDIR/results.csv and results.json."""
    from . import api

    precision = _value(precision)
    if dry_run:
        plan = api.plan_costs(config, checkpoints, measures=measures, device=device, precision=precision)
        for line in plan.lines():
            console.print(line, highlight=False, soft_wrap=True, markup=False)
        raise typer.Exit(plan.exit_code)
    from .config import overrides

    cfg = api.load(config, overrides(device=device, seed=seed, threads=threads, precision=precision))
    format = _value(format) or cfg.output.format
    out = cfg.output_dir(outdir)
    shown = CheckpointProgress("measuring")
    try:
        report = api.measure(
            cfg, checkpoints, measures=measures, outdir=out, allow_unsafe_pickle=allow_unsafe_pickle or None,
            on_row=shown.row, on_start=shown.start, on_progress=shown.detail if shown.is_tty else None,
            debug=debug, plots=plots,
        )
    finally:
        shown.stop()
    if report.rank == 0:  # under torchrun only rank 0 prints; every rank has the exit code
        log_line(report.meta.get("threads"))
        _print_report(report, format, out, wide)
    raise typer.Exit(report.exit_code)


def _print_report(report, format: str, out: Path, wide: bool = False) -> None:
    """``measure``'s stdout (table, csv or json) and its error lines on stderr."""
    labels = report.rows[0].labels if report.rows else []
    if format == "table":
        print_table(console, render_rows(report.rows, labels, fit_width(console, wide)), wide)
        where = report.written_to or out
        console.print(f"wrote {where / 'results.csv'} and {where / 'results.json'} ({report.seconds:.1f}s)",
                      highlight=False)
    elif format == "csv":
        from .results import to_csv

        sys.stdout.write(to_csv(report.rows))
    else:
        from .results import jsonable

        sys.stdout.write(json.dumps(jsonable([r.to_json() for r in report.rows]), indent=2) + "\n")
    if report.meta.get("plots"):
        err_console.print(f"wrote {len(report.meta['plots'])} plot(s) in {out / 'plots'}", highlight=False)
    for r in report.rows:
        if r.status != "ok":
            err_console.print(f"[red]error:[/red] {r.checkpoint}: {r.error}", highlight=False, soft_wrap=True)
    if report.write_error:
        err_console.print(f"[red]error:[/red] {report.write_error}", highlight=False, soft_wrap=True)


# ------------------------------------------------------------------ measures
@app.command("measures", cls=FitHelp)
@handle_errors
def measures_cmd(
    pattern: Annotated[str, typer.Argument(help="Shell wildcard over names.")] = "*",
    debug: DebugOpt = False,
):
    """List every measure with a one-line description and its options."""
    from .measures import list_measures
    from .measures._options import describe_options

    infos = list_measures(pattern)
    if not infos:
        import difflib

        names = [m.name for m in list_measures()]
        hint = difflib.get_close_matches(pattern, names, n=1)
        raise ConfigError(f"no measure matches {pattern!r}." + (f" Did you mean '{hint[0]}'?" if hint
                          else " Run 'flatcli measures' for the list."))
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

    from . import api

    cfg = api.load(config)
    console.print(f"# {config}  (hash {cfg.hash()})", highlight=False)
    console.print(yaml.safe_dump(cfg.to_dict(defaults=True), sort_keys=False).rstrip(), highlight=False)
    console.print("\n# where each value came from", highlight=False)
    for k in sorted(cfg.provenance):
        console.print(f"#   {k}: {cfg.provenance[k]}", highlight=False)


# ------------------------------------------------------------------ demo
@app.command(cls=FitHelp)
@handle_errors
def demo(
    outdir: Annotated[Path, typer.Option("--outdir", "-o", help="Where checkpoints and results go.")] = Path("flatcli-demo"),
    measures: Annotated[str | None, typer.Option("--measures", "-m", help="Measures to run ('all' for the whole catalogue).")] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    threads: ThreadsOpt = None,
    wide: WideOpt = False,
    debug: DebugOpt = False,
):
    """Train a small zoo of MLPs on bundled digits to a fixed loss, measure them, rank the measures by granulated Kendall Ψ (ties by Kendall τ-b)."""
    from .demo import run_demo

    run_demo(outdir, measures=measures, seed=seed, console=console, threads=threads, wide=wide)


# ------------------------------------------------------------------ experiments
@experiments_app.command("list")
@handle_errors
def experiments_list(debug: DebugOpt = False):
    """List the experiments with their studies and the models of each full grid."""
    from .experiments import list_experiments

    t = Table(show_header=True, header_style="bold")
    for col in ("experiment", "title", "studies (models)"):
        t.add_column(col)
    for e in list_experiments():
        t.add_row(e.name, f"{e.title}\n[dim]{e.reference}[/dim]", ", ".join(f"{s}: {n}" for s, n in e.studies))
    print_table(console, t)


@experiments_app.command("run")
@handle_errors
def experiments_run(
    name: Annotated[str, typer.Argument(help="An experiment (see 'flatcli experiments list') or a spec YAML file.")],
    quick: Annotated[bool, typer.Option("--quick", help="Tiny grid, tiny models, few steps: a smoke test of the pipeline (seconds), not a result.")] = False,
    outdir: Annotated[Path | None, typer.Option("--outdir", "-o", help="Output folder (default experiments-out/NAME, NAME-quick with --quick).")] = None,
    jobs: Annotated[int | None, typer.Option("--jobs", min=1, help="Models trained and sweep workers in parallel, one thread each; the numbers do not depend on it (default 1 with --quick, else the cores up to 2).")] = None,
    study: Annotated[str | None, typer.Option("--study", help="Run only these studies (comma-separated).")] = None,
    publish: Annotated[Path | None, typer.Option("--publish", metavar="DIR", help="Copy the small outputs (tables, summary, figures) into DIR/NAME/, e.g. docs/experiments.")] = None,
    device: Annotated[str | None, typer.Option("--device", help="auto, cpu or cuda:N for training and measuring (default: the spec's).", envvar="FLATCLI_DEVICE")] = None,
    plots: Annotated[bool, typer.Option("--plots/--no-plots", help="Draw the figures (needs matplotlib).")] = True,
    debug: DebugOpt = False,
):
    """Run one experiment: train its grid to the loss target, flatcli sweep, collect, correlate; print summary.md."""
    from .experiments import publish as publish_outputs
    from .experiments import run_experiment

    def log(msg: str) -> None:
        err_console.print(msg, highlight=False, soft_wrap=True, markup=False)

    studies = [s.strip() for s in study.split(",") if s.strip()] if study else None
    rep = run_experiment(name, outdir, quick=quick, jobs=jobs, studies=studies, plots=plots, device=device, log=log)
    console.print(rep.summary.read_text(), highlight=False, soft_wrap=True, markup=False)
    console.print(f"done in {rep.seconds:.0f}s; outputs in {rep.outdir} (summary.md)", highlight=False, soft_wrap=True)
    if publish is not None:
        files = publish_outputs(rep, publish)
        console.print(f"published {len(files)} files to {publish / rep.spec.name}", highlight=False, soft_wrap=True)
    raise typer.Exit(rep.exit_code)


# ------------------------------------------------------------------ landscape
@app.command(cls=FitHelp)
@handle_errors
def landscape(
    checkpoints: Annotated[list[str], typer.Argument(help="Checkpoint at the centre of the slice (θ_a with --to); with --pca the trajectory's checkpoints (files or globs, in training order), with --connect the two endpoints.", show_default=False)],
    config: ConfigOpt = ...,
    outdir: Annotated[Path, typer.Option("--outdir", "-o", help="Write landscape.csv, landscape.json and PNG plots here (pca_* files with --pca, connect* and bend.pt with --connect).")] = ...,
    dims: Annotated[int, typer.Option("--dims", min=1, max=2, help="1 or 2 filter-normalized random directions.")] = 1,
    steps: Annotated[int, typer.Option("--steps", help="Grid points per axis.")] = 25,
    span: Annotated[str | None, typer.Option("--span", help="Grid range 'a,b' (default -1,1; with --to -0.5,1.5).")] = None,
    to: Annotated[str | None, typer.Option("--to", help="Second checkpoint: interpolate (1-t)·θ_a + t·θ_b instead of slicing.")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Seed of the random directions; with --connect of the bend training, with --pca of the randomized solver (default runtime.seed).")] = None,
    device: Annotated[str | None, typer.Option("--device", help="auto, cpu or cuda:N.", envvar="FLATCLI_DEVICE")] = None,
    bias_bn: Annotated[BiasBN, typer.Option("--bias-bn", help="Direction on biases and norm layers: zero (Li et al.) or keep.")] = BiasBN.zero,
    points_per_pass: Annotated[int | None, typer.Option("--points-per-pass", min=1, help="Grid points per vmapped forward pass (1 = loop; default: 1 for conv nets, else 8).")] = None,
    plots: Annotated[bool, typer.Option("--plots/--no-plots", help="Write PNG plots (needs matplotlib).")] = True,
    allow_unsafe_pickle: Annotated[bool, typer.Option("--allow-unsafe-pickle", help="Load full pickled checkpoints (trusted files only).")] = False,
    pca: Annotated[bool, typer.Option("--pca", help="Trajectory PCA (Li et al. 2018): CHECKPOINTS are a training run (≥ 3, sorted naturally); loss over the plane of its top-2 PCA directions around the last, with the path.")] = False,
    connect: Annotated[bool, typer.Option("--connect", help="Mode connectivity (Garipov et al. 2018): CHECKPOINTS are A B; train the bend of a quadratic Bezier curve between them, loss and barrier along the curve and the line.")] = False,
    solver: Annotated[str, typer.Option("--solver", help="--pca: auto, full (scikit-learn PCA) or randomized (randomized SVD, for large models).")] = "auto",
    keep_order: Annotated[bool, typer.Option("--keep-order", help="--pca: keep the checkpoints in the order given instead of sorting them naturally.")] = False,
    bend_steps: Annotated[int, typer.Option("--bend-steps", help="--connect: optimizer steps for the bend (the step budget).")] = 1000,
    bend_lr: Annotated[float | None, typer.Option("--bend-lr", help="--connect: learning rate (default 1e-3 for adam, 1e-2 for sgd).")] = None,
    bend_optimizer: Annotated[str, typer.Option("--bend-optimizer", help="--connect: adam or sgd (momentum 0.9).")] = "adam",
    bend_batch_size: Annotated[int, typer.Option("--bend-batch-size", help="--connect: minibatch size of the bend training.")] = 128,
    threads: ThreadsOpt = None,
    precision: PrecisionOpt = None,
    debug: DebugOpt = False,
):
    """Loss-landscape view: 1D/2D slices along filter-normalized random directions, with --to the
    linear interpolation between two checkpoints, with --pca a training trajectory's PCA plane, with
    --connect a fitted Bezier curve against the line; writes CSVs and PNG plots."""
    from . import api

    if pca or connect:
        _landscape_view(checkpoints, config, outdir, pca=pca, connect=connect, to=to, dims=dims, steps=steps, span=span,
                        seed=seed, device=device, points_per_pass=points_per_pass, plots=plots,
                        allow_unsafe_pickle=allow_unsafe_pickle, solver=solver, keep_order=keep_order,
                        bend_steps=bend_steps, bend_lr=bend_lr, bend_optimizer=bend_optimizer,
                        bend_batch_size=bend_batch_size, threads=threads, precision=_value(precision))
        return
    if len(checkpoints) != 1:
        raise ConfigError(f"landscape takes one checkpoint (several with --pca, two with --connect); got {len(checkpoints)}")
    checkpoint = checkpoints[0]
    with GridProgress("landscape") as shown:
        res = api.landscape(
            config, checkpoint, to=to, dims=dims, steps=steps, span=span, seed=seed, device=device,
            bias_bn=_value(bias_bn), points_per_pass=points_per_pass, outdir=outdir, plots=plots,
            allow_unsafe_pickle=allow_unsafe_pickle or None, on_progress=shown.update, threads=threads,
            precision=_value(precision),
        )
    what = {"1d": "1D slice", "2d": "2D slice", "interpolation": "interpolation"}[res.kind]
    grid = f"{len(res.alpha)}" + (f"×{len(res.beta)}" if res.beta is not None else "")
    _print_view(f"{what} of {checkpoint}" + (f" → {to}" if to else "") + f" ({grid} points)", res)
    for split, d in res.meta.get("evaluator", {}).items():
        if d.get("vmap_fallback"):
            err_console.print(f"note: vmap failed on {split} ({d['vmap_fallback']}); evaluated point by point", highlight=False)


def _print_view(title: str, res) -> None:
    """A landscape view's summary table, its plots and files."""
    log_line(res.meta.get("threads"))
    t = Table(title=title, header_style="bold")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    for k, v in res.summary.items():
        t.add_row(k, ", ".join(fmt(x) for x in v) if isinstance(v, list) else fmt(v))
    print_table(console, t)
    if res.meta.get("plots"):
        err_console.print(res.meta["plots"], highlight=False)
    files = ", ".join(str(p) for p in res.files.values())
    console.print(f"wrote {files} ({res.seconds:.1f}s)", highlight=False, soft_wrap=True)


def _check_view_options(checkpoints, *, pca, connect, to, dims, span) -> None:
    """One-line errors for option combinations ``--pca``/``--connect`` do not take."""
    if pca and connect:
        raise ConfigError("--pca and --connect are two different views; choose one")
    flag = "--pca" if pca else "--connect"
    if to is not None:
        raise ConfigError(f"--to does not apply to {flag} (--connect A B already includes the straight line)")
    if connect and len(checkpoints) != 2:
        raise ConfigError(f"--connect needs exactly two checkpoints, A and B; got {len(checkpoints)}")
    if connect and dims != 1:
        raise ConfigError("--dims does not apply to --connect (paths are one-dimensional)")
    if connect and span is not None:
        raise ConfigError("--span does not apply to --connect (the curve is defined for t in [0, 1])")


def _landscape_view(checkpoints, config, outdir, *, pca, connect, to, dims, steps, span, seed, device, points_per_pass,
                    plots, allow_unsafe_pickle, solver, keep_order, bend_steps, bend_lr, bend_optimizer, bend_batch_size,
                    threads, precision):
    """``landscape --pca`` and ``landscape --connect``: check the option combination, call the API, render."""
    from . import api

    _check_view_options(checkpoints, pca=pca, connect=connect, to=to, dims=dims, span=span)
    with GridProgress("landscape") as shown:
        common = dict(steps=steps, seed=seed, device=device, points_per_pass=points_per_pass, outdir=outdir,
                      plots=plots, allow_unsafe_pickle=allow_unsafe_pickle or None, on_progress=shown.update,
                      threads=threads, precision=precision)
        if pca:
            res = api.landscape_pca(config, checkpoints, span=span, solver=solver, sort=not keep_order, **common)
        else:
            res = api.landscape_connect(config, checkpoints[0], checkpoints[1], bend_steps=bend_steps, bend_lr=bend_lr,
                                        bend_optimizer=bend_optimizer, bend_batch_size=bend_batch_size, **common)
    if pca:
        grid = f"{len(res.surface.alpha)}×{len(res.surface.beta)}"
        title = f"trajectory PCA of {len(res.meta['checkpoints'])} checkpoints ({grid} points, {res.meta['solver']} SVD)"
    else:
        title = f"mode connectivity {checkpoints[0]} → {checkpoints[1]} ({len(res.curve.alpha)} points, {res.meta['bend_steps']} bend steps)"
    _print_view(title, res)


# ------------------------------------------------------------------ sweep / collect / correlate
@app.command(cls=FitHelp)
@handle_errors
def sweep(
    config: ConfigOpt = ...,
    outdir: Annotated[Path, typer.Option("--outdir", "-o", help="Sweep directory: plan.json, units/ (one file per finished unit), locks/.")] = ...,
    measures: Annotated[str | None, typer.Option("--measures", "-m", help="Comma-separated measure names or labels ('all' for every measure).")] = None,
    gpus: Annotated[str | None, typer.Option("--gpus", help="'all' or indices like 0,1: one worker process per GPU (default: every visible GPU when the device is auto).")] = None,
    workers: Annotated[int | None, typer.Option("--workers", min=1, help="CPU worker processes (default 1).")] = None,
    shard: Annotated[str | None, typer.Option("--shard", help="I/N: run only shard I of N (for array schedulers); shards cover every unit exactly once.")] = None,
    executor: Annotated[Executor, typer.Option("--executor", help="local, or slurm (a job array through submitit; needs submitit, the slurm extra of flatcli).")] = Executor.local,
    resume: Annotated[bool, typer.Option("--resume/--no-resume", help="Skip finished units (--no-resume recomputes them).")] = True,
    retry_failed: Annotated[bool, typer.Option("--retry-failed", help="Rerun units that finished with an error.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would be run or submitted; run nothing.")] = False,
    device: Annotated[str | None, typer.Option("--device", help="auto, cpu or cuda:N.", envvar="FLATCLI_DEVICE")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Seed of every stochastic measure.")] = None,
    tasks: Annotated[int | None, typer.Option("--tasks", min=1, help="slurm: number of array tasks (default: one per checkpoint).")] = None,
    slurm: Annotated[list[str] | None, typer.Option("--slurm", help="slurm: submitit parameter KEY=VALUE (repeatable), e.g. slurm_partition=gpu, timeout_min=120.")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="slurm: wait for the array to finish.")] = False,
    cluster: Annotated[str, typer.Option("--submitit-cluster", hidden=True, help="submitit backend: slurm, local or debug.")] = "slurm",
    lock_timeout: Annotated[float, typer.Option("--lock-timeout", min=0.0, help="Seconds without a heartbeat after which another worker's lock is stale.")] = 600.0,
    allow_unsafe_pickle: Annotated[bool, typer.Option("--allow-unsafe-pickle", help="Load full pickled checkpoints (trusted files only).")] = False,
    threads: ThreadsOpt = None,
    precision: PrecisionOpt = None,
    debug: DebugOpt = False,
):
    """Measure a whole sweep as resumable units (checkpoint × measure); merge with 'flatcli collect'."""
    from . import api
    from .sweep.runner import parse_slurm_params

    def log(msg: str) -> None:
        err_console.print(msg, highlight=False, soft_wrap=True, markup=False)

    report = api.sweep(
        config, outdir, measures=measures, device=device, seed=seed, gpus=gpus, workers=workers, shard=shard,
        executor=_value(executor), resume=resume, retry_failed=retry_failed, dry_run=dry_run, lock_timeout=lock_timeout,
        tasks=tasks, slurm=parse_slurm_params(slurm), cluster=cluster, wait=wait,
        allow_unsafe_pickle=allow_unsafe_pickle or None, log=log, debug=debug, threads=threads,
        precision=_value(precision),
    )
    for line in report.lines:
        console.print(line, highlight=False, soft_wrap=True)
    if report.dry_run:
        plan = api.plan_costs(config, measures=measures, device=device, precision=_value(precision))
        for line in plan.lines():
            console.print(line, highlight=False, soft_wrap=True, markup=False)
        raise typer.Exit(max(report.exit_code, plan.exit_code))
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
    output: Annotated[Path | None, typer.Option("--output", "-o", help="CSV to write (default OUTDIR/results.csv; a .json goes beside it).")] = None,
    debug: DebugOpt = False,
):
    """Merge a sweep's unit files into results.csv (the columns of 'flatcli measure')."""
    from . import api

    rep = api.collect(outdir, output)
    n_err = sum(r.status == "error" for r in rep.rows)
    console.print(
        f"wrote {rep.csv_path} and {rep.json_path}: {len(rep.rows)} checkpoints × {len(rep.labels)} measures, "
        f"{len(rep.missing)} units not finished, {n_err} rows with errors",
        highlight=False, soft_wrap=True,
    )
    if rep.stale:
        err_console.print(f"note: {rep.stale} unit files of an earlier plan were ignored", highlight=False)
    for p in rep.unreadable:
        err_console.print(f"[yellow]warning:[/yellow] unreadable unit file {p} (ignored)", highlight=False)
    for c, lab in rep.missing[:10]:
        err_console.print(f"not finished: {c} {lab}", highlight=False)
    raise typer.Exit(rep.exit_code)


@app.command(cls=FitHelp)
@handle_errors
def correlate(
    results: Annotated[Path, typer.Argument(help="A table with one row per checkpoint: a results.csv from 'flatcli measure' or 'flatcli collect', or any CSV.")],
    target: Annotated[str, typer.Option("--target", help="Column to predict.")] = "gen_gap",
    by: Annotated[str | None, typer.Option("--by", help="Hyperparameter axes for Ψ and CMI: columns of any name, e.g. lr,width (hp_lr is found by lr; default: every hp_* column that forms a grid axis).")] = None,
    outdir: Annotated[Path | None, typer.Option("--outdir", "-o", help="Write correlations.csv (and plots/) here.")] = None,
    plots: Annotated[bool, typer.Option("--plots", help="Scatter per measure and a ψ heatmap in OUTDIR/plots (needs matplotlib and -o OUTDIR).")] = False,
    sort: Annotated[str | None, typer.Option("--sort", help="Rank by psi, kendall_tau_b, jiang_tau, spearman, pearson or cmi.")] = None,
    measures: Annotated[str | None, typer.Option("--measures", "-m", help="Measure columns, any numeric columns (default: the measures flatcli recorded, else every numeric column that is not the target, a metric or a hyperparameter).")] = None,
    where: Annotated[str | None, typer.Option("--where", help="Keep only the rows matching this pandas query (DataFrame.query), e.g. 'hp_lr < 0.1 and train_acc >= 0.99'; backquote names that are not identifiers.")] = None,
    max_train_loss: Annotated[float | None, typer.Option("--max-train-loss", help="Keep only the rows with train_loss ≤ this (models at a minimum; Jiang et al. use 0.01).")] = None,
    bootstrap: Annotated[int | None, typer.Option("--bootstrap", help="Resamples of the checkpoints for percentile intervals of Pearson, Spearman and Kendall τ-b (e.g. 1000).")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the bootstrap resampling.")] = 0,
    confidence: Annotated[float, typer.Option("--confidence", help="Level of the bootstrap intervals.")] = 0.95,
    wide: WideOpt = False,
    color_by: Annotated[str | None, typer.Option("--color-by", help="Column colouring the scatter plots (default the first axis; 'none' for one colour).")] = None,
    marker_by: Annotated[str | None, typer.Option("--marker-by", help="Column choosing the markers of the scatter plots (default the next axis; 'none' for one marker).")] = None,
    compare: CompareOpt = None,
    debug: DebugOpt = False,
):
    """Rank measures by how well they predict the gap: Pearson, Spearman, Kendall τ-b, Jiang τ, granulated Ψ, CMI."""
    from . import api
    from .analysis.report import notes, render_table

    with GridProgress("correlate: measures bootstrapped" if bootstrap else "correlate") as shown:
        rep = api.correlate(results, target=target, by=by, outdir=outdir, plots=plots, sort=sort, measures=measures,
                            color_by=color_by, marker_by=marker_by, where=where, max_train_loss=max_train_loss,
                            bootstrap=bootstrap, seed=seed, confidence=confidence,
                            progress=shown.update if bootstrap else None)
    print_table(console, render_table(rep, fit_width(console, wide)), wide)
    rows = f"{rep.n_rows} checkpoints" + (f" (of {rep.n_input}, after the filters)" if rep.filters else "")
    console.print(
        f"{rows}; measures from {rep.measures_source}; n = checkpoints used "
        "(ψ groups and CMI pairs in correlations.csv)",
        highlight=False, soft_wrap=True,
    )
    for n in notes(rep):
        err_console.print(f"note: {n}", highlight=False, soft_wrap=True, markup=False)
    for w in rep.warnings:
        err_console.print(f"warning: {w}", style="yellow", highlight=False, soft_wrap=True, markup=False)
    if rep.csv_path is not None:
        console.print(f"wrote {rep.csv_path}" + (f" and {len(rep.plots)} plots in {rep.plots[0].parent}" if rep.plots else ""),
                      highlight=False, soft_wrap=True)
    if compare:
        _print_comparison(results, compare, target=target, bootstrap=bootstrap, seed=seed, confidence=confidence,
                          where=where, max_train_loss=max_train_loss, outdir=outdir)


# ------------------------------------------------------------------ correlate --compare
CompareOpt = Annotated[str | None, typer.Option(
    "--compare",
    help="A,B: paired bootstrap over the checkpoints of the difference of A's and B's correlations with the target "
         "(Kendall τ-b, Spearman, Pearson; Zou's interval for Pearson); says 'A ranks above B' only when the interval "
         "excludes 0, else 'tied'. Uses --bootstrap (default 2000), --seed and --confidence.")]


def _print_comparison(results, compare: str, *, target, bootstrap, seed, confidence, where, max_train_loss, outdir) -> None:
    """Run `flatcli.analysis.compare.compare_measures` for ``A,B`` and print one line per statistic
    (and write comparison.csv beside correlations.csv)."""
    from .analysis.compare import compare_measures, describe

    names = [x.strip() for x in compare.split(",") if x.strip()]
    if len(names) != 2:
        raise ConfigError(f"--compare takes two measures as A,B; got {compare!r}")
    df = compare_measures(results, names[0], names[1], target=target, bootstrap=bootstrap or 2000, seed=seed,
                          confidence=confidence, where=where, max_train_loss=max_train_loss)
    console.print(f"paired comparison with {target} ({names[0]} vs {names[1]}):", highlight=False, soft_wrap=True)
    for line in describe(df):
        console.print("  " + line, highlight=False, soft_wrap=True, markup=False)
    if outdir is not None:
        path = Path(outdir) / "comparison.csv"
        df.to_csv(path, index=False)
        console.print(f"wrote {path}", highlight=False, soft_wrap=True)


# ------------------------------------------------------------------ check-invariance
@app.command("check-invariance", cls=FitHelp)
@handle_errors
def check_invariance_cmd(
    checkpoint: Annotated[Path, typer.Argument(help="The checkpoint to rescale.")],
    config: ConfigOpt = ...,
    measures: Annotated[str | None, typer.Option("--measures", "-m", help="Comma-separated measures or labels (default: the configured ones plus every measure that claims invariance).")] = None,
    scale: Annotated[float, typer.Option("--scale", min=1.0, help="Rescaling factors range over [1/A, A].")] = 10.0,
    transform: Annotated[Transform, typer.Option("--transform", help="node, layer or both (node-wise then layer-wise).")] = Transform.both,
    tol: Annotated[float, typer.Option("--tol", min=0.0, help="Relative change up to which a claimed invariance holds (float64).")] = 1e-6,
    seed: Annotated[int | None, typer.Option("--seed", help="Seed of the rescaling and of every stochastic measure (equal for both runs).")] = None,
    device: Annotated[str | None, typer.Option("--device", help="auto, cpu or cuda:N.", envvar="FLATCLI_DEVICE")] = None,
    threads: ThreadsOpt = None,
    debug: DebugOpt = False,
):
    """Rescale the network without changing its function; show which measures stay put (exit 0 if every claimed invariance holds)."""
    from rich.markup import escape

    from .api import check_invariance

    with StageProgress("check-invariance: rescaling") as shown:
        rep = check_invariance(config, checkpoint, measures, transform=_value(transform), scale=scale, seed=seed,
                               tol=tol, device=device, progress=shown.update, threads=threads)
    log_line(rep.threads)
    console.print(f"[bold]{escape(rep.checkpoint)}[/bold]: {escape(rep.describe())}", highlight=False, soft_wrap=True)
    console.print(f"network output changed by {rep.output_rel_change:.2g} (relative, float64)", highlight=False)
    print_table(console, _invariance_table(rep))
    for r in rep.results:
        if r.note:
            console.print(f"* {r.label}: {r.note}", highlight=False, soft_wrap=True)
        if r.error:
            err_console.print(f"[red]error:[/red] {escape(r.error)}", highlight=False, soft_wrap=True)
    ref = next((r for r in rep.results if r.label == rep.reference), None)
    if ref is not None and ref.original and math.isfinite(ref.rescaled):
        console.print(f"the Hessian trace changed by a factor {ref.rescaled / ref.original:.3g}", highlight=False)
    claimed = [r for r in rep.results if r.claims_invariance]
    bad = [r.label for r in claimed if not r.held]
    if bad:
        err_console.print(f"[red]invariance violated[/red] (tolerance {rep.tol:g}): {', '.join(bad)}", highlight=False)
    else:
        console.print(f"all {len(claimed)} measure(s) claiming invariance held it within {rep.tol:g}", highlight=False)
    raise typer.Exit(rep.exit_code)


def _invariance_table(rep) -> Table:
    """The per-measure table of ``check-invariance``."""
    from rich import box

    t = Table(show_header=True, header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
    t.add_column("measure", no_wrap=True)
    for col, just in (("claims\ninvariance", "left"), ("original", "right"), ("rescaled", "right"),
                      ("rel.\nchange", "right"), ("held?", "left")):
        t.add_column(col, justify=just, no_wrap=True)
    for r in rep.results:
        name = r.label + ("*" if r.note else "")
        claims = "yes" if r.claims_invariance else "no"
        if r.held is None:
            held = "[dim]ref.[/dim]" if r.label == rep.reference else "-"
        else:
            held = "[green]yes[/green]" if r.held else "[red]NO[/red]"
        rel = "[red]error[/red]" if r.error else fmt(r.rel_change)
        t.add_row(name, claims, fmt(r.original), fmt(r.rescaled), rel, held)
    return t


# ------------------------------------------------------------------ sweep worker (hidden)
@app.command("sweep-worker", hidden=True, cls=FitHelp)
@handle_errors
def sweep_worker(
    outdir: Annotated[Path, typer.Argument(help="A planned sweep directory (holds plan.json).")],
    shard: Annotated[str | None, typer.Option("--shard", help="I/N: only shard I of N.")] = None,
    worker: Annotated[int, typer.Option("--worker", min=0, help="This worker's index in its pool.")] = 0,
    workers: Annotated[int, typer.Option("--workers", min=1, help="Workers in the pool.")] = 1,
    device: Annotated[str | None, typer.Option("--device", help="auto, cpu or cuda:N.")] = None,
    redo_before: Annotated[float | None, typer.Option("--redo-before", help="Recompute units finished before this time.")] = None,
    retry_before: Annotated[float | None, typer.Option("--retry-before", help="Rerun error units finished before this time.")] = None,
    lock_timeout: Annotated[float, typer.Option("--lock-timeout", min=0.0, help="Seconds after which a silent lock is stale.")] = 600.0,
    threads: ThreadsOpt = None,
    run: Annotated[str | None, typer.Option("--run", help="Id of the sweep run this worker belongs to (stored in its unit records).")] = None,
    debug: DebugOpt = False,
):
    """One worker over a planned sweep: what 'flatcli sweep' runs per GPU and array schedulers run per task."""
    from .sweep.runner import run_worker_process

    line = run_worker_process(outdir, shard=shard, worker=worker, workers=workers, device=device,
                              redo_before=redo_before, retry_before=retry_before, lock_timeout=lock_timeout,
                              threads=threads, run=run)
    err_console.print(line, highlight=False, markup=False)


def main(argv: list[str] | None = None) -> None:
    """The ``flatcli`` console script."""
    quiet_torch_warnings()
    app(args=argv)


if __name__ == "__main__":
    main()
