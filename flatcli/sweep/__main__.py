"""``python -m flatcli.sweep OUTDIR [--shard I/N] ...``: an alias of ``flatcli sweep-worker`` (one
worker), through the one entry point `flatcli.__main__`."""

import sys

from .. import __main__ as entry

if __name__ == "__main__":
    entry.run(["sweep-worker", *sys.argv[1:]])
