"""``python -m flatcli.experiments NAME [options]``: an alias of ``flatcli experiments run NAME
[options]`` (and ``python -m flatcli.experiments list`` of ``flatcli experiments list``), through
the one entry point `flatcli.__main__`."""

from __future__ import annotations

import sys

from .. import __main__ as entry


def main(argv: list[str] | None = None) -> None:
    """Run ``flatcli experiments`` with ``run`` put in front of an experiment's name."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] not in ("list", "run", "--help"):
        args = ["run", *args]
    entry.run(["experiments", *args])


if __name__ == "__main__":
    main()
