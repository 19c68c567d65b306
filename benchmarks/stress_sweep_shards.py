"""Two (or more) concurrent sweep shards over one folder: every unit exactly once.

Writes ``--checkpoints`` tiny MLP checkpoints and a config with two cheap measures, runs
``flatcli sweep --shard I/N`` for every shard at once (separate processes, one thread each),
optionally ``kill -9``s shard 0 part-way through (``--kill-at``, a fraction of its units) and
reruns it, then checks the folder: one unit file per planned unit (no unit missing, none
extra, no (checkpoint, measure) pair twice), every unit ``ok``, no lock or temp file left, and
``flatcli collect`` exits 0 with one ``ok`` row per checkpoint. Prints the counts and each
shard's ms/unit (wall time over the units it computed: only meaningful on an idle machine).
Exits 1 when a check fails::

    python -m benchmarks.stress_sweep_shards                      # 10,000 × 2 = 20,000 units
    python -m benchmarks.stress_sweep_shards --checkpoints 200 --kill-at 0
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IN, CLASSES = 16, 4
MEASURES = ["frobenius_norm", "spectral_norm"]


def project(folder: Path, n: int) -> Path:
    """``n`` tiny MLP checkpoints, a manifest and a config; returns the config path."""
    import torch
    import yaml

    from flatcli.demo.models import MLP

    (folder / "ck").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        torch.manual_seed(i)
        torch.save(MLP(IN, 8, 1, CLASSES).state_dict(), folder / "ck" / f"m{i}.pt")
    with open(folder / "manifest.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "i"])
        w.writerows([f"ck/m{i}.pt", i] for i in range(n))
    syn = {"source": "synthetic", "num_samples": 64, "input_shape": [IN], "num_classes": CLASSES}
    cfg = {
        "model": {
            "target": "flatcli.demo.models:MLP",
            "kwargs": {"in_features": IN, "width": 8, "depth": 1, "num_classes": CLASSES},
        },
        "checkpoints": {"manifest": "manifest.csv"},
        "data": {"train": {**syn, "seed": 0}, "test": {**syn, "seed": 1}},
        "measure_data": {"batch_size": 64},
        "measures": MEASURES,
        "runtime": {"device": "cpu", "seed": 0, "threads": 1},
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    return folder / "config.yaml"


def shard(cfg: Path, out: Path, i: int, n: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "flatcli", "sweep", "-c", str(cfg), "-o", str(out)]
    argv += ["--shard", f"{i}/{n}", "--threads", "1"]
    return subprocess.Popen(argv, env=env, stdout=open(log, "a"), stderr=subprocess.STDOUT)


def computed_by(log: Path) -> int:
    """Units a shard's runs computed (a killed run's included), from their per-unit log lines."""
    return sum(line.startswith("[w") and " ok " in line for line in log.read_text().splitlines())


def run_shards(cfg: Path, out: Path, n: int, kill_at: float, logs: Path) -> dict:
    """Every shard at once; shard 0 killed with SIGKILL after ``kill_at`` of its units and rerun."""
    t0 = time.perf_counter()
    procs = {i: shard(cfg, out, i, n, logs / f"shard{i}.log") for i in range(n)}
    walls: dict[int, float] = {}
    killed = 0
    if kill_at > 0:
        total = None
        while procs[0].poll() is None:
            if total is None and (out / "plan.json").is_file():
                try:
                    plan = json.loads((out / "plan.json").read_text())
                    total = sum(int(u["id"], 16) % n == 0 for u in plan["units"])
                except (ValueError, KeyError):
                    pass
            text = (logs / "shard0.log").read_text()
            done = text.count(" ok ")
            if total and done >= kill_at * total:
                procs[0].send_signal(signal.SIGKILL)
                procs[0].wait()
                killed = done
                procs[0] = shard(cfg, out, 0, n, logs / "shard0.log")
                break
            time.sleep(0.2)
    while len(walls) < len(procs):  # each shard's own finish time
        for i, p in procs.items():
            if i not in walls and p.poll() is not None:
                walls[i] = time.perf_counter() - t0
        time.sleep(0.1)
    return {"walls": walls, "codes": {i: p.returncode for i, p in procs.items()}, "killed": killed}


def check(out: Path, n_ckpt: int) -> tuple[dict, list[str]]:
    """The counts and the failed checks of a finished sweep folder."""
    plan = json.loads((out / "plan.json").read_text())
    planned = {u["id"] for u in plan["units"]}
    files = sorted((out / "units").glob("*.json"))
    recs = [json.loads(p.read_text()) for p in files]
    ids = [r["unit"] for r in recs]
    pairs = collections.Counter((r["checkpoint_index"], r["label"]) for r in recs)
    bad_names = [p.name for p, r in zip(files, recs, strict=True) if p.stem != r["unit"]]
    counts = {
        "planned": len(planned),
        "unit_files": len(files),
        "distinct_units": len(set(ids)),
        "missing": len(planned - set(ids)),
        "extra": len(set(ids) - planned),
        "duplicate_pairs": sum(c - 1 for c in pairs.values() if c > 1),
        "not_ok": sum(r["status"] != "ok" for r in recs),
        "locks_left": len(list((out / "locks").glob("*.lock"))) if (out / "locks").is_dir() else 0,
        "temp_files_left": len([p for p in (out / "units").iterdir() if p.name.startswith(".")]),
    }
    fails = [
        k for k in ("missing", "extra", "duplicate_pairs", "not_ok", "locks_left") if counts[k]
    ]
    fails += [k for k in ("temp_files_left",) if counts[k]]
    if counts["planned"] != n_ckpt * len(MEASURES) or counts["unit_files"] != counts["planned"]:
        fails.append("unit count")
    if bad_names:
        fails.append("file names")
    return counts, fails


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoints", type=int, default=10_000)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--kill-at", type=float, default=0.25, help="0: no kill")
    ap.add_argument("--keep", type=Path, default=None, help="work here and keep the folder")
    a = ap.parse_args(argv)
    tmp = a.keep or Path(tempfile.mkdtemp(prefix="flatcli-stress-"))
    tmp.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cfg = project(tmp / "p", a.checkpoints)
    print(f"{a.checkpoints} checkpoints written in {time.perf_counter() - t0:.0f} s ({tmp})")
    out = tmp / "s"
    ran = run_shards(cfg, out, a.shards, a.kill_at, tmp)
    counts, fails = check(out, a.checkpoints)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    col = subprocess.run(
        [sys.executable, "-m", "flatcli", "collect", str(out)],
        env=env,
        capture_output=True,
        text=True,
    )
    rows = list(csv.DictReader(open(out / "results.csv"))) if col.returncode == 0 else []
    counts["collect_exit"] = col.returncode
    counts["collected_ok_rows"] = sum(r["status"] == "ok" for r in rows)
    if col.returncode != 0 or counts["collected_ok_rows"] != a.checkpoints:
        fails.append("collect")
    if any(ran["codes"].values()):
        fails.append(f"shard exit codes {ran['codes']}")
    print(json.dumps(counts))
    if ran["killed"]:
        print(f"shard 0 killed with SIGKILL after {ran['killed']} units, then rerun")
    for i in range(a.shards):
        k = computed_by(tmp / f"shard{i}.log")
        ms = 1000 * ran["walls"][i] / max(1, k)
        print(
            f"shard {i}/{a.shards}: {k} units computed, {ran['walls'][i]:.0f} s, {ms:.1f} ms/unit"
        )
    print("OK: every unit exactly once" if not fails else f"FAILED: {', '.join(fails)}")
    return 1 if fails else 0


if __name__ == "__main__":
    raise SystemExit(main())
