"""Exception types, the kind of a failure, and the one declaration of exit codes.

`ExitCode` names every code a command exits with, `EXIT_MEANINGS` says what each means and
`COMMAND_EXITS` when each command returns it; the CLI exits only with `ExitCode` members and the
documentation's exit-code tables are generated from these two dicts (docs/guide/statuses.md).

A failure recorded in a result row keeps the class name of its exception
(``Row.error_kind``), and `exit_code` maps rows to the command's exit code, so
``measure``, ``sweep``, ``collect`` and ``check-invariance`` agree.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import IntEnum
from typing import Any


class ExitCode(IntEnum):
    """The exit codes of every command (`EXIT_MEANINGS`, `COMMAND_EXITS`)."""

    OK = 0
    FAILED = 1
    USAGE = 2
    INCOMPLETE = 3
    BUDGET = 4
    INTERRUPTED = 130


EXIT_MEANINGS: dict[ExitCode, str] = {
    ExitCode.OK: "success: every row (checkpoint, unit) is `ok`, or has a status of a value "
    "(`not_applicable`, `not_converged`, `saturated`, `near_zero`, `budget`, ...), not a failure",
    ExitCode.FAILED: "a measurement failed: its row has `status=error` and results.json records "
    "the exception class as `error_kind`; every other checkpoint still completes. Also any "
    "unexpected error, and results that could not be written during a run",
    ExitCode.USAGE: "bad usage or input: an option, a config key, a file, a checkpoint that does "
    "not fit the model, a data split of the wrong shape or with NaN/inf, an output folder held by "
    "another run",
    ExitCode.INCOMPLETE: "`collect` only: some units are not finished (none failed); the table "
    "is written with those checkpoints `incomplete`",
    ExitCode.BUDGET: "`measure` only: a budget or a cap (`--budget`, `runtime.budget`, a "
    "measure's `max_seconds` or `max_hvps`) left a measure without a value: its row has "
    "`status=budget`. Nothing failed; every row is written. A measure the budget merely capped (a "
    "value, status `budget`) still exits 0; a failure's code wins over 4",
    ExitCode.INTERRUPTED: "interrupted (Ctrl-C); `measure` keeps every finished measure",
}

_BAD_INPUT = "bad config, option or input"
# when each command returns each code; every command also exits 1 on an unexpected error, 2 on a
# usage error (an unknown option, a bad value) and 130 on Ctrl-C (`ALWAYS`). "measure --dry-run"
# is `measure` with that flag.
COMMAND_EXITS: dict[str, dict[ExitCode, str]] = {
    "measure": {
        ExitCode.OK: "every row ok",
        ExitCode.FAILED: "a measure or checkpoint failed; or the results could not be written "
        "during the run",
        ExitCode.USAGE: f"{_BAD_INPUT}; a missing or unreadable checkpoint; `-o DIR` held by "
        "another run",
        ExitCode.BUDGET: "a budget or cap left a measure without a value (row status `budget`)",
    },
    "measure --dry-run": {
        ExitCode.OK: "every checkpoint loads and fits",
        ExitCode.FAILED: "a checkpoint will not fit in free memory (status `will_not_fit`)",
        ExitCode.USAGE: "a checkpoint cannot be loaded; bad config or option",
    },
    "measures": {
        ExitCode.OK: "the list or a measure's options printed",
        ExitCode.USAGE: "an unknown measure",
    },
    "demo": {
        ExitCode.OK: "the demo ran (its table shows a measure that failed)",
        ExitCode.USAGE: "bad option or output folder",
    },
    "sweep": {
        ExitCode.OK: "no error unit in this run's selection",
        ExitCode.FAILED: "an error unit (a failed measurement); a worker process failed",
        ExitCode.USAGE: f"{_BAD_INPUT}; an error unit whose failure is bad input",
    },
    "collect": {
        ExitCode.OK: "every planned unit finished and ok",
        ExitCode.FAILED: "a unit failed",
        ExitCode.USAGE: "bad folder (no plan.json and no unit files); a unit failed on bad input",
        ExitCode.INCOMPLETE: "units not finished, none failed (a failed unit's 1 or 2 wins)",
    },
    "correlate": {
        ExitCode.OK: "table written",
        ExitCode.USAGE: "unreadable table, unknown column or option",
    },
    "check-invariance": {
        ExitCode.OK: "every measure that claims invariance kept it",
        ExitCode.FAILED: "a claimed invariance broke",
        ExitCode.USAGE: _BAD_INPUT,
    },
    "config show": {ExitCode.OK: "the config printed", ExitCode.USAGE: "a bad config"},
    "experiments list": {ExitCode.OK: "the studies listed"},
    "report": {
        ExitCode.OK: "the page written (it says what it could not draw)",
        ExitCode.USAGE: "a table with no target or measure column, a bad option or filter, an "
        "output that cannot be written",
    },
    "plot-track": {
        ExitCode.OK: "the plot written",
        ExitCode.USAGE: "no tracker output in the folder, an unknown label, or no plotting library",
    },
    "experiments run": {
        ExitCode.OK: "every study ran",
        ExitCode.FAILED: "a measurement of a study failed",
        ExitCode.USAGE: "bad spec or option",
    },
}
for _view in ("slice", "interpolate", "pca", "connect"):
    COMMAND_EXITS[f"landscape {_view}"] = {
        ExitCode.OK: "views written",
        ExitCode.FAILED: "a measurement failed",
        ExitCode.USAGE: _BAD_INPUT,
    }

ALWAYS = (ExitCode.FAILED, ExitCode.USAGE, ExitCode.INTERRUPTED)
INCOMPLETE = ExitCode.INCOMPLETE  # `collect`: units not finished, none failed
BUDGET = ExitCode.BUDGET  # `measure`: a budget left a measure without a value, none failed


class FlatcliError(Exception):
    """Base class of every error flatcli raises on purpose."""

    exit_code = ExitCode.FAILED


class ConfigError(FlatcliError):
    """Bad user input: a config key, a file, an API parameter. Exit code 2.

    A message names an API parameter as ```name``` (``"`where` 'x > 1' selects no rows"``), never
    as a command-line flag: the CLI alone turns ```name``` into its flag (``--where``)."""

    exit_code = ExitCode.USAGE


class MeasurementError(FlatcliError):
    """A measurement failed (non-finite loss, OOM that could not be backed off...). Exit code 1."""

    exit_code = ExitCode.FAILED


class ResultsWriteError(MeasurementError):
    """The results could not be written to the output folder during a run (disk full, folder
    removed or read-only): the run stops, exit code 1. ``rows``: every checkpoint's row at that
    moment (finished measures with their status, the rest ``interrupted``), set by the run."""

    def __init__(self, folder, error: OSError):
        super().__init__(f"could not write {folder} ({error.strerror or error})")
        self.folder, self.error = folder, error
        self.rows: list = []


class RankFailure(Exception):
    """A failure on one rank of a distributed run that the other ranks cannot see (they may wait
    in a collective this rank never reaches): the run ends on every rank (`flatcli.engine.dist`)."""


_PEER_GONE = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "socket closed",
)


def is_peer_gone(exc: BaseException) -> bool:
    """Whether ``exc`` (or its cause) only says that another rank of the process group went away."""
    while exc is not None:
        name = type(exc).__name__
        if name in ("DistNetworkError", "DistBackendError") or any(
            s in str(exc).lower() for s in _PEER_GONE
        ):
            return True
        exc = exc.__cause__
    return False


_KINDS: dict[str, type[FlatcliError]] = {
    c.__name__: c for c in (FlatcliError, ConfigError, MeasurementError)
}


def error_kind(exc: BaseException) -> str:
    """The kind recorded for a failure: the class name of its exception."""
    return type(exc).__name__


def exit_code_of(kind: str) -> int:
    """Exit code of one failure kind: that of the flatcli error class, 1 for any other exception."""
    cls = _KINDS.get(kind)
    return cls.exit_code if cls is not None else ExitCode.FAILED


def exit_code(rows: Iterable[Any]) -> int:
    """The exit code of a command from its result rows (objects with ``status`` and ``error_kind``).

    0 when no row has ``status == "error"``; otherwise the largest exit code among
    the failed rows' kinds (2 for bad input wins over 1 for a failed measurement).
    """
    codes = [exit_code_of(getattr(r, "error_kind", "") or "") for r in rows if r.status == "error"]
    return max(codes, default=ExitCode.OK)


def budget_code(rows: Iterable[Any]) -> int:
    """`BUDGET` when some row has status ``budget`` (a budget left a measure without a value;
    a value merely capped keeps its row ``ok``), else 0. A failure's code wins over it."""
    return BUDGET if any(getattr(r, "status", "") == "budget" for r in rows) else ExitCode.OK
