"""Train the demo zoo and run the measure pipeline on it."""

from __future__ import annotations

import csv
import itertools
import math
import time
from pathlib import Path

import torch
import yaml

from ..loading.data import digits_split
from .models import MLP

# width × weight decay × label-noise fraction: 8 models
ZOO_GRID = {"width": [64, 256], "weight_decay": [0.0, 1e-4], "label_noise": [0.0, 0.2]}
TARGET_LOSS = 0.01
MAX_STEPS = 6000

def default_measures() -> list:
    """The demo's measure list (``flatcli/demo/measures.yaml``; configuration, not code)."""
    return yaml.safe_load((Path(__file__).parent / "measures.yaml").read_text())


def _noisy_labels(y: torch.Tensor, frac: float, seed: int) -> torch.Tensor:
    if frac <= 0:
        return y
    g = torch.Generator().manual_seed(10_000 + seed)
    y = y.clone()
    n = len(y)
    idx = torch.randperm(n, generator=g)[: int(round(frac * n))]
    y[idx] = torch.randint(0, 10, (len(idx),), generator=g)
    return y


def train_to_target(model, x, y, weight_decay: float, target: float = TARGET_LOSS, max_steps: int = MAX_STEPS, lr: float = 2e-3,
                    on_step=None):
    """Full-batch Adam until the train cross-entropy (eval mode, no regularizer) is ≤ target.

    ``on_step(step, model)``, when given, is called after every optimizer step (e.g. to save a
    trajectory, `flatcli.demo.trajectory`); it must not change the model."""
    torch.set_flush_denormal(True)  # denormals slow CPU training by 10x near the target
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=0.0)
    lossf = torch.nn.functional.cross_entropy
    steps = 0
    loss = math.inf
    while steps < max_steps:
        model.train()
        opt.zero_grad()
        out = model(x)
        objective = lossf(out, y)
        if weight_decay:
            objective = objective + 0.5 * weight_decay * sum((p * p).sum() for n, p in model.named_parameters() if "weight" in n)
        objective.backward()
        opt.step()
        steps += 1
        if on_step is not None:
            on_step(steps, model)
        if steps % 10 == 0:
            model.eval()
            with torch.no_grad():
                loss = float(lossf(model(x), y))
            if loss <= target:
                break
    return steps, loss


def model_name(hp: dict) -> str:
    """The zoo's name of the model with hyperparameters ``hp`` (width, weight_decay, label_noise)."""
    return f"mlp_w{hp['width']}_wd{hp['weight_decay']:g}_noise{hp['label_noise']:g}"


def train_zoo(outdir: Path, seed: int = 0, log=print) -> Path:
    """Train every model of `ZOO_GRID`; write checkpoints, a manifest CSV and a config. Returns the config path."""
    outdir = Path(outdir)
    ck = outdir / "checkpoints"
    ck.mkdir(parents=True, exist_ok=True)
    x, y = digits_split("train")
    rows = []
    keys = list(ZOO_GRID)
    for i, values in enumerate(itertools.product(*ZOO_GRID.values())):
        hp = dict(zip(keys, values, strict=True))
        name = model_name(hp)
        path = ck / f"{name}.pt"
        torch.manual_seed(seed * 1000 + i)
        model = MLP(64, hp["width"], 2, 10)
        init = {k: v.clone() for k, v in model.state_dict().items()}
        yn = _noisy_labels(y, hp["label_noise"], seed)  # one noisy training set per noise level
        t0 = time.perf_counter()
        steps, loss = train_to_target(model, x, yn, hp["weight_decay"])
        mk = {"in_features": 64, "width": hp["width"], "depth": 2, "num_classes": 10}
        torch.save({"state_dict": model.state_dict(), "model_kwargs": mk, "hparams": hp}, path)
        torch.save({"state_dict": init, "model_kwargs": mk}, ck / f"{name}.init.pt")
        data_path = outdir / "data" / f"train_noise{hp['label_noise']:g}_seed{seed}.pt"
        if not data_path.exists():
            data_path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"x": x, "y": yn}, data_path)
        log(f"trained {name}: {steps} steps, train CE on its labels {loss:.4f} ({time.perf_counter() - t0:.1f}s)")
        rows.append({"path": f"checkpoints/{name}.pt", "init_checkpoint": f"checkpoints/{name}.init.pt",
                     "train_data": str(data_path.relative_to(outdir)), **hp,
                     "steps": steps, "reached_target": int(loss <= TARGET_LOSS)})
    with open(outdir / "manifest.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    from ..measures import list_measures

    known = {m.name for m in list_measures()}
    measures = [m for m in default_measures() if (m if isinstance(m, str) else next(iter(m))) in known]
    cfg = {
        "model": {"target": "flatcli.demo.models:MLP", "kwargs": {"in_features": 64, "width": 64, "depth": 2, "num_classes": 10}},
        "checkpoints": {"manifest": "manifest.csv"},
        "data": {"train": {"source": "digits"}, "test": {"source": "digits"}},
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


def run_demo(outdir, measures=None, seed: int = 0, console=None, workers: int | None = None,
             threads: int | str | None = None, wide: bool = False):
    """The full pipeline on the zoo: train (skipped when its checkpoints exist), sweep (local, CPU),
    collect, correlate with the gap over the zoo's grid, and plot (when matplotlib is installed).

    Writes ``OUTDIR/sweep/`` (plan and one file per checkpoint × measure; rerunning resumes),
    ``OUTDIR/results/results.csv``, ``results.json``, ``correlations.csv`` and ``plots/``.
    ``threads`` sizes the sweep workers' intra-op threads (``runtime.threads``, `flatcli.threads`);
    tables fit a terminal's width unless ``wide``.
    Returns the `flatcli.analysis.CorrelationReport`.
    """
    import importlib.util

    from rich.console import Console
    from rich.table import Table

    from .. import api
    from ..analysis.report import notes, render_table
    from ..console import fit_width, print_table, render_rows

    console = console or Console()
    outdir = Path(outdir)
    t0 = time.perf_counter()
    cfg_path = outdir / "config.yaml"
    if not (cfg_path.exists() and (outdir / "manifest.csv").exists()):
        console.print(f"training {len(list(itertools.product(*ZOO_GRID.values())))} MLPs on digits to train CE ≤ {TARGET_LOSS} ...")
        cfg_path = train_zoo(outdir, seed=seed, log=lambda m: console.print("  " + m, highlight=False, soft_wrap=True))
    else:
        console.print(f"reusing the zoo in {outdir} (delete it to retrain)")
    t1 = time.perf_counter()

    def log(msg: str) -> None:
        console.print("  " + msg, highlight=False, markup=False, soft_wrap=True)

    sweep_dir = outdir / "sweep"
    rep = api.sweep(cfg_path, sweep_dir, measures=measures, workers=workers, device="cpu", log=log, threads=threads)
    console.print(f"sweep: {rep.lines[0]}; {rep.computed} units computed in {rep.seconds:.1f}s", highlight=False, soft_wrap=True)
    t2 = time.perf_counter()
    results = outdir / "results"
    col = api.collect(sweep_dir, results / "results.csv")
    width = fit_width(console, wide)
    print_table(console, render_rows(col.rows, col.labels, width), wide)
    tt = Table(title="wall time per measure (this and earlier runs of the sweep)", header_style="bold", title_justify="left")
    for name in ("measure", "total s", "s / checkpoint", "checkpoints"):
        tt.add_column(name, justify="left" if name == "measure" else "right")
    for lab, total, mean, k in sorted(measure_times(col), key=lambda t: -t[1]):
        tt.add_row(lab, f"{total:.2f}", f"{mean:.2f}", str(k))
    print_table(console, tt)
    plots = importlib.util.find_spec("matplotlib") is not None
    corr = api.correlate(results / "results.csv", by=list(ZOO_GRID), outdir=results, plots=plots,
                         color_by="label_noise")  # label noise drives the gap: colour by it
    print_table(console, render_table(corr, width), wide)
    for n in notes(corr):
        console.print(f"note: {n}", highlight=False, soft_wrap=True)
    t3 = time.perf_counter()
    console.print(
        f"training {t1 - t0:.1f}s, sweep {t2 - t1:.1f}s, collect + correlate{' + plots' if plots else ''} "
        f"{t3 - t2:.1f}s; results in {results} (results.csv, results.json, correlations.csv"
        + (", plots/" if plots else "") + ")",
        highlight=False, soft_wrap=True,
    )
    return corr
