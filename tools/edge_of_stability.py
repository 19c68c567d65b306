"""The edge of stability, reproduced with `flatcli.tracking.Tracker` (docs/experiments/edge_of_stability).

Full-batch gradient descent on a small tanh network under MSE at three step sizes η, λmax tracked
every few steps (warm-started Lanczos, tol 1e-3); then full-batch Adam with its preconditioned
sharpness against (2 + 2β₁)/((1 − β₁)η) (Cohen et al. 2021; 2022). The data: 256 inputs in 8
dimensions, targets from a fixed random tanh teacher with noise. Everything is seeded; one torch
thread.

    OMP_NUM_THREADS=1 python tools/edge_of_stability.py run      # a few minutes on one core
    python tools/edge_of_stability.py render                     # the figure from the JSON
    python tools/edge_of_stability.py summarize                  # the summary from the rows

``run`` writes docs/experiments/edge_of_stability/eos.json (every tracked row of every run and the
summary); ``render`` draws eos.png from that file alone.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from flatcli.tracking import Tracker, TrackOptions

OUT = Path(__file__).resolve().parents[1] / "docs" / "experiments" / "edge_of_stability"
GD_LRS = (0.04, 0.06, 0.08)
ADAM_LR, BETA1 = 1e-2, 0.9


def problem(seed: int = 0):
    """(x, y) of the teacher and a fresh student network."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 8, generator=g)
    teacher = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 1.5)
        y = teacher(x) + 0.1 * torch.randn(256, 1, generator=g)
    torch.manual_seed(seed + 1)
    student = nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
    )
    return x, y, student


def run_one(opt_name: str, lr: float, steps: int, every: int) -> dict:
    """One full-batch run; the tracked rows and the wall times."""
    x, y, model = problem()
    if opt_name == "gd":
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        measures = [{"hessian_lambda_max": {"tol": 1e-3}}]
    else:
        opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(BETA1, 0.999))
        measures = [
            {"preconditioned_lambda_max": {"tol": 1e-3}},
            {"hessian_lambda_max": {"tol": 1e-3}},
        ]
    tracker = Tracker(model, (x, y), "mse", measures, every=every, options=TrackOptions(seed=0))
    losses = []
    t0 = time.perf_counter()
    for s in range(steps):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).sum(1).mean()  # flatcli's mse: the tracked loss
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        tracker.step(s, optimizer=opt)
    wall = time.perf_counter() - t0
    keep = ("step", "lr", "tracking_loss", "hessian_lambda_max", "hessian_lambda_max_status")
    keep += (
        "hessian_lambda_max_n_hvp",
        "preconditioned_lambda_max",
        "preconditioned_lambda_max_threshold",
    )
    keep += ("preconditioned_lambda_max_status", "preconditioned_lambda_max_n_hvp")
    rows = [{k: r[k] for k in keep if k in r} for r in tracker.rows]
    sch = tracker.schedule
    return {
        "optimizer": opt_name,
        "lr": lr,
        "steps": steps,
        "every": every,
        "rows": rows,
        "train_loss": losses[::every],
        "tracker_seconds": sch.spent,
        "training_seconds": sch.trained,
        "overhead": sch.overhead,
        "wall_seconds": wall,
    }


def settle(run: dict, key: str, threshold) -> dict:
    """Where ``key`` sits relative to its threshold once settled: over the tracked steps from the
    later of the run's midpoint and the first step within 10% of the threshold, the median, 10th
    and 90th percentiles of value/threshold (and the window's first step)."""
    rows = run["rows"]
    ratio = np.array([r[key] / threshold(r) for r in rows if r.get(key) is not None])
    steps = np.array([r["step"] for r in rows if r.get(key) is not None])
    reached = np.nonzero(ratio >= 0.9)[0]
    first = int(steps[reached[0]]) if len(reached) else None
    start = max(first if first is not None else steps[-1], run["steps"] // 2)
    tail = ratio[steps >= start]
    out = {"first_within_10pct": first, "window_from": int(start)}
    out.update(
        median=float(np.median(tail)),
        p10=float(np.percentile(tail, 10)),
        p90=float(np.percentile(tail, 90)),
        start=float(ratio[0]),
        max=float(ratio.max()),
    )
    return out


def summarize(runs: list[dict]) -> list[dict]:
    """The settled ratios (`settle`) and the tracking overhead of every run."""
    summary = []
    for r in runs:
        if r["optimizer"] == "gd":
            s = settle(r, "hessian_lambda_max", lambda row: 2.0 / row["lr"])
        else:
            s = settle(
                r,
                "preconditioned_lambda_max",
                lambda row: row["preconditioned_lambda_max_threshold"],
            )
        summary.append({"optimizer": r["optimizer"], "lr": r["lr"], **s, "overhead": r["overhead"]})
    return summary


def run(args) -> None:
    runs = [run_one("gd", lr, args.steps, args.every) for lr in GD_LRS]
    runs.append(run_one("adam", ADAM_LR, args.steps, args.every))
    write(runs)


def write(runs: list[dict]) -> None:
    """eos.json: the command, the summary and every run's rows."""
    summary = summarize(runs)
    OUT.mkdir(parents=True, exist_ok=True)
    doc = {
        "command": "OMP_NUM_THREADS=1 python tools/edge_of_stability.py run",
        "torch": torch.__version__,
        "summary": summary,
        "runs": runs,
    }
    (OUT / "eos.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


def render(args) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    doc = json.loads((OUT / "eos.json").read_text())
    runs = doc["runs"]
    fig = Figure(figsize=(10, 6.5), layout="constrained")
    FigureCanvasAgg(fig)
    (a, b), (c, d) = fig.subplots(2, 2)
    for i, r in enumerate(x for x in runs if x["optimizer"] == "gd"):
        steps = [row["step"] for row in r["rows"]]
        a.plot(
            steps,
            [row["hessian_lambda_max"] for row in r["rows"]],
            color=f"C{i}",
            lw=1,
            label=f"η = {r['lr']}",
        )
        a.axhline(2 / r["lr"], color=f"C{i}", ls="--", lw=0.8)
        b.semilogy(
            [k * r["every"] for k in range(len(r["train_loss"]))],
            r["train_loss"],
            color=f"C{i}",
            lw=1,
        )
    a.set(title="GD: λmax and 2/η (dashed)", xlabel="step", ylabel="λmax")
    a.legend(fontsize=8)
    b.set(title="GD: training loss", xlabel="step", ylabel="MSE")
    adam = next(x for x in runs if x["optimizer"] == "adam")
    steps = [row["step"] for row in adam["rows"]]
    c.plot(
        steps,
        [row["preconditioned_lambda_max"] for row in adam["rows"]],
        color="C3",
        lw=1,
        label="λmax(P⁻¹H)",
    )
    c.plot(
        steps,
        [row["preconditioned_lambda_max_threshold"] for row in adam["rows"]],
        "k--",
        lw=0.8,
        label="(2+2β₁)/((1−β₁)η)",
    )
    c.set(title=f"Adam (η = {adam['lr']}): preconditioned sharpness", xlabel="step")
    c.legend(fontsize=8)
    d.plot(
        steps,
        [row["hessian_lambda_max"] for row in adam["rows"]],
        color="C4",
        lw=1,
        label="λmax(H)",
    )
    d.axhline(2 / adam["lr"], color="k", ls=":", lw=0.8, label="2/η")
    d.set(title="Adam: λmax of H itself", xlabel="step", yscale="log")
    d.legend(fontsize=8)
    fig.savefig(OUT / "eos.png", dpi=100)
    print(OUT / "eos.png")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train and track; write eos.json")
    r.add_argument("--steps", type=int, default=3000)
    r.add_argument("--every", type=int, default=20)
    sub.add_parser("render", help="draw eos.png from eos.json")
    sub.add_parser("summarize", help="recompute eos.json's summary from its rows")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.cmd == "summarize":
        write(json.loads((OUT / "eos.json").read_text())["runs"])
        return
    (run if args.cmd == "run" else render)(args)


if __name__ == "__main__":
    main()
