"""The CPUs' and this process's jiffies when flatcli was first imported, so that ``threads: auto``
(`flatcli.threads.machine_load`) measures the other work on the machine over the process's
start-up (imports, config, loading: a second or more) instead of sleeping for a sample of its
own. Reading two small /proc files costs well under a millisecond; where they are missing (macOS,
Windows) the texts are None and `flatcli.threads` samples as before. Nothing here imports torch."""

from __future__ import annotations

import os
import time


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


# (monotonic seconds, process id, /proc/stat text, /proc/self/stat text) at the first import
MARK: tuple[float, int, str | None, str | None] = (
    time.monotonic(),
    os.getpid(),
    _read("/proc/stat"),
    _read("/proc/self/stat"),
)
