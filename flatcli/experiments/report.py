"""The report side of an experiment: what a study produced, the summary's correlation and
comparison tables, and publishing a run's tables and figures into the docs."""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ExitCode
from ..run.results import read_table
from .spec import Spec, Study

STATS = ("pearson", "kendall_tau_b", "psi", "cmi")
STAT_TITLES = {
    "pearson": "Pearson",
    "kendall_tau_b": "Kendall τ-b",
    "psi": "Ψ",
    "cmi": "CMI",
    "spearman": "Spearman",
}


@dataclass
class StudyOutcome:
    """What one study produced: counts, the correlation report, files, timings."""

    name: str
    folder: Path
    models: int
    converged: int
    unconverged: list[dict[str, Any]] = field(default_factory=list)
    correlation: Any = None  # flatcli.analysis.CorrelationReport on the converged models
    by_seed: list[dict[str, Any]] = field(default_factory=list)  # rows of correlations_by_seed.csv
    comparisons: Any = (
        None  # pandas DataFrame of `flatcli.analysis.compare` rows (the study's `compare` pairs)
    )
    subsets: list[dict[str, Any]] = field(
        default_factory=list
    )  # per subset: title, where, axes, correlation, comparisons
    seconds: dict[str, float] = field(default_factory=dict)  # training, sweep, analysis
    files: dict[str, Path] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    exit_code: int = 0  # the sweep's: 1 when a unit failed


@dataclass
class ExperimentReport:
    """The outcome of `Experiment.run`: one `StudyOutcome` per study and the summary's path."""

    spec: Spec
    outdir: Path
    studies: list[StudyOutcome]
    summary: Path
    seconds: float

    @property
    def exit_code(self) -> int:
        """0, or 1 when a measurement of any study failed (its rows carry the errors)."""
        return max((o.exit_code for o in self.studies), default=ExitCode.OK)


def fmt_cell(cell: Any, spec: str) -> str:
    """A table cell formatted as a number when it is one, else as it is."""
    try:
        return format(float(cell), spec)
    except (TypeError, ValueError):
        return str(cell)


def gap_range(path: Path | None, column: str = "gen_gap") -> tuple[float, float, int] | None:
    """(min, max, count) of the finite ``gen_gap`` values of a results table; None without any."""
    if path is None or not Path(path).is_file():
        return None
    vals = []
    for r in read_table(path)[1]:
        try:
            v = float(r.get(column) or "nan")
        except ValueError:
            continue
        if math.isfinite(v):
            vals.append(v)
    return (min(vals), max(vals), len(vals)) if vals else None


def fmt_stat(v: float) -> str:
    """A statistic as ``+0.12``, or ``–`` when undefined."""
    return "–" if v is None or not math.isfinite(v) else f"{v:+.2f}"


def correlation_table(spec: Spec, study: Study, o: StudyOutcome, stats=STATS) -> list[str]:
    """Markdown rows: each measure's statistics with their 95% bootstrap interval [lo, hi] (as
    ``flatcli correlate --bootstrap`` prints them) or, for Ψ and CMI, the {min, max} over seeds; then
    the papers' values."""
    if o.correlation is None:
        return ["No correlations (fewer than 3 converged models).", ""]
    paper = spec.paper
    pcols = paper.get("columns", [])
    pstat = STAT_TITLES.get(paper.get("statistic", "pearson"), paper.get("statistic", ""))
    head = (
        ["measure", "n"] + [STAT_TITLES[k] for k in stats] + [f"paper {pstat}: {c}" for c in pcols]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    spread: dict[tuple[str, str], list[float]] = {}
    for r in o.by_seed:
        for k in stats:
            v = r[k]
            if v is not None and math.isfinite(v):
                spread.setdefault((r["measure"], k), []).append(v)
    for mc in o.correlation.measures:
        cells = [f"`{mc.measure}`", str(mc.n)]
        for k in stats:
            v = mc.get(k)
            iv = mc.intervals.get(k)
            sp = spread.get((mc.measure, k))
            if iv is not None and math.isfinite(iv.lo) and math.isfinite(iv.hi):
                cells.append(f"{fmt_stat(v)} [{iv.lo:+.2f}, {iv.hi:+.2f}]")
            else:
                cells.append(
                    fmt_stat(v)
                    + (f" {{{min(sp):+.2f}, {max(sp):+.2f}}}" if sp and len(sp) >= 2 else "")
                )
        pv = paper.get("values", {}).get(mc.measure)
        cells += [
            (
                "–"
                if pv is None
                else f"{pv[i]:+.2f}"
                if isinstance(pv[i], (int, float))
                else str(pv[i])
            )
            for i in range(len(pcols))
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    if o.by_seed:
        lines += [
            f"[lo, hi]: 95% bootstrap interval over the models ({spec.bootstrap:,} resamples, seed 0); {{min, max}}: the "
            "value on each seed's models alone (`correlations_by_seed.csv`).",
            "",
        ]
    axes = ", ".join(study.axes) if study.axes else "none"
    lines += [f"Ψ and CMI over the axes: {axes}.", ""]
    return lines


def comparison_table(df, command: str, target: str = "the gap") -> list[str]:
    """Markdown rows of `Experiment.compare`'s table: per pair, the differences of Kendall τ-b and
    Pearson with their 95% paired-bootstrap intervals (and Zou's for Pearson) and the verdicts."""
    if df is None or len(df) == 0:
        return []
    first = df.iloc[0]
    lines = [f"Paired comparisons of the correlations with {target} (`{command} --compare A,B`: the same "
             f"{int(first['resamples'] + first['undefined_resamples']):,} resamples of the models for both measures, "
             "seed 0; \"A ranks above B\" only when the 95% interval of the difference excludes 0, else \"tied\"):", "",
             "| A | B | n | Kendall τ-b: A − B [95%] | τ-b verdict | Pearson: A − B [95%] (Zou) | Pearson verdict |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip

    def verdict(r) -> str:
        return (
            "A above" if r["lo"] > 0 else "B above" if r["hi"] < 0 else r["verdict"]
        )  # tied or undefined

    for (a, b), g in df.groupby(["measure_a", "measure_b"], sort=False):
        rows = {r["statistic"]: r for _, r in g.iterrows()}
        k, p = rows.get("kendall_tau_b"), rows.get("pearson")
        cells = [f"`{a}`", f"`{b}`", str(int(g["n"].iloc[0]))]
        for r, zou in ((k, False), (p, True)):
            if r is None:
                cells += ["–", "–"]
                continue
            extra = (
                f" ({r['zou_lo']:+.2f}, {r['zou_hi']:+.2f})"
                if zou and math.isfinite(r["zou_lo"])
                else ""
            )
            cells += [
                f"{fmt_stat(r['difference'])} [{r['lo']:+.2f}, {r['hi']:+.2f}]{extra}",
                verdict(r),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def publish(report: ExperimentReport, dest: str | Path) -> list[Path]:
    """Copy the small outputs (CSV tables, summary, figures) into ``dest/<experiment>/``."""
    base = Path(dest) / report.spec.name
    copied = []
    base.mkdir(parents=True, exist_ok=True)
    text = report.summary.read_text()  # the published copy's commands refer to its own layout
    for o in report.studies:
        text = text.replace(f"{o.name}/results/results.csv", f"{o.name}/results.csv")
    text = text.replace(f"(in `{report.outdir}`)", "(in this folder)")
    (base / "summary.md").write_text(text)
    copied.append(base / "summary.md")
    for o in report.studies:
        d = base / o.name
        d.mkdir(parents=True, exist_ok=True)
        res = o.folder / "results"
        for name in ("results.csv", "results_converged.csv", "unconverged.csv", "correlations.csv",
                     "correlations_by_seed.csv", "relative_change.csv", "comparisons.csv"):  # fmt: skip
            for src in (res / name, res / "vs_noise" / name):
                if src.is_file():
                    dst = d / (f"vs_noise_{name}" if src.parent.name == "vs_noise" else name)
                    shutil.copy2(src, dst)
                    copied.append(dst)
        for name in ("training.csv", "config.yaml"):
            if (o.folder / name).is_file():
                shutil.copy2(o.folder / name, d / name)
                copied.append(d / name)
        for fig in [
            res / "plots" / "scatter_all.png",
            res / "plots" / "psi_heatmap.png",
            *o.extra.get("figures", []),
        ]:
            if Path(fig).is_file():
                shutil.copy2(fig, d / Path(fig).name)
                copied.append(d / Path(fig).name)
    return copied
