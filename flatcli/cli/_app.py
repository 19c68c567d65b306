"""The command line's common parts: the Typer app and its groups, shared options and choices,
one-line errors (`handle_errors`, `cli_message`: API parameters become flags) and the log line."""

from __future__ import annotations

import contextlib
import functools
import os
import re
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

from .._version import __version__
from ..console import (
    DEBUG_ENV,
    as_text,
    console,
    err_console,
)
from ..errors import FlatcliError, RankFailure, is_peer_gone
from ..validation import BIAS_BN, EXECUTORS, FORMATS, PRECISIONS, STATS, TRANSFORMS

WIDE_HELP = (
    100  # columns from which --help uses typer's rich panels (narrower ones cut option names)
)


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
            rv = super().main(
                args=args,
                prog_name=prog_name,
                complete_var=complete_var,
                standalone_mode=False,
                **extra,
            )
        except click_exceptions.NoArgsIsHelpError as e:  # a bare command group: its help
            print(e.ctx.get_help() if e.ctx is not None else e.format_message())
            if not standalone_mode:
                return 0
            sys.exit(0)
        except click_exceptions.UsageError as e:
            where = e.ctx.command_path if e.ctx is not None else "flatcli"
            err_console.print(
                f"[red]error:[/red] {as_text(e.format_message())} (see '{as_text(where)} --help')",
                highlight=False,
                soft_wrap=True,
            )
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
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
):
    """Measure how flat or sharp trained networks are, and how well each measure predicts generalization."""


def _choices(name: str, values: tuple[str, ...], doc: str) -> type[Enum]:
    """A Typer choice Enum built from a vocabulary tuple (the values are spelled out once, in
    `flatcli.validation` or the module that owns them)."""
    e = Enum(name, [(v, v) for v in values], type=str)
    e.__doc__ = doc
    return e


Format = _choices("Format", FORMATS, "Output formats of ``measure`` on stdout.")
BiasBN = _choices(
    "BiasBN", BIAS_BN, "How landscape directions treat biases and normalization layers."
)
Transform = _choices("Transform", TRANSFORMS, "Rescalings of ``check-invariance``.")
Executor = _choices("Executor", EXECUTORS, "Where ``sweep`` runs its workers.")
SortBy = _choices("SortBy", STATS, "Statistics ``correlate`` can rank by.")
Precision = _choices("Precision", PRECISIONS, "``runtime.precision`` (`flatcli.engine.precision`).")


def _value(v):
    """An Enum option's string (None stays None)."""
    return v.value if isinstance(v, Enum) else v


landscape_app = typer.Typer(
    cls=OneLineErrors, no_args_is_help=True,
    help="Loss-landscape views, one sub-command each: slice (1D/2D, filter-normalized random directions), "
         "interpolate (the line between two checkpoints), pca (a training trajectory's PCA plane), connect "
         "(a fitted Bezier curve against the line); each writes CSVs, JSON and PNG plots.",
)  # fmt: skip
app.add_typer(config_app, name="config")
app.add_typer(experiments_app, name="experiments")
app.add_typer(landscape_app, name="landscape")


ConfigOpt = Annotated[
    Path, typer.Option("--config", "-c", help="YAML config file.", envvar="FLATCLI_CONFIG")
]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show full tracebacks.")]
WideOpt = Annotated[
    bool,
    typer.Option(
        "--wide",
        help="Print every table column even when the terminal is narrow (a pipe or a file always gets them all).",
    ),
]
ThreadsOpt = Annotated[
    str | None,
    typer.Option(
        "--threads",
        envvar="FLATCLI_THREADS",
        show_default=False,
        help="Intra-op CPU threads per worker process: N or auto (default runtime.threads, auto: OMP_NUM_THREADS "
        "when set, else free cores // workers, the free cores being this process's cores less the load).",
    ),
]


BudgetOpt = Annotated[
    str | None,
    typer.Option(
        "--budget",
        envvar="FLATCLI_BUDGET",
        show_default=False,
        help="Seconds for one checkpoint's measures together: 90, 90s, 10m or 1h (runtime.budget), shared by "
        "predicted cost; a measure stopped by it reports its estimate so far with status budget.",
    ),
]


def _budget(text: str | None) -> float | None:
    """``--budget`` in seconds (a `ConfigError` naming the flag for a bad value), None when not given."""
    from ..config import parse_seconds  # lazy: CLI start-up (loads torch)

    return None if text is None else parse_seconds(text, "--budget")


DeviceOpt = Annotated[
    str | None, typer.Option("--device", help="auto, cpu or cuda:N.", envvar="FLATCLI_DEVICE")
]
UnsafePickleOpt = Annotated[
    bool,
    typer.Option(
        "--allow-unsafe-pickle",
        help="Load full pickled checkpoints (runs code from the file: trusted files only).",
    ),
]


def run_options(
    *,
    device: str | None = None,
    precision=None,
    seed: int | None = None,
    threads: str | None = None,
    allow_unsafe_pickle: bool = False,
    budget: str | None = None,
):
    """The `flatcli.api.RunOptions` of a command's shared flags, built once and passed to every API
    call of the command (an Enum's value, ``--budget`` in seconds, an unset switch as None)."""
    from ..run.settings import RunOptions  # lazy: CLI start-up (loads torch)

    return RunOptions(
        device=device,
        precision=_value(precision),
        seed=seed,
        threads=threads,
        allow_unsafe_pickle=allow_unsafe_pickle or None,
        budget=_budget(budget),
    )


PrecisionOpt = Annotated[
    Precision | None,
    typer.Option(
        "--precision",
        envvar="FLATCLI_PRECISION",
        show_default=False,
        help="auto (TF32 products on a tensor-core GPU, verified in fp32; fp32 elsewhere), fp32, tf32, bf16 "
        "(bfloat16 forward and products, float32 vectors and sums, verified in fp32) or fp64 "
        "(default runtime.precision).",
    ),
]


def _fail(e: BaseException, code: int, message: str, debug: bool):
    """End a command on an error: with ``debug`` its traceback first, then the one-line message;
    the exit code is the same with and without ``--debug``."""
    if debug:
        import traceback

        traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
    err_console.print(message, highlight=False, soft_wrap=True)
    raise typer.Exit(code) from None


@functools.cache
def _flags() -> dict[str, str]:
    """The one table from API parameter names to command-line flags (``max_train_loss`` →
    ``--max-train-loss``), read off every command's options."""
    table: dict[str, str] = {}

    def walk(cmd) -> None:
        for p in cmd.params:
            if getattr(p, "param_type_name", "") == "option":
                table.setdefault(
                    p.name,
                    max((o for o in p.opts if o.startswith("--")), key=len, default=p.opts[0]),
                )
        for sub in getattr(cmd, "commands", {}).values():
            walk(sub)

    root = typer.main.get_command(app)
    walk(root)
    for view in getattr(root.commands.get("landscape"), "commands", {}):  # `pca` -> landscape pca
        table.setdefault(view, f"landscape {view}")
    return table


def cli_message(e: BaseException | str) -> str:
    """An error's message in command-line terms: each API parameter the layers below name as
    ```name``` (they never name a flag) becomes its flag; other text is left as it is."""
    return re.sub(r"`([a-z_]+)`", lambda m: _flags().get(m.group(1), m.group(0)), str(e))


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
            with _debug_env(debug):
                return fn(*args, **kwargs)
        except FlatcliError as e:
            _fail(e, e.exit_code, f"[red]error:[/red] {as_text(cli_message(e))}", debug)
        except (
            KeyboardInterrupt
        ) as e:  # `measure` says what it kept (flatcli.api.MeasureInterrupted)
            err_console.print(
                str(e) or "interrupted", highlight=False, soft_wrap=True, markup=False
            )
            raise typer.Exit(130) from None
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except RankFailure as e:
            _end_all_ranks(e, debug)
        except Exception as e:
            hint = "" if debug else " (run with --debug for the traceback)"
            _fail(e, 1, f"[red]error:[/red] {type(e).__name__}: {as_text(e)}{hint}", debug)

    return wrapper


@contextlib.contextmanager
def _debug_env(debug: bool):
    """`flatcli.console.DEBUG_ENV` set while a ``--debug`` command runs (its workers inherit it)."""
    old = os.environ.get(DEBUG_ENV)
    if debug:
        os.environ[DEBUG_ENV] = "1"
    try:
        yield
    finally:
        if debug and old is None:
            os.environ.pop(DEBUG_ENV, None)


def _end_all_ranks(e: BaseException, debug: bool) -> None:
    """A failure on one rank of a distributed run: the other ranks may wait in a collective this one
    never reaches, so the process ends at once (torchrun then stops the others; exit code 1). A rank
    that fails only because a peer went away says nothing: the peer's message is the one error."""
    if debug:
        traceback.print_exception(e)
    if not is_peer_gone(e):
        err_console.print(f"[red]error:[/red] {as_text(e)}", highlight=False, soft_wrap=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


# ------------------------------------------------------------------ measure
