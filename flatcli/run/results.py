"""Result rows and their CSV / JSON rendering.

Column order is fixed by `Row.columns`: ``checkpoint, status, error``, then one
column per measure (its label) holding the value, then the measure's
diagnostics prefixed by its label (``<label>_stderr``, ``<label>_seconds``,
``<label>_<diagnostic>`` for scalar diagnostics; lists and dicts go to JSON
only), then the metrics ``train_loss, train_acc, test_loss, test_acc, gen_gap, loss_gap``
(``gen_gap = train_acc − test_acc``, ``loss_gap = test_loss − train_loss``) and, for a per-token
loss (``causal_lm``), ``train_ppl, test_ppl`` (exp of the loss per scored token), then ``hp_*``
hyperparameters.

Tables are pandas (imported when a table is made, so ``import flatcli`` stays cheap).
`to_csv` writes the rows' Python values as pandas does (with the csv module): integers stay integers, floats are
written with their shortest round-trip repr (``pd.read_csv`` reads them back exactly), a
missing value is an empty field (earlier versions wrote a failed measure's value as
``nan``; both read as NaN). `to_frame` and `read_results` give the same DataFrame, with
these dtypes:

* ``checkpoint``, ``error``: text (pandas' default string dtype), ``""`` when empty;
* ``status`` and every ``<label>_status``: categorical (missing: NaN);
* every other numeric column (measure values, stderr, seconds, numeric diagnostics, metrics,
  numeric ``hp_*``): float64, so a column keeps its dtype whether or not it has gaps;
* boolean diagnostics (``True``/``False``): pandas' nullable ``boolean``;
* other text (string hyperparameters or diagnostics): as pandas reads it.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import hashlib
import io
import json
import math
import numbers
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, exit_code_of
from ..tempfiles import clean_orphans as clean_orphans  # re-exported: results folders
from ..tempfiles import temp_prefix

if TYPE_CHECKING:  # only an annotation: reading tables must not import torch
    import pandas as pd

    from ..measures import MeasureResult

METRICS = (
    "train_loss",
    "train_acc",
    "test_loss",
    "test_acc",
    "gen_gap",
    "loss_gap",
    "train_ppl",
    "test_ppl",
)


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
    params: dict[str, Any] | None = None  # the parameter selection (patterns, names, count)
    model: dict[str, Any] | None = (
        None  # Hugging Face models: class, attention implementation, ties
    )
    keys: dict[str, str] = field(
        default_factory=dict
    )  # label -> key for `measure --resume` (flatcli.api)

    def fail(self, message: str, kind: str, label: str | None = None) -> None:
        """Record a failure of the whole row (``label`` None) or of one measure."""
        if label is not None:
            self.errors[label] = message
            self.error_kinds[label] = kind
        self.status = "error"
        self.error = self.error or message
        if not self.error_kind or exit_code_of(kind) > exit_code_of(self.error_kind):
            self.error_kind = kind

    def mark_budget(self) -> None:
        """Status ``budget`` for a row that is otherwise ``ok`` when a budget left one of its
        measures without a value (status ``budget``, value NaN); a capped value keeps ``ok``."""
        empty = [
            lab
            for lab, r in self.results.items()
            if r.status == "budget" and not math.isfinite(r.value)
        ]
        if self.status == "ok" and empty:
            self.status = "budget"
            self.error = f"no value within the budget: {', '.join(empty)}"

    def flat(self) -> dict[str, Any]:
        """The row as results.csv's cells, column name → value, in column order (see the module
        docstring); a measure without a result has value NaN."""
        out: dict[str, Any] = {
            "checkpoint": self.checkpoint,
            "status": self.status,
            "error": self.error,
        }
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
            **({"params": self.params} if self.params is not None else {}),
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
            **({"model": jsonable(self.model)} if self.model else {}),
            **({"keys": dict(self.keys)} if self.keys else {}),
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
    """results.csv's columns for ``rows``: every row's `Row.flat` columns in first-seen order,
    then the metrics (in `METRICS` order) and the ``hp_*`` columns last."""
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
    """results.csv's text: `columns` in order, one line per row, written by the standard library's
    csv writer as pandas' ``to_csv`` of an object table writes it (``str`` of each value, an empty
    field for a missing value or NaN), without importing pandas (~0.3 s of every measure)."""
    cols = columns(rows)
    if not cols:
        return "\n"
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(cols)
    for r in rows:
        flat = r.flat()
        w.writerow([_csv_field(flat.get(c)) for c in cols])
    return out.getvalue()


def _csv_field(v: Any) -> str:
    """One cell as pandas writes an object column's value: empty for None and NaN, else ``str``."""
    if v is None or (
        isinstance(v, numbers.Real) and not isinstance(v, numbers.Integral) and v != v
    ):
        return ""
    return str(v)


def write_table(
    path: str | os.PathLike, rows: list[dict[str, Any]], columns: list[str] | None = None
) -> Path:
    """Plain rows (mappings) as a CSV, written atomically through pandas (`atomic_write`): the
    ``columns`` in order (default: the first row's keys; other keys are left out), values as
    `to_csv` writes them (integers stay integers, floats in their shortest round-trip repr), a
    missing key an empty field. Manifests, training logs and the experiments' tables use it."""
    import pandas as pd

    cols = list(columns) if columns is not None else (list(rows[0]) if rows else [])
    table = pd.DataFrame(rows, columns=cols, dtype=object)
    atomic_write(path, table.to_csv(index=False, lineterminator="\n"))
    return Path(path)


def read_table(path: str | os.PathLike) -> tuple[list[str], list[dict[str, str]]]:
    """A CSV's header and rows with every cell as the text written (no type guessing; an empty
    field is ``""``): what `write_table` wrote, for code that copies or filters rows."""
    import pandas as pd

    table = pd.read_csv(path, dtype=str, keep_default_na=False)
    return list(table.columns), table.to_dict("records")


TEXT_COLUMNS = ("checkpoint", "error")


def status_columns(cols) -> list[str]:
    """``status`` and every ``<label>_status`` whose ``<label>`` is a column."""
    have = set(cols)
    return [
        c for c in cols if c == "status" or (c.endswith("_status") and c[: -len("_status")] in have)
    ]


def with_dtypes(table: pd.DataFrame) -> pd.DataFrame:
    """The documented dtypes (module docstring) applied to a results table as pandas read it."""
    from pandas.api.types import is_bool_dtype, is_numeric_dtype

    out = table.copy()
    status = set(status_columns(out.columns))
    for c in out.columns:
        s = out[c]
        if c in TEXT_COLUMNS:
            out[c] = s.fillna("").astype(str)
        elif c in status:
            out[c] = s.astype("category")
        elif is_bool_dtype(s) or (
            s.dtype == object and s.dropna().map(type).eq(bool).all() and s.notna().any()
        ):
            out[c] = s.astype("boolean")
        elif is_numeric_dtype(s):
            out[c] = s.astype("float64")
    return out


def read_results(source) -> pd.DataFrame:
    """A results.csv (a path or a text buffer) as a DataFrame with the documented dtypes.

    Also reads the results.csv of older flatcli versions (``nan`` fields read as NaN).
    """
    import pandas as pd

    return with_dtypes(pd.read_csv(source))


def to_frame(rows: list[Row]) -> pd.DataFrame:
    """The rows as the DataFrame `read_results` gives for their results.csv: same columns,
    values and dtypes (it is parsed from the same CSV text, so the two cannot drift)."""
    text = to_csv(rows)
    if not text.strip():
        import pandas as pd

        return pd.DataFrame()
    return read_results(io.StringIO(text))


def atomic_write(path: str | os.PathLike, text: str | bytes) -> None:
    """Write ``text`` (or bytes, as they are) via a temp file in the same folder
    (`temp_prefix`), fsync, then os.replace."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=temp_prefix(path), suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; results are ordinary files
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def ensure_writable_dir(path: str | os.PathLike, what: str = "the output directory") -> Path:
    """Create ``path`` (with parents) and check a file can be written in it, before any work.

    A path under a regular file, an existing file, or a folder without write permission is a
    one-line `ConfigError` (exit code 2) naming ``what`` and the reason."""
    path = Path(path).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".flatcli-write-test.")
        os.close(fd)
        os.unlink(probe)
    except FileExistsError:
        raise ConfigError(f"{what} {path} exists and is not a directory") from None
    except NotADirectoryError:
        blocker = next((q for q in [path, *path.parents] if q.exists() and not q.is_dir()), path)
        raise ConfigError(f"{what} {path} cannot be created: {blocker} is a file") from None
    except OSError as e:
        raise ConfigError(f"{what} {path} is not writable: {e.strerror or e}") from None
    return path


def write_results(
    outdir: str | os.PathLike, rows: list[Row], meta: dict[str, Any]
) -> tuple[Path, Path]:
    """Write ``results.csv`` and ``results.json`` into ``outdir`` as a pair (`write_pair`)."""
    outdir = Path(outdir)
    return write_pair(outdir / "results.csv", rows, meta)


def write_pair(
    csv_path: str | os.PathLike, rows: list[Row], meta: dict[str, Any]
) -> tuple[Path, Path]:
    """Write the CSV ``csv_path`` and the JSON beside it (same stem) as one unit; return the paths.

    Both are first staged beside their targets (``.results.csv.next``, ``.results.json.next``),
    then a commit marker (``.results.commit``) is written, then both are moved into place and the
    marker removed. A kill before the marker leaves the old pair (the staged files are ignored and
    overwritten by the next write); a kill after it is rolled forward by the next reader or writer
    (`settle_pair`): a reader never sees a new CSV beside an old JSON. The JSON also records the
    CSV's sha256 (``csv_sha256``, `json_matches_csv`), which catches a pair edited by hand."""
    csv_path = Path(csv_path)
    csv_next, json_next, commit = _staged(csv_path)
    settle_pair(csv_path)  # finish an earlier write that a kill interrupted after its commit
    text = to_csv(rows)
    doc = {**meta, "csv_sha256": hashlib.sha256(text.encode()).hexdigest()}
    atomic_write(csv_next, text)
    atomic_write(
        json_next, json.dumps(jsonable({**doc, "rows": [r.to_json() for r in rows]}), indent=2)
    )
    atomic_write(commit, "")  # the pair is decided: from here on it is rolled forward
    settle_pair(csv_path)
    return csv_path, csv_path.with_suffix(".json")


def _staged(csv_path: Path) -> tuple[Path, Path, Path]:
    """The staged CSV and JSON of a pair and its commit marker."""
    json_path = csv_path.with_suffix(".json")
    return (
        csv_path.with_name(f".{csv_path.name}.next"),
        json_path.with_name(f".{json_path.name}.next"),
        csv_path.with_name(f".{csv_path.stem}.commit"),
    )


def settle_pair(csv_path: str | os.PathLike) -> None:
    """Finish a pair write whose commit marker exists (a kill after the commit): move the staged
    CSV and JSON into place and drop the marker. Readers call it before reading a pair; without
    a marker it changes nothing (staged files of an unfinished write are left to the writer)."""
    csv_path = Path(csv_path)
    csv_next, json_next, commit = _staged(csv_path)
    if not commit.exists():
        return
    for staged, target in ((csv_next, csv_path), (json_next, csv_path.with_suffix(".json"))):
        try:
            os.replace(staged, target)
        except FileNotFoundError:  # moved already (by another reader, or before a kill)
            pass
    with contextlib.suppress(FileNotFoundError):
        commit.unlink()


def json_matches_csv(doc: Any, csv_path: str | os.PathLike) -> bool:
    """Whether a results JSON (parsed) was written with the CSV at ``csv_path`` (`write_pair`):
    its ``csv_sha256`` is the CSV's; JSON files that do not record it match any CSV."""
    want = doc.get("csv_sha256") if isinstance(doc, dict) else None
    if want is None:
        return True
    try:
        return hashlib.sha256(Path(csv_path).read_bytes()).hexdigest() == want
    except OSError:
        return False


def check_still_there(folder: str | os.PathLike) -> None:
    """``FileNotFoundError`` when the output folder a run created was removed meanwhile: results are
    never written into a folder created again behind the user's back (the run stops, exit 1)."""
    if not Path(folder).is_dir():
        raise FileNotFoundError(errno.ENOENT, "the folder was removed during the run", str(folder))


def write_results_or_fallback(
    outdir: str | os.PathLike, rows: list[Row], meta: dict[str, Any]
) -> tuple[Path, str]:
    """`write_results`, and when that fails (disk full, folder removed meanwhile) the same files in a
    fresh temporary folder, so computed results are never lost. Returns (folder written, error or '')."""
    try:
        check_still_there(outdir)
        write_results(outdir, rows, meta)
        return Path(outdir), ""
    except OSError as e:
        fallback = Path(tempfile.mkdtemp(prefix="flatcli-results-"))
        write_results(fallback, rows, meta)
        return (
            fallback,
            f"could not write {outdir} ({e.strerror or e}); results written to {fallback} instead",
        )
