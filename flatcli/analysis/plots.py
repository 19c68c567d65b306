"""Plots of a correlation report (matplotlib, Agg backend: headless; ``pip install 'flatcli[plot]'``).

* ``scatter_<measure>.png``: the measure against the gap, one point per checkpoint,
  coloured by a hyperparameter, Kendall τ-b and Ψ in the title; ``scatter_all.png``
  puts every measure on one page.
* ``psi_heatmap.png``: ψ_i per measure (rows, ranked) × hyperparameter axis (columns), and Ψ.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from .correlation import CorrelationReport, ResultsTable, _natural


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--plots needs matplotlib: pip install 'flatcli[plot]'") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _fmt(v: float) -> str:
    return "nan" if not math.isfinite(v) else f"{v:+.2f}"


def _scatter(ax, table: ResultsTable, report: CorrelationReport, mc, color_by: str | None) -> None:
    m, g = table.numeric(mc.measure), table.numeric(report.target)
    ok = np.isfinite(m) & np.isfinite(g)
    if color_by:
        vals = table.strings(f"hp_{color_by}")
        levels = sorted(set(v for v, k in zip(vals, ok, strict=True) if k), key=_natural)
        cmap = _pyplot().get_cmap("viridis", max(2, len(levels)))
        for li, lev in enumerate(levels):
            sel = ok & np.array([v == lev for v in vals])
            ax.scatter(m[sel], g[sel], color=cmap(li), label=f"{color_by}={lev}", s=28, edgecolors="k", linewidths=0.3)
        ax.legend(fontsize=6, loc="best")
    else:
        ax.scatter(m[ok], g[ok], s=28, edgecolors="k", linewidths=0.3)
    if ok.sum() and np.all(m[ok] > 0) and m[ok].max() / m[ok].min() > 100:
        ax.set_xscale("log")
    psi = f", Ψ={_fmt(mc.psi)}" if report.axes else ""
    ax.set_title(f"{mc.measure}: τ={_fmt(mc.kendall_tau_b)}{psi} (n={mc.n})", fontsize=8)
    ax.set_xlabel(mc.measure, fontsize=7)
    ax.set_ylabel(report.target, fontsize=7)
    ax.tick_params(labelsize=6)


def plot_report(report: CorrelationReport, table: ResultsTable, outdir: str | Path,
                color_by: str | None = None) -> list[Path]:
    """Write every plot into ``outdir``; returns their paths."""
    plt = _pyplot()
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    if color_by is None and report.axes:
        color_by = report.axes[0]
    if color_by is not None and f"hp_{color_by}" not in table.columns:
        raise ConfigError(f"--color-by {color_by!r}: no column hp_{color_by}")
    paths: list[Path] = []
    for mc in report.measures:
        fig, ax = plt.subplots(figsize=(4, 3.2), dpi=120)
        _scatter(ax, table, report, mc, color_by)
        fig.tight_layout()
        p = outdir / f"scatter_{_safe(mc.measure)}.png"
        fig.savefig(p)
        plt.close(fig)
        paths.append(p)
    k = len(report.measures)
    if k:
        ncol = min(4, k)
        nrow = math.ceil(k / ncol)
        fig, axes = plt.subplots(nrow, ncol, figsize=(3.2 * ncol, 2.7 * nrow), dpi=110, squeeze=False)
        for ax, mc in zip(axes.flat, report.measures, strict=False):
            _scatter(ax, table, report, mc, color_by)
        for ax in list(axes.flat)[k:]:
            ax.axis("off")
        fig.tight_layout()
        p = outdir / "scatter_all.png"
        fig.savefig(p)
        plt.close(fig)
        paths.append(p)
    if report.axes and k:
        cols = list(report.axes) + ["Ψ"]
        data = np.array([[mc.psi_axes[a].psi if a in mc.psi_axes else np.nan for a in report.axes] + [mc.psi]
                         for mc in report.measures])
        fig, ax = plt.subplots(figsize=(1.1 * len(cols) + 2.5, 0.35 * k + 1.4), dpi=120)
        cmap = plt.get_cmap("RdBu_r").with_extremes(bad="0.85")
        im = ax.imshow(np.ma.masked_invalid(data), cmap=cmap, vmin=-1, vmax=1, aspect="auto")
        ax.set_xticks(range(len(cols)), cols, fontsize=8)
        ax.set_yticks(range(k), [mc.measure for mc in report.measures], fontsize=8)
        for r in range(k):
            for c in range(len(cols)):
                v = data[r, c]
                dark = math.isfinite(v) and abs(v) > 0.6
                ax.text(c, r, "–" if not math.isfinite(v) else f"{v:+.2f}", ha="center", va="center", fontsize=7,
                        color="white" if dark else "black")
        ax.set_title(f"granulated Kendall ψ_i vs {report.target}", fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.04)
        fig.tight_layout()
        p = outdir / "psi_heatmap.png"
        fig.savefig(p)
        plt.close(fig)
        paths.append(p)
    return paths
