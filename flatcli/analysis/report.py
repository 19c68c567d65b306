"""Rendering a `CorrelationReport`: the ranked terminal table, ``correlations.csv``, Markdown."""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any

from ..results import atomic_write
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
    rows = report.to_rows()
    buf = io.StringIO()
    cols = list(rows[0]) if rows else ["rank", "measure"]
    w = csv.DictWriter(buf, fieldnames=cols, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: repr(v) if isinstance(v, float) else v for k, v in r.items()})
    return buf.getvalue()


def write_csv(report: CorrelationReport, path: str | Path) -> Path:
    path = Path(path)
    atomic_write(path, correlations_csv(report))
    return path


def _header(report: CorrelationReport) -> list[tuple[str, str]]:
    cols = [("#", "rank"), ("measure", "measure"), ("n", "n"), ("Kendall τ-b", "kendall_tau_b"),
            ("Jiang τ", "jiang_tau"), ("Spearman", "spearman"), ("Pearson", "pearson")]
    if report.axes:
        cols.append(("Ψ", "psi"))
        cols += [(f"ψ {a}", f"psi_{a}") for a in report.axes]
    cols.append(("CMI", "cmi"))
    return cols


def title(report: CorrelationReport) -> str:
    by = f", Ψ over {', '.join(report.axes)}" if report.axes else ""
    return f"How well each measure predicts {report.target} (ranked by {TITLES[report.sort]}{by})"


def render_table(report: CorrelationReport):
    """A rich Table, best measure first; the number of checkpoints each statistic used is in 'n'
    (ψ groups and CMI pairs are in correlations.csv)."""
    from rich.table import Table

    t = Table(title=title(report), header_style="bold", title_justify="left")
    cols = _header(report)
    for name, _ in cols:
        t.add_column(name, justify="left" if name == "measure" else "right", no_wrap=True)
    for r in report.to_rows():
        cells = []
        for _, key in cols:
            v = r[key]
            cells.append(_f(v, signed=key != "cmi") if isinstance(v, float) else str(v))
        t.add_row(*cells)
    return t


def to_markdown(report: CorrelationReport) -> str:
    cols = _header(report)
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "|".join("---" if k == "measure" else "---:" for _, k in cols) + "|"]
    for r in report.to_rows():
        cells = [(_f(r[k], signed=k != "cmi") if isinstance(r[k], float) else str(r[k])) for _, k in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def notes(report: CorrelationReport) -> list[str]:
    """Report-level notes, then per-measure ones (missing values, constant columns, undefined ψ)."""
    out = list(report.notes)
    for mc in report.measures:
        out += [f"{mc.measure}: {n}" for n in mc.notes]
    return out
