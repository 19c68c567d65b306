"""Result rows and their CSV / JSON rendering.

Column order is fixed by `Row.columns`: ``checkpoint, status, error``, then one
column per measure (its label) holding the value, then the measure's
diagnostics prefixed by its label (``<label>_stderr``, ``<label>_seconds``,
``<label>_<diagnostic>`` for scalar diagnostics; lists and dicts go to JSON
only), then the metrics ``train_loss, train_acc, test_loss, test_acc, gen_gap``,
then ``hp_*`` hyperparameters.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import exit_code_of
from .measures import MeasureResult

METRICS = ("train_loss", "train_acc", "test_loss", "test_acc", "gen_gap")


@dataclass
class Row:
    """One checkpoint's results: measure values by label, metrics, hyperparameters, failures.

    ``error``/``error_kind`` describe the row's failure (the first message, and the kind
    with the largest exit code, see `flatcli.errors.exit_code`); ``errors`` and
    ``error_kinds`` hold each failed measure's message and kind.
    """

    checkpoint: str
    status: str = "ok"
    error: str = ""
    results: dict[str, MeasureResult] = field(default_factory=dict)  # label -> result
    errors: dict[str, str] = field(default_factory=dict)  # label -> error message
    metrics: dict[str, float] = field(default_factory=dict)
    hparams: dict[str, Any] = field(default_factory=dict)
    labels: list[str] = field(default_factory=list)  # configured labels, in order
    error_kind: str = ""  # exception class of the failure ('' when ok)
    error_kinds: dict[str, str] = field(default_factory=dict)  # label -> exception class

    def fail(self, message: str, kind: str, label: str | None = None) -> None:
        """Record a failure of the whole row (``label`` None) or of one measure."""
        if label is not None:
            self.errors[label] = message
            self.error_kinds[label] = kind
        self.status = "error"
        self.error = self.error or message
        if not self.error_kind or exit_code_of(kind) > exit_code_of(self.error_kind):
            self.error_kind = kind

    def flat(self) -> dict[str, Any]:
        out: dict[str, Any] = {"checkpoint": self.checkpoint, "status": self.status, "error": self.error}
        for lab in self.labels:
            r = self.results.get(lab)
            out[lab] = r.value if r is not None else float("nan")
        for lab in self.labels:
            r = self.results.get(lab)
            if r is None:
                out[f"{lab}_status"] = "error" if lab in self.errors else ""
                continue
            out[f"{lab}_status"] = r.status
            if r.stderr is not None:
                out[f"{lab}_stderr"] = r.stderr
            out[f"{lab}_seconds"] = round(r.seconds, 6)
            for k, v in r.diagnostics.items():
                if isinstance(v, (bool, int, float, str)) or v is None:
                    out[f"{lab}_{k}"] = v
        for m in METRICS:
            if m in self.metrics:
                out[m] = self.metrics[m]
        for k, v in self.hparams.items():
            out[f"hp_{k}"] = v
        return out

    def to_json(self) -> dict[str, Any]:
        """The row for results.json (full diagnostics, per-measure errors and their kinds)."""
        return {
            "checkpoint": self.checkpoint,
            "status": self.status,
            "error": self.error,
            "error_kind": self.error_kind,
            "measures": {
                lab: (
                    {
                        "value": r.value,
                        "stderr": r.stderr,
                        "status": r.status,
                        "seconds": r.seconds,
                        "diagnostics": jsonable(r.diagnostics),
                    }
                    if (r := self.results.get(lab)) is not None
                    else {
                        "value": None,
                        "status": "error",
                        "error": self.errors.get(lab, ""),
                        "error_kind": self.error_kinds.get(lab, ""),
                    }
                )
                for lab in self.labels
            },
            "metrics": self.metrics,
            "hparams": self.hparams,
        }


def jsonable(v: Any, *, exact: bool = False) -> Any:
    """A JSON-ready copy of ``v``: dict keys as strings, tuples as lists, tensors and arrays as lists.

    ``exact=False`` (results.json, for any JSON reader): NaN becomes ``null`` and ±inf the
    strings ``"inf"``/``"-inf"``. ``exact=True`` (sweep unit files, read back by flatcli):
    non-finite floats stay floats (Python's json writes and reads NaN/Infinity), and
    objects JSON cannot hold become their ``str``.
    """
    if isinstance(v, dict):
        return {str(k): jsonable(x, exact=exact) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x, exact=exact) for x in v]
    if hasattr(v, "tolist"):
        return jsonable(v.tolist(), exact=exact)
    if isinstance(v, float) and not math.isfinite(v) and not exact:
        return None if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if exact and not (isinstance(v, (str, int, float, bool)) or v is None):
        return str(v)
    return v


def columns(rows: list[Row]) -> list[str]:
    cols: list[str] = []
    seen = set()
    for r in rows:
        for k in r.flat():
            if k not in seen:
                seen.add(k)
                cols.append(k)
    # metrics and hp columns last, in that order
    head = [c for c in cols if c not in METRICS and not c.startswith("hp_")]
    return head + [m for m in METRICS if m in seen] + [c for c in cols if c.startswith("hp_")]


def to_csv(rows: list[Row]) -> str:
    buf = io.StringIO()
    cols = columns(rows)
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: _fmt(v) for k, v in r.flat().items()})
    return buf.getvalue()


def _fmt(v):
    if isinstance(v, float):
        return repr(v)
    return v


def atomic_write(path: str | os.PathLike, text: str) -> None:
    """Write via a temp file in the same folder, fsync, then os.replace."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; results are ordinary files
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_results(outdir: str | os.PathLike, rows: list[Row], meta: dict[str, Any]) -> tuple[Path, Path]:
    outdir = Path(outdir)
    csv_path, json_path = outdir / "results.csv", outdir / "results.json"
    atomic_write(csv_path, to_csv(rows))
    atomic_write(json_path, json.dumps(jsonable({**meta, "rows": [r.to_json() for r in rows]}), indent=2))
    return csv_path, json_path
