"""Results tables: reading results.csv (or any CSV or DataFrame), the measure columns, and
the row filters (``where``, convergence) applied before any statistic."""

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..errors import ConfigError
from ..readback import read_json
from ..run.results import METRICS, json_matches_csv, settle_pair
from .expressions import Columns, evaluate_condition, nearest

NON_MEASURE = {"checkpoint", "status", "error", *METRICS}
CONVERGED_LOSS = 0.01  # Jiang et al. 2020 train every model to cross-entropy 0.01 ...
CONVERGED_ACC = 0.99  # ... and accuracy is then ≥ 99%: rows beyond either are not at a minimum
PER_TOKEN_COLUMNS = ("train_ppl", "test_ppl")  # written for per-token losses only
MAX_NAMES = 20  # names listed in a note; the report keeps them all


# ------------------------------------------------------------------ the table
@dataclass
class ResultsTable:
    """A table of checkpoints (one row each) as a DataFrame, with the measure columns flatcli
    recorded (empty for a table flatcli did not write)."""

    frame: pd.DataFrame
    path: Path | None = None
    measures: list[str] = field(default_factory=list)
    measures_source: str = ""  # "results.json", "inferred (columns X with X_status)" or ""
    recorded_loss: str | None = None  # results.json's config.loss, when beside the CSV

    @property
    def loss(self) -> str | None:
        """The loss the table was measured with: the one results.json records, else ``causal_lm``
        (a per-token loss) when the table has perplexity columns, else None (unknown)."""
        if self.recorded_loss:
            return self.recorded_loss
        if any(c in self.frame.columns for c in PER_TOKEN_COLUMNS):
            return "causal_lm"
        return None

    @property
    def name(self) -> str:
        """What the table is called in messages: its path, or "the DataFrame"."""
        return str(self.path) if self.path is not None else "the DataFrame"

    @property
    def columns(self) -> list[str]:
        """The column names, as strings."""
        return [str(c) for c in self.frame.columns]

    def numeric(self, col: str) -> np.ndarray:
        """The column as float64 (values that are not numbers become NaN)."""
        s = pd.to_numeric(self.frame[col], errors="coerce")
        return s.to_numpy(dtype="float64", na_value=np.nan)

    def strings(self, col: str) -> list[str]:
        """The column as labels: ``""`` when missing, ``"2"`` for the number 2.0."""
        return [_label(v) for v in self.frame[col].tolist()]

    @property
    def hp_columns(self) -> list[str]:
        """The hyperparameter columns flatcli writes (``hp_<name>``)."""
        return [c for c in self.columns if c.startswith("hp_")]

    def row_names(self) -> list[str]:
        """What a row is called in messages: its ``checkpoint``; else the index when it holds
        labels rather than row numbers; else the first column of distinct text values (a
        model name); else its row number."""
        f = self.frame
        if "checkpoint" in f.columns:
            return [_label(v) for v in f["checkpoint"].tolist()]
        if not pd.api.types.is_integer_dtype(f.index):
            return [str(v) for v in f.index.tolist()]
        for c in f.columns:
            s = f[c]
            if (
                not (pd.api.types.is_numeric_dtype(s) or pd.api.types.is_bool_dtype(s))
                and s.notna().all()
                and s.is_unique
            ):
                return [str(v) for v in s.tolist()]
        return [str(v) for v in f.index.tolist()]


def _label(v: Any) -> str:
    if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    return str(v)


def _labels_from_json(path: Path, csv_path: Path | None = None) -> list[str] | None:
    """The measure labels a results JSON records; None when it records none, is unreadable, or was
    not written with ``csv_path`` (a mixed pair, `flatcli.run.results.json_matches_csv`)."""
    try:
        d = read_json(path)
    except (OSError, ValueError):
        return None
    if csv_path is not None and not json_matches_csv(d, csv_path):
        return None
    if isinstance(d, dict) and isinstance(d.get("labels"), list):
        return [str(x) for x in d["labels"]]
    rows = d.get("rows") if isinstance(d, dict) else d
    if not isinstance(rows, list):
        return None
    labels: list[str] = []
    for r in rows:
        for lab in (r.get("measures") or {}) if isinstance(r, dict) else {}:
            if lab not in labels:
                labels.append(lab)
    return labels or None


def detect_measures(columns: list[str], csv_path: Path | None = None) -> tuple[list[str], str]:
    """The measure value columns flatcli recorded: results.json's labels when beside the CSV,
    else every column X for which ``X_status`` exists (diagnostics, metrics and ``hp_*`` never
    count). ``([], "")`` for a table without that metadata."""
    stale = ""
    if csv_path is not None:
        for j in (csv_path.with_suffix(".json"), csv_path.parent / "results.json"):
            if j.is_file():
                labels = _labels_from_json(j, csv_path)
                if labels and all(lab in columns for lab in labels):
                    return labels, j.name
                if labels is None and _labels_from_json(j) is not None:
                    stale = f"; {j.name} ignored: not written with {csv_path.name}"
    cols = set(columns)
    labels = [
        c
        for c in columns
        if f"{c}_status" in cols and c not in NON_MEASURE and not c.startswith("hp_")
    ]
    return (labels, f"inferred (columns X with X_status{stale})") if labels else ([], "")


def read_table(path: Path) -> pd.DataFrame:
    """Any CSV as pandas reads it; unreadable input is a one-line ConfigError naming the file."""
    try:
        return pd.read_csv(path)
    except pd.errors.EmptyDataError:
        raise ConfigError(f"{path} is empty (no header row)") from None
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"{path} is not a readable CSV: {first}") from None


def load_results(path: str | Path) -> ResultsTable:
    """A CSV table (flatcli's results.csv or any other) with flatcli's measure metadata when present."""
    path = Path(path)
    settle_pair(path)  # a pair write a kill interrupted after its commit is finished first
    if not path.is_file():
        raise ConfigError(f"results file not found: {path}")
    frame = read_table(path)
    measures, source = detect_measures([str(c) for c in frame.columns], path)
    return ResultsTable(frame, path, measures, source, recorded_loss(path))


def recorded_loss(csv_path: Path) -> str | None:
    """The ``loss`` of the config recorded in the results.json beside a results CSV (None
    without one)."""
    for j in (csv_path.with_suffix(".json"), csv_path.parent / "results.json"):
        if j.is_file():
            try:
                d = read_json(j)
            except (OSError, ValueError):
                return None
            cfg = d.get("config") if isinstance(d, dict) else None
            loss = cfg.get("loss") if isinstance(cfg, dict) else None
            return loss if isinstance(loss, str) else None
    return None


def as_table(data: pd.DataFrame | ResultsTable | str | Path) -> ResultsTable:
    """A `ResultsTable` from a path, a DataFrame (e.g. ``report.to_pandas()``) or a table."""
    if isinstance(data, ResultsTable):
        return data
    if isinstance(data, pd.DataFrame):
        if not data.columns.is_unique:
            dup = sorted({str(c) for c in data.columns[data.columns.duplicated()]})
            raise ConfigError(f"the DataFrame has duplicate columns: {', '.join(dup)}")
        measures, source = detect_measures([str(c) for c in data.columns])
        # without the caller's attrs: pandas deep-copies attrs on every operation
        return ResultsTable(
            pd.DataFrame(data, copy=False) if data.attrs else data, None, measures, source
        )
    if isinstance(data, (str, Path)):
        return load_results(data)
    raise ConfigError(
        f"correlate takes a DataFrame or the path of a CSV. Got {type(data).__name__} instead."
    )


def numeric_columns(table: ResultsTable) -> list[str]:
    """Columns holding numbers (booleans excluded), with at least one finite value."""
    out = []
    for c in table.columns:
        s = table.frame[c]
        if pd.api.types.is_bool_dtype(s) or not pd.api.types.is_numeric_dtype(s):
            continue
        if np.isfinite(table.numeric(c)).any():
            out.append(c)
    return out


# ------------------------------------------------------------------ filters
@dataclass
class FilterInfo:
    """What one filter left out: ``dropped`` of ``n_before`` rows, by name."""

    option: str  # "--where 'lr < 0.1'" or "--max-train-loss 0.01"
    n_before: int
    dropped: list[str]

    def describe(self) -> str:
        """One line: the option, how many of how many rows it dropped, and their names (the first
        `MAX_NAMES`)."""
        names = ", ".join(self.dropped[:MAX_NAMES])
        more = (
            f", … ({len(self.dropped) - MAX_NAMES} more)" if len(self.dropped) > MAX_NAMES else ""
        )
        tail = f": {names}{more}" if self.dropped else ""
        return f"{self.option} dropped {len(self.dropped)} of {self.n_before} rows{tail}"


def table_columns(frame: pd.DataFrame, table: ResultsTable) -> Columns:
    """The columns of ``frame`` for an expression: numbers as float64, booleans as booleans, any
    other column as its values (a missing one as None)."""
    label = {str(c): c for c in frame.columns}  # a DataFrame's labels need not be text

    def values(col: str) -> np.ndarray:
        s = frame[label[col]]
        if pd.api.types.is_bool_dtype(s):
            return s.to_numpy(dtype=bool)
        if pd.api.types.is_numeric_dtype(s):
            return pd.to_numeric(s, errors="coerce").to_numpy(dtype="float64", na_value=np.nan)
        return np.array([None if _label(v) == "" else v for v in s.tolist()], dtype=object)

    def numbers(col: str) -> np.ndarray:
        return pd.to_numeric(frame[label[col]], errors="coerce").to_numpy(
            dtype="float64", na_value=np.nan
        )

    return Columns(list(label), numbers, values, n=len(frame), kind=f"columns of {table.name}")


def filter_rows(
    table: ResultsTable, *, where: str | None = None, max_train_loss: float | None = None
) -> tuple[ResultsTable, list[FilterInfo]]:
    """Rows kept by ``where`` (a condition on columns, `flatcli.analysis.expressions`, e.g.
    ``"hp_lr < 0.1 and train_acc > 0.99"``; backquote odd names: ``"`asam_0.05` > 1"``; never run
    as code) and then by ``train_loss <= max_train_loss`` (a row without a finite train_loss is
    dropped: it is not known to be at a minimum)."""
    frame = (
        table.frame
    )  # filtered by position; the index (row names without a checkpoint column) is kept
    names = table.row_names()
    infos: list[FilterInfo] = []

    def drop(option: str, keep: np.ndarray) -> None:
        nonlocal frame, names
        infos.append(
            FilterInfo(option, len(frame), [n for n, k in zip(names, keep, strict=True) if not k])
        )
        frame, names = frame[keep], [n for n, k in zip(names, keep, strict=True) if k]

    if where is not None and str(where).strip():
        keep = evaluate_condition(str(where), table_columns(frame, table), f"`where` {where!r}")
        drop(f"--where {where!r}", keep)
    if max_train_loss is not None:
        if "train_loss" not in frame.columns:
            raise ConfigError(f"`max_train_loss` needs a train_loss column; {table.name} has none")
        loss = pd.to_numeric(frame["train_loss"], errors="coerce").to_numpy(
            dtype="float64", na_value=np.nan
        )
        drop(f"--max-train-loss {max_train_loss:g}", np.isfinite(loss) & (loss <= max_train_loss))
    if not infos:
        return table, infos
    if frame.empty:
        raise ConfigError(
            f"the filters left no rows of {table.name}: " + "; ".join(i.describe() for i in infos)
        )
    return (
        ResultsTable(frame, table.path, table.measures, table.measures_source, table.recorded_loss),
        infos,
    )


def convergence_warning(table: ResultsTable, rows: np.ndarray) -> str | None:
    """A warning when some of the ``rows`` (a mask) are not at a minimum: train_loss above 0.01
    or train accuracy below 0.99 (Jiang et al. 2020 compare models that reached the loss target)."""
    names = table.row_names()
    bad = np.zeros(len(names), dtype=bool)
    why = []
    if "train_loss" in table.columns:
        hit = rows & (table.numeric("train_loss") > CONVERGED_LOSS)
        if hit.any():
            why.append(f"train_loss > {CONVERGED_LOSS:g}")
        bad |= hit
    if "train_acc" in table.columns:
        hit = rows & (table.numeric("train_acc") < CONVERGED_ACC)
        if hit.any():
            why.append(f"train_acc < {CONVERGED_ACC:g}")
        bad |= hit
    if not bad.any():
        return None
    listed = [n for n, b in zip(names, bad, strict=True) if b]
    more = f", … ({len(listed) - MAX_NAMES} more)" if len(listed) > MAX_NAMES else ""
    fix = (
        f"--max-train-loss {CONVERGED_LOSS:g} leaves them out"
        if "train_loss" in table.columns
        else f"--where 'train_acc >= {CONVERGED_ACC:g}' leaves them out"
    )
    return (
        f"{len(listed)} of {int(rows.sum())} rows being correlated are not at a minimum ({' or '.join(why)}): "
        f"{', '.join(listed[:MAX_NAMES])}{more}. Measures compare models at minima (Jiang et al. 2020); {fix}"
    )


def _natural(v: str):
    try:
        return (0, float(v), v)
    except ValueError:
        return (1, 0.0, v)


def resolve_column(table: ResultsTable, name: str, option: str) -> tuple[str, str]:
    """``(axis name, column)`` for a hyperparameter named on the command line: ``hp_<name>``
    (flatcli's column for it), else the column ``name`` itself; ``hp_x`` names ``x``."""
    cols = set(table.columns)
    if name.startswith("hp_") and name in cols:
        return name[3:], name
    if f"hp_{name}" in cols:
        return name, f"hp_{name}"
    if name in cols:
        return name, name
    avail = [c for c in table.columns if c not in NON_MEASURE]
    raise ConfigError(
        f"{option} {name!r}: no column {name} or hp_{name} in {table.name} ({nearest(name, avail)})"
    )


def usable(table: ResultsTable, measure: str, target: str) -> np.ndarray:
    """Rows where the measure and the target are finite and the measure did not fail."""
    ok = np.isfinite(table.numeric(measure)) & np.isfinite(table.numeric(target))
    if f"{measure}_status" in table.columns:
        ok &= np.array([s != "error" for s in table.strings(f"{measure}_status")], dtype=bool)
    return ok
