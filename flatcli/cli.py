"""The flatcli command line: parsing and rendering only; the work is in `flatcli.api`.

Exit codes: 0 success, 1 a measurement failed, 2 bad usage or config. Errors are
one line on stderr; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import functools
import json
import math
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from .errors import ConfigError, FlatcliError

app = typer.Typer(
    name="flatcli",
    help="Measure how flat or sharp trained networks are, and how well each measure predicts generalization.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
config_app = typer.Typer(help="Inspect configs.", no_args_is_help=True)
app.add_typer(config_app, name="config")

console = Console()
err_console = Console(stderr=True)

ConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="YAML config file.", envvar="FLATCLI_CONFIG")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show full tracebacks.")]


def handle_errors(fn):
    """Turn FlatcliError into a one-line message and its exit code (traceback with --debug)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        debug = kwargs.get("debug", False)
        try:
            return fn(*args, **kwargs)
        except FlatcliError as e:
            if debug:
                raise
            err_console.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            err_console.print("interrupted")
            raise typer.Exit(130) from None
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except Exception as e:
            if debug:
                raise
            err_console.print(
                f"[red]error:[/red] {type(e).__name__}: {e} (run with --debug for the traceback)",
                highlight=False,
                soft_wrap=True,
            )
            raise typer.Exit(1) from None

    return wrapper


def fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:.4g}"
    return str(v)


def render_rows(rows, labels: list[str]) -> Table:
    t = Table(show_header=True, header_style="bold")
    t.add_column("checkpoint", overflow="fold")
    t.add_column("status")
    for lab in labels:
        t.add_column(lab, justify="right")
    extra = [m for m in ("train_acc", "test_acc", "gen_gap") if any(m in r.metrics for r in rows)]
    for m in extra:
        t.add_column(m, justify="right")
    for r in rows:
        vals = []
        for lab in labels:
            res = r.results.get(lab)
            if res is None:
                vals.append("[red]error[/red]")
            else:
                s = fmt(res.value)
                if res.stderr:
                    s += f" ± {res.stderr:.2g}"
                if res.status != "ok":
                    s += f" ({res.status})"
                vals.append(s)
        status = "ok" if r.status == "ok" else "[red]error[/red]"
        t.add_row(r.checkpoint, status, *vals, *[fmt(r.metrics.get(m)) for m in extra])
    return t


# ------------------------------------------------------------------ measure
@app.command()
@handle_errors
def measure(
    checkpoints: Annotated[list[str] | None, typer.Argument(help="Checkpoint files (default: the config's 'checkpoints').")] = None,
    config: ConfigOpt = ...,
    measures: Annotated[str | None, typer.Option("--measures", "-m", help="Comma-separated measure names or labels ('all' for every measure).")] = None,
    outdir: Annotated[Path | None, typer.Option("--outdir", "-o", help="Write results.csv and results.json here (default: output.dir).")] = None,
    device: Annotated[str | None, typer.Option("--device", help="auto, cpu or cuda:N.", envvar="FLATCLI_DEVICE")] = None,
    format: Annotated[str, typer.Option("--format", help="table, csv or json on stdout.")] = "table",
    seed: Annotated[int | None, typer.Option("--seed", help="Seed of every stochastic measure.")] = None,
    allow_unsafe_pickle: Annotated[bool, typer.Option("--allow-unsafe-pickle", help="Load full pickled checkpoints (runs code from the file: trusted files only).")] = False,
    debug: DebugOpt = False,
):
    """Compute the configured measures for each checkpoint; write OUTDIR/results.csv and results.json."""
    from . import api

    if format not in ("table", "csv", "json"):
        raise ConfigError(f"--format must be table, csv or json; got {format!r}")
    cfg = api.load(config, {"runtime.device": device, "runtime.seed": seed})
    out = outdir if outdir is not None else Path(cfg.output.dir)
    if outdir is None and not Path(cfg.output.dir).is_absolute():
        out = cfg.base_dir / cfg.output.dir if cfg.provenance.get("output.dir") == "yaml" else Path(cfg.output.dir)
    is_tty = err_console.is_terminal
    progress = None
    task = None

    def on_start(i, n, job):
        nonlocal progress, task
        if is_tty:
            if progress is None:
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

                progress = Progress(
                    TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err_console, transient=True,
                )
                progress.start()
                task = progress.add_task("measuring", total=n)
            progress.update(task, description=f"measuring {job.checkpoint}")

    def on_row(i, n, row):
        if progress is not None:
            progress.advance(task)
        secs = sum(r.seconds for r in row.results.values())
        line = f"[{i + 1}/{n}] {row.checkpoint} {row.status} {secs:.1f}s"
        if row.status != "ok":
            line += f" {row.error}"
        if is_tty and progress is not None:
            progress.console.print(line, highlight=False, soft_wrap=True)
        else:
            print(line, file=sys.stderr, flush=True)

    try:
        report = api.measure(
            cfg,
            checkpoints,
            measures=measures,
            outdir=out,
            allow_unsafe_pickle=allow_unsafe_pickle or None,
            on_row=on_row,
            on_start=on_start,
            debug=debug,
        )
    finally:
        if progress is not None:
            progress.stop()
    labels = report.rows[0].labels if report.rows else []
    if format == "table":
        console.print(render_rows(report.rows, labels))
        console.print(f"wrote {out / 'results.csv'} and {out / 'results.json'} ({report.seconds:.1f}s)", highlight=False)
    elif format == "csv":
        from .results import to_csv

        sys.stdout.write(to_csv(report.rows))
    else:
        from .results import _jsonable

        sys.stdout.write(json.dumps(_jsonable([r.to_json() for r in report.rows]), indent=2) + "\n")
    for r in report.rows:
        if r.status != "ok":
            err_console.print(f"[red]error:[/red] {r.checkpoint}: {r.error}", highlight=False, soft_wrap=True)
    raise typer.Exit(report.exit_code)


# ------------------------------------------------------------------ measures
@app.command("measures")
@handle_errors
def measures_cmd(
    pattern: Annotated[str, typer.Argument(help="Shell wildcard over names.")] = "*",
    debug: DebugOpt = False,
):
    """List every measure with a one-line description and its options."""
    from .measures import list_measures
    from .measures._options import describe_options

    t = Table(show_header=True, header_style="bold", show_lines=True)
    t.add_column("measure")
    t.add_column("description")
    t.add_column("options (default)")
    for info in list_measures(pattern):
        opts = ", ".join(f"{n} ({d})" for n, d, _ in describe_options(info.options)) or "-"
        desc = info.description + (f"\n[dim]{info.reference}[/dim]" if info.reference else "")
        t.add_row(info.name, desc, opts)
    console.print(t)


# ------------------------------------------------------------------ config show
@config_app.command("show")
@handle_errors
def config_show(config: ConfigOpt = ..., debug: DebugOpt = False):
    """Print the resolved config and where each value came from."""
    import yaml

    from . import api

    cfg = api.load(config)
    console.print(f"# {config}  (hash {cfg.hash()})", highlight=False)
    console.print(yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip(), highlight=False)
    console.print("\n# where each value came from", highlight=False)
    for k in sorted(cfg.provenance):
        console.print(f"#   {k}: {cfg.provenance[k]}", highlight=False)


# ------------------------------------------------------------------ demo
@app.command()
@handle_errors
def demo(
    outdir: Annotated[Path, typer.Option("--outdir", "-o", help="Where checkpoints and results go.")] = Path("flatcli-demo"),
    measures: Annotated[str | None, typer.Option("--measures", "-m", help="Measures to run ('all' for the whole catalogue).")] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    debug: DebugOpt = False,
):
    """Train a small zoo of MLPs on bundled digits to a fixed loss, measure them, rank measures by Kendall τ."""
    from .demo import run_demo

    run_demo(outdir, measures=measures, seed=seed, console=console)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
