"""The tracker's output folder: ``track.json`` (settings and every row with its full diagnostics) and
``track.csv`` (the rows' scalar columns), both rewritten atomically after every evaluation.

A row holds ``step``, ``lr`` (the first parameter group's learning rate, when an optimizer is
given), ``epoch``, ``overhead`` (tracker time over training time so far), ``tracking_loss``, then
the columns of a ``measure`` row (`flatcli.run.results.Row.flat`): ``status``, ``error``, one
value column per measure label and its ``<label>_status``, ``<label>_stderr``, ``<label>_seconds``,
``<label>_n_hvp`` ... A kill loses at most the evaluation in flight: each file is replaced whole
(`flatcli.run.results.atomic_write`), the JSON first, and the CSV is rendered from it.

Resuming: a tracker opened on a folder that holds a ``track.json`` keeps its rows; at its first
step it drops the rows at or after that step (they belong to the run that training resumed
from before it was interrupted) and appends from there.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..run.results import atomic_write, ensure_writable_dir, jsonable

JSON_NAME, CSV_NAME = "track.json", "track.csv"


class TrackStore:
    """Rows of one tracked run, kept in memory and on disk (``out`` None: memory only)."""

    def __init__(self, out: str | Path | None, meta: dict[str, Any]):
        self.dir = None if out is None else ensure_writable_dir(out, "the tracking output folder")
        self.meta = meta
        self.rows: list[dict[str, Any]] = []  # the flat rows (CSV columns)
        self.details: list[dict[str, Any]] = []  # per row: label -> full diagnostics
        self._resumed = False
        if self.dir is not None and (self.dir / JSON_NAME).exists():
            self._read(self.dir / JSON_NAME)

    def _read(self, path: Path) -> None:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path} cannot be read as a tracker's output ({e})") from None
        rows = doc.get("rows") if isinstance(doc, dict) else None
        if not isinstance(rows, list) or not all(
            isinstance(r, dict) and isinstance(r.get("row"), dict) and _is_step(r["row"])
            for r in rows
        ):
            raise ConfigError(
                f"{path} is not a tracker's output: 'rows' must hold rows with a step"
            )
        self.rows = [r["row"] for r in rows]
        self.details = [r.get("details") or {} for r in rows]

    def resume_at(self, step: int) -> int:
        """Drop the rows at or after ``step`` (once, at the first step); return how many."""
        if self._resumed:
            return 0
        self._resumed = True
        keep = [i for i, r in enumerate(self.rows) if r["step"] < step]
        dropped = len(self.rows) - len(keep)
        self.rows = [self.rows[i] for i in keep]
        self.details = [self.details[i] for i in keep]
        if dropped:
            self._write()
        return dropped

    def append(self, row: dict[str, Any], details: dict[str, Any]) -> None:
        """Add a row and rewrite the files."""
        self.rows.append(row)
        self.details.append(details)
        self._write()

    def columns(self) -> list[str]:
        """Every column of the rows, in order of first appearance."""
        seen: dict[str, None] = {}
        for r in self.rows:
            seen.update(dict.fromkeys(r))
        return list(seen)

    def _write(self) -> None:
        if self.dir is None:
            return
        doc = {
            **self.meta,
            "rows": [
                {"row": r, "details": d} for r, d in zip(self.rows, self.details, strict=True)
            ],
        }
        atomic_write(self.dir / JSON_NAME, json.dumps(jsonable(doc), indent=1))
        atomic_write(self.dir / CSV_NAME, self.to_csv())

    def to_csv(self) -> str:
        """The rows as CSV text (pandas; a missing cell is empty)."""
        import pandas as pd  # lazy: tables only when written

        return pd.DataFrame(self.rows, columns=self.columns()).to_csv(index=False)


def _is_step(row: dict) -> bool:
    s = row.get("step")
    return isinstance(s, int) and not isinstance(s, bool)


def numeric_columns(row: dict[str, Any]) -> dict[str, float]:
    """The finite numeric cells of a row (what a trainer's logger takes), bools as 0/1."""
    out = {}
    for k, v in row.items():
        if isinstance(v, bool):
            out[k] = float(v)
        elif isinstance(v, (int, float)) and math.isfinite(float(v)):
            out[k] = float(v)
    return out


LOGGED = ("", "_stderr", "_n_hvp", "_seconds", "_threshold")  # per label, what a logger gets


def log_columns(row: dict[str, Any], labels: list[str], prefix: str = "") -> dict[str, float]:
    """The columns of a row a training framework's logger receives, named ``prefix`` + column:
    ``tracking_loss``, ``overhead`` and, per measure label, its value, ``_stderr``, ``_n_hvp``,
    ``_seconds``, ``_threshold`` and ``_lambda_<i>`` (the finite numbers among them)."""
    cells = numeric_columns(row)
    keep = ["tracking_loss", "overhead"]
    for lab in labels:
        keep += [lab + s for s in LOGGED]
        keep += [c for c in cells if c.startswith(f"{lab}_lambda_")]
    return {prefix + c: cells[c] for c in keep if c in cells}
