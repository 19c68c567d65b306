"""Pilot for experiment 1's regularizer grid: which strengths of the l2 penalty, AdamW's
decoupled weight decay and dropout move the generalization gap, and which can still be trained
to the convergence criterion (`flatcli.training.Plateau`).

One regularizer at a time (the others off), one seed, on the MLPs and data of the
``ns_regularization`` spec; prints one row per model: steps, train CE and accuracy (eval mode),
test accuracy, gap, whether the criterion held. Run from the repository root:

    OMP_NUM_THREADS=1 python scripts/pilot_regularizers.py [--study mnist1d|digits] [--seed 0]
"""

from __future__ import annotations

import argparse
import time

import torch

from flatcli.experiments import load_spec
from flatcli.experiments.pipeline import absolute_paths
from flatcli.training import Plateau, Recipe, _training_data, evaluate, train_to_target

LEVELS = {
    "l2": [1e-4, 3e-4, 1e-3, 3e-3, 1e-2],
    "weight_decay": [0.03, 0.1, 0.3, 1.0, 3.0],
    "dropout": [0.1, 0.2, 0.3, 0.5],
}


def test_split(data: dict, base_dir: str):
    from flatcli.config import from_dict
    from flatcli.pipeline import DataCache

    cfg = from_dict({"data": data, "checkpoints": []}, base_dir=base_dir, env={})
    t = DataCache(cfg).get("test")
    return t["x"], t["y"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--study", default="mnist1d")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-steps", type=int, default=30000)
    ap.add_argument("--width", type=int, default=None, help="the MLP's width (default the spec's)")
    ap.add_argument(
        "--runs",
        default="",
        help="e.g. none:0,l2:3e-4,dropout:0.2 (default: every level of LEVELS)",
    )
    args = ap.parse_args()
    spec = load_spec("ns_regularization")
    study = next(s for s in spec.studies if s.name == args.study)
    flat = absolute_paths(study.flatcli, spec.path.parent)
    x, y, _, _ = _training_data(flat["data"], str(spec.path.parent))
    xt, yt = test_split(flat["data"], str(spec.path.parent))
    from flatcli.loading.models import build_model

    crit = Plateau()
    print(
        f"# {args.study} (width {args.width or 'as in the spec'}): adamw lr {args.lr}, batch {args.batch_size}, "
        f"seed {args.seed}; {crit.describe()}"
    )
    print("regularizer,strength,steps,train_ce,train_acc,test_acc,gap,met,seconds")
    runs = [("none", 0.0)] + [(k, v) for k, vals in LEVELS.items() for v in vals]
    if args.runs:
        runs = [(r.split(":")[0], float(r.split(":")[1])) for r in args.runs.split(",")]
    for reg, val in runs:
        torch.manual_seed(args.seed)
        kwargs = dict(flat["model"].get("kwargs", {}))
        if args.width:
            kwargs["width"] = args.width
        if reg == "dropout":
            kwargs["dropout"] = val
        model = build_model(flat["model"]["target"], kwargs, spec.path.parent)
        recipe = Recipe(
            optimizer="adamw",
            lr=args.lr,
            batch_size=args.batch_size,
            max_steps=args.max_steps,
            l2=val if reg == "l2" else 0.0,
            weight_decay=val if reg == "weight_decay" else 0.0,
        )
        t0 = time.perf_counter()
        r = train_to_target(model, x, y, recipe, seed=args.seed, criterion=crit)
        te = evaluate(model, xt, yt)
        print(
            f"{reg},{val:g},{r.steps},{r.train_loss:.4f},{r.train_acc:.4f},{te.accuracy:.4f},"
            f"{r.train_acc - te.accuracy:.4f},{int(r.reached_target)},{time.perf_counter() - t0:.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
