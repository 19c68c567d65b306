"""Experiment 2: random labels raise normalized sharpness (Tsuzuku et al. 2020, Sec. 8.1, Fig. 1).

The same MLP is trained to the loss target on training sets whose labels are random for a
fraction 0 → 1 of the samples (one nested corruption per seed). Besides the generic correlation
with the gap, every measure is correlated with the noise fraction itself
(``results/vs_noise/correlations.csv``, ``flatcli correlate --target hp_label_noise``; with the
study's ``compare`` pairs also ``results/vs_noise/comparisons.csv``), and
``results/plots/random_labels.png`` redraws the paper's Fig. 1: each measure rescaled to [0, 1]
by its minimum and maximum over the models, mean ± standard deviation over seeds per fraction.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..run.results import read_table
from ..training import TrainRecord
from .base import Experiment, pyplot, save_figure
from .report import StudyOutcome, comparison_table, correlation_table, fmt_stat
from .spec import Study

NOISE = "label_noise"


class RandomLabels(Experiment):
    """Experiment 2: the generic analysis plus the correlation with the noise fraction and Fig. 1."""

    def analyze(
        self, study: Study, sd: Path, results: Path, records: list[TrainRecord]
    ) -> StudyOutcome:
        """The generic analysis, then every measure against the random-label fraction and the figure."""
        outcome = super().analyze(study, sd, results, records)
        if outcome.correlation is None or NOISE not in study.grid:
            return outcome
        conv = outcome.files["converged"]
        vs = sd / "results" / "vs_noise"
        outcome.extra["vs_noise"] = self.correlate(conv, study, vs, False, target=f"hp_{NOISE}",
                                                   bootstrap=self.spec.bootstrap or None)  # fmt: skip
        outcome.files["vs_noise"] = vs / "correlations.csv"
        outcome.extra["vs_noise_comparisons"] = self.compare(
            study, results, vs / "comparisons.csv", target=f"hp_{NOISE}"
        )
        if self.plots:
            fig = noise_figure(
                conv,
                outcome.correlation.measures,
                sd / "results" / "plots" / "random_labels.png",
                study.title,
            )
            outcome.extra["figures"] = [fig]
            outcome.files["figure"] = fig
        return outcome

    def correlate_command(self, study: Study, rel: str) -> str:
        """Both correlate commands: against the gap and against the fraction."""
        base = super().correlate_command(study, rel)
        return f"{base}` and `{base} --target hp_{NOISE}"

    def summary_sections(self, study: Study, o: StudyOutcome) -> list[str]:
        """The table against the gap, the table against the fraction, the figure."""
        lines = ["Against the generalization gap:", ""] + correlation_table(self.spec, study, o)
        base = super().correlate_command(study, study.name)
        lines += comparison_table(o.comparisons, base)
        rep = o.extra.get("vs_noise")
        if rep is not None:
            lines += ["Against the random-label fraction (Kendall τ-b, Spearman and Pearson with the fraction, "
                      "[95% bootstrap interval]):", "",
                      "| measure | n | Kendall τ-b | Spearman | Pearson |", "|---|---|---|---|---|"]  # fmt: skip
            for mc in sorted(
                rep.measures,
                key=lambda m: -m.kendall_tau_b if math.isfinite(m.kendall_tau_b) else math.inf,
            ):
                lines.append(
                    f"| `{mc.measure}` | {mc.n} | "
                    + " | ".join(
                        _with_interval(mc, k) for k in ("kendall_tau_b", "spearman", "pearson")
                    )
                    + " |"
                )
            lines.append("")
            lines += comparison_table(
                o.extra.get("vs_noise_comparisons"),
                f"{base} --target hp_{NOISE}",
                target="the random-label fraction",
            )
        if "figure" in o.files:
            lines += [
                f"Figure (as the paper's Fig. 1): `{o.files['figure'].relative_to(self.outdir)}`.",
                "",
            ]
        lines += [
            f"Reproduce: `{self.correlate_command(study, study.name)}` (in `{self.outdir}`).",
            "",
        ]
        return lines


def _with_interval(mc, stat: str) -> str:
    """A statistic with its bootstrap interval, ``+0.91 [+0.81, +0.96]``, when it has one."""
    iv = mc.intervals.get(stat)
    if iv is not None and math.isfinite(iv.lo) and math.isfinite(iv.hi):
        return f"{fmt_stat(mc.get(stat))} [{iv.lo:+.2f}, {iv.hi:+.2f}]"
    return fmt_stat(mc.get(stat))


def noise_means(
    csv_path: Path, labels: list[str]
) -> tuple[list[float], dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Per measure (and gen_gap): mean and std over seeds of the value rescaled to [0, 1] by its
    min and max over all rows, at each noise fraction (sorted)."""
    _, rows = read_table(csv_path)
    fr = np.array([float(r[f"hp_{NOISE}"]) for r in rows])
    levels = sorted(set(fr.tolist()))
    out = {}
    for lab in [*labels, "gen_gap"]:
        v = np.array([float(r.get(lab) or "nan") for r in rows])
        ok = np.isfinite(v)
        if ok.sum() < 2:
            continue
        lo, hi = np.nanmin(v[ok]), np.nanmax(v[ok])
        z = (v - lo) / (hi - lo) if hi > lo else np.zeros_like(v)
        mean = np.array(
            [np.nanmean(z[(fr == f) & ok]) if ((fr == f) & ok).any() else np.nan for f in levels]
        )
        std = np.array(
            [np.nanstd(z[(fr == f) & ok]) if ((fr == f) & ok).any() else np.nan for f in levels]
        )
        out[lab] = (mean, std)
    return levels, out


def noise_figure(csv_path: Path, measures, path: Path, title: str) -> Path:
    """One panel per measure (ranked as in the correlation report) plus the gap."""
    plt = pyplot()
    labels = [m.measure for m in measures]
    levels, curves = noise_means(csv_path, labels)
    names = [lab for lab in [*labels, "gen_gap"] if lab in curves]
    ncol = min(5, len(names))
    nrow = math.ceil(len(names) / ncol)
    fig, axes = plt.subplots(
        nrow,
        ncol,
        figsize=(2.6 * ncol, 2.2 * nrow),
        dpi=110,
        squeeze=False,
        sharex=True,
        sharey=True,
    )
    for ax, lab in zip(axes.flat, names, strict=False):
        mean, std = curves[lab]
        ax.errorbar(
            levels,
            mean,
            yerr=std,
            marker="o",
            ms=3,
            capsize=2,
            lw=1,
            color="C3" if lab == "gen_gap" else "C0",
        )
        ax.set_title(lab, fontsize=8)
        ax.set_ylim(-0.05, 1.05)
        ax.tick_params(labelsize=6)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    fig.supxlabel("random-label fraction", fontsize=8)
    fig.supylabel("value rescaled to [0, 1] (mean ± std over seeds)", fontsize=8)
    fig.suptitle(
        f"{title}: measures vs. random labels (cf. Tsuzuku et al. 2020, Fig. 1)", fontsize=9
    )
    return save_figure(fig, path)
