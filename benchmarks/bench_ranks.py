"""One process against torchrun with 2 ranks on the CPU (gloo): the same `flatcli measure`, side by side.

Trains nothing: a seeded MLP (784-256-256-10 on synthetic 784-feature inputs, or ``--width``) is
saved with a measurement set of ``--n`` samples, then measured by ``flatcli measure`` once in one
process and once under ``torchrun --standalone --nproc_per_node 2``, each as a whole process
(imports and the process group included) and by the measures' own seconds (results.json).
Prints one table row per measure: seconds with 1 and 2 ranks, their ratio, and the relative
difference of the values (the trace with the same 64 probes in both).

    python -m benchmarks.bench_ranks                  # n = 4096, batch 256
    python -m benchmarks.bench_ranks --n 8192 --width 512

The result goes to docs/benchmarks/data/ranks.json (``--json`` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from torch import nn

from benchmarks._common import Tables, json_arg, write_json

MEASURES = [
    {"hessian_lambda_max": {"tol": 1e-4}},
    {"hessian_trace": {"min_probes": 64, "max_probes": 64}},
    "normalized_sharpness",
    {"sharpness_worst": {"rho": 0.05, "batch_size": 256}},
]

MODEL = """
from torch import nn


class MLP(nn.Sequential):
    def __init__(self, width=256):
        super().__init__(nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
"""


def _prepare(folder: Path, n: int, width: int, batch: int) -> Path:
    (folder / "models.py").write_text(MODEL)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )
    torch.save(model.state_dict(), folder / "ck.pt")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 784, generator=g)
    y = (x[:, :10] + 0.5 * torch.randn(n, 10, generator=g)).argmax(1)
    torch.save({"x": x, "y": y}, folder / "data.pt")
    cfg = {
        "model": {"target": "models.py:MLP", "kwargs": {"width": width}},
        "checkpoints": ["ck.pt"],
        "data": {"train": {"source": "tensors", "path": "data.pt"}},
        "measure_data": {"batch_size": batch},
        "measures": MEASURES,
        "runtime": {"device": "cpu", "precision": "fp32"},
    }
    (folder / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    return folder / "cfg.yaml"


def _run(cmd: list[str], folder: Path, out: str) -> tuple[float, dict]:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    t0 = time.perf_counter()
    res = subprocess.run(cmd + ["-o", out], cwd=folder, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{res.stderr[-2000:]}")
    rows = json.loads((folder / out / "results.json").read_text())["rows"]
    return wall, rows[0]["measures"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=256)
    json_arg(ap, "ranks")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        cfg = str(_prepare(folder, args.n, args.width, args.batch_size))
        one = _run([sys.executable, "-m", "flatcli", "measure", "-c", cfg], folder, "one")
        two = _run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                "2",
                "-m",
                "flatcli",
                "measure",
                "-c",
                cfg,
            ],
            folder,
            "two",
        )
    setup = (
        f"MLP 784-{args.width}-{args.width}-10, n = {args.n}, batch {args.batch_size}, fp32, CPU, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')} per rank, torch {torch.__version__}"
    )
    rows = []
    for name, a in one[1].items():
        b = two[1][name]
        rel = abs(a["value"] - b["value"]) / abs(a["value"])
        ratio = b["seconds"] / a["seconds"]
        rows.append(
            [name, f"{a['seconds']:.2f}", f"{b['seconds']:.2f}", f"{ratio:.2f}", f"{rel:.1e}"]
        )
    rows.append(["whole process", f"{one[0]:.2f}", f"{two[0]:.2f}", f"{two[0] / one[0]:.2f}", ""])
    tables = Tables()
    tables.add(setup, ["measure", "1 rank s", "2 ranks s", "ratio", "rel. diff"], rows)
    title = "One process against torchrun with 2 CPU ranks"
    print(f"wrote {write_json('ranks', title, tables, args.json)}")


if __name__ == "__main__":
    main()
