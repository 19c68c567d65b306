"""Exception types, the kind of a failure, and the one mapping from failures to exit codes.

Exit codes (every command):

====  ==================================================================
code  meaning
====  ==================================================================
0     success: every row (checkpoint, unit) is ok
1     a measurement failed (``MeasurementError`` or any unexpected error);
      every other checkpoint still completes and is written
2     bad usage or input: an option, a config key, a file, a checkpoint
      that does not fit the model (``ConfigError``)
3     incomplete: ``collect`` found units not finished (none failed)
4     budget: ``measure`` ran, but a budget or a measure's cap left a measure
      without a value (its row's status is ``budget``; none failed)
130   interrupted (Ctrl-C)
====  ==================================================================

A failure recorded in a result row keeps the class name of its exception
(``Row.error_kind``), and `exit_code` maps rows to the command's exit code, so
``measure``, ``sweep``, ``collect`` and ``check-invariance`` agree.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

INCOMPLETE = 3  # `collect`: units not finished, none failed
BUDGET = 4  # `measure`: a budget left a measure without a value, none failed


class FlatcliError(Exception):
    """Base class of every error flatcli raises on purpose."""

    exit_code = 1


class ConfigError(FlatcliError):
    """Bad user input: a config key, a file, an API parameter. Exit code 2.

    A message names an API parameter as ```name``` (``"`where` 'x > 1' selects no rows"``), never
    as a command-line flag: the CLI alone turns ```name``` into its flag (``--where``)."""

    exit_code = 2


class MeasurementError(FlatcliError):
    """A measurement failed (non-finite loss, OOM that could not be backed off...). Exit code 1."""

    exit_code = 1


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
    return cls.exit_code if cls is not None else 1


def exit_code(rows: Iterable[Any]) -> int:
    """The exit code of a command from its result rows (objects with ``status`` and ``error_kind``).

    0 when no row has ``status == "error"``; otherwise the largest exit code among
    the failed rows' kinds (2 for bad input wins over 1 for a failed measurement).
    """
    codes = [exit_code_of(getattr(r, "error_kind", "") or "") for r in rows if r.status == "error"]
    return max(codes, default=0)


def budget_code(rows: Iterable[Any]) -> int:
    """`BUDGET` when some row has status ``budget`` (a budget left a measure without a value;
    a value merely capped keeps its row ``ok``), else 0. A failure's code wins over it."""
    return BUDGET if any(getattr(r, "status", "") == "budget" for r in rows) else 0
