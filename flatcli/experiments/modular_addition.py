"""Experiment 6: a small transformer on modular addition, the grokking task (Power et al. 2022).

Each model trains on its own fraction of the p² pairs (the grid axis ``train_fraction``, a key
of ``data.train.kwargs``: the pipeline saves every model's training set and lists it in the
manifest's ``train_data`` column) and is measured on it; the test set is the same for all. On
top of the generic analysis (correlations with the gap over the converged models, Ψ over
training fraction and weight decay, per-seed spread):

* ``results/comparisons.csv``: the measure with the largest Kendall τ-b against every other
  measure, by the paired bootstrap of `flatcli.analysis.compare` (``flatcli correlate
  --compare A,B``; 1,000 resamples, seed 0): "ranks above" only where the interval of the
  difference excludes 0, "tied" otherwise;
* ``results/plots/modular_addition.png``: the gap and every measure against the training
  fraction, one line per weight decay (mean ± standard deviation over the seeds).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from ..analysis.compare import compare_measures
from ..errors import ConfigError
from ..run.results import read_table, write_table
from ..training import TrainRecord
from .base import Experiment, pyplot, save_figure
from .report import StudyOutcome, correlation_table, fmt_stat
from .spec import Study

FRACTION, DECAY = "train_fraction", "weight_decay"
COMPARE_STAT = "kendall_tau_b"


class ModularAddition(Experiment):
    """Experiment 6: the generic analysis, paired comparisons with the best measure, the figure."""

    def analyze(
        self, study: Study, sd: Path, results: Path, records: list[TrainRecord]
    ) -> StudyOutcome:
        """The generic analysis, then the comparisons and the figure."""
        outcome = super().analyze(study, sd, results, records)
        if outcome.correlation is None:
            return outcome
        rows = self.comparisons(results, outcome)
        if rows:
            outcome.extra["comparisons"] = rows
            outcome.files["comparisons"] = write_table(sd / "results" / "comparisons.csv", rows)
        if self.plots and FRACTION in study.grid:
            path = sd / "results" / "plots" / "modular_addition.png"
            fig = fraction_figure(outcome.files["converged"], [m.measure for m in outcome.correlation.measures], path,
                                  study.title)  # fmt: skip
            outcome.extra["figures"] = [fig]
            outcome.files["figure"] = fig
        return outcome

    def comparisons(self, results: Path, outcome: StudyOutcome) -> list[dict[str, Any]]:
        """The best measure by Kendall τ-b against each other one (`compare_measures`, the rows of
        ``comparisons.csv``); measures without a usable column are skipped."""
        ranked = [m for m in outcome.correlation.measures if math.isfinite(m.get(COMPARE_STAT))]
        ranked.sort(key=lambda m: -m.get(COMPARE_STAT))
        if len(ranked) < 2:
            return []
        best = ranked[0].measure
        out = []
        for m in ranked[1:]:
            try:
                df = compare_measures(results, best, m.measure, bootstrap=max(self.spec.bootstrap, 100), seed=0,
                                      max_train_loss=self.spec.target_loss)  # fmt: skip
            except ConfigError as e:  # a constant column: no comparison
                self.log(f"  --compare {best},{m.measure}: {e}")
                continue
            out += df.to_dict("records")
        return out

    def compare_command(self, study: Study, b: str, rel: str) -> str:
        """The ``flatcli correlate --compare`` command behind one row of comparisons.csv."""
        return (
            f"flatcli correlate {rel}/results/results.csv --max-train-loss {self.spec.target_loss:g} "
            f"--compare {b} --bootstrap {max(self.spec.bootstrap, 100)} --seed 0"
        )

    def summary_sections(self, study: Study, o: StudyOutcome) -> list[str]:
        """The correlation table, the paired comparisons, the figure, the commands."""
        lines = ["Against the generalization gap (train accuracy − test accuracy):", ""]
        lines += correlation_table(self.spec, study, o)
        comps = [r for r in o.extra.get("comparisons", []) if r["statistic"] == COMPARE_STAT]
        if comps:
            best = comps[0]["measure_a"]
            lines += [f"Paired bootstrap of the difference in Kendall τ-b with the gap, `{best}` (the largest τ-b) "
                      f"against each other measure (`comparisons.csv`, {comps[0]['resamples']:,} resamples, seed 0, "
                      "95% interval; \"ranks above\" only when the interval excludes 0):", "",
                      "| measure B | τ-b of A | τ-b of B | A − B [95% interval] | verdict |", "|---|---|---|---|---|"]  # fmt: skip
            for r in comps:
                lines.append(
                    f"| `{r['measure_b']}` | {fmt_stat(r['a'])} | {fmt_stat(r['b'])} | "
                    f"{fmt_stat(r['difference'])} [{r['lo']:+.2f}, {r['hi']:+.2f}] | {r['verdict']} |"
                )
            lines.append("")
        if "figure" in o.files:
            lines += [
                f"Figure: `{o.files['figure'].relative_to(self.outdir)}` (the gap and each measure against the "
                "training fraction, one line per weight decay, mean ± std over seeds).",
                "",
            ]
        lines += [f"Reproduce: `{self.correlate_command(study, study.name)}`"
                  + (f" and `{self.compare_command(study, f'{best},MEASURE', study.name)}`" if comps else "")
                  + f" (in `{self.outdir}`).", ""]  # fmt: skip
        return lines


def fraction_means(
    csv_path: Path, labels: list[str]
) -> tuple[list[float], list[float], dict[str, np.ndarray]]:
    """Training fractions, weight decays, and per column (measures and gen_gap) the mean and std
    over seeds at each (decay, fraction): an array of shape (2, decays, fractions), NaN where empty."""
    _, rows = read_table(csv_path)
    fr = np.array([float(r[f"hp_{FRACTION}"]) for r in rows])
    wd = np.array([float(r.get(f"hp_{DECAY}") or 0.0) for r in rows])
    fracs, decays = sorted(set(fr.tolist())), sorted(set(wd.tolist()))
    out = {}
    for lab in [*labels, "gen_gap"]:
        v = np.array([float(r.get(lab) or "nan") for r in rows])
        stats = np.full((2, len(decays), len(fracs)), np.nan)
        for i, d in enumerate(decays):
            for j, f in enumerate(fracs):
                cell = v[(wd == d) & (fr == f) & np.isfinite(v)]
                if len(cell):
                    stats[:, i, j] = cell.mean(), cell.std()
        if np.isfinite(stats[0]).any():
            out[lab] = stats
    return fracs, decays, out


def fraction_figure(csv_path: Path, labels: list[str], path: Path, title: str) -> Path:
    """The gap first, then one panel per measure (in the report's order): value against the
    training fraction, one line per weight decay, mean ± std over seeds."""
    plt = pyplot()
    fracs, decays, curves = fraction_means(csv_path, labels)
    names = [lab for lab in ["gen_gap", *labels] if lab in curves]
    ncol = min(5, len(names))
    nrow = math.ceil(len(names) / ncol)
    fig, axes = plt.subplots(
        nrow, ncol, figsize=(2.7 * ncol, 2.3 * nrow), dpi=110, squeeze=False, sharex=True
    )
    for ax, lab in zip(axes.flat, names, strict=False):
        for i, d in enumerate(decays):
            mean, std = curves[lab][:, i]
            ax.errorbar(
                fracs,
                mean,
                yerr=std,
                marker="o",
                ms=3,
                capsize=2,
                lw=1,
                color=f"C{i}",
                label=f"wd {d:g}",
            )
        ax.set_title(lab, fontsize=8, color="C3" if lab == "gen_gap" else "black")
        ax.tick_params(labelsize=6)
    axes.flat[0].legend(fontsize=6)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    fig.supxlabel("training fraction of the p² pairs", fontsize=8)
    fig.suptitle(
        f"{title}: gap and measures vs. training fraction (mean ± std over seeds)", fontsize=9
    )
    return save_figure(fig, path)
