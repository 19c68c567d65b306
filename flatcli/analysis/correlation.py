"""How well does each measure predict the generalization gap? Rank correlations over checkpoints.

For a measure μ and the gap g over the checkpoints where both are finite (n of them); g is the
``target`` (`flatcli.analysis.targets`): by default ``gen_gap = train_acc − test_acc`` for
classifiers and ``loss_gap = test_loss − train_loss`` (per token) for language models:

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
(``where``, a condition on columns, `flatcli.analysis.expressions`; ``max_train_loss``) before anything is computed.
"""

import itertools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..errors import ConfigError
from .expressions import nearest
from .statistics import (
    CI_STATS,
    STATS,
    AxisPsi,
    CMICheck,
    Interval,
    _scipy_stats,
    bootstrap_intervals,
    check_cmi_grid,
    conditional_mi,
    granulated_kendall,
    jiang_tau,
)
from .table import (
    NON_MEASURE,
    FilterInfo,
    ResultsTable,
    _natural,
    as_table,
    convergence_warning,
    filter_rows,
    numeric_columns,
    resolve_column,
    usable,
)
from .targets import minimum_rule, resolve_target


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
    caption: str = ""  # what the target is: "target: loss_gap = test_loss − train_loss ..."

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
            d.update(
                {
                    "cmi": mc.cmi,
                    "cmi_condition": mc.cmi_condition,
                    "cmi_pairs": mc.cmi_pairs,
                    "notes": "; ".join(mc.notes),
                }
            )
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
    return GridInfo(
        axes, values, expected, len(combos), sum(c > 1 for c in combos.values()), missing
    )


def _split(v: list[str] | str | None) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        v = v.split(",")
    return [str(x).strip() for x in v if str(x).strip()]


def _axes(table: ResultsTable, by: list[str], notes: list[str]) -> dict[str, str]:
    """Axis name -> column: the ``--by`` columns, else every ``hp_*`` column that forms a grid axis."""
    if by:
        out: dict[str, str] = {}
        for b in by:
            ax, col = resolve_column(table, b, "`by`")
            out.setdefault(ax, col)
        return out
    out = {}
    for col in table.hp_columns:
        vals = table.strings(col)
        distinct = len(set(vals))
        if distinct < 2:
            notes.append(f"hyperparameter {col[3:]} is constant: not an axis")
        elif distinct == len(vals) and len(vals) > 2:
            notes.append(
                f"hyperparameter {col[3:]} differs on every checkpoint: not a grid axis (use --by to force)"
            )
        else:
            out[col[3:]] = col
    return out


def _measures(
    table: ResultsTable, measures: list[str], target: str, axis_cols: set[str], notes: list[str]
) -> tuple[list[str], str]:
    """The measure columns and where they came from (see the module docstring)."""
    numeric = numeric_columns(table)
    if measures:
        for m in measures:
            if m not in table.columns:
                raise ConfigError(
                    f"-m {m!r}: no column {m} in {table.name} "
                    f"({nearest(m, numeric, 'numeric columns')})"
                )
            values = table.frame[m]
            if values.notna().any() and pd.to_numeric(values, errors="coerce").isna().all():
                raise ConfigError(f"-m {m!r}: column {m} of {table.name} holds no numbers")
        return list(dict.fromkeys(measures)), "-m"
    if table.measures:
        return list(table.measures), table.measures_source
    cols = set(table.columns)
    taken = [
        c
        for c in numeric
        if c != target
        and c not in NON_MEASURE
        and c not in axis_cols
        and not c.startswith("hp_")
        and not re.fullmatch(r"Unnamed: \d+", c)
        and not (c.endswith("_stderr") and c[: -len("_stderr")] in cols)
    ]
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
        raise ConfigError(f"`sort` must be one of {', '.join(STATS)}. Got {sort!r} instead.")
    if bootstrap is not None and bootstrap < 0:
        raise ConfigError(f"`bootstrap` must be ≥ 0 resamples. Got {bootstrap} instead.")
    if not 0 < confidence < 1:
        raise ConfigError(f"`confidence` must be in (0, 1). Got {confidence} instead.")
    least = min_resamples(confidence)
    if bootstrap and bootstrap < least:
        raise ConfigError(
            f"`bootstrap` {bootstrap}: a {confidence:.0%} percentile interval needs at least {least} resamples "
            f"(5 / (1 − confidence): 2.5 beyond each end); 1000 is usual"
        )
    if max_train_loss is not None and not max_train_loss >= 0:
        raise ConfigError(f"`max_train_loss` must be ≥ 0. Got {max_train_loss} instead.")


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
        rows = {
            a: [v for v, ok in zip(self.hp[a], self.hp_ok, strict=True) if ok] for a in self.axes
        }
        return _grid(rows, self.axes)


def _design(
    table: ResultsTable, target: str, axis_columns: dict[str, str], notes: list[str]
) -> _Design:
    """The target's values and the axes' values; `ConfigError` when the target holds no numbers;
    notes for rows without a finite target and rows without a value on an axis."""
    axes = list(axis_columns)
    hp = {a: table.strings(axis_columns[a]) for a in axes}
    gvals = table.numeric(target)
    if (
        not np.isfinite(gvals).any()
        and len(gvals)
        and not pd.api.types.is_numeric_dtype(table.frame[target])
    ):
        raise ConfigError(f"`target` {target!r}: column {target} of {table.name} holds no numbers")
    n_target_missing = int((~np.isfinite(gvals)).sum())
    if n_target_missing:
        notes.append(
            f"{n_target_missing} of {len(gvals)} checkpoints have no finite {target}: left out"
        )
    hp_ok = np.ones(len(gvals), dtype=bool)
    for a in axes:
        miss = np.array([v == "" for v in hp[a]], dtype=bool)
        if miss.any():
            notes.append(
                f"{int(miss.sum())} checkpoints have no value for hyperparameter {a}: left out of Ψ and CMI"
            )
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
        notes.append(
            f"{grid.duplicates} hyperparameter combination(s) hold several checkpoints (e.g. seeds): pooled in their groups"
        )
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


def _pair_statistics(
    mc: MeasureCorrelation, m: np.ndarray, g: np.ndarray, boot: _Bootstrap
) -> None:
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
            mc.intervals, undefined = bootstrap_intervals(
                m, g, boot.resamples, boot.seed, boot.confidence
            )
            if undefined:
                mc.notes.append(
                    f"bootstrap: {undefined} of {boot.resamples} resamples had a constant column "
                    "(statistics undefined): intervals from the others"
                )


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
    target: str | None = None,
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

    ``target``: a column, a derived gap or an expression of columns (`flatcli.analysis.targets`);
    None: the table's loss's gap (``gen_gap`` for classifiers, ``loss_gap`` for language models).
    ``where``/``max_train_loss`` filter the rows first (`filter_rows`); ``bootstrap`` N adds
    percentile intervals from N resamples (seeded by ``seed``) at level ``confidence``.
    ``progress(done, total)`` is called after each measure (the bootstrap takes seconds each).
    """
    table = as_table(table)
    _check_options(sort, bootstrap, confidence, max_train_loss)
    n_input = len(table.frame)
    notes: list[str] = []
    table, target, caption = resolve_target(table, target)
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
    at_min = convergence_warning(table, used_rows) if minimum_rule(table.loss) else None
    warns = [w for w in (at_min, cmi_check.warning() if cmi_check else "") if w]
    return CorrelationReport(
        source=table.path,
        target=target,
        axes=axes,
        measures=results,
        sort=sort,
        grid=grid,
        n_rows=len(table.frame),
        measures_source=measures_source,
        notes=notes,
        axis_columns=axis_columns,
        n_input=n_input,
        filters=filters,
        warnings=warns,
        bootstrap=int(bootstrap or 0),
        confidence=confidence,
        seed=seed,
        table=table,
        cmi_check=cmi_check,
        caption=caption,
    )


def _cmi_check(design: _Design) -> CMICheck | None:
    """`check_cmi_grid` over the rows with a finite target and every axis's value."""
    sel = design.hp_ok & np.isfinite(design.gvals)
    hp = {a: [v for v, s in zip(design.hp[a], sel, strict=True) if s] for a in design.axes}
    return check_cmi_grid(design.gvals[sel], hp, design.axes)
