"""``python -m flatcli``: the command line (see `flatcli.cli`).

This is the one module below the CLI's own package that imports it: the aliases
``python -m flatcli.sweep`` and ``python -m flatcli.experiments`` call `run`, so that no folder of
flatcli imports the CLI (docs/architecture.md, "Entry points").
"""

from __future__ import annotations

from . import cli


def run(argv: list[str] | None = None) -> None:
    """Run the command line on ``argv`` (default: this process's arguments)."""
    cli.main(argv)


if __name__ == "__main__":
    run()
