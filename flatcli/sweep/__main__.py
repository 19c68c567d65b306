"""``python -m flatcli.sweep OUTDIR [--shard I/N] ...``: an alias of ``flatcli sweep-worker`` (one worker)."""

import sys

from ..cli import main

main(["sweep-worker", *sys.argv[1:]])
