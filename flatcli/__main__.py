"""``python -m flatcli``: the command line (see `flatcli.cli`)."""

from .cli import main

main()
