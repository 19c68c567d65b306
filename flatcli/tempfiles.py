"""Temp files written beside their target and the orphans of killed writers.

A writer names its temp file with `temp_prefix` (``.<name>.pid<pid>@<host>.``), so that
`clean_orphans` can tell a dead writer's file from a live one's. At the bottom of the package:
loading/ (the tokenized-data cache), run/ (results) and sweep/ (unit files) all write this way.
"""

from __future__ import annotations

import os
import re
import socket
import time
from pathlib import Path

ORPHAN_AGE = 3600.0  # seconds after which a temp file of another host's writer is an orphan
_TEMP = re.compile(r"^\..+\.pid(\d+)@(.+)\.[A-Za-z0-9_]+\.(tmp|new|stale)$")


def temp_prefix(path: Path) -> str:
    """The name prefix of a temp file written beside ``path``: ``.<name>.pid<pid>@<host>.``, so
    that `clean_orphans` can tell a dead writer's file from a live one's."""
    return f".{path.name}.pid{os.getpid()}@{socket.gethostname()}."


def clean_orphans(folder: str | os.PathLike) -> list[Path]:
    """Remove the temp files (`temp_prefix`) that writers killed mid-write left in ``folder``:
    those of a process no longer running on this host, or older than `ORPHAN_AGE` seconds
    (another host's). Returns what was removed; errors are ignored (a reader may be read-only)."""
    removed = []
    host, now = socket.gethostname(), time.time()
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for e in entries:
        m = _TEMP.match(e.name)
        if m is None:
            continue
        try:
            dead = m.group(2) == host and not _alive(int(m.group(1)))
            if dead or now - e.stat().st_mtime > ORPHAN_AGE:
                os.unlink(e.path)
                removed.append(Path(e.path))
        except OSError:
            continue
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process
    return True
