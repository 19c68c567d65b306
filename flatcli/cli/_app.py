"""The command line's common parts: the Typer app and its groups, shared options and choices,
one-line errors (`handle_errors`, `cli_message`: API parameters become flags) and the log line."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shlex
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

from .._version import __date__, __version__
from ..console import (
    DEBUG_ENV,
    as_text,
    console,
    err_console,
)
from ..errors import ExitCode, FlatcliError, RankFailure, is_peer_gone
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
                return ExitCode.OK
            sys.exit(ExitCode.OK)
        except click_exceptions.UsageError as e:
            where = e.ctx.command_path if e.ctx is not None else "flatcli"
            said = option_message(e) or e.format_message()
            err_console.print(
                f"[red]error:[/red] {as_text(said)} (see '{as_text(where)} --help')",
                highlight=False,
                soft_wrap=True,
            )
            if not standalone_mode:
                raise
            sys.exit(ExitCode.USAGE)
        except typer.Abort:
            err_console.print("interrupted")
            if not standalone_mode:
                raise
            sys.exit(ExitCode.INTERRUPTED)
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else ExitCode.OK)


def _refused_words(err: dict) -> str | None:
    """What a refused option value must be, in `flatcli.validation`'s words, from typer's
    (pydantic's) error record; None for a kind of error not known here."""
    kind, ctx = err.get("type", ""), err.get("ctx") or {}
    choices = re.search(r"is not one of (.+)\.$", str(err.get("msg", "")))
    if kind == "value_error" and choices:
        return "one of " + ", ".join(c.strip(" '") for c in choices.group(1).split(","))
    bounds = {"greater_than_equal": ("≥", "ge"), "greater_than": (">", "gt")}
    bounds |= {"less_than_equal": ("≤", "le"), "less_than": ("<", "lt")}
    if kind in bounds:
        sign, key = bounds[kind]
        lo = ctx.get(key)
        return f"{'an int' if isinstance(lo, int) else 'a float'} {sign} {lo!r}"
    return {
        "int_parsing": "an int",
        "int_from_float": "an int",
        "float_parsing": "a float",
        "bool_parsing": "true or false",
    }.get(kind)


def option_message(e: BaseException) -> str | None:
    """A refused option value in the one grammar (`flatcli.validation.message`): "--workers must
    be an int ≥ 1. Got 0 instead.", from the validation error typer raised it with; None when
    ``e`` is not one (a missing argument, an unknown option: click's words stay)."""
    param, cause = getattr(e, "param", None), e.__cause__
    errors = getattr(cause, "errors", None)
    if param is None or not callable(errors):
        return None
    try:
        err = errors()[0]
    except (IndexError, TypeError):
        return None
    words = _refused_words(err)
    if words is None:
        return None
    name = max((o for o in param.opts if o.startswith("--")), key=len, default=param.opts[0])
    given = err.get("input")
    number = isinstance(given, str) and re.fullmatch(r"-?[\d.]+(e-?\d+)?", given)
    return f"{name} must be {words}. Got {given if number else repr(given)} instead."


def _version(value: bool) -> None:
    if value:
        console.print(f"flatcli {__version__} ({__date__})", highlight=False)
        raise typer.Exit(ExitCode.OK)


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
            "--version",
            callback=_version,
            is_eager=True,
            help="Print the version and its release date, and exit.",
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


def rerun_command(ctx, drop: tuple[str, ...] = ()) -> str:
    """The command line that runs ``ctx``'s command again with the options the user gave (not
    their defaults), leaving out the parameters named in ``drop``; quoted for a POSIX shell.
    Arguments come first, then each option by its longest name."""
    words = ctx.command_path.split()
    opts: list[str] = []
    for p in ctx.command.params:
        src = ctx.get_parameter_source(p.name)
        value = ctx.params.get(p.name)
        if p.name in drop or src is None or src.name == "DEFAULT" or value is None:
            continue
        values = list(value) if getattr(p, "multiple", False) else [value]
        if p.param_type_name == "argument":
            words += [str(_value(v)) for v in values]
            continue
        name = max((o for o in p.opts if o.startswith("--")), key=len, default=p.opts[0])
        if getattr(p, "is_flag", False) and isinstance(value, bool):
            off = [o for o in p.secondary_opts if o.startswith("--")]
            opts += [name] if value else off[:1]
            continue
        for v in values:
            opts += [name, str(_value(v))]
    return shlex.join(words + opts)


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
            raise typer.Exit(ExitCode.INTERRUPTED) from None
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except RankFailure as e:
            _end_all_ranks(e, debug)
        except Exception as e:
            hint = "" if debug else " (run with --debug for the traceback)"
            _fail(
                e,
                ExitCode.FAILED,
                f"[red]error:[/red] {type(e).__name__}: {as_text(e)}{hint}",
                debug,
            )

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
    os._exit(ExitCode.FAILED)


# ------------------------------------------------------------------ measure
