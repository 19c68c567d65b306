"""The flatcli command line: parsing and rendering only; the work is in `flatcli.api`.

`_app` holds the app, the shared options and the error handling; `compute`, `explore` and
`pages` register the commands on it.

Exit codes (`flatcli.errors`): 0 success, 1 a measurement failed, 2 bad usage or config, 3
`collect` found units not finished, 4 a budget left a measure without a value. Errors are
one line on stderr; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

from ..console import quiet_torch_warnings
from . import compute, explore, pages  # noqa: F401  (registers the commands)
from ._app import app, cli_message, err_console
from .compute import *  # noqa: F403

__all__ = ["app", "cli_message", "err_console", "main"]


def main(argv: list[str] | None = None) -> None:
    """The ``flatcli`` console script."""
    quiet_torch_warnings()
    app(args=argv)
