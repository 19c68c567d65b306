"""``--dry-run``'s predicted peak memory against the measured peak resident set, for λmax (6
Lanczos steps) and a 16-probe Hutchinson trace on GPT-2-shaped models with random weights
(`benchmarks/bench_large.py`'s ``build``: vocabulary 8192, ``--rows`` × ``--length`` tokens,
``causal_lm``), in fp32 defaults and in ``precision: bf16`` + ``recompute: true``.

Each cell runs in a fresh process: one dry-run per (size, setting) (`flatcli.run.predict.time_products`
and `flatcli.run.predict.predict`, as ``flatcli measure --dry-run`` does; its own wall seconds and peak
resident set are recorded too), and one run per (size, setting, measure) (`flatcli.measure_model`),
whose peak resident set (``VmHWM``, the whole process: Python, torch, weights and tokens included)
is the measured figure. ``ratio`` = measured / predicted; the goal is within ×1.5 either way.
The predicted seconds (the dry-run's, most) sit beside the run's, and the dry-run's own seconds
and peak beside both. Memory figures hold under load (a shared machine); seconds do not. Writes
docs/benchmarks/data/memory_prediction.json.

    python -m benchmarks.bench_memory_prediction                      # 2M, 10M and 30M
    python -m benchmarks.bench_memory_prediction --size 2M --size 10M
    python -m benchmarks.bench_memory_prediction --cells /tmp/cells   # keep (and reuse) each cell

``--cells DIR`` writes each cell's result to DIR and reuses the ones already there (a long run can
be resumed, or a memory-only rerun of the dry-runs combined with earlier runs).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._common import json_arg, table, write_json

ROOT = Path(__file__).resolve().parents[1]

MEASURES = {
    "lambda_max": {"hessian_lambda_max": {"min_steps": 6, "max_steps": 6, "tol": 1e-12}},
    "trace16": {"hessian_trace": {"min_probes": 16, "max_probes": 16}},
}
SETTINGS = {
    "fp32": {"precision": "fp32"},
    "bf16+recompute": {"precision": "bf16", "recompute": "true"},
}


def _hwm() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise KeyError("VmHWM")


def child(args) -> dict:
    """One dry-run (``--measure`` omitted) or one run, in this process."""
    import torch

    from benchmarks.bench_large import build
    from flatcli.config import parse_measures
    from flatcli.run.measuring import measure_model, problem_dims
    from flatcli.run.predict import predict, time_products
    from flatcli.run.settings import Settings

    torch.set_num_threads(args.threads)
    model, batch = build(args.size, 8192, args.rows, args.length)
    fields = {"loss": "causal_lm", "batch_size": args.rows, **SETTINGS[args.setting]}
    t0 = time.perf_counter()
    if args.measure is None:
        st = Settings.build(None, **fields)
        times, problem = time_products(model, batch, st)
        dims = problem_dims(model, batch, st)
        preds = {
            k: predict(parse_measures([m])[0], dims, times, problem) for k, m in MEASURES.items()
        }
        return {
            "predicted": {k: p.peak_bytes for k, p in preds.items()},
            "predicted_seconds": {k: p.seconds[1] for k, p in preds.items()},
            "seconds": time.perf_counter() - t0,
            "peak": _hwm(),
        }
    row = measure_model(model, batch, [MEASURES[args.measure]], **fields)
    (res,) = row.results.values()
    return {"status": res.status, "seconds": time.perf_counter() - t0, "peak": _hwm()}


def spawn(args, size: str, setting: str, measure: str | None) -> dict:
    cell = None
    if args.cells:
        cell = Path(args.cells) / f"{size}_{setting}_{measure or 'dry-run'}.json"
        if cell.exists():
            return json.loads(cell.read_text())
    cmd = [sys.executable, "-m", "benchmarks.bench_memory_prediction", "--child", "--size", size]
    cmd += ["--setting", setting]
    cmd += ["--rows", str(args.rows), "--length", str(args.length), "--threads", str(args.threads)]
    cmd += ["--measure", measure] if measure else []
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        raise SystemExit(f"{size} {setting} {measure}: exit {p.returncode}: {p.stderr[-2000:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    if cell is not None:
        cell.parent.mkdir(parents=True, exist_ok=True)
        cell.write_text(json.dumps(out))
    return out


def _note(rows: list) -> str:
    """The table's note: what the cells mean, and the cells outside ×1.5 by name."""
    out = [f"{r[0]} {r[1]} {r[2]} ({r[5]})" for r in rows if not 1 / 1.5 <= r[5] <= 1.5]
    return (
        "predicted s: the dry-run's most; memory figures hold on a loaded machine, seconds do "
        "not. A trace's prediction counts the near-zero floor's SLQ (its runs in lockstep), which the run "
        "holds only when the trace is near 0 (status near_zero); a trace that converges (ok) "
        "holds less. Outside ×1.5: " + (", ".join(out) or "none")
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--size", action="append")
    ap.add_argument("--setting", default="fp32")
    ap.add_argument("--measure", default=None)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--cells", default=None, help="a folder keeping (and reusing) each cell's result"
    )
    json_arg(ap, "memory_prediction")
    args = ap.parse_args()
    if args.child:
        args.size = args.size[0]
        print(json.dumps(child(args)))
        return
    rows = []
    for size in args.size or ["2M", "10M", "30M"]:
        for setting in SETTINGS:
            dry = spawn(args, size, setting, None)
            for measure in MEASURES:
                run = spawn(args, size, setting, measure)
                pred = dry["predicted"][measure]
                row = [
                    size,
                    setting,
                    measure,
                    round(pred / 2**20, 1),
                    round(run["peak"] / 2**20, 1),
                ]
                row += [round(run["peak"] / pred, 2), run["status"]]
                row += [round(dry.get("predicted_seconds", {}).get(measure, float("nan")), 1)]
                row += [round(run["seconds"], 1)]
                row += [round(dry["seconds"], 1), round(dry["peak"] / 2**20, 1)]
                rows.append(row)
                print(" | ".join(str(c) for c in row), flush=True)
    cols = [
        "size",
        "setting",
        "measure",
        "predicted MiB",
        "measured peak RSS MiB",
        "measured / predicted",
        "status",
        "predicted s",
        "run s",
        "dry-run s",
        "dry-run peak RSS MiB",
    ]
    write_json(
        "memory_prediction",
        "--dry-run's predicted peak memory against the measured peak RSS",
        [
            table(
                f"GPT-2 shapes, {args.rows} × {args.length} tokens, causal_lm, "
                f"{args.threads} threads; each cell a fresh process",
                cols,
                rows,
                _note(rows),
            )
        ],
        args.json,
        command="python -m benchmarks.bench_memory_prediction "
        + " ".join(f"--size {s}" for s in args.size or ["2M", "10M", "30M"]),
    )


if __name__ == "__main__":
    main()
