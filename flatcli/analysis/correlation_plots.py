"""Plots of a correlation report (matplotlib's Agg canvas, no pyplot: headless and thread-safe;
``pip install 'flatcli[plot]'``).

* ``scatter_<measure>.png``: the measure against the target, one point per checkpoint used,
  coloured by one hyperparameter (``color_by``, default the first axis) and marked by another
  (``marker_by``, default the second axis), with error bars from the ``<measure>_stderr``
  (and ``<target>_stderr``) columns when the table has them; Kendall τ-b and Ψ in the title.
  ``scatter_all.png`` puts every measure on one page.
* ``psi_heatmap.png``: ψ_i per measure (rows, ranked) × hyperparameter axis (columns), and Ψ.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from .correlation import CorrelationReport
from .table import ResultsTable, _natural, resolve_column, usable

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p")


def _figure(**kwargs):
    """A matplotlib Figure on an Agg canvas."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("`plots` needs matplotlib: pip install 'flatcli[plot]'") from None
    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


def _colormap(name: str, n: int | None = None):
    import matplotlib

    cmap = matplotlib.colormaps[name]
    return cmap.resampled(n) if n is not None else cmap


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _fmt(v: float) -> str:
    return "nan" if not math.isfinite(v) else f"{v:+.2f}"


def _levels(table: ResultsTable, col: str | None, ok: np.ndarray) -> tuple[list[str], list[str]]:
    if col is None:
        return [""] * len(ok), [""]
    vals = table.strings(col)
    return vals, sorted({v for v, k in zip(vals, ok, strict=True) if k}, key=_natural)


def _stderr(table: ResultsTable, col: str) -> np.ndarray | None:
    if f"{col}_stderr" not in table.columns:
        return None
    e = np.abs(table.numeric(f"{col}_stderr"))
    return np.where(np.isfinite(e), e, 0.0)


def _scatter(
    ax,
    table: ResultsTable,
    report: CorrelationReport,
    mc,
    color: tuple[str, str] | None,
    marker: tuple[str, str] | None,
) -> None:
    """One measure against the target; ``color``/``marker`` are (axis name, column) or None."""
    from matplotlib.lines import Line2D

    m, g = table.numeric(mc.measure), table.numeric(report.target)
    ok = usable(table, mc.measure, report.target)
    xerr, yerr = _stderr(table, mc.measure), _stderr(table, report.target)
    if (xerr is not None or yerr is not None) and ok.any():
        ax.errorbar(
            m[ok],
            g[ok],
            xerr=None if xerr is None else xerr[ok],
            yerr=None if yerr is None else yerr[ok],
            fmt="none",
            ecolor="0.55",
            elinewidth=0.7,
            capsize=1.5,
            zorder=1,
        )
    cvals, clevels = _levels(table, color[1] if color else None, ok)
    mvals, mlevels = _levels(table, marker[1] if marker else None, ok)
    cmap = _colormap("viridis", max(2, len(clevels)))
    for ci, clev in enumerate(clevels):
        for mi, mlev in enumerate(mlevels):
            sel = ok & np.array(
                [c == clev and k == mlev for c, k in zip(cvals, mvals, strict=True)], dtype=bool
            )
            if sel.any():
                ax.scatter(
                    m[sel],
                    g[sel],
                    color=cmap(ci) if color else "C0",
                    marker=MARKERS[mi % len(MARKERS)],
                    s=28,
                    edgecolors="k",
                    linewidths=0.3,
                    zorder=2,
                )
    handles = []
    if color:
        handles += [
            Line2D(
                [],
                [],
                ls="",
                marker="o",
                color=cmap(ci),
                markeredgecolor="k",
                markeredgewidth=0.3,
                label=f"{color[0]}={lev}",
            )
            for ci, lev in enumerate(clevels)
        ]
    if marker:
        handles += [
            Line2D(
                [],
                [],
                ls="",
                marker=MARKERS[mi % len(MARKERS)],
                color="0.6",
                markeredgecolor="k",
                markeredgewidth=0.3,
                label=f"{marker[0]}={lev}",
            )
            for mi, lev in enumerate(mlevels)
        ]
    if handles:
        ax.legend(handles=handles, fontsize=6, loc="best")
    if ok.sum() and np.all(m[ok] > 0) and m[ok].max() / m[ok].min() > 100:
        ax.set_xscale("log")
    psi = f", Ψ={_fmt(mc.psi)}" if report.axes else ""
    ax.set_title(f"{mc.measure}: τ={_fmt(mc.kendall_tau_b)}{psi} (n={mc.n})", fontsize=8)
    ax.set_xlabel(mc.measure, fontsize=7)
    ax.set_ylabel(report.target, fontsize=7)
    ax.tick_params(labelsize=6)


def _encoding(
    report: CorrelationReport,
    table: ResultsTable,
    name: str | None,
    option: str,
    avoid: str | None = None,
) -> tuple[str, str] | None:
    """(axis name, column) for --color-by/--marker-by: the named column (resolved as for --by),
    else the report's first axis whose column is not ``avoid``, else None; ``"none"`` turns
    the encoding off."""
    if name is None:
        for ax in report.axes:
            col = report.axis_columns.get(ax, f"hp_{ax}")
            if col != avoid:
                return ax, col
        return None
    if name.lower() == "none":
        return None
    if name in report.axis_columns:
        return name, report.axis_columns[name]
    return resolve_column(table, name, option)


def plot_report(
    report: CorrelationReport,
    table: ResultsTable | None = None,
    outdir: str | Path = ".",
    color_by: str | None = None,
    marker_by: str | None = None,
) -> list[Path]:
    """Write every plot into ``outdir``; returns their paths. ``table`` defaults to the rows the
    report correlated (``report.table``)."""
    table = table if table is not None else report.table
    if table is None:
        raise ConfigError("plot_report needs the table the report was computed from")
    _figure()  # fails early with the install hint when matplotlib is missing
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    color = _encoding(report, table, color_by, "`color_by`")
    marker = _encoding(report, table, marker_by, "`marker_by`", avoid=color[1] if color else None)
    paths: list[Path] = []
    for mc in report.measures:
        fig = _figure(figsize=(4, 3.2), dpi=120)
        _scatter(fig.subplots(), table, report, mc, color, marker)
        fig.tight_layout()
        p = outdir / f"scatter_{_safe(mc.measure)}.png"
        fig.savefig(p)
        paths.append(p)
    k = len(report.measures)
    if k:
        ncol = min(4, k)
        nrow = math.ceil(k / ncol)
        fig = _figure(figsize=(3.2 * ncol, 2.7 * nrow), dpi=110)
        axes = fig.subplots(nrow, ncol, squeeze=False)
        for ax, mc in zip(axes.flat, report.measures, strict=False):
            _scatter(ax, table, report, mc, color, marker)
        for ax in list(axes.flat)[k:]:
            ax.axis("off")
        fig.tight_layout()
        p = outdir / "scatter_all.png"
        fig.savefig(p)
        paths.append(p)
    if report.axes and k:
        cols = list(report.axes) + ["Ψ"]
        data = np.array(
            [
                [mc.psi_axes[a].psi if a in mc.psi_axes else np.nan for a in report.axes] + [mc.psi]
                for mc in report.measures
            ]
        )
        fig = _figure(figsize=(1.1 * len(cols) + 2.5, 0.35 * k + 1.4), dpi=120)
        ax = fig.subplots()
        cmap = _colormap("RdBu_r").with_extremes(bad="0.85")
        im = ax.imshow(np.ma.masked_invalid(data), cmap=cmap, vmin=-1, vmax=1, aspect="auto")
        ax.set_xticks(range(len(cols)), cols, fontsize=8)
        ax.set_yticks(range(k), [mc.measure for mc in report.measures], fontsize=8)
        for r in range(k):
            for c in range(len(cols)):
                v = data[r, c]
                dark = math.isfinite(v) and abs(v) > 0.6
                ax.text(
                    c,
                    r,
                    "–" if not math.isfinite(v) else f"{v:+.2f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if dark else "black",
                )
        ax.set_title(f"granulated Kendall ψ_i vs {report.target}", fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.04)
        fig.tight_layout()
        p = outdir / "psi_heatmap.png"
        fig.savefig(p)
        paths.append(p)
    return paths
