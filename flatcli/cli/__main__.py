"""``python -m flatcli.cli``: the command line."""

from . import main

main()
