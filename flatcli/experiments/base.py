"""One experiment, end to end, as a user would run it: train, write a manifest and a flatcli
config, then ``flatcli sweep`` → ``collect`` → ``correlate`` through `flatcli.api`.

Per study (``OUTDIR/<study>/``):

* ``checkpoints/`` (final and ``.init.pt`` checkpoints), ``data/`` (the training sets that are a
  model's own: noisy labels, or a grid over ``data.train.kwargs`` such as a training fraction),
  ``manifest.csv`` (``path``, ``init_checkpoint``, ``train_data`` and one column per grid axis),
  ``training.csv`` (steps, final train loss, ``reached_target`` per model), ``config.yaml``
  (the flatcli config of the sweep), ``study.json`` (the resolved study: training is skipped
  when it and the checkpoints are unchanged);
* ``sweep/`` (one file per checkpoint × measure; rerunning resumes);
* ``results/results.csv`` (every model), ``results_converged.csv`` (models whose train loss,
  as flatcli measured it, is ≤ the target), ``unconverged.csv`` (the others, listed),
  ``correlations.csv`` and ``plots/`` (on the converged models, Ψ over the study's axes),
  ``by_seed/`` and ``correlations_by_seed.csv`` (the same statistics on each seed's models alone;
  the {min, max} beside Ψ and CMI in the tables), ``comparisons.csv`` (``flatcli correlate
  --compare A,B`` for the study's ``compare`` pairs: paired bootstrap over the models).

``OUTDIR/summary.md`` holds the tables of every study with the papers' numbers beside ours.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import yaml

from .. import api
from ..analysis.compare import compare_measures
from ..analysis.table import as_table, filter_rows
from ..errors import ConfigError, MeasurementError
from ..extras import have_matplotlib
from ..readback import read_json
from ..run.results import read_table, write_table
from ..training import (
    TrainRecord,
    TrainTask,
    model_name,
    read_training,
    run_tasks,
    single_threaded,
    write_manifest,
)
from .report import (
    ExperimentReport,
    StudyOutcome,
    comparison_table,
    correlation_table,
    fmt_cell,
    gap_range,
)
from .spec import Spec, Study


def pyplot():
    """matplotlib.pyplot on the headless Agg backend."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> Path:
    """Lay out ``fig``, write it to ``path`` (creating its folder), close it; returns ``path``."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    pyplot().close(fig)
    return path


def work_seconds(folder: Path) -> tuple[float, float]:
    """Seconds of work behind a study, summed over its models: training (``training.csv``) and
    measurement (every ``<measure>_seconds`` column of ``results/results.csv``); 0 where a file is missing."""

    def total(path: Path, cols) -> float:
        if not path.is_file():
            return 0.0
        header, rows = read_table(path)
        keep = [c for c in header if cols(c)]
        return sum(
            float(r[c])
            for r in rows
            for c in keep
            if r.get(c) not in (None, "") and math.isfinite(float(r[c]))
        )

    return (
        total(folder / "training.csv", lambda c: c == "seconds"),
        total(folder / "results" / "results.csv", lambda c: c.endswith("_seconds")),
    )


def absolute_paths(flat: dict[str, Any], base_dir: Path) -> dict[str, Any]:
    """The flatcli part of a spec with its relative data paths and model file made absolute."""
    out = json.loads(json.dumps(flat))
    for split in ("train", "test"):
        src = (out.get("data") or {}).get(split)
        if isinstance(src, dict):
            for key in ("path", "root"):
                v = src.get(key)
                if isinstance(v, str) and not os.path.isabs(os.path.expanduser(v)):
                    src[key] = str((base_dir / v).resolve())
    target = out["model"]["target"]
    left, _, attr = target.rpartition(":")
    if left.endswith(".py") and not os.path.isabs(left):
        out["model"]["target"] = f"{(base_dir / left).resolve()}:{attr}"
    return out


class Experiment:
    """The generic experiment: train every study's grid, measure, keep the converged models,
    correlate. Subclasses add steps (`prepare_checkpoints`, `analyze`, `summary_sections`)."""

    def __init__(
        self,
        spec: Spec,
        outdir: str | Path,
        jobs: int = 1,
        log=print,
        plots: bool = True,
        device: str | None = None,
    ):
        self.spec = spec
        self.outdir = Path(outdir)
        self.jobs = max(1, int(jobs))
        self.log = log
        self.plots = plots and have_matplotlib()
        self.device = device  # overrides training.device and runtime.device of every study

    # ------------------------------------------------------------ the whole run
    def run(self, studies: list[str] | None = None) -> ExperimentReport:
        """Run every study (or those named), single-threaded per process; write summary.md."""
        t0 = time.perf_counter()
        chosen = self.spec.studies
        if studies:
            names = [s.name for s in self.spec.studies]
            unknown = [s for s in studies if s not in names]
            if unknown:
                raise ConfigError(
                    f"`study`: {', '.join(unknown)} not in {self.spec.name} (studies: {', '.join(names)})"
                )
            chosen = [s for s in self.spec.studies if s.name in studies]
        self.outdir.mkdir(parents=True, exist_ok=True)
        outcomes = []
        with single_threaded():
            for study in chosen:
                self.log(f"== {self.spec.name} / {study.name}: {len(study.points())} models")
                outcomes.append(self.run_study(study))
        summary = self.outdir / "summary.md"
        summary.write_text(self.summary(outcomes))
        return ExperimentReport(self.spec, self.outdir, outcomes, summary, time.perf_counter() - t0)

    def run_study(self, study: Study) -> StudyOutcome:
        """Train, prepare the checkpoints, write the config, measure and analyze one study."""
        sd = self.outdir / study.name
        t0 = time.perf_counter()
        records = self.train(study, sd)
        self.prepare_checkpoints(study, sd, records)
        cfg_path = self.write_config(study, sd)
        t1 = time.perf_counter()
        results, code = self.measure(study, sd, cfg_path)
        t2 = time.perf_counter()
        outcome = self.analyze(study, sd, results, records)
        outcome.exit_code = code
        outcome.seconds = {
            "training": t1 - t0,
            "sweep": t2 - t1,
            "analysis": time.perf_counter() - t2,
        }
        self.log(
            f"{study.name}: {outcome.converged}/{outcome.models} models met the criterion; "
            f"training {t1 - t0:.0f}s, sweep {t2 - t1:.0f}s, analysis {outcome.seconds['analysis']:.0f}s"
        )
        return outcome

    # ------------------------------------------------------------ training
    def study_record(self, study: Study) -> dict[str, Any]:
        """What determines the trained weights (compared with study.json to reuse a training)."""
        return {
            "flatcli": {k: study.flatcli[k] for k in ("model", "data")},
            "training": study.training,
            "grid": study.grid,
            "target": self.spec.target_loss,
            **(
                {"criterion": self.spec.criterion.describe()}
                if self.spec.plateau is not None
                else {}
            ),
            **({"device": self.device} if self.device else {}),
        }

    def tasks(self, study: Study, sd: Path) -> list[TrainTask]:
        """One `TrainTask` per grid point: the grid's model axes are model kwargs, its training
        axes override the recipe, its data axes ``data.train.kwargs`` (the model's own training
        set, saved as ``data/<axes>.pt``), ``seed`` seeds initialization, batch order and label noise."""
        flat = absolute_paths(study.flatcli, self.spec.path.parent)
        out = []
        for i, hp in enumerate(study.points()):
            recipe, noise = study.recipe(hp, self.device)
            kwargs = {**flat["model"].get("kwargs", {}), **{k: hp[k] for k in study.model_axes}}
            data, own = flat["data"], ""
            if study.data_axes:
                train = {
                    **data["train"],
                    "kwargs": {**data["train"]["kwargs"], **{k: hp[k] for k in study.data_axes}},
                }
                data = {**data, "train": train}
                named = {
                    **{k: hp[k] for k in study.data_axes},
                    **({"noise": noise, "seed": hp["seed"]} if noise is not None else {}),
                }
                own = f"data/{model_name(named)}.pt"
            out.append(TrainTask(
                name=model_name(hp, index=i), outdir=str(sd), model_target=flat["model"]["target"], model_kwargs=kwargs,
                data=data, recipe=recipe, hparams=hp, criterion=self.spec.criterion, seed=int(hp["seed"]),
                label_noise=noise, base_dir=str(self.spec.path.parent), train_data=own,
            ))  # fmt: skip
        return out

    def train(self, study: Study, sd: Path) -> list[TrainRecord]:
        """Train the grid (or reuse identical earlier training); write manifest.csv and training.csv."""
        record = json.loads(json.dumps(self.study_record(study), default=str))
        stamp = sd / "study.json"
        tasks = self.tasks(study, sd)
        if stamp.is_file() and (sd / "training.csv").is_file():
            try:
                same = read_json(stamp) == record
            except (OSError, ValueError):
                same = False
            if same and all((sd / "checkpoints" / f"{t.name}.pt").is_file() for t in tasks):
                self.log(
                    f"reusing the {len(tasks)} trained models in {sd} (delete {stamp.name} to retrain)"
                )
                return read_training(sd / "training.csv", list(study.grid))
        sd.mkdir(parents=True, exist_ok=True)
        stamp.unlink(missing_ok=True)
        records = run_tasks(tasks, self.jobs, log=lambda m: self.log("  " + m))
        write_manifest(
            sd, records, list(study.grid), converged_column=self.spec.plateau is not None
        )
        stamp.write_text(json.dumps(record, indent=1))
        return records

    def prepare_checkpoints(self, study: Study, sd: Path, records: list[TrainRecord]) -> None:
        """A hook after training (the reparameterization experiment adds rescaled checkpoints)."""

    # ------------------------------------------------------------ measuring
    def flatcli_config(self, study: Study) -> dict[str, Any]:
        """The flatcli config of the study's sweep: its measures over the manifest's checkpoints."""
        flat = absolute_paths(study.flatcli, self.spec.path.parent)
        runtime = {
            "device": "cpu",
            "seed": 0,
            **(flat.get("runtime") or {}),
            **({"device": self.device} if self.device else {}),
        }
        return {
            "model": flat["model"],
            "checkpoints": {"manifest": "manifest.csv"},
            "data": flat["data"],
            "measure_data": flat.get("measure_data", {}),
            "loss": flat.get("loss", "cross_entropy"),
            "measures": flat["measures"],
            "runtime": runtime,
            "output": {"dir": "results"},
        }

    def write_config(self, study: Study, sd: Path) -> Path:
        """Write ``<study>/config.yaml``; returns its path."""
        cfg = self.flatcli_config(study)
        head = (
            f"# flatcli config of experiment {self.spec.name}, study {study.name} (written by "
            f"`flatcli experiments run {self.spec.name}`).\n# Measure again with: flatcli sweep -c config.yaml -o sweep\n"
        )
        path = sd / "config.yaml"
        path.write_text(head + yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True))
        return path

    def measure(self, study: Study, sd: Path, cfg_path: Path) -> tuple[Path, int]:
        """``flatcli sweep`` (resumable) then ``flatcli collect`` → results/results.csv; returns its
        path and the sweep's exit code (1 when a unit failed: its row carries the error)."""
        cfg = api.load(cfg_path)
        cpu = cfg.runtime.device == "cpu"
        workers = self.jobs if cpu and self.jobs > 1 else None
        rep = api.sweep(cfg_path, sd / "sweep", options=api.SweepOptions(workers=workers),
                        log=lambda m: self.log("  " + m))  # fmt: skip
        self.log(
            f"  sweep: {rep.lines[0]}; {rep.computed} computed, {rep.errors} with errors ({rep.seconds:.0f}s)"
        )
        col = api.collect_report(sd / "sweep", sd / "results")
        if col.missing:
            raise MeasurementError(
                f"{study.name}: {len(col.missing)} units of the sweep did not finish; rerun the command to resume"
            )
        return col.csv_path, rep.exit_code

    # ------------------------------------------------------------ analysis
    @property
    def converged_filter(self) -> tuple[str | None, float | None]:
        """``(where, max_train_loss)`` of `flatcli.api.correlate_report` that keeps the converged models:
        ``--max-train-loss TARGET`` (flatcli's own train loss), or with a plateau criterion
        ``--where "hp_converged == 1"`` (the manifest's record of the training criterion)."""
        if self.spec.plateau is not None:
            return "hp_converged == 1", None
        return None, self.spec.target_loss

    def is_converged(self, row: dict[str, Any]) -> bool:
        """Whether a results.csv row passes `converged_filter`."""
        if self.spec.plateau is not None:
            return str(row.get("hp_converged", "")).strip() in ("1", "1.0", "True")
        try:
            return float(row.get("train_loss") or "nan") <= self.spec.target_loss
        except ValueError:
            return False

    def keep_converged(self, results: Path) -> tuple[Path, list[dict[str, Any]], int]:
        """Split results.csv by `is_converged`: flatcli's own ``train_loss`` (eval mode, the
        model's training labels) ≤ target, or with a plateau criterion the manifest's ``converged``.

        Writes ``results_converged.csv`` and ``unconverged.csv``; returns (converged csv,
        unconverged rows, converged count). This is the filter that ``flatcli correlate
        --max-train-loss TARGET`` (or ``--where "hp_converged == 1"``) applies to results.csv:
        with that option the correlations are computed from results.csv directly.
        """
        cols, rows = read_table(results)
        keep, drop = [], []
        for r in rows:
            (keep if self.is_converged(r) else drop).append(r)
        out = results.with_name("results_converged.csv")
        write_table(out, keep, cols)
        hp_cols = [c for c in cols if c.startswith("hp_")]
        unconv = [
            {"checkpoint": r["checkpoint"], **{c: r.get(c, "") for c in hp_cols}, "train_loss": r.get("train_loss", ""),
             "train_acc": r.get("train_acc", ""), "status": r.get("status", ""), "error": r.get("error", "")}
            for r in drop
        ]  # fmt: skip
        write_table(results.with_name("unconverged.csv"), unconv,
                  ["checkpoint", *hp_cols, "train_loss", "train_acc", "status", "error"])  # fmt: skip
        return out, unconv, len(keep)

    def correlate(
        self,
        csv_path: Path,
        study: Study,
        outdir: Path | None,
        plots: bool,
        target: str = "gen_gap",
        bootstrap: int | None = None,
    ):
        """``flatcli correlate --max-train-loss TARGET`` over the study's axes (`flatcli.api.correlate_report`):
        the models above the target train loss are left out (and named) by flatcli itself."""
        where, max_loss = self.converged_filter
        return api.correlate_report(csv_path, target=target, by=study.axes or None, outdir=outdir, where=where,
                             max_train_loss=max_loss, bootstrap=bootstrap, run=api.RunOptions(seed=0),
                             plots=plots and outdir is not None, color_by=study.color_by if plots else None)  # fmt: skip

    def seed_spread(
        self, study: Study, converged: Path, target: str = "gen_gap"
    ) -> list[dict[str, Any]]:
        """The correlation statistics on each seed's models alone (``by_seed/results_seed<S>.csv``)."""
        if len(study.grid.get("seed", [])) < 2:
            return []
        cols, rows = read_table(converged)
        out = []
        for s in study.grid["seed"]:
            sub = [r for r in rows if r.get("hp_seed") == str(s)]
            if len(sub) < 3:
                continue
            p = write_table(converged.parent / "by_seed" / f"results_seed{s}.csv", sub, cols)
            rep = self.correlate(p, study, None, False, target)
            for mc in rep.measures:
                out.append({"measure": mc.measure, "seed": s, "n": mc.n, "pearson": mc.pearson, "spearman": mc.spearman,
                            "kendall_tau_b": mc.kendall_tau_b, "psi": mc.psi, "cmi": mc.cmi})  # fmt: skip
        return out

    def analyze(
        self, study: Study, sd: Path, results: Path, records: list[TrainRecord]
    ) -> StudyOutcome:
        """Keep the converged models, correlate them with the gap, and each seed's alone."""
        converged, unconv, kept = self.keep_converged(results)
        outcome = StudyOutcome(
            study.name, sd, models=kept + len(unconv), converged=kept, unconverged=unconv
        )
        outcome.files.update(
            results=results, converged=converged, unconverged=results.with_name("unconverged.csv")
        )
        if unconv:
            self.log(
                f"  {len(unconv)} model(s) did not meet the convergence criterion, left out of the correlations (unconverged.csv)"
            )
        if kept < 3:
            self.log(f"  only {kept} converged model(s): no correlations")
            return outcome
        outcome.correlation = self.correlate(
            results, study, sd / "results", self.plots, bootstrap=self.spec.bootstrap or None
        )
        outcome.files["correlations"] = sd / "results" / "correlations.csv"
        outcome.by_seed = self.seed_spread(study, converged)
        if outcome.by_seed:
            outcome.files["correlations_by_seed"] = write_table(
                sd / "results" / "correlations_by_seed.csv", outcome.by_seed
            )
        outcome.comparisons = self.compare(study, results, sd / "results" / "comparisons.csv")
        if outcome.comparisons is not None:
            outcome.files["comparisons"] = sd / "results" / "comparisons.csv"
        for i, (title, expr) in enumerate(study.subsets.items(), 1):
            sub = self.subset(study, results, title, expr, sd / "results" / f"subset{i}")
            if sub is not None:
                outcome.subsets.append(sub)
        return outcome

    def where(self, expr: str | None = None) -> str | None:
        """The converged filter's ``--where`` (if any) and ``expr``, joined by ``and``."""
        base = self.converged_filter[0]
        parts = [p for p in (base, expr) if p]
        return (
            parts[0]
            if len(parts) == 1
            else " and ".join(f"({p})" for p in parts)
            if parts
            else None
        )

    def subset(
        self, study: Study, results: Path, title: str, expr: str, out: Path
    ) -> dict[str, Any] | None:
        """The converged models matching ``expr`` correlated (over the axes that still vary) and
        compared alone, into ``out/correlations.csv`` and ``out/comparisons.csv``; None (logged)
        when fewer than 3 models remain."""
        where = self.where(expr)
        try:
            table, _ = filter_rows(
                as_table(results), where=where, max_train_loss=self.converged_filter[1]
            )
        except ConfigError as e:
            self.log(f"  subset {title!r} skipped: {e}")
            return None
        if len(table.frame) < 3:
            self.log(f"  subset {title!r} skipped: {len(table.frame)} converged model(s)")
            return None
        axes = [
            a
            for a in study.axes
            if f"hp_{a}" in table.frame and table.frame[f"hp_{a}"].nunique() > 1
        ]
        rep = api.correlate_report(results, by=axes or None, outdir=out, where=where, max_train_loss=self.converged_filter[1],
                            bootstrap=self.spec.bootstrap or None, run=api.RunOptions(seed=0))  # fmt: skip
        comps = self.compare(study, results, out / "comparisons.csv", extra_where=expr)
        return {
            "title": title,
            "expr": expr,
            "where": where,
            "axes": axes,
            "correlation": rep,
            "comparisons": comps,
            "dir": out,
        }

    def compare(
        self,
        study: Study,
        results: Path,
        out: Path,
        target: str = "gen_gap",
        extra_where: str | None = None,
    ):
        """``flatcli correlate --compare A,B`` for each of the study's ``compare`` pairs on the
        converged models (paired bootstrap, the spec's ``bootstrap`` resamples, seed 0), written to
        ``out``; None without pairs or resamples. A pair that cannot be compared (fewer than 3
        usable models, a constant column) is logged and skipped."""
        import pandas as pd

        if not study.compare or not self.spec.bootstrap:
            return None
        where, max_loss = self.where(extra_where), self.converged_filter[1]
        frames = []
        for a, b in study.compare:
            try:
                frames.append(compare_measures(results, a, b, target=target, bootstrap=self.spec.bootstrap, seed=0,
                                               where=where, max_train_loss=max_loss))  # fmt: skip
            except ConfigError as e:
                self.log(f"  --compare {a},{b} skipped: {e}")
        if not frames:
            return None
        df = pd.concat(frames, ignore_index=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        df.to_csv(out, index=False)
        return df

    # ------------------------------------------------------------ the summary
    def correlate_command(
        self, study: Study, rel: str, expr: str | None = None, axes: list[str] | None = None
    ) -> str:
        """The ``flatcli correlate`` command that reproduces the study's table (or a subset's:
        ``expr``, ``axes``) from its folder."""
        axes = study.axes if axes is None else axes
        by = f" --by {','.join(axes)}" if axes else ""
        boot = f" --bootstrap {self.spec.bootstrap} --seed 0" if self.spec.bootstrap else ""
        return f"flatcli correlate {rel}/results/results.csv {self.filter_options(expr)}{by}{boot}"

    def filter_options(self, expr: str | None = None) -> str:
        """`converged_filter` (and ``expr``) as ``flatcli correlate`` options."""
        where, max_loss = self.where(expr), self.converged_filter[1]
        return " ".join(
            ([f'--where "{where}"'] if where else [])
            + ([f"--max-train-loss {max_loss:g}"] if max_loss is not None else [])
        )

    @property
    def filter_option(self) -> str:
        """`converged_filter` as ``flatcli correlate`` options."""
        return self.filter_options()

    def summary(self, outcomes: list[StudyOutcome]) -> str:
        """summary.md: per study, the counts, timings, tables and the models left out."""
        s = self.spec
        lines = [f"# {s.title}", "", f"Experiment `{s.name}`" + (" (quick mode: a smoke test, not a result)" if s.quick else "")
                 + (f"; reference: {s.reference}" if s.reference else "") + ".", ""]  # fmt: skip
        for c in s.paper.get("claims", []):
            lines.append(f"- paper: {c}")
        for c in s.paper.get("setup", []):
            lines.append(f"- differs from the paper: {c}")
        if s.paper.get("claims") or s.paper.get("setup"):
            lines.append("")
        for o in outcomes:
            study = next(st for st in s.studies if st.name == o.name)
            lines += [f"## {study.title}", ""]
            train_s, measure_s = work_seconds(o.folder)
            lines.append(
                f"{o.converged} of {o.models} models met the convergence criterion ({s.criterion.describe()}) and "
                f"enter the correlations ({self.filter_option}). Work: training {train_s:.0f} s and measurement {measure_s:.0f} s, summed "
                f"over the models (`training.csv`, the `*_seconds` columns of `results.csv`); this run's wall time: "
                f"training {o.seconds.get('training', 0):.0f} s, sweep {o.seconds.get('sweep', 0):.0f} s, analysis "
                f"{o.seconds.get('analysis', 0):.0f} s (a rerun reuses the trained models and finished units)."
            )
            gaps = gap_range(o.files.get("converged"))
            if gaps is not None:
                lines.append(
                    f"Generalization gap (train accuracy − test accuracy) of the {gaps[2]} converged models: "
                    f"{gaps[0]:.3f} to {gaps[1]:.3f}."
                )
            lines.append("")
            lines += self.summary_sections(study, o)
            if o.unconverged:
                lines += ["Left out (convergence criterion not met):", ""]
                for u in o.unconverged:
                    hp = ", ".join(
                        f"{k[3:]}={v}"
                        for k, v in u.items()
                        if k.startswith("hp_") and k != "hp_converged"
                    )
                    lines.append(
                        f"- `{u['checkpoint']}` ({hp}): train loss {fmt_cell(u['train_loss'], '.4f')}, "
                        f"train accuracy {fmt_cell(u['train_acc'], '.4f')}"
                    )
                lines.append("")
        return "\n".join(lines) + "\n"

    def summary_sections(self, study: Study, o: StudyOutcome) -> list[str]:
        """The study's tables (markdown lines); experiments with their own tables override it."""
        return correlation_table(self.spec, study, o) + [
            f"Reproduce: `{self.correlate_command(study, study.name)}` (in `{self.outdir}`).", "",
        ] + comparison_table(o.comparisons, self.correlate_command(study, study.name)) + self.subset_sections(study, o)  # fmt: skip

    def subset_sections(self, study: Study, o: StudyOutcome) -> list[str]:
        """Per subset of the spec: its correlation table, command and paired comparisons."""
        lines: list[str] = []
        for sub in o.subsets:
            cmd = self.correlate_command(study, study.name, sub["expr"], sub["axes"])
            part = StudyOutcome(
                o.name,
                o.folder,
                models=o.models,
                converged=o.converged,
                correlation=sub["correlation"],
            )
            lines += [
                f"### Subset: {sub['title']}",
                "",
                f"The converged models with `{sub['where']}`, correlated alone (Ψ over {', '.join(sub['axes']) or 'no axis'}):",
                "",
            ]
            lines += correlation_table(
                self.spec,
                Study(study.name, study.title, {}, {}, study.grid, sub["axes"], None),
                part,
            )
            lines += [f"Reproduce: `{cmd}` (in `{self.outdir}`).", ""]
            lines += comparison_table(sub["comparisons"], cmd)
        return lines
