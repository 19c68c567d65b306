"""``python -m flatcli.sweep OUTDIR [--shard I/N] ...``: one sweep worker (see `flatcli.sweep.runner.main`)."""

import sys

from .runner import main

sys.exit(main())
