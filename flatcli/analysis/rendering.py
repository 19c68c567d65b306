"""Rendering a `CorrelationReport`: the ranked terminal table, ``correlations.csv``, Markdown."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..console import Column, as_text, build_table
from ..run.results import atomic_write
from .correlation import CorrelationReport

TITLES = {
    "psi": "Ψ",
    "kendall_tau_b": "Kendall τ-b",
    "jiang_tau": "Jiang τ",
    "spearman": "Spearman",
    "pearson": "Pearson",
    "cmi": "CMI",
}


def _f(v: Any, signed: bool = True) -> str:
    if isinstance(v, float):
        if not math.isfinite(v):
            return "nan"
        return f"{v:+.3f}" if signed else f"{v:.3f}"
    return str(v)


def correlations_csv(report: CorrelationReport) -> str:
    """correlations.csv's text: `CorrelationReport.to_pandas` written by pandas (floats with their
    shortest round-trip repr, an undefined statistic as an empty field)."""
    table = report.to_pandas()
    if table.empty:
        return "rank,measure\n"
    return table.to_csv(index=False, lineterminator="\n")


def write_csv(report: CorrelationReport, path: str | Path) -> Path:
    """Write `correlations_csv` to ``path`` atomically; returns the path."""
    path = Path(path)
    atomic_write(path, correlations_csv(report))
    return path


def _header(report: CorrelationReport) -> list[tuple[str, str]]:
    cols = [
        ("#", "rank"),
        ("measure", "measure"),
        ("n", "n"),
        ("Kendall τ-b", "kendall_tau_b"),
        ("Jiang τ", "jiang_tau"),
        ("Spearman", "spearman"),
        ("Pearson", "pearson"),
    ]
    if report.axes:
        cols.append(("Ψ", "psi"))
        cols += [(f"ψ {a}", f"psi_{a}") for a in report.axes]
    cols.append(("CMI", "cmi"))
    return cols


def title(report: CorrelationReport) -> str:
    """The table's title: the target, the ranking statistic, the Ψ axes and the bootstrap."""
    by = f", Ψ over {', '.join(report.axes)}" if report.axes else ""
    ci = (
        f"; in brackets: {report.confidence:.0%} bootstrap intervals, {report.bootstrap} resamples"
        if report.bootstrap
        else ""
    )
    return (
        f"How well each measure predicts {report.target} (ranked by {TITLES[report.sort]}{by}{ci})"
    )


def _cell(r: dict[str, Any], key: str) -> str:
    v = r[key]
    if not isinstance(v, float):
        return str(v)
    s = _f(v, signed=key != "cmi")
    if f"{key}_lo" in r and math.isfinite(r[f"{key}_lo"]):
        s += f" [{r[f'{key}_lo']:+.2f}, {r[f'{key}_hi']:+.2f}]"
    return s


def _priority(report: CorrelationReport, key: str) -> int:
    """Which columns leave first when the table must fit a narrow terminal: never the rank, the
    measure, n or the ranking statistic; then Kendall τ-b and Ψ, Spearman, Pearson, Jiang τ, CMI,
    and the per-axis ψ first of all."""
    if key in ("rank", "measure", "n", report.sort):
        return 0
    order = ["kendall_tau_b", "psi", "spearman", "pearson", "jiang_tau", "cmi"]
    return 1 + order.index(key) if key in order else len(order) + 1


def render_table(report: CorrelationReport, width: int | None = None):
    """A rich Table, best measure first; the number of checkpoints each statistic used is in 'n'
    (ψ groups and CMI pairs are in correlations.csv). With ``width`` (a terminal's) it fits: long
    measure names wrap, the least telling columns leave first and the caption names them."""
    rows = report.to_rows()
    cols = [
        Column(
            as_text(name),
            [as_text(_cell(r, key)) for r in rows],
            justify="left" if key == "measure" else "right",
            priority=_priority(report, key),
            fold=key == "measure",
            min_width=14,
        )
        for name, key in _header(report)
    ]
    return build_table(
        cols,
        width,
        title=as_text(title(report)),
        header_style="bold",
        title_justify="left",
        caption=as_text(report.caption) if report.caption else None,
        caption_justify="left",
    )


def to_markdown(report: CorrelationReport) -> str:
    """The ranked table as a Markdown table, with the terminal table's columns and cells."""
    cols = _header(report)
    lines = [
        "| " + " | ".join(c for c, _ in cols) + " |",
        "|" + "|".join("---" if k == "measure" else "---:" for _, k in cols) + "|",
    ]
    for r in report.to_rows():
        cells = [_cell(r, k) for _, k in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def notes(report: CorrelationReport) -> list[str]:
    """Report-level notes (filters and the rows they dropped, measure selection, grid), then
    per-measure ones (missing values, constant columns, undefined ψ); a note shared by several
    measures is one line naming them with their count. Warnings are ``report.warnings``."""
    out = list(dict.fromkeys(report.notes))
    shared: dict[str, list[str]] = {}
    for mc in report.measures:
        for n in mc.notes:
            shared.setdefault(n, []).append(mc.measure)
    for n, names in shared.items():
        out.append(
            f"{names[0]}: {n}"
            if len(names) == 1
            else f"{n} ({len(names)} measures: {', '.join(names)})"
        )
    return out
