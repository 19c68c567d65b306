r"""Paired comparison of two measures' correlations with the gap, over the same checkpoints.

Does measure A predict the generalization gap better than measure B, or can the
checkpoints at hand not tell? For each statistic s ∈ {Kendall τ-b, Spearman,
Pearson}, the difference :math:`d = s(A, g) - s(B, g)` of the two correlations
with the target g (signed: every flatcli measure is oriented so that larger
predicts a larger gap) is bootstrapped *over checkpoints*: each of ``bootstrap``
resamples draws n checkpoints with replacement (numpy ``default_rng(seed)``:
reproducible) and recomputes both correlations on the *same* resampled rows, so
the dependence between the two correlations (they share g, and A and B are
usually correlated) is kept. Reported per statistic:

* the observed difference and the percentile interval of the resampled
  differences at level ``confidence`` (resamples where a statistic is undefined,
  a constant resampled column, are left out and counted);
* ``p_value``: the two-sided bootstrap fraction
  :math:`\min(1, 2\min(P^*(d^* \le 0), P^*(d^* \ge 0)))`, a p-value-like
  summary of how often the resampled difference reaches 0 (not an exact test);
* ``verdict``: "A ranks above B" when the interval lies above 0, "B ranks above
  A" when below, "tied" when it contains 0;
* for Pearson also Zou's (2007) interval for two dependent overlapping
  correlations, from Fisher-z intervals of r_A, r_B and r_AB = corr(A, B)
  (Zou, G. Y., "Toward using confidence intervals to compare correlations",
  Psychological Methods 12(4), 399–413, 2007; their example r = 0.396 and 0.179,
  r_AB = 0.088, n = 66 gives [−0.093, 0.517]).

Only rows where A, B and the target are all finite (and neither measure failed)
are used: both correlations are over the same models. Everything is in
`compare_measures` (``flatcli.compare``), which returns a DataFrame.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pandas as pd

from ..errors import ConfigError
from .statistics import kendall_rows, pearson_rows, spearman_rows
from .table import as_table, filter_rows, usable
from .targets import resolve_target

STATISTICS = ("kendall_tau_b", "spearman", "pearson")


_ROWS = {"kendall_tau_b": kendall_rows, "spearman": spearman_rows, "pearson": pearson_rows}


def zou_interval(
    r_a: float, r_b: float, r_ab: float, n: int, confidence: float = 0.95
) -> tuple[float, float]:
    r"""Zou's (2007) interval for :math:`r_A - r_B`, two correlations with a common variable g
    (dependent, overlapping), :math:`r_{AB}` the correlation of A and B, n observations.

    With Fisher-z intervals :math:`(l_i, u_i) = \tanh(\operatorname{atanh} r_i \mp z/\sqrt{n-3})` and
    :math:`c = \frac{(r_{AB} - \frac12 r_A r_B)(1 - r_A^2 - r_B^2 - r_{AB}^2) + r_{AB}^3}{(1 - r_A^2)(1 - r_B^2)}`,

    .. math:: L = r_A - r_B - \sqrt{(r_A - l_A)^2 + (u_B - r_B)^2 - 2c(r_A - l_A)(u_B - r_B)},
    .. math:: U = r_A - r_B + \sqrt{(u_A - r_A)^2 + (r_B - l_B)^2 - 2c(u_A - r_A)(r_B - l_B)}.

    NaN when n ≤ 3 or a correlation is ±1."""
    if n <= 3 or max(abs(r_a), abs(r_b)) >= 1:
        return math.nan, math.nan
    z = NormalDist().inv_cdf(0.5 + confidence / 2) / math.sqrt(n - 3)
    la, ua = math.tanh(math.atanh(r_a) - z), math.tanh(math.atanh(r_a) + z)
    lb, ub = math.tanh(math.atanh(r_b) - z), math.tanh(math.atanh(r_b) + z)
    c = ((r_ab - 0.5 * r_a * r_b) * (1 - r_a**2 - r_b**2 - r_ab**2) + r_ab**3) / (
        (1 - r_a**2) * (1 - r_b**2)
    )
    d = r_a - r_b
    lo = d - math.sqrt(
        max(0.0, (r_a - la) ** 2 + (ub - r_b) ** 2 - 2 * c * (r_a - la) * (ub - r_b))
    )
    hi = d + math.sqrt(
        max(0.0, (ua - r_a) ** 2 + (r_b - lb) ** 2 - 2 * c * (ua - r_a) * (r_b - lb))
    )
    return lo, hi


def paired_bootstrap(
    a: np.ndarray, b: np.ndarray, g: np.ndarray, resamples: int, seed: int = 0
) -> dict[str, np.ndarray]:
    """Per statistic, the resampled differences s(a*, g*) − s(b*, g*) over ``resamples`` draws of the rows with
    replacement (the same rows for both measures; ``default_rng(seed)``); NaN where undefined."""
    n = len(g)
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    A, B, G = a[idx], b[idx], g[idx]
    return {s: _ROWS[s](A, G) - _ROWS[s](B, G) for s in STATISTICS}


def _verdict(lo: float, hi: float, a: str, b: str) -> str:
    if lo > 0:
        return f"{a} ranks above {b}"
    if hi < 0:
        return f"{b} ranks above {a}"
    return "tied" if math.isfinite(lo) and math.isfinite(hi) else "undefined"


def _row(stat, va, vb, diffs, confidence, names) -> dict:
    ok = np.isfinite(diffs)
    d = diffs[ok]
    alpha = (1 - confidence) / 2
    lo, hi = (
        (float(q) for q in np.quantile(d, [alpha, 1 - alpha])) if len(d) else (math.nan, math.nan)
    )
    p = min(1.0, 2 * min(float((d <= 0).mean()), float((d >= 0).mean()))) if len(d) else math.nan
    return {
        "statistic": stat,
        "measure_a": names[0],
        "measure_b": names[1],
        "a": va,
        "b": vb,
        "difference": va - vb,
        "lo": lo,
        "hi": hi,
        "confidence": confidence,
        "p_value": p,
        "resamples": int(ok.sum()),
        "undefined_resamples": int((~ok).sum()),
        "verdict": _verdict(lo, hi, *names),
    }


def compare_measures(
    data,
    a: str,
    b: str,
    *,
    target: str | None = None,
    bootstrap: int = 2000,
    seed: int = 0,
    confidence: float = 0.95,
    where: str | None = None,
    max_train_loss: float | None = None,
) -> pd.DataFrame:
    """Paired bootstrap comparison of the correlations of measures ``a`` and ``b`` with ``target``
    (module docstring; ``target`` as in `flatcli.correlate`: a column, a derived gap or an
    expression of columns, default the loss's gap). ``data``: a results CSV path, a DataFrame or a `ResultsTable`; ``where``
    and ``max_train_loss`` filter rows as in `flatcli.correlate`.

    Returns one row per statistic (kendall_tau_b, spearman, pearson) with columns ``statistic,
    measure_a, measure_b, n, a, b, difference, lo, hi, confidence, p_value, resamples,
    undefined_resamples, verdict, zou_lo, zou_hi`` (Zou's interval for Pearson only; NaN otherwise).

    Example: ``flatcli.compare("results.csv", "relative_flatness", "hessian_trace", bootstrap=2000)``.
    """
    if a == b:
        raise ConfigError(f"`compare` needs two different measures. Got {a!r} twice instead.")
    if bootstrap < 1:
        raise ConfigError(
            f"`bootstrap` must be ≥ 1 resample for `compare`. Got {bootstrap} instead."
        )
    if not 0 < confidence < 1:
        raise ConfigError(f"`confidence` must be in (0, 1). Got {confidence} instead.")

    table, target, _ = resolve_target(as_table(data), target)
    table, _ = filter_rows(table, where=where, max_train_loss=max_train_loss)
    for col, what in ((a, "--compare"), (b, "--compare")):
        if col not in table.columns:
            raise ConfigError(f"{what} {col!r}: no column {col} in {table.name}")
    ok = usable(table, a, target) & usable(table, b, target)
    va, vb, g = table.numeric(a)[ok], table.numeric(b)[ok], table.numeric(target)[ok]
    n = int(ok.sum())
    if n < 3:
        raise ConfigError(
            f"`compare` {a},{b}: needs ≥ 3 checkpoints with both values and {target}; "
            f"{table.name} has {n} usable rows"
        )
    flat = [col for col, v in ((target, g), (a, va), (b, vb)) if np.ptp(v) == 0]
    if flat:
        raise ConfigError(
            f"`compare` {a},{b}: {', '.join(flat)} is constant over the {n} usable rows of "
            f"{table.name}: no correlation to compare"
        )
    diffs = paired_bootstrap(va, vb, g, bootstrap, seed)
    rows = []
    for s in STATISTICS:
        ra, rb = (float(_ROWS[s](v[None], g[None])[0]) for v in (va, vb))
        row = _row(s, ra, rb, diffs[s], confidence, (a, b))
        row["zou_lo"], row["zou_hi"] = (
            zou_interval(ra, rb, float(pearson_rows(va[None], vb[None])[0]), n, confidence)
            if s == "pearson"
            else (math.nan, math.nan)
        )
        rows.append({**row, "n": n})
    cols = [
        "statistic",
        "measure_a",
        "measure_b",
        "n",
        "a",
        "b",
        "difference",
        "lo",
        "hi",
        "confidence",
        "p_value",
        "resamples",
        "undefined_resamples",
        "verdict",
        "zou_lo",
        "zou_hi",
    ]
    return pd.DataFrame(rows)[cols]


def compare_pair(compare) -> tuple[str, str]:
    """``"A,B"`` (or a pair) as the two measures of ``--compare``; `ConfigError` otherwise."""
    names = (
        [x.strip() for x in compare.split(",") if x.strip()]
        if isinstance(compare, str)
        else [str(x) for x in compare]
    )
    if len(names) != 2:
        raise ConfigError(f"`compare` must be two measures as A,B. Got {compare!r} instead.")
    return names[0], names[1]


def describe(df: pd.DataFrame) -> list[str]:
    """One line per statistic of a `compare_measures` table, for the command line."""
    lines = []
    for r in df.itertuples():
        zou = (
            f"; Zou (2007) [{r.zou_lo:+.3f}, {r.zou_hi:+.3f}]"
            if r.statistic == "pearson" and math.isfinite(r.zou_lo)
            else ""
        )
        p = (
            f"p ≈ {r.p_value:.2g}"
            if r.p_value > 0 or r.resamples == 0
            else f"p < {1 / r.resamples:.1g}"
        )
        lines.append(
            f"{r.statistic}: {r.measure_a} {r.a:+.3f} − {r.measure_b} {r.b:+.3f} = {r.difference:+.3f}, "
            f"{100 * r.confidence:g}% interval [{r.lo:+.3f}, {r.hi:+.3f}] ({r.resamples} resamples, "
            f"{p}, n = {r.n}){zou}: {r.verdict}"
        )
    return lines
