"""One tolerant reader for every file flatcli reads back from its own folders: unit files, lock
files, ``measure.lock``, results.json, plan.json, the tokenized cache's metadata.

A file is read as bytes (at most ``max_bytes``), decoded as UTF-8 and parsed as JSON nested at
most ``max_depth`` levels, all inside one handler: whatever the bytes (not UTF-8, truncated, a
megabyte of ``[``), the caller gets the data or an `Unreadable` naming why in a few words, never
a ``UnicodeDecodeError`` or a ``RecursionError``. A missing file or another OS error is an
``OSError`` as usual (the caller decides what a missing file means).

`set_aside` moves a bad file beside itself (``<name>.bad``) instead of deleting it, so what was
there can still be looked at after it is recomputed.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

MAX_BYTES = 256 * 2**20  # no file flatcli writes comes near: a sweep of 10⁵ units' results.json
MAX_DEPTH = 64  # flatcli's records nest at most ~8 levels


class Unreadable(ValueError):
    """A file whose bytes are not the JSON flatcli wrote; ``why`` says how, in a few words."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


def read_text(path: str | os.PathLike, max_bytes: int = MAX_BYTES) -> str:
    """The UTF-8 text of ``path``; `Unreadable` when it is larger than ``max_bytes`` or not
    UTF-8 (``OSError`` for a missing or unreadable file)."""
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise Unreadable(f"larger than {max_bytes:,} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Unreadable(f"not UTF-8 text (byte {e.start})") from None


def parse_json(text: str, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value of ``text``; `Unreadable` when it is not JSON or nests deeper than
    ``max_depth`` (checked before parsing, so a deep file never reaches the parser's recursion)."""
    depth = _max_nesting(text)
    if depth > max_depth:
        raise Unreadable(f"nested deeper than {max_depth} levels")
    try:
        return json.loads(text)
    except RecursionError:
        raise Unreadable(f"nested deeper than {max_depth} levels") from None
    except ValueError as e:
        raise Unreadable(f"not JSON ({getattr(e, 'msg', None) or type(e).__name__})") from None


# a JSON string, escapes included: removed before the brackets are counted
_STRINGS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')


def _max_nesting(text: str) -> int:
    """The deepest nesting of ``[``/``{`` in ``text``, brackets inside strings left out (a regular
    expression and numpy: no Python loop over the text)."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return 0  # too few brackets to nest deeper, whatever their order
    import numpy as np

    b = np.frombuffer(_STRINGS.sub("", text).encode("utf-8", "replace"), dtype=np.uint8)
    step = np.isin(b, (ord("["), ord("{"))).astype(np.int64) - np.isin(b, (ord("]"), ord("}")))
    return int(np.cumsum(step).max(initial=0))


def read_json(
    path: str | os.PathLike, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH
) -> Any:
    """`read_text` then `parse_json`: the JSON value in ``path``, or `Unreadable`."""
    return parse_json(read_text(path, max_bytes), max_depth)


def set_aside(path: str | os.PathLike) -> Path | None:
    """Move ``path`` to ``<path>.bad`` (replacing an older one); the new path, or None when the
    file is gone or cannot be moved (another process moved it first, a read-only folder)."""
    path = Path(path)
    aside = path.with_name(path.name + ".bad")
    try:
        os.replace(path, aside)
    except OSError:
        return None
    return aside
