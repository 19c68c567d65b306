"""How well does each measure predict the generalization gap? Rank correlations over checkpoints.

For a measure μ and the gap g (default ``gen_gap = train_acc − test_acc``) over the
checkpoints where both are finite (n of them):

* **Pearson** r, **Spearman** ρ and **Kendall τ-b** (``scipy.stats``; τ-b corrects for ties).
* **Jiang's τ** (Jiang et al. 2020, "Fantastic generalization measures and where to find
  them", ICLR, eq. 2), without tie correction:
  ``τ = 1/(n(n−1)) Σ_{i≠j} sign(μ_i − μ_j) sign(g_i − g_j)``.
* **Granulated Kendall Ψ** (Jiang et al. 2020, eq. 3–4): for each hyperparameter axis i,
  ``ψ_i`` is the mean, over the groups of checkpoints that share the values of every other
  axis, of Jiang's τ within the group (only axis i varies in it); ``Ψ = mean_i ψ_i``.
  Groups with fewer than two checkpoints carry no pair and are skipped (counted).
* **Conditional mutual information** as scored in the PGDL 2020 competition (Jiang et al.
  2020, NeurIPS competition report; "Fantastic...", §6): for ordered pairs of distinct
  checkpoints (i, j), ``V_μ = sign(μ_i − μ_j)`` and ``V_g = sign(g_i − g_j)``; ``U_S`` is the
  values of the hyperparameters S of both checkpoints. For every pair of axes S,
  ``Î_S = I(V_μ; V_g | U_S) / H(V_g | U_S)`` (conditional quantities weighted by the
  empirical probability of each cell of U_S); the score is ``min_S Î_S`` (a measure that
  only reads off a hyperparameter gets 0). Pairs with a tied gap carry no order and are
  dropped; ``V_μ`` keeps ties as a third value. With one axis S is that axis, with none
  the mutual information is unconditional.

Every statistic comes with the number of checkpoints (or groups, or pairs) it used.
Missing values, constant columns and incomplete hyperparameter grids become notes.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError

NON_MEASURE = {"checkpoint", "status", "error", "train_loss", "train_acc", "test_loss", "test_acc", "gen_gap"}
STATS = ("psi", "kendall_tau_b", "jiang_tau", "spearman", "pearson", "cmi")


# ------------------------------------------------------------------ the results table
@dataclass
class ResultsTable:
    """A results.csv read as strings, with the measure columns identified."""

    path: Path
    columns: list[str]
    rows: list[dict[str, str]]
    measures: list[str]
    measures_source: str  # "results.json" or "inferred (columns X with X_status)"

    def numeric(self, col: str) -> np.ndarray:
        out = np.full(len(self.rows), np.nan)
        for i, r in enumerate(self.rows):
            v = r.get(col, "")
            try:
                out[i] = float(v) if v not in ("", None) else np.nan
            except ValueError:
                out[i] = np.nan
        return out

    def strings(self, col: str) -> list[str]:
        return [str(r.get(col, "") or "") for r in self.rows]

    @property
    def hp_columns(self) -> list[str]:
        return [c for c in self.columns if c.startswith("hp_")]


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
    """The measure value columns: results.json's labels when beside the CSV, else every
    column X for which ``X_status`` exists (diagnostics, metrics and ``hp_*`` never count)."""
    if csv_path is not None:
        for j in (csv_path.with_suffix(".json"), csv_path.parent / "results.json"):
            if j.is_file():
                labels = _labels_from_json(j)
                if labels and all(lab in columns for lab in labels):
                    return labels, j.name
    cols = set(columns)
    labels = [c for c in columns if f"{c}_status" in cols and c not in NON_MEASURE and not c.startswith("hp_")]
    return labels, "inferred (columns X with X_status)"


def load_results(path: str | Path) -> ResultsTable:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"results file not found: {path}")
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        columns = list(reader.fieldnames or [])
        rows = list(reader)
    if not columns:
        raise ConfigError(f"{path} is empty (no header row)")
    measures, source = detect_measures(columns, path)
    return ResultsTable(path, columns, rows, measures, source)


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
    psi: float  # mean of Jiang's τ over the groups where only this axis varies
    groups: int  # groups used (≥ 2 checkpoints)
    n: int  # checkpoints in those groups
    skipped: int  # groups with fewer than 2 checkpoints


def granulated_kendall(
    m: np.ndarray, g: np.ndarray, hp: dict[str, list[str]], axes: list[str]
) -> tuple[float, dict[str, AxisPsi]]:
    """Granulated Kendall coefficient Ψ and every ψ_i (Jiang et al. 2020, eq. 3–4).

    ``hp[axis][k]`` is checkpoint k's value of that hyperparameter (as a string).
    Ψ is the mean of the finite ψ_i (nan when none is finite).
    """
    out: dict[str, AxisPsi] = {}
    n = len(m)
    for ax in axes:
        others = [a for a in axes if a != ax]
        groups: dict[tuple, list[int]] = {}
        for k in range(n):
            groups.setdefault(tuple(hp[a][k] for a in others), []).append(k)
        taus, used, skipped = [], 0, 0
        for idx in groups.values():
            if len(idx) < 2:
                skipped += 1
                continue
            taus.append(jiang_tau(m[idx], g[idx]))
            used += len(idx)
        out[ax] = AxisPsi(float(np.mean(taus)) if taus else math.nan, len(taus), used, skipped)
    finite = [a.psi for a in out.values() if math.isfinite(a.psi)]
    return (float(np.mean(finite)) if finite else math.nan), out


@dataclass
class CMI:
    value: float  # min over conditioning sets of I(Vμ;Vg|U)/H(Vg|U)
    condition: str  # the conditioning set that gave the minimum
    pairs: int  # ordered pairs used (distinct checkpoints, untied gap)
    per_condition: dict[str, float] = field(default_factory=dict)


def _codes(values: list[str]) -> tuple[np.ndarray, int]:
    uniq = {v: i for i, v in enumerate(sorted(set(values)))}
    return np.array([uniq[v] for v in values], dtype=np.int64), len(uniq)


def conditional_mi(m: np.ndarray, g: np.ndarray, hp: dict[str, list[str]], axes: list[str]) -> CMI:
    """PGDL-2020 conditional mutual information score (see the module docstring); natural log."""
    m, g = np.asarray(m, float), np.asarray(g, float)
    n = len(m)
    i, j = np.nonzero(~np.eye(n, dtype=bool))
    vg = _sign(g[i] - g[j])
    keep = vg != 0
    i, j, vg = i[keep], j[keep], vg[keep]
    vm = _sign(m[i] - m[j])
    npairs = len(i)
    if npairs == 0:
        return CMI(math.nan, "", 0)
    if len(axes) >= 2:
        conds = [tuple(c) for c in itertools.combinations(axes, 2)]
    else:
        conds = [tuple(axes)]
    codes = {a: _codes(hp[a]) for a in axes}
    per: dict[str, float] = {}
    for cond in conds:
        cell = np.zeros(npairs, dtype=np.int64)
        for a in cond:
            c, k = codes[a]
            cell = (cell * k + c[i]) * k + c[j]
        _, cell = np.unique(cell, return_inverse=True)
        ncell = int(cell.max()) + 1
        joint = np.zeros((ncell, 3, 2))  # V_μ ∈ {−1, 0, +1} × V_g ∈ {−1, +1}
        np.add.at(joint, (cell, vm + 1, (vg > 0).astype(np.int64)), 1.0)
        nu = joint.sum(axis=(1, 2))  # pairs per cell
        pa = joint.sum(axis=2)  # V_μ marginal per cell
        pb = joint.sum(axis=1)  # V_g marginal per cell
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = joint * nu[:, None, None] / (pa[:, :, None] * pb[:, None, :])
            mi = np.where(joint > 0, joint * np.log(ratio), 0.0).sum() / npairs
            h = -np.where(pb > 0, pb * np.log(pb / nu[:, None]), 0.0).sum() / npairs
        per[" × ".join(cond) or "(none)"] = float(mi / h) if h > 1e-15 else math.nan
    finite = {k: v for k, v in per.items() if math.isfinite(v)}
    if not finite:
        return CMI(math.nan, "", npairs, per)
    best = min(finite, key=finite.get)
    return CMI(max(0.0, finite[best]), best, npairs, per)


# ------------------------------------------------------------------ the report
@dataclass
class GridInfo:
    axes: list[str]
    values: dict[str, list[str]]
    expected: int  # product of the numbers of distinct values
    observed: int  # distinct combinations present
    duplicates: int  # combinations held by more than one checkpoint
    missing: list[str]  # a few missing combinations, rendered

    @property
    def complete(self) -> bool:
        return self.observed == self.expected


@dataclass
class MeasureCorrelation:
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
    notes: list[str] = field(default_factory=list)

    def get(self, stat: str) -> float:
        return getattr(self, stat)


@dataclass
class CorrelationReport:
    source: Path
    target: str
    axes: list[str]  # hyperparameter axes (without the hp_ prefix)
    measures: list[MeasureCorrelation]  # ranked
    sort: str
    grid: GridInfo | None
    n_rows: int
    measures_source: str
    notes: list[str] = field(default_factory=list)
    csv_path: Path | None = None  # correlations.csv, once written
    plots: list[Path] = field(default_factory=list)

    def to_rows(self) -> list[dict[str, Any]]:
        out = []
        for rank, mc in enumerate(self.measures, 1):
            d: dict[str, Any] = {
                "rank": rank, "measure": mc.measure, "n": mc.n, "pearson": mc.pearson, "spearman": mc.spearman,
                "kendall_tau_b": mc.kendall_tau_b, "jiang_tau": mc.jiang_tau, "psi": mc.psi,
            }
            for ax in self.axes:
                a = mc.psi_axes.get(ax)
                d[f"psi_{ax}"] = a.psi if a else math.nan
                d[f"psi_{ax}_groups"] = a.groups if a else 0
                d[f"psi_{ax}_n"] = a.n if a else 0
            d.update({"cmi": mc.cmi, "cmi_condition": mc.cmi_condition, "cmi_pairs": mc.cmi_pairs,
                      "notes": "; ".join(mc.notes)})
            out.append(d)
        return out


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


def _scipy_stats(m: np.ndarray, g: np.ndarray) -> tuple[float, float, float]:
    from scipy import stats

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pr = float(stats.pearsonr(m, g).statistic)
        sr = float(stats.spearmanr(m, g).statistic)
        kt = float(stats.kendalltau(m, g, variant="b").statistic)
    return pr, sr, kt


def correlate_table(
    table: ResultsTable,
    *,
    target: str = "gen_gap",
    by: list[str] | str | None = None,
    sort: str | None = None,
    measures: list[str] | None = None,
) -> CorrelationReport:
    """Every statistic of the module docstring for every measure of ``table``, ranked by ``sort``."""
    notes: list[str] = []
    if target not in table.columns:
        avail = ", ".join(c for c in table.columns if c in NON_MEASURE - {"checkpoint", "status", "error"}) or "none"
        raise ConfigError(
            f"--target {target!r} is not a column of {table.path} (metric columns present: {avail}); "
            "gen_gap needs test data in the config (data.test)"
        )
    labels = list(table.measures)
    if measures:
        unknown = [m for m in measures if m not in labels]
        if unknown:
            raise ConfigError(f"-m: {', '.join(unknown)} not among the measures of {table.path}: {', '.join(labels)}")
        labels = list(measures)
    if not labels:
        raise ConfigError(f"{table.path} holds no measure columns (a measure column X has an X_status column)")
    # hyperparameter axes
    if isinstance(by, str):
        by = [b.strip() for b in by.split(",") if b.strip()]
    hp_cols = table.hp_columns
    if by:
        axes = []
        for b in by:
            col = b if b.startswith("hp_") else f"hp_{b}"
            if col not in hp_cols:
                avail = ", ".join(c[3:] for c in hp_cols) or "none"
                raise ConfigError(f"--by {b!r}: no column {col} in {table.path} (hyperparameters: {avail})")
            axes.append(col[3:])
    else:
        axes = []
        for col in hp_cols:
            vals = table.strings(col)
            distinct = len(set(vals))
            if distinct < 2:
                notes.append(f"hyperparameter {col[3:]} is constant: not an axis")
            elif distinct == len(vals) and len(vals) > 2:
                notes.append(f"hyperparameter {col[3:]} differs on every checkpoint: not a grid axis (use --by to force)")
            else:
                axes.append(col[3:])
    hp = {a: table.strings(f"hp_{a}") for a in axes}
    gvals = table.numeric(target)
    n_target_missing = int((~np.isfinite(gvals)).sum())
    if n_target_missing:
        notes.append(f"{n_target_missing} of {len(gvals)} checkpoints have no finite {target}: left out")
    hp_ok = np.ones(len(gvals), dtype=bool)
    for a in axes:
        miss = np.array([v == "" for v in hp[a]])
        if miss.any():
            notes.append(f"{int(miss.sum())} checkpoints have no value for hyperparameter {a}: left out of Ψ and CMI")
        hp_ok &= ~miss
    grid = _grid({a: [v for v, ok in zip(hp[a], hp_ok, strict=True) if ok] for a in axes}, axes) if axes else None
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
        notes.append("no hyperparameter axes: Ψ undefined, CMI unconditional")
    if np.isfinite(gvals).sum() >= 2 and np.nanstd(gvals) == 0:
        notes.append(f"{target} is constant over the checkpoints: no statistic is defined")
    if sort is None:
        sort = "psi" if axes else "kendall_tau_b"
    if sort not in STATS:
        raise ConfigError(f"--sort must be one of {', '.join(STATS)}; got {sort!r}")

    results = []
    for lab in labels:
        mvals = table.numeric(lab)
        status = table.strings(f"{lab}_status") if f"{lab}_status" in table.columns else [""] * len(mvals)
        ok = np.isfinite(mvals) & np.isfinite(gvals) & np.array([s != "error" for s in status])
        mc = MeasureCorrelation(measure=lab, n=int(ok.sum()))
        dropped = int((np.isfinite(gvals) & ~ok).sum())
        if dropped:
            mc.notes.append(f"{dropped} checkpoint(s) without a value")
        m, g = mvals[ok], gvals[ok]
        if mc.n >= 2:
            mc.jiang_tau = jiang_tau(m, g)
        if mc.n < 3:
            mc.notes.append(f"only {mc.n} checkpoint(s): correlations need ≥ 3")
        elif np.ptp(m) == 0:
            mc.notes.append("constant over the checkpoints")
        elif np.ptp(g) > 0:
            mc.pearson, mc.spearman, mc.kendall_tau_b = _scipy_stats(m, g)
        if mc.n >= 2 and axes:
            sel = ok & hp_ok
            sub = {a: [v for v, s in zip(hp[a], sel, strict=True) if s] for a in axes}
            mc.psi, mc.psi_axes = granulated_kendall(mvals[sel], gvals[sel], sub, axes)
            flat = [a for a, p in mc.psi_axes.items() if not math.isfinite(p.psi)]
            if flat:
                mc.notes.append(f"ψ undefined for {', '.join(flat)} (no group with ≥ 2 checkpoints)")
        if mc.n >= 2:
            sel = ok & hp_ok
            sub = {a: [v for v, s in zip(hp[a], sel, strict=True) if s] for a in axes}
            c = conditional_mi(mvals[sel], gvals[sel], sub, axes)
            mc.cmi, mc.cmi_condition, mc.cmi_pairs = c.value, c.condition, c.pairs
            if c.pairs and not math.isfinite(c.value):
                mc.notes.append("CMI undefined: the conditioning hyperparameters determine the gap order")
        results.append(mc)

    def key(mc: MeasureCorrelation):
        v = mc.get(sort)
        return (0, -v) if math.isfinite(v) else (1, 0.0)

    results.sort(key=key)
    return CorrelationReport(
        source=table.path, target=target, axes=axes, measures=results, sort=sort, grid=grid,
        n_rows=len(table.rows), measures_source=table.measures_source, notes=notes,
    )
