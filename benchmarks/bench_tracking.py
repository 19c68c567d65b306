"""Curvature during training (`flatcli.tracking.Tracker`): products per evaluation of warm-started
against cold-started Lanczos over a training run, and the tracker's overhead under ``budget``.

1. Warm against cold. A tanh MLP (20-64-64-10, 6,154 parameters) trained by mini-batch SGD on
   class-structured data; two trackers over the same model and tracking set (256 samples) evaluate
   ``hessian_lambda_max`` (tol 1e-3) and ``hessian_top_eigenvalues`` (top 3, tol 1e-3) every
   ``--every`` steps, one warm (``cold_every`` larger than the run) and one cold. Per evaluation:
   the products each spent and the two values; the summary gives the mean products after the first
   evaluation and their ratio (target: warm ≤ 0.5 × cold), and the largest relative difference of
   the values (both meet the same residual test). Products are counts, not timings: they do not
   depend on the machine's load.
2. Overhead at a budget. The same training with a tracker at ``budget`` (default 0.1) measuring
   ``hessian_lambda_max``: the tracker's seconds over the training's seconds as the tracker keeps
   them (`flatcli.tracking.Schedule`), and the same ratio from outside (wall time of the tracked
   run over that of an untracked run, minus one). Timings: on a loaded machine they move.

    OMP_NUM_THREADS=1 python -m benchmarks.bench_tracking          # about a minute on one core
    python -m benchmarks.bench_tracking --steps 400 --every 10

The result goes to docs/benchmarks/data/tracking.json (``--json`` elsewhere).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch import nn

from benchmarks._common import class_structured_data, json_arg, table, write_json
from flatcli.tracking import Tracker, TrackOptions

MEASURES = [
    {"hessian_lambda_max": {"tol": 1e-3}},
    {"hessian_top_eigenvalues": {"top_k": 3, "tol": 1e-3}},
]


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10)
    )
    x, y = class_structured_data(2048, seed, classes=10, noise=2.0, shape=(20,))
    return model, x, y


def _train(model, x, y, steps: int, on_step, lr: float = 0.05, batch: int = 64):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for s in range(steps):
        idx = torch.randint(0, len(x), (batch,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
        on_step(s, opt)


def warm_vs_cold(steps: int, every: int) -> list[dict]:
    model, x, y = _setup()
    track = (x[:256], y[:256])
    warm = Tracker(
        model, track, measures=MEASURES, every=every, options=TrackOptions(cold_every=10**6)
    )
    cold = Tracker(model, track, measures=MEASURES, every=every, options=TrackOptions(warm=False))
    _train(
        model,
        x,
        y,
        steps,
        lambda s, opt: (warm.step(s, optimizer=opt), cold.step(s, optimizer=opt)),
    )
    return [{"warm": w, "cold": c} for w, c in zip(warm.rows, cold.rows, strict=True)]


def overhead(steps: int, budget: float) -> dict:
    model, x, y = _setup()
    t0 = time.perf_counter()
    _train(model, x, y, steps, lambda s, opt: None)
    plain = time.perf_counter() - t0
    model, x, y = _setup()
    tracker = Tracker(model, (x[:256], y[:256]), measures=MEASURES[:1], budget=budget)
    t0 = time.perf_counter()
    _train(model, x, y, steps, lambda s, opt: tracker.step(s, optimizer=opt))
    tracked = time.perf_counter() - t0
    sch = tracker.schedule
    return {
        "budget": budget,
        "evaluations": sch.evaluations,
        "tracker seconds": sch.spent,
        "training seconds": sch.trained,
        "overhead (tracker)": sch.overhead,
        "overhead (wall, tracked/untracked − 1)": tracked / plain - 1,
    }


def _summary(pairs: list[dict], every: int) -> list[list]:
    out = []
    for m in ("hessian_lambda_max", "hessian_top_eigenvalues"):
        wn = float(np.mean([p["warm"][f"{m}_n_hvp"] for p in pairs[1:]]))
        cn = float(np.mean([p["cold"][f"{m}_n_hvp"] for p in pairs[1:]]))
        diff = max(abs(p["warm"][m] - p["cold"][m]) / abs(p["cold"][m]) for p in pairs)
        out.append([m, every, len(pairs), cn, wn, wn / cn, float(diff)])
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="training steps of part 1")
    ap.add_argument(
        "--every", type=int, nargs="+", default=[1, 5, 10], help="steps between evaluations"
    )
    ap.add_argument("--overhead-steps", type=int, default=3000, help="training steps of part 2")
    ap.add_argument("--budget", type=float, default=0.1, help="overhead budget (part 2)")
    json_arg(ap, "tracking")
    args = ap.parse_args(argv)
    summary, rows = [], []
    for every in args.every:
        pairs = warm_vs_cold(args.steps, every)
        summary += _summary(pairs, every)
        if every == args.every[0]:
            for p in pairs:
                w, c = p["warm"], p["cold"]
                n = [
                    r[f"{m}_n_hvp"]
                    for m in ("hessian_lambda_max", "hessian_top_eigenvalues")
                    for r in (w, c)
                ]
                vals = [w["hessian_lambda_max"], c["hessian_lambda_max"]]
                rows.append([w["step"], *n, *vals, c["hessian_top_eigenvalues_lambda_1"]])
    ov = overhead(args.overhead_steps, args.budget)
    tables = [
        table(
            "Products per evaluation after the first, warm against cold",
            [
                "measure",
                "every",
                "evaluations",
                "cold (mean)",
                "warm (mean)",
                "warm / cold",
                "largest relative difference of values",
            ],
            summary,
            note="Counts of Hessian-vector products at the same tolerance (1e-3); the first evaluation of both is cold. "
            "The farther apart the evaluations, the more the Hessian moves between them and the less the warm start saves. "
            "A difference of values above the tolerance means one run met the residual test on a neighbouring eigenvalue: "
            "a Ritz value is at most λmax, so the larger is the closer (the top-3 column of the next table tells which).",
        ),
        table(
            f"Per evaluation (every {args.every[0]})",
            [
                "step",
                "λmax products warm",
                "λmax products cold",
                "top-3 products warm",
                "top-3 products cold",
                "λmax value (warm)",
                "λmax value (cold)",
                "λ1 of the top-3 (cold)",
            ],
            rows,
        ),
        table(
            f"Overhead at budget={args.budget}",
            list(ov),
            [list(ov.values())],
            note="Wall-clock seconds; the figures move with the machine's load (a shared CPU moves them much).",
        ),
    ]
    print(
        write_json(
            "tracking",
            "Curvature during training: warm starts and the overhead budget",
            tables,
            args.json,
        )
    )


if __name__ == "__main__":
    main()
