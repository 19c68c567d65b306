"""What ``flatcli measure -m all`` costs at default settings on the tiny GPT-2 of issue 26, per measure,
for one or more checkouts of flatcli side by side (README "Budgets").

The model and data: a GPT-2 from a config with random weights (``torch.manual_seed(0)``; 2 layers,
width 32, 2 heads, vocabulary 100, 32 positions: 29,696 parameters), written with save_pretrained;
64 train and 64 test sequences of 32 tokens (ids 2..99 from one generator seeded 0), ``causal_lm``,
all 64 train sequences measured in one batch. Each checkout runs
``python -m flatcli measure -c gpt2.yaml -m all --threads 1`` in a fresh process started in the
checkout's folder (so that it imports that checkout's flatcli), one after the other; the table gives each measure's ``<label>_seconds`` and products
(``_n_hvp``, ``_n_grad``) from results.csv, its value ± stderr and status, the sum of the seconds
(measuring) and each process's wall time, and the load average before and after each run (a
shared machine: seconds are upper bounds; compare checkouts run in one call).

    python -m benchmarks.bench_all_defaults --code /path/to/main --code .   # ~15 min at load 8, 2 cores
    python -m benchmarks.bench_all_defaults --code . --budget 30s
    python -m benchmarks.bench_all_defaults --code . --budget-property

``--budget-property`` runs the first checkout three times: without a budget, with a budget twice
its measuring seconds (every status and value must be the unbudgeted one) and with half of them
(the seconds spent must be 60–125% of the budget), and prints the three side by side.
The result goes to docs/benchmarks/data/all_defaults.json (``--json`` elsewhere).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._common import Tables, json_arg, write_json

CONFIG = {
    "model": {
        "source": "huggingface",
        "class": "AutoModelForCausalLM",
        "kwargs": {"attn_implementation": "eager"},
    },
    "checkpoints": ["ckpt"],
    "data": {
        "train": {"source": "tensors", "path": "train.pt"},
        "test": {"source": "tensors", "path": "test.pt"},
    },
    "measure_data": {"split": "train", "num_samples": 64, "batch_size": 64, "seed": 0},
    "loss": "causal_lm",
    "runtime": {"device": "cpu", "seed": 0},
}


def build(folder: Path) -> Path:
    """The checkpoint, the two splits and gpt2.yaml in ``folder``; returns the config's path."""
    import torch
    import transformers as tf

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    cfg = tf.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=100,
        n_positions=32,
        use_cache=False,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
    )
    tf.GPT2LMHeadModel(cfg).save_pretrained(folder / "ckpt")
    g = torch.Generator().manual_seed(0)
    for split in ("train", "test"):
        ids = torch.randint(2, 100, (64, 32), generator=g)
        torch.save(
            {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, folder / f"{split}.pt"
        )
    path = folder / "gpt2.yaml"
    path.write_text(json.dumps(CONFIG, indent=1))  # JSON is YAML
    return path


def run(config: Path, code: Path, out: Path, budget: str | None) -> dict:
    """One ``flatcli measure -m all --threads 1`` process with ``PYTHONPATH=code``: its results row,
    wall seconds and load averages."""
    cmd = [
        sys.executable,
        "-m",
        "flatcli",
        "measure",
        "-c",
        str(config),
        "-m",
        "all",
        "--threads",
        "1",
        "-o",
        str(out),
    ] + (["--budget", budget] if budget else [])
    before = os.getloadavg()[0]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=code.resolve(), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if not (out / "results.csv").exists():
        raise SystemExit(f"{code}: no results.csv (exit {p.returncode}): {p.stderr[-2000:]}")
    with open(out / "results.csv") as f:
        row = next(csv.DictReader(f))
    return {"row": row, "wall": wall, "load": (before, os.getloadavg()[0])}


def labels(row: dict) -> list[str]:
    """The measures of a results row (those with a ``<label>_seconds`` column)."""
    return [
        k[: -len("_seconds")]
        for k in row
        if k.endswith("_seconds") and not k.endswith("_budget_seconds")
    ]


def cell(row: dict, lab: str) -> str:
    """Seconds · products · value ± stderr · status of one measure."""
    sec = float(row.get(f"{lab}_seconds") or 0.0)
    prods = " + ".join(
        f"{row[f'{lab}_{k}']} {k[2:]}"
        for k in ("n_hvp", "n_grad")
        if row.get(f"{lab}_{k}") not in (None, "", "0")
    )
    val, se = row.get(lab, ""), row.get(f"{lab}_stderr", "")
    v = f"{float(val):.4g}" if val not in ("", None) else "–"
    if se not in ("", None):
        v += f" ± {float(se):.2g}"
    return f"{sec:.2f} s | {prods or '–'} | {v} | {row.get(f'{lab}_status', '')}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--code", action="append", type=Path, help="a flatcli checkout (repeat to compare)"
    )
    ap.add_argument("--out", type=Path, default=Path("/tmp/flatcli-bench-all"))
    ap.add_argument("--budget", default=None, help="--budget for every run (default: none)")
    json_arg(ap, "all_defaults")
    ap.add_argument(
        "--budget-property",
        action="store_true",
        help="unbudgeted, 2× and ½ its cost (docstring)",
    )
    args = ap.parse_args()
    config = build(args.out)
    if args.budget_property:
        budget_property(config, (args.code or [Path(".")])[0], args.out)
        return
    codes = args.code or [Path(".")]
    runs = [run(config, c, args.out / f"out{i}", args.budget) for i, c in enumerate(codes)]
    columns = ["measure"] + [
        f"{c} {k}" for c in codes for k in ("s", "products", "value", "status")
    ]
    rows = [
        [lab, *[x.strip() for r in runs for x in cell(r["row"], lab).split(" | ")]]
        for lab in labels(runs[0]["row"])
    ]
    notes = []
    for c, r in zip(codes, runs, strict=True):
        total = sum(float(r["row"].get(f"{lab}_seconds") or 0.0) for lab in labels(r["row"]))
        notes.append(
            f"{c}: {total:.1f} s measuring, {r['wall']:.1f} s wall, load {r['load'][0]:.2f} -> {r['load'][1]:.2f}"
        )
    tables = Tables()
    tables.add("flatcli measure -m all at defaults, per measure", columns, rows, "; ".join(notes))
    title = "-m all at defaults on the tiny GPT-2"
    print(f"wrote {write_json('all_defaults', title, tables, args.json)}")


def measuring(row: dict) -> float:
    """The sum of the measures' seconds of a results row."""
    return sum(float(row.get(f"{lab}_seconds") or 0.0) for lab in labels(row))


def budget_property(config: Path, code: Path, out: Path) -> None:
    """The unbudgeted run, a budget of twice its measuring seconds and one of half of them."""
    free = run(config, code, out / "free", None)
    cost = measuring(free["row"])
    runs = {"none": free}
    for name, f in (("2x", 2.0), ("half", 0.5)):
        runs[name] = run(config, code, out / name, f"{f * cost:.3f}")
    print(f"| measure | {' | '.join(f'{k}: s | products | value | status' for k in runs)} |")
    print("|---|" + "---:|---|---|---|" * len(runs))
    for lab in labels(free["row"]):
        print(f"| {lab} | " + " | ".join(cell(r["row"], lab) for r in runs.values()) + " |")
    cols = ("", "_status")
    same = [
        lab
        for lab in labels(free["row"])
        if all(free["row"].get(lab + c) == runs["2x"]["row"].get(lab + c) for c in cols)
    ]
    n = len(labels(free["row"]))
    print(f"unbudgeted: {cost:.2f} s measuring, {free['wall']:.1f} s wall")
    print(f"budget 2x = {2 * cost:.2f} s: {len(same)}/{n} measures identical (value and status)")
    spent = measuring(runs["half"]["row"])
    print(
        f"budget 1/2 = {cost / 2:.2f} s: spent {spent:.2f} s = {100 * spent / (cost / 2):.0f}% "
        "(60-125% wanted)"
    )
    for k, r in runs.items():
        print(f"{k}: load {r['load'][0]:.2f} -> {r['load'][1]:.2f}")


if __name__ == "__main__":
    main()
