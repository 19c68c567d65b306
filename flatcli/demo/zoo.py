"""Train the demo zoo (`flatcli.training`, the experiments' training module) and run the measure
pipeline on it."""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from pathlib import Path

import yaml

from .. import api
from ..analysis.rendering import notes, render_table
from ..config import safe_yaml
from ..console import fit_width, print_table, render_rows
from ..extras import have_matplotlib
from ..measures import list_measures
from ..training import (
    LossTarget,
    Recipe,
    TrainTask,
    default_jobs,
    model_name,
    run_tasks,
    write_manifest,
)

# width × weight decay × label-noise fraction: 8 models
ZOO_GRID = {"width": [64, 256], "weight_decay": [0.0, 1e-4], "label_noise": [0.0, 0.2]}
TARGET_LOSS = 0.01
# Full-batch Adam; weight_decay is Adam's coupled L2 penalty on the weight matrices. float64 and one
# thread (flatcli.training): the same weights for any thread count, and CPU kernels' rounding
# differences stay ~1e-13 instead of changing the number of steps (checkpoints are float32).
RECIPE = Recipe(
    optimizer="adam", lr=2e-3, batch_size=None, max_steps=6000, eval_every=10, dtype="float64"
)
SHORT_NAMES = {"width": "w", "weight_decay": "wd", "label_noise": "noise"}
DATA = {"train": {"source": "digits"}, "test": {"source": "digits"}}


def default_measures() -> list:
    """The demo's measure list (``flatcli/demo/measures.yaml``; configuration, not code)."""
    return safe_yaml((Path(__file__).parent / "measures.yaml").read_text())


def zoo_tasks(outdir: str | Path, seed: int = 0) -> list[TrainTask]:
    """One `TrainTask` per model of `ZOO_GRID`, in grid order: initialization seed ``seed·1000 +
    index``, one noisy training set per noise level (noise seed ``seed``), named like
    ``mlp_w64_wd0_noise0.2``."""
    keys = list(ZOO_GRID)
    tasks = []
    for i, values in enumerate(itertools.product(*ZOO_GRID.values())):
        hp = dict(zip(keys, values, strict=True))
        tasks.append(TrainTask(
            name=model_name(hp, prefix="mlp", short=SHORT_NAMES), outdir=str(outdir), model_target="flatcli.demo.models:MLP",
            model_kwargs={"in_features": 64, "width": hp["width"], "depth": 2, "num_classes": 10}, data=DATA,
            recipe=dataclasses.replace(RECIPE, weight_decay=hp["weight_decay"]), hparams=hp,
            criterion=LossTarget(TARGET_LOSS), seed=seed * 1000 + i, noise_seed=seed, label_noise=hp["label_noise"],
        ))  # fmt: skip
    return tasks


def train_zoo(outdir: Path, seed: int = 0, log=print, jobs: int | None = None) -> Path:
    """Train every model of `ZOO_GRID` (``jobs`` single-threaded processes, default one per core up
    to 2: the weights do not depend on it); write checkpoints, manifest.csv, training.csv and a
    config. Returns the config path."""
    outdir = Path(outdir)
    records = run_tasks(
        zoo_tasks(outdir, seed), jobs=default_jobs() if jobs is None else jobs, log=log
    )
    write_manifest(outdir, records, list(ZOO_GRID))

    known = {m.name for m in list_measures()}
    measures = [
        m for m in default_measures() if (m if isinstance(m, str) else next(iter(m))) in known
    ]
    cfg = {
        "model": {
            "target": "flatcli.demo.models:MLP",
            "kwargs": {"in_features": 64, "width": 64, "depth": 2, "num_classes": 10},
        },
        "checkpoints": {"manifest": "manifest.csv"},
        "data": DATA,
        "measure_data": {"split": "train", "num_samples": "all", "batch_size": 1024, "seed": 0},
        "loss": "cross_entropy",
        "measures": measures,
        "runtime": {"device": "cpu", "seed": seed},
        "output": {"dir": "results"},
    }
    path = outdir / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def kendall_table(rows, labels, target="gen_gap"):
    """Kendall τ-b of each measure against ``target`` over ok rows: [(label, tau, n)], best first."""
    from scipy.stats import kendalltau

    out = []
    for lab in labels:
        pairs = [
            (r.results[lab].value, r.metrics[target])
            for r in rows
            if lab in r.results and target in r.metrics and math.isfinite(r.results[lab].value)
        ]
        if len(pairs) < 3:
            out.append((lab, float("nan"), len(pairs)))
            continue
        a, b = zip(*pairs, strict=True)
        tau = kendalltau(a, b).statistic
        out.append((lab, float(tau), len(pairs)))
    return sorted(out, key=lambda t: -t[1] if math.isfinite(t[1]) else math.inf)


def measure_times(collected) -> list[tuple[str, float, float, int]]:
    """(label, total seconds, mean seconds per checkpoint, checkpoints) from a `CollectReport`."""
    out = []
    for lab in collected.labels:
        secs = collected.seconds_by_label.get(lab, [])
        out.append((lab, sum(secs), sum(secs) / len(secs) if secs else math.nan, len(secs)))
    return out


def run_demo(
    outdir,
    measures=None,
    seed: int = 0,
    console=None,
    workers: int | None = None,
    threads: int | str | None = None,
    wide: bool = False,
):
    """The full pipeline on the zoo: train (skipped when its checkpoints exist), sweep (local, CPU),
    collect, correlate with the gap over the zoo's grid, and plot (when matplotlib is installed).

    Writes ``OUTDIR/sweep/`` (plan and one file per checkpoint × measure; rerunning resumes),
    ``OUTDIR/results/results.csv``, ``results.json``, ``correlations.csv`` and ``plots/``, and
    the results page ``OUTDIR/report.html`` (`flatcli.api.report`; with the report extra).
    ``threads`` sizes the sweep workers' intra-op threads (``runtime.threads``, `flatcli.threads`);
    tables fit a terminal's width unless ``wide``.
    Returns the `flatcli.analysis.CorrelationReport`.
    """
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    outdir = Path(outdir)
    t0 = time.perf_counter()
    cfg_path = outdir / "config.yaml"
    if not (cfg_path.exists() and (outdir / "manifest.csv").exists()):
        console.print(
            f"training {len(list(itertools.product(*ZOO_GRID.values())))} MLPs on digits to train CE ≤ {TARGET_LOSS} ..."
        )
        cfg_path = train_zoo(
            outdir,
            seed=seed,
            log=lambda m: console.print("  " + m, highlight=False, soft_wrap=True, markup=False),
        )
    else:
        console.print(f"reusing the zoo in {outdir} (delete it to retrain)")
    t1 = time.perf_counter()

    def log(msg: str) -> None:
        console.print("  " + msg, highlight=False, markup=False, soft_wrap=True)

    sweep_dir = outdir / "sweep"
    rep = api.sweep(
        cfg_path,
        sweep_dir,
        measures=measures,
        run=api.RunOptions(device="cpu", threads=threads),
        options=api.SweepOptions(workers=workers),
        log=log,
    )
    console.print(
        f"sweep: {rep.lines[0]}; {rep.computed} units computed in {rep.seconds:.1f}s",
        highlight=False,
        soft_wrap=True,
    )
    t2 = time.perf_counter()
    results = outdir / "results"
    col = api.collect_report(sweep_dir, results)
    width = fit_width(console, wide)
    print_table(console, render_rows(col.rows, col.labels, width), wide)
    tt = Table(
        title="wall time per measure (this and earlier runs of the sweep)",
        header_style="bold",
        title_justify="left",
    )
    for name in ("measure", "total s", "s / checkpoint", "checkpoints"):
        tt.add_column(name, justify="left" if name == "measure" else "right")
    for lab, total, mean, k in sorted(measure_times(col), key=lambda t: -t[1]):
        tt.add_row(lab, f"{total:.2f}", f"{mean:.2f}", str(k))
    print_table(console, tt)
    plots = have_matplotlib()
    corr = api.correlate_report(
        results / "results.csv",
        by=list(ZOO_GRID),
        outdir=results,
        plots=plots,
        color_by="label_noise",
    )  # label noise drives the gap: colour by it
    print_table(console, render_table(corr, width), wide)
    for n in notes(corr):
        console.print(f"note: {n}", highlight=False, soft_wrap=True)
    page = _report_page(outdir, results)
    t3 = time.perf_counter()
    console.print(
        f"training {t1 - t0:.1f}s, sweep {t2 - t1:.1f}s, collect + correlate{' + plots' if plots else ''} "
        f"{t3 - t2:.1f}s; results in {results} (results.csv, results.json, correlations.csv"
        + (", plots/" if plots else "")
        + ")"
        + (f"; the results page: {page}" if page else ""),
        highlight=False,
        soft_wrap=True,
    )
    return corr


def _report_page(outdir: Path, results: Path) -> Path | None:
    """``OUTDIR/report.html``, the results page of the zoo (`flatcli.api.report`, with the axes and
    colouring of the demo's correlate); None without the report extra (matplotlib and Jinja2)."""
    import importlib.util

    if not all(importlib.util.find_spec(m) for m in ("matplotlib", "jinja2")):
        return None
    page = api.report(
        results / "results.csv",
        outdir / "report.html",
        by=list(ZOO_GRID),
        color_by="label_noise",
        bootstrap=1000,
    )
    return page.path
