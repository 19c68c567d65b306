"""How well does each measure predict the generalization gap? Rank correlations over checkpoints.

For a measure μ and the gap g (default ``gen_gap = train_acc − test_acc``) over the
checkpoints where both are finite (n of them):

* **Pearson** r, **Spearman** ρ and **Kendall τ-b** (``scipy.stats``; τ-b corrects for ties).
* **Jiang's τ** (Jiang et al. 2020, "Fantastic generalization measures and where to find
  them", ICLR, eq. 2), without tie correction:
  ``τ = 1/(n(n−1)) Σ_{i≠j} sign(μ_i − μ_j) sign(g_i − g_j)``. Our own code: scipy's
  ``kendalltau`` offers τ-b and τ-c, both tie-corrected.
* **Granulated Kendall Ψ** (Jiang et al. 2020, eq. 3–4): for each hyperparameter axis i,
  ``ψ_i`` is the mean, over the groups of checkpoints that share the values of every other
  axis, of Jiang's τ within the group (only axis i varies in it); ``Ψ = mean_i ψ_i``.
  Groups with fewer than two checkpoints carry no pair and are skipped (counted). The groups
  are a pandas ``groupby``; ``psi_<axis>_sem`` is ``scipy.stats.sem`` of the group τs.
* **Conditional mutual information** as scored in the PGDL 2020 competition (Jiang et al.
  2020, NeurIPS competition report; "Fantastic...", §6): for ordered pairs of distinct
  checkpoints (i, j), ``V_μ = sign(μ_i − μ_j)`` and ``V_g = sign(g_i − g_j)``; ``U_S`` is the
  values of the hyperparameters S of both checkpoints. For every pair of axes S,
  ``Î_S = I(V_μ; V_g | U_S) / H(V_g | U_S)`` (conditional quantities weighted by the
  empirical probability of each cell of U_S); the score is ``min_S Î_S`` (a measure that
  only reads off a hyperparameter gets 0). Pairs with a tied gap carry no order and are
  dropped; ``V_μ`` keeps ties as a third value. With one axis S is that axis, with none
  the mutual information is unconditional. The cell counts are a pandas ``groupby``; the
  score itself is our own code (neither scipy nor pandas has the PGDL definition).
* **Bootstrap intervals** (optional): percentile intervals of Pearson, Spearman and Kendall
  τ-b from ``scipy.stats.bootstrap`` resampling checkpoints (pairs (μ_i, g_i)) with a seeded
  generator; Ψ and CMI get none (their groups and cells fall apart under resampling).

Every statistic comes with the number of checkpoints (or groups, or pairs) it used.
Missing values, constant columns and incomplete hyperparameter grids become notes.

Any table works: a results.csv of `flatcli measure`/`collect`, another CSV, or a DataFrame.
Measures are the columns named by ``measures``, else those flatcli recorded (results.json's
labels, or the columns X with an ``X_status`` column), else every numeric column that is not
the target, a metric, a hyperparameter axis or a ``<column>_stderr``. Rows can be filtered
(``where``, a ``DataFrame.query`` expression; ``max_train_loss``) before anything is computed.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..errors import ConfigError

METRICS = ("train_loss", "train_acc", "test_loss", "test_acc", "gen_gap")
NON_MEASURE = {"checkpoint", "status", "error", *METRICS}
STATS = ("psi", "kendall_tau_b", "jiang_tau", "spearman", "pearson", "cmi")
CI_STATS = ("pearson", "spearman", "kendall_tau_b")  # statistics with bootstrap intervals, `_scipy_stats` order
CONVERGED_LOSS = 0.01  # Jiang et al. 2020 train every model to cross-entropy 0.01 ...
CONVERGED_ACC = 0.99  # ... and accuracy is then ≥ 99%: rows beyond either are not at a minimum
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
            if not (pd.api.types.is_numeric_dtype(s) or pd.api.types.is_bool_dtype(s)) and s.notna().all() and s.is_unique:
                return [str(v) for v in s.tolist()]
        return [str(v) for v in f.index.tolist()]


def _label(v: Any) -> str:
    if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    return str(v)


def _labels_from_json(path: Path) -> list[str] | None:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
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
    if csv_path is not None:
        for j in (csv_path.with_suffix(".json"), csv_path.parent / "results.json"):
            if j.is_file():
                labels = _labels_from_json(j)
                if labels and all(lab in columns for lab in labels):
                    return labels, j.name
    cols = set(columns)
    labels = [c for c in columns if f"{c}_status" in cols and c not in NON_MEASURE and not c.startswith("hp_")]
    return (labels, "inferred (columns X with X_status)") if labels else ([], "")


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
    if not path.is_file():
        raise ConfigError(f"results file not found: {path}")
    frame = read_table(path)
    measures, source = detect_measures([str(c) for c in frame.columns], path)
    return ResultsTable(frame, path, measures, source)


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
        return ResultsTable(pd.DataFrame(data, copy=False) if data.attrs else data, None, measures, source)
    if isinstance(data, (str, Path)):
        return load_results(data)
    raise ConfigError(f"correlate takes a DataFrame or the path of a CSV; got {type(data).__name__}")


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
        more = f", … ({len(self.dropped) - MAX_NAMES} more)" if len(self.dropped) > MAX_NAMES else ""
        tail = f": {names}{more}" if self.dropped else ""
        return f"{self.option} dropped {len(self.dropped)} of {self.n_before} rows{tail}"


def _one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def filter_rows(
    table: ResultsTable, *, where: str | None = None, max_train_loss: float | None = None
) -> tuple[ResultsTable, list[FilterInfo]]:
    """Rows kept by ``where`` (``DataFrame.query`` syntax, e.g. ``"hp_lr < 0.1 and train_acc > 0.99"``;
    backquote odd names: ``"`asam_0.05` > 1"``) and then by ``train_loss <= max_train_loss``
    (a row without a finite train_loss is dropped: it is not known to be at a minimum)."""
    frame = table.frame  # filtered by position; the index (row names without a checkpoint column) is kept
    names = table.row_names()
    infos: list[FilterInfo] = []

    def drop(option: str, keep: np.ndarray) -> None:
        nonlocal frame, names
        infos.append(FilterInfo(option, len(frame), [n for n, k in zip(names, keep, strict=True) if not k]))
        frame, names = frame[keep], [n for n, k in zip(names, keep, strict=True) if k]

    if where is not None and where.strip():
        positional = frame.reset_index(drop=True)
        try:
            kept = positional.query(where)
        except Exception as e:  # any error of the user's expression
            raise ConfigError(f"--where {where!r} is not a valid expression on {table.name}: {_one_line(e)}") from None
        if not isinstance(kept, pd.DataFrame):
            raise ConfigError(f"--where {where!r} does not select rows of {table.name}")
        drop(f"--where {where!r}", positional.index.isin(kept.index))
    if max_train_loss is not None:
        if "train_loss" not in frame.columns:
            raise ConfigError(f"--max-train-loss needs a train_loss column; {table.name} has none")
        loss = pd.to_numeric(frame["train_loss"], errors="coerce").to_numpy(dtype="float64", na_value=np.nan)
        drop(f"--max-train-loss {max_train_loss:g}", np.isfinite(loss) & (loss <= max_train_loss))
    if not infos:
        return table, infos
    if frame.empty:
        raise ConfigError(f"the filters left no rows of {table.name}: " + "; ".join(i.describe() for i in infos))
    return ResultsTable(frame, table.path, table.measures, table.measures_source), infos


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
    fix = (f"--max-train-loss {CONVERGED_LOSS:g} leaves them out" if "train_loss" in table.columns
           else f"--where 'train_acc >= {CONVERGED_ACC:g}' leaves them out")
    return (f"{len(listed)} of {int(rows.sum())} rows being correlated are not at a minimum ({' or '.join(why)}): "
            f"{', '.join(listed[:MAX_NAMES])}{more}. Measures compare models at minima (Jiang et al. 2020); {fix}")


# ------------------------------------------------------------------ statistics
def _sign(x: np.ndarray) -> np.ndarray:
    return np.sign(x).astype(np.int64)


def jiang_tau(m: np.ndarray, g: np.ndarray) -> float:
    """Kendall's τ without tie correction (Jiang et al. 2020, eq. 2); nan for fewer than 2 points."""
    m, g = np.asarray(m, float), np.asarray(g, float)
    n = len(m)
    if n < 2:
        return math.nan
    s = _sign(m[:, None] - m[None, :]) * _sign(g[:, None] - g[None, :])
    return float(s.sum()) / (n * (n - 1))


@dataclass
class AxisPsi:
    """ψ_i of one hyperparameter axis i (Jiang et al. 2020, eq. 3): the mean of Jiang's τ over the
    groups of checkpoints that share every other axis's values, with what it used."""

    psi: float  # mean of Jiang's τ over the groups where only this axis varies
    groups: int  # groups used (≥ 2 checkpoints)
    n: int  # checkpoints in those groups
    skipped: int  # groups with fewer than 2 checkpoints
    sem: float = math.nan  # standard error of that mean over the groups (scipy.stats.sem)


def _group_keys(hp: dict[str, list[str]], axes: list[str], n: int) -> list[np.ndarray]:
    keys = [np.asarray(hp[a], dtype=object) for a in axes]
    return keys or [np.zeros(n, dtype=np.int64)]  # no other axis: one group of everything


def granulated_kendall(
    m: np.ndarray, g: np.ndarray, hp: dict[str, list[str]], axes: list[str]
) -> tuple[float, dict[str, AxisPsi]]:
    """Granulated Kendall coefficient Ψ and every ψ_i (Jiang et al. 2020, eq. 3–4).

    ``hp[axis][k]`` is checkpoint k's value of that hyperparameter (as a string).
    Ψ is the mean of the finite ψ_i (nan when none is finite).
    """
    from scipy import stats

    frame = pd.DataFrame({"m": np.asarray(m, float), "g": np.asarray(g, float)})
    out: dict[str, AxisPsi] = {}
    for ax in axes:
        others = [a for a in axes if a != ax]
        taus, used, skipped = [], 0, 0
        for _, grp in frame.groupby(_group_keys(hp, others, len(frame)), sort=False):
            if len(grp) < 2:
                skipped += 1
                continue
            taus.append(jiang_tau(grp["m"].to_numpy(), grp["g"].to_numpy()))
            used += len(grp)
        sem = float(stats.sem(taus)) if len(taus) >= 2 else math.nan
        out[ax] = AxisPsi(float(np.mean(taus)) if taus else math.nan, len(taus), used, skipped, sem)
    finite = [a.psi for a in out.values() if math.isfinite(a.psi)]
    return (float(np.mean(finite)) if finite else math.nan), out


@dataclass
class CMI:
    """The PGDL-2020 conditional mutual information score (see the module docstring):
    ``min_S I(V_μ; V_g | U_S) / H(V_g | U_S)``, the S that gave it, the ordered pairs used, and
    the normalized value for every conditioning set S (``per_condition``)."""

    value: float  # min over conditioning sets of I(Vμ;Vg|U)/H(Vg|U)
    condition: str  # the conditioning set that gave the minimum
    pairs: int  # ordered pairs used (distinct checkpoints, untied gap)
    per_condition: dict[str, float] = field(default_factory=dict)


def _normalized_cmi(cell: np.ndarray, vm: np.ndarray, vg: np.ndarray) -> float:
    """``I(V_μ; V_g | U) / H(V_g | U)`` from one entry per pair: its cell U (`_cell_ids`), ``vm`` ∈
    {−1, 0, 1} and ``vg`` ∈ {−1, 1}; the counts per (cell, V_μ, V_g) a ``bincount``."""
    n = len(cell)
    ncell = int(cell.max()) + 1
    code = (cell * 3 + vm + 1) * 2 + (vg > 0)
    joint = np.bincount(code, minlength=ncell * 6).reshape(ncell, 3, 2).astype(float)
    nu = joint.sum(axis=(1, 2))  # pairs per cell
    pa = joint.sum(axis=2)  # V_μ marginal per cell
    pb = joint.sum(axis=1)  # V_g marginal per cell
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = joint * nu[:, None, None] / (pa[:, :, None] * pb[:, None, :])
        mi = np.where(joint > 0, joint * np.log(ratio), 0.0).sum() / n
        h = -np.where(pb > 0, pb * np.log(pb / nu[:, None]), 0.0).sum() / n
    return float(mi / h) if h > 1e-15 else math.nan


def _conditions(axes: list[str]) -> list[tuple[str, ...]]:
    """The conditioning sets S of the CMI score: every pair of axes (the one axis, or none)."""
    return [tuple(c) for c in itertools.combinations(axes, 2)] if len(axes) >= 2 else [tuple(axes)]


def _ordered_pairs(g: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ordered pairs (i, j) of distinct checkpoints with untied gaps, and V_g = sign(g_i − g_j)."""
    i, j = np.nonzero(~np.eye(len(g), dtype=bool))
    vg = _sign(g[i] - g[j])
    keep = vg != 0
    return i[keep], j[keep], vg[keep]


def _cell_ids(i: np.ndarray, j: np.ndarray, codes: dict[str, np.ndarray], cond: tuple[str, ...]) -> np.ndarray:
    """U_S of every pair as a cell number 0..cells−1: the values of both checkpoints on each axis of
    ``cond`` (one cell without); numpy, not a pandas groupby: a CMI score of 54 checkpoints on 4 axes
    in 1.2 instead of 12.3 ms."""
    sizes = [int(codes[a].max()) + 1 for a in cond]
    if math.prod(sizes) ** 2 >= 2**62:  # too many combinations for one int64 key: unique rows
        keys = np.stack([c for a in cond for c in (codes[a][i], codes[a][j])], axis=1)
        return np.unique(keys, axis=0, return_inverse=True)[1].reshape(-1)
    key = np.zeros(len(i), dtype=np.int64)
    for a, k in zip(cond, sizes, strict=True):  # mixed radix: one integer per combination of the 2·|S| values
        key = (key * k + codes[a][i]) * k + codes[a][j]
    return np.unique(key, return_inverse=True)[1].reshape(-1)


def _axis_codes(hp: dict[str, list[str]], axes: list[str]) -> dict[str, np.ndarray]:
    return {a: pd.factorize(np.asarray(hp[a], dtype=object))[0] for a in axes}


def conditional_mi(m: np.ndarray, g: np.ndarray, hp: dict[str, list[str]], axes: list[str]) -> CMI:
    """PGDL-2020 conditional mutual information score (see the module docstring); natural log."""
    m, g = np.asarray(m, float), np.asarray(g, float)
    i, j, vg = _ordered_pairs(g)
    vm = _sign(m[i] - m[j])
    npairs = len(i)
    if npairs == 0:
        return CMI(math.nan, "", 0)
    codes = _axis_codes(hp, axes)
    per: dict[str, float] = {}
    for cond in _conditions(axes):
        per[" × ".join(cond) or "(none)"] = _normalized_cmi(_cell_ids(i, j, codes, cond), vm, vg)
    finite = {k: v for k, v in per.items() if math.isfinite(v)}
    if not finite:
        return CMI(math.nan, "", npairs, per)
    best = min(finite, key=finite.get)
    return CMI(max(0.0, finite[best]), best, npairs, per)


MIN_PAIRS_PER_CELL = 10  # plug-in MI is biased up by ≈ 1/(pairs in the cell) nats, against H ≤ log 2
CHANCE_DRAWS = 20


@dataclass
class CMICheck:
    """Whether the grid is large enough for the CMI score. ``pairs_per_cell``: the fewest untied
    ordered pairs per occupied cell U_S, averaged over the cells, among the conditioning sets S
    (``condition`` the S that has so few). On small grids the plug-in estimate is biased towards 1
    (a cell of one or two pairs is "explained" by anything); ``chance`` is then the mean score of
    `CHANCE_DRAWS` random orderings on the same grid and gaps, ``chance_hi`` their 95th percentile:
    scores below it say nothing."""

    pairs_per_cell: float
    condition: str
    chance: float = math.nan
    chance_hi: float = math.nan

    @property
    def reliable(self) -> bool:
        """Whether every conditioning set leaves at least `MIN_PAIRS_PER_CELL` pairs per cell."""
        return self.pairs_per_cell >= MIN_PAIRS_PER_CELL

    def warning(self) -> str:
        """The warning for an unreliable grid (empty when reliable)."""
        if self.reliable:
            return ""
        return (
            f"CMI is not reliable on this grid: conditioning on {self.condition} leaves "
            f"{self.pairs_per_cell:.1f} ordered pairs per cell, and CMI needs ≳ {MIN_PAIRS_PER_CELL} "
            "(several checkpoints for every combination of values of each two axes); a random measure scores "
            f"{self.chance:.2f} on average here (95th percentile {self.chance_hi:.2f}): ignore CMI values below that"
        )


def check_cmi_grid(g: np.ndarray, hp: dict[str, list[str]], axes: list[str], seed: int = 0) -> CMICheck | None:
    """`CMICheck` of the gaps ``g`` on the grid ``hp`` (None without two distinct gaps); the chance
    level is computed only when the grid is too small (random orderings seeded by ``seed``)."""
    g = np.asarray(g, float)
    i, j, _ = _ordered_pairs(g)
    if len(i) == 0:
        return None
    codes = _axis_codes(hp, axes)
    per = {" × ".join(c) or "(none)": len(i) / (int(_cell_ids(i, j, codes, c).max()) + 1)
           for c in _conditions(axes)}
    cond = min(per, key=per.get)
    check = CMICheck(per[cond], cond)
    if not check.reliable:
        rng = np.random.default_rng(seed)
        draws = [conditional_mi(rng.random(len(g)), g, hp, axes).value for _ in range(CHANCE_DRAWS)]
        draws = [d for d in draws if math.isfinite(d)]
        if draws:
            check.chance, check.chance_hi = float(np.mean(draws)), float(np.quantile(draws, 0.95))
    return check


_CHUNK_ELEMENTS = 8_000_000  # resamples × n × n int8 signs held at once (Kendall)
_KENDALL_PAIRWISE_MAX = 150


def pearson_rows(X: np.ndarray, Y: np.ndarray) -> np.ndarray:
    """Pearson's r of every row pair (X[k], Y[k]); NaN where a row is constant."""
    Xc = X - X.mean(1, keepdims=True)
    Yc = Y - Y.mean(1, keepdims=True)
    den = np.sqrt((Xc * Xc).sum(1) * (Yc * Yc).sum(1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (Xc * Yc).sum(1) / np.where(den > 0, den, 1.0), np.nan)


def spearman_rows(X: np.ndarray, Y: np.ndarray) -> np.ndarray:
    """Spearman's ρ of every row pair: Pearson's r of the average ranks (ties share their mean rank)."""
    from scipy.stats import rankdata

    return pearson_rows(rankdata(X, axis=1), rankdata(Y, axis=1))


def kendall_rows(X: np.ndarray, Y: np.ndarray) -> np.ndarray:
    r"""Kendall's τ-b of every row pair: :math:`(C - D)/\sqrt{(n_0 - n_1)(n_0 - n_2)}` over the pairs
    i < j, ties in X (n_1) or Y (n_2) excluded from the denominator's counts; NaN where a row is constant.

    Up to ``_KENDALL_PAIRWISE_MAX`` columns all rows at once from int8 sign matrices (O(n²) per row,
    15× faster than a scipy call per row at 48 columns, 1.4× at 128); above, scipy.stats.kendalltau
    per row (O(n log n); the crossover measured with 1,000 rows)."""
    K, n = X.shape
    if n > _KENDALL_PAIRWISE_MAX:
        from scipy.stats import kendalltau

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a constant row: nan, as below
            return np.array([kendalltau(X[k], Y[k], variant="b").statistic for k in range(K)], dtype=float)
    out = np.empty(K)
    step = max(1, _CHUNK_ELEMENTS // max(1, n * n))
    for s in range(0, K, step):
        x, y = X[s : s + step], Y[s : s + step]
        sx = np.sign(x[:, :, None] - x[:, None, :]).astype(np.int8)  # both triangles: every count doubled
        sy = np.sign(y[:, :, None] - y[:, None, :]).astype(np.int8)
        num = np.einsum("kij,kij->k", sx, sy, dtype=np.int64)
        den = np.sqrt(np.count_nonzero(sx, axis=(1, 2)) * np.count_nonzero(sy, axis=(1, 2)).astype(float))
        with np.errstate(invalid="ignore", divide="ignore"):
            out[s : s + step] = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)
    return out


def _scipy_stats(m: np.ndarray, g: np.ndarray) -> np.ndarray:
    """``[Pearson, Spearman, Kendall τ-b]`` of (m, g) from scipy.stats; nan where undefined."""
    from scipy import stats

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # constant resamples: scipy warns and returns nan
        return np.array([
            stats.pearsonr(m, g).statistic,
            stats.spearmanr(m, g).statistic,
            stats.kendalltau(m, g, variant="b").statistic,
        ], dtype=float)


@dataclass
class Interval:
    """A bootstrap percentile interval [lo, hi] of one statistic."""

    lo: float
    hi: float


def _row_stats(m: np.ndarray, g: np.ndarray, axis: int = -1) -> np.ndarray:
    """``[Pearson, Spearman, Kendall τ-b]`` of every resample (scipy's vectorized bootstrap
    statistic): arrays (..., n) → (3, ...)."""
    m, g = np.moveaxis(m, axis, -1), np.moveaxis(g, axis, -1)
    M, G = m.reshape(-1, m.shape[-1]), g.reshape(-1, g.shape[-1])
    return np.stack([f(M, G) for f in (pearson_rows, spearman_rows, kendall_rows)]).reshape(3, *m.shape[:-1])


def bootstrap_intervals(
    m: np.ndarray, g: np.ndarray, n_resamples: int, seed: int = 0, confidence: float = 0.95
) -> tuple[dict[str, Interval], int]:
    """Percentile intervals of Pearson, Spearman and Kendall τ-b over ``n_resamples`` resamples
    of the checkpoints (``scipy.stats.bootstrap``, paired, generator seeded by ``seed``). The
    statistics of all resamples are computed at once (`pearson_rows`, `spearman_rows`,
    `kendall_rows`, equal to scipy.stats' to rounding): 1,000 resamples of 48 / 150 / 400
    checkpoints take 0.03 / 0.25 / 0.30 s instead of 0.78 / 0.84 / 0.93 s with scipy's call per
    resample (``scripts/bench_bootstrap.py --n 48,150,400``, one thread of this project's 2-core CPU
    machine, scipy 1.17).

    Returns the intervals and the number of resamples on which a statistic was undefined (a
    resample whose measure or gap is constant); the intervals then come from the other
    resamples (``numpy.nanquantile``, the same linear interpolation as scipy's).
    """
    from scipy import stats

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scipy's degenerate-distribution warning: handled below
        res = stats.bootstrap((m, g), _row_stats, paired=True, vectorized=True, n_resamples=n_resamples,
                              confidence_level=confidence, method="percentile",
                              rng=np.random.default_rng(seed))
    dist = np.asarray(res.bootstrap_distribution, dtype=float)  # (pearson, spearman, τ-b) × resamples
    lo, hi = np.asarray(res.confidence_interval.low, float), np.asarray(res.confidence_interval.high, float)
    undefined = int((~np.isfinite(dist)).any(axis=0).sum())
    if undefined:
        alpha = (1 - confidence) / 2
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-nan rows stay nan
            lo, hi = np.nanquantile(dist, [alpha, 1 - alpha], axis=-1)
    return {s: Interval(float(lo[k]), float(hi[k])) for k, s in enumerate(CI_STATS)}, undefined


# ------------------------------------------------------------------ the report
@dataclass
class GridInfo:
    """The grid the checkpoints form over the hyperparameter axes: each axis's distinct values
    (natural order), how many combinations a full grid has and how many are present, how many
    hold several checkpoints, and a few missing ones."""

    axes: list[str]
    values: dict[str, list[str]]
    expected: int  # product of the numbers of distinct values
    observed: int  # distinct combinations present
    duplicates: int  # combinations held by more than one checkpoint
    missing: list[str]  # a few missing combinations, rendered

    @property
    def complete(self) -> bool:
        """Whether every combination of the axes' values is present."""
        return self.observed == self.expected


@dataclass
class MeasureCorrelation:
    """Every statistic of one measure against the target (NaN where undefined, see ``notes``).

    ``n``: checkpoints with a finite measure and target (what Pearson, Spearman, Kendall τ-b
    and Jiang's τ use); ``psi`` Ψ and ``psi_axes`` each axis's ψ_i; ``cmi`` the PGDL score,
    ``cmi_condition`` its conditioning set and ``cmi_pairs`` the pairs it used; ``intervals``
    the bootstrap intervals by statistic (with ``bootstrap``). Every statistic is larger when
    the measure orders the checkpoints more like the target does; the ranking puts larger first.
    """

    measure: str
    n: int
    pearson: float = math.nan
    spearman: float = math.nan
    kendall_tau_b: float = math.nan
    jiang_tau: float = math.nan
    psi: float = math.nan
    psi_axes: dict[str, AxisPsi] = field(default_factory=dict)
    cmi: float = math.nan
    cmi_condition: str = ""
    cmi_pairs: int = 0
    intervals: dict[str, Interval] = field(default_factory=dict)  # bootstrap, by statistic
    notes: list[str] = field(default_factory=list)

    def get(self, stat: str) -> float:
        """The statistic named ``stat`` (one of `STATS`)."""
        return getattr(self, stat)


@dataclass
class CorrelationReport:
    """The result of `correlate_table`: every measure's statistics, best first by ``sort``, with
    the axes, the grid, the filters applied, notes and warnings; ``table`` holds the rows that
    were correlated (after the filters)."""

    source: Path | None  # the CSV read (None for a DataFrame)
    target: str
    axes: list[str]  # hyperparameter axes (a column's name, without an hp_ prefix)
    measures: list[MeasureCorrelation]  # ranked
    sort: str
    grid: GridInfo | None
    n_rows: int  # rows correlated (after the filters)
    measures_source: str
    notes: list[str] = field(default_factory=list)
    csv_path: Path | None = None  # correlations.csv, once written
    plots: list[Path] = field(default_factory=list)
    axis_columns: dict[str, str] = field(default_factory=dict)  # axis -> its column
    n_input: int = 0  # rows of the input table, before the filters
    filters: list[FilterInfo] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # e.g. rows that are not at a minimum
    bootstrap: int = 0  # resamples behind the intervals (0: none)
    confidence: float = 0.95
    seed: int = 0
    table: ResultsTable | None = field(default=None, repr=False, compare=False)  # the filtered rows
    cmi_check: CMICheck | None = None  # whether the grid is large enough for CMI

    @property
    def dropped(self) -> list[str]:
        """Names of the rows the filters left out."""
        return [name for f in self.filters for name in f.dropped]

    def to_rows(self) -> list[dict[str, Any]]:
        """One dict per measure, best first, with the columns of `to_pandas`."""
        out = []
        for rank, mc in enumerate(self.measures, 1):
            d: dict[str, Any] = {"rank": rank, "measure": mc.measure, "n": mc.n}
            for stat in CI_STATS:
                d[stat] = mc.get(stat)
                if self.bootstrap:
                    iv = mc.intervals.get(stat)
                    d[f"{stat}_lo"] = iv.lo if iv else math.nan
                    d[f"{stat}_hi"] = iv.hi if iv else math.nan
            d.update({"jiang_tau": mc.jiang_tau, "psi": mc.psi})
            for ax in self.axes:
                a = mc.psi_axes.get(ax)
                d[f"psi_{ax}"] = a.psi if a else math.nan
                d[f"psi_{ax}_groups"] = a.groups if a else 0
                d[f"psi_{ax}_n"] = a.n if a else 0
                d[f"psi_{ax}_sem"] = a.sem if a else math.nan
            d.update({"cmi": mc.cmi, "cmi_condition": mc.cmi_condition, "cmi_pairs": mc.cmi_pairs,
                      "notes": "; ".join(mc.notes)})
            out.append(d)
        return out

    def to_pandas(self) -> pd.DataFrame:
        """One row per measure, best first: the columns of correlations.csv (``rank``, ``measure``,
        ``n``, the statistics, ``<stat>_lo``/``_hi`` with a bootstrap, per-axis ψ with its
        group count, checkpoints and standard error, CMI with its condition and pairs, notes)."""
        return pd.DataFrame(self.to_rows())


def _grid(hp: dict[str, list[str]], axes: list[str]) -> GridInfo:
    values = {a: sorted(set(hp[a]), key=_natural) for a in axes}
    combos: dict[tuple, int] = {}
    for k in range(len(hp[axes[0]]) if axes else 0):
        t = tuple(hp[a][k] for a in axes)
        combos[t] = combos.get(t, 0) + 1
    expected = math.prod(len(v) for v in values.values()) if axes else 0
    missing = []
    if axes and len(combos) < expected:
        for t in itertools.product(*values.values()):
            if t not in combos:
                missing.append(", ".join(f"{a}={v}" for a, v in zip(axes, t, strict=True)))
                if len(missing) >= 5:
                    break
    return GridInfo(axes, values, expected, len(combos), sum(c > 1 for c in combos.values()), missing)


def _natural(v: str):
    try:
        return (0, float(v), v)
    except ValueError:
        return (1, 0.0, v)


def _split(v: list[str] | str | None) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        v = v.split(",")
    return [str(x).strip() for x in v if str(x).strip()]


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
    avail = ", ".join(c for c in table.columns if c not in NON_MEASURE) or "none"
    raise ConfigError(f"{option} {name!r}: no column {name} or hp_{name} in {table.name} (columns: {avail})")


def _axes(table: ResultsTable, by: list[str], notes: list[str]) -> dict[str, str]:
    """Axis name -> column: the ``--by`` columns, else every ``hp_*`` column that forms a grid axis."""
    if by:
        out: dict[str, str] = {}
        for b in by:
            ax, col = resolve_column(table, b, "--by")
            out.setdefault(ax, col)
        return out
    out = {}
    for col in table.hp_columns:
        vals = table.strings(col)
        distinct = len(set(vals))
        if distinct < 2:
            notes.append(f"hyperparameter {col[3:]} is constant: not an axis")
        elif distinct == len(vals) and len(vals) > 2:
            notes.append(f"hyperparameter {col[3:]} differs on every checkpoint: not a grid axis (use --by to force)")
        else:
            out[col[3:]] = col
    return out


def _measures(table: ResultsTable, measures: list[str], target: str, axis_cols: set[str],
              notes: list[str]) -> tuple[list[str], str]:
    """The measure columns and where they came from (see the module docstring)."""
    numeric = numeric_columns(table)
    if measures:
        for m in measures:
            if m not in table.columns:
                raise ConfigError(f"-m {m!r}: no column {m} in {table.name} (numeric columns: {', '.join(numeric) or 'none'})")
            values = table.frame[m]
            if values.notna().any() and pd.to_numeric(values, errors="coerce").isna().all():
                raise ConfigError(f"-m {m!r}: column {m} of {table.name} holds no numbers")
        return list(dict.fromkeys(measures)), "-m"
    if table.measures:
        return list(table.measures), table.measures_source
    cols = set(table.columns)
    taken = [c for c in numeric
             if c != target and c not in NON_MEASURE and c not in axis_cols and not c.startswith("hp_")
             and not re.fullmatch(r"Unnamed: \d+", c)
             and not (c.endswith("_stderr") and c[: -len("_stderr")] in cols)]
    if not taken:
        raise ConfigError(
            f"{table.name} holds no measure columns: name them with -m "
            f"(numeric columns: {', '.join(numeric) or 'none'})"
        )
    notes.append(
        "no flatcli metadata (results.json or X_status columns): took every numeric column that is not the "
        f"target, a metric or a hyperparameter as a measure: {', '.join(taken)} (choose with -m)"
    )
    return taken, "numeric columns"


def usable(table: ResultsTable, measure: str, target: str) -> np.ndarray:
    """Rows where the measure and the target are finite and the measure did not fail."""
    ok = np.isfinite(table.numeric(measure)) & np.isfinite(table.numeric(target))
    if f"{measure}_status" in table.columns:
        ok &= np.array([s != "error" for s in table.strings(f"{measure}_status")], dtype=bool)
    return ok


def min_resamples(confidence: float) -> int:
    """The fewest bootstrap resamples whose percentile interval at level ``confidence`` has at least
    2.5 resamples beyond each end: ⌈5 / (1 − confidence)⌉ (100 for 95%)."""
    return math.ceil(5 / (1 - confidence) - 1e-9)


def _check_options(
    sort: str | None, bootstrap: int | None, confidence: float, max_train_loss: float | None
) -> None:
    """`ConfigError` for an unknown ``sort``, negative resamples, a confidence level outside
    (0, 1) or a negative (or NaN) ``max_train_loss``."""
    if sort is not None and sort not in STATS:
        raise ConfigError(f"--sort must be one of {', '.join(STATS)}; got {sort!r}")
    if bootstrap is not None and bootstrap < 0:
        raise ConfigError(f"--bootstrap must be ≥ 0 resamples; got {bootstrap}")
    if not 0 < confidence < 1:
        raise ConfigError(f"--confidence must be in (0, 1); got {confidence}")
    least = min_resamples(confidence)
    if bootstrap and bootstrap < least:
        raise ConfigError(
            f"--bootstrap {bootstrap}: a {confidence:.0%} percentile interval needs at least {least} resamples "
            f"(5 / (1 − confidence): 2.5 beyond each end); 1000 is usual"
        )
    if max_train_loss is not None and not max_train_loss >= 0:
        raise ConfigError(f"--max-train-loss must be ≥ 0; got {max_train_loss}")


def _check_target(table: ResultsTable, target: str) -> None:
    """`ConfigError` naming the metric columns present when ``target`` is not a column."""
    if target not in table.columns:
        avail = ", ".join(c for c in table.columns if c in METRICS) or "none"
        hint = "; gen_gap needs test data in the config (data.test)" if target == "gen_gap" else ""
        raise ConfigError(
            f"--target {target!r} is not a column of {table.name} (metric columns present: {avail}){hint}"
        )


@dataclass
class _Design:
    """What every measure is correlated against: the (filtered) table, the target and its values
    ``gvals``, the hyperparameter axes with every row's value of each (``hp``, labels, "" when
    missing) and ``hp_ok``, the rows that have a value on every axis."""

    table: ResultsTable
    target: str
    gvals: np.ndarray
    axes: list[str]
    hp: dict[str, list[str]]
    hp_ok: np.ndarray

    def grid(self) -> GridInfo | None:
        """The grid the rows with every axis's value form; None without axes."""
        if not self.axes:
            return None
        rows = {a: [v for v, ok in zip(self.hp[a], self.hp_ok, strict=True) if ok] for a in self.axes}
        return _grid(rows, self.axes)


def _design(
    table: ResultsTable, target: str, axis_columns: dict[str, str], notes: list[str]
) -> _Design:
    """The target's values and the axes' values; `ConfigError` when the target holds no numbers;
    notes for rows without a finite target and rows without a value on an axis."""
    axes = list(axis_columns)
    hp = {a: table.strings(axis_columns[a]) for a in axes}
    gvals = table.numeric(target)
    if not np.isfinite(gvals).any() and len(gvals) and not pd.api.types.is_numeric_dtype(table.frame[target]):
        raise ConfigError(f"--target {target!r}: column {target} of {table.name} holds no numbers")
    n_target_missing = int((~np.isfinite(gvals)).sum())
    if n_target_missing:
        notes.append(f"{n_target_missing} of {len(gvals)} checkpoints have no finite {target}: left out")
    hp_ok = np.ones(len(gvals), dtype=bool)
    for a in axes:
        miss = np.array([v == "" for v in hp[a]], dtype=bool)
        if miss.any():
            notes.append(f"{int(miss.sum())} checkpoints have no value for hyperparameter {a}: left out of Ψ and CMI")
        hp_ok &= ~miss
    return _Design(table, target, gvals, axes, hp, hp_ok)


def _design_notes(design: _Design, grid: GridInfo | None, notes: list[str]) -> None:
    """Notes on the grid (incomplete, pooled duplicates), on one or no axis, and on a constant
    target."""
    axes, gvals = design.axes, design.gvals
    if grid is not None and not grid.complete:
        notes.append(
            f"incomplete grid over {', '.join(axes)}: {grid.observed} of {grid.expected} combinations present"
            + (f" (missing e.g. {'; '.join(grid.missing[:3])})" if grid.missing else "")
        )
    if grid is not None and grid.duplicates:
        notes.append(f"{grid.duplicates} hyperparameter combination(s) hold several checkpoints (e.g. seeds): pooled in their groups")
    if len(axes) == 1:
        notes.append(f"one hyperparameter axis: CMI conditions on {axes[0]} alone")
    elif not axes:
        notes.append("no hyperparameter axes (name them with --by): Ψ undefined, CMI unconditional")
    if np.isfinite(gvals).sum() >= 2 and np.nanstd(gvals) == 0:
        notes.append(f"{design.target} is constant over the checkpoints: no statistic is defined")


@dataclass(frozen=True)
class _Bootstrap:
    """Bootstrap settings: ``resamples`` (None or 0: no intervals), ``seed`` and ``confidence``."""

    resamples: int | None
    seed: int
    confidence: float


def _correlate_measure(
    design: _Design, measure: str, boot: _Bootstrap
) -> tuple[MeasureCorrelation, np.ndarray]:
    """Every statistic of one measure, and the mask of the rows it used (`usable`)."""
    ok = usable(design.table, measure, design.target)
    mvals, gvals = design.table.numeric(measure), design.gvals
    mc = MeasureCorrelation(measure=measure, n=int(ok.sum()))
    dropped = int((np.isfinite(gvals) & ~ok).sum())
    if dropped:
        mc.notes.append(f"{dropped} checkpoint(s) without a value")
    _pair_statistics(mc, mvals[ok], gvals[ok], boot)
    sel = ok & design.hp_ok
    sub = {a: [v for v, s in zip(design.hp[a], sel, strict=True) if s] for a in design.axes}
    _grouped_statistics(mc, mvals[sel], gvals[sel], sub, design.axes)
    return mc, ok


def _pair_statistics(mc: MeasureCorrelation, m: np.ndarray, g: np.ndarray, boot: _Bootstrap) -> None:
    """Jiang's τ (n ≥ 2); Pearson, Spearman, Kendall τ-b and their bootstrap intervals (n ≥ 3 and
    neither column constant); a note where they are undefined."""
    if mc.n >= 2:
        mc.jiang_tau = jiang_tau(m, g)
    if mc.n < 3:
        mc.notes.append(f"only {mc.n} checkpoint(s): correlations need ≥ 3")
    elif np.ptp(m) == 0:
        mc.notes.append("constant over the checkpoints")
    elif np.ptp(g) > 0:
        mc.pearson, mc.spearman, mc.kendall_tau_b = (float(v) for v in _scipy_stats(m, g))
        if boot.resamples:
            mc.intervals, undefined = bootstrap_intervals(m, g, boot.resamples, boot.seed, boot.confidence)
            if undefined:
                mc.notes.append(f"bootstrap: {undefined} of {boot.resamples} resamples had a constant column "
                                "(statistics undefined): intervals from the others")


def _grouped_statistics(
    mc: MeasureCorrelation, m: np.ndarray, g: np.ndarray, hp: dict[str, list[str]], axes: list[str]
) -> None:
    """Ψ with every ψ_i (with axes) and the CMI score over the rows with every axis's value
    (n ≥ 2); a note where they are undefined."""
    if mc.n < 2:
        return
    if axes:
        mc.psi, mc.psi_axes = granulated_kendall(m, g, hp, axes)
        flat = [a for a, p in mc.psi_axes.items() if not math.isfinite(p.psi)]
        if flat:
            mc.notes.append(f"ψ undefined for {', '.join(flat)} (no group with ≥ 2 checkpoints)")
    c = conditional_mi(m, g, hp, axes)
    mc.cmi, mc.cmi_condition, mc.cmi_pairs = c.value, c.condition, c.pairs
    if c.pairs and not math.isfinite(c.value):
        mc.notes.append("CMI undefined: the conditioning hyperparameters determine the gap order")


def _rank_key(mc: MeasureCorrelation, sort: str) -> tuple:
    """Sort key: larger ``sort`` statistic first, undefined ones last; ties (equal to 12 digits, as
    Ψ's means of a few group τs often are) broken by the larger Kendall τ-b, then by name."""

    def desc(v: float) -> tuple[int, float]:
        return (0, -round(v, 12)) if math.isfinite(v) else (1, 0.0)

    return (*desc(mc.get(sort)), *desc(mc.kendall_tau_b), mc.measure)


def correlate_table(
    table: ResultsTable | pd.DataFrame,
    *,
    target: str = "gen_gap",
    by: list[str] | str | None = None,
    sort: str | None = None,
    measures: list[str] | str | None = None,
    where: str | None = None,
    max_train_loss: float | None = None,
    bootstrap: int | None = None,
    seed: int = 0,
    confidence: float = 0.95,
    progress: Callable[[int, int], None] | None = None,
) -> CorrelationReport:
    """Every statistic of the module docstring for every measure of ``table``, ranked by ``sort``.

    ``where``/``max_train_loss`` filter the rows first (`filter_rows`); ``bootstrap`` N adds
    percentile intervals from N resamples (seeded by ``seed``) at level ``confidence``.
    ``progress(done, total)`` is called after each measure (the bootstrap takes seconds each).
    """
    table = as_table(table)
    _check_options(sort, bootstrap, confidence, max_train_loss)
    n_input = len(table.frame)
    notes: list[str] = []
    _check_target(table, target)
    table, filters = filter_rows(table, where=where, max_train_loss=max_train_loss)
    notes += [f.describe() for f in filters]
    axis_columns = _axes(table, _split(by), notes)
    axes = list(axis_columns)
    labels, measures_source = _measures(
        table, _split(measures), target, set(axis_columns.values()), notes
    )
    design = _design(table, target, axis_columns, notes)
    grid = design.grid()
    _design_notes(design, grid, notes)
    if sort is None:
        sort = "psi" if axes else "kendall_tau_b"
    boot = _Bootstrap(bootstrap, seed, confidence)
    results = []
    used_rows = np.zeros(len(design.gvals), dtype=bool)
    for k, lab in enumerate(labels, 1):
        mc, ok = _correlate_measure(design, lab, boot)
        used_rows |= ok
        results.append(mc)
        if progress is not None:
            progress(k, len(labels))
    results.sort(key=lambda mc: _rank_key(mc, sort))
    cmi_check = _cmi_check(design)
    warns = [w for w in (convergence_warning(table, used_rows), cmi_check.warning() if cmi_check else "") if w]
    return CorrelationReport(
        source=table.path, target=target, axes=axes, measures=results, sort=sort, grid=grid,
        n_rows=len(table.frame), measures_source=measures_source, notes=notes, axis_columns=axis_columns,
        n_input=n_input, filters=filters, warnings=warns, bootstrap=int(bootstrap or 0),
        confidence=confidence, seed=seed, table=table, cmi_check=cmi_check,
    )


def _cmi_check(design: _Design) -> CMICheck | None:
    """`check_cmi_grid` over the rows with a finite target and every axis's value."""
    sel = design.hp_ok & np.isfinite(design.gvals)
    hp = {a: [v for v, s in zip(design.hp[a], sel, strict=True) if s] for a in design.axes}
    return check_cmi_grid(design.gvals[sel], hp, design.axes)
