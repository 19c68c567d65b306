"""A sweep worker's memory over a long run: RSS after warm-up and at the end of N units.

Two tables, both from one sweep worker running in this process (`flatcli.api.sweep`, one
worker, one thread):

1. ``--units`` cheap units (``frobenius_norm`` and ``spectral_norm``, which fold BatchNorm and so
   trace the model with torch.fx once per unit) on tiny MLPs: the resident set size (RSS) after
   ``--warmup`` units and every ``--every`` units after; the growth after warm-up must stay under
   ``--limit-mb`` (the script exits 1 otherwise).
2. ``--own-data`` checkpoints that each bring their own ``train_data`` of ``--data-mb`` MB
   (a manifest's ``train_data`` column): the peak RSS with the default data-cache budget
   and with ``FLATCLI_DATA_CACHE_MB=--budget-mb``.

Writes docs/benchmarks/data/sweep_memory.json (``--json``) and prints ms/unit (a loaded machine's
times say little; the memory figures do not depend on load)::

    python scripts/bench_sweep_memory.py                 # 5,000 units, ~5-10 min on one core
    python scripts/bench_sweep_memory.py --units 400 --warmup 100 --every 100 --own-data 0
"""

from __future__ import annotations

import argparse
import csv
import json
import linecache
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import yaml  # noqa: E402

from benchmarks._common import json_arg, table, write_json  # noqa: E402
from flatcli import api  # noqa: E402
from flatcli.demo.models import MLP  # noqa: E402

IN, CLASSES = 16, 4


def rss_mb() -> float:
    """The resident set size of the process now, in MB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def project(folder: Path, n: int, measures: list, own_data_rows: int = 0) -> Path:
    """``n`` tiny MLP checkpoints and a config; with ``own_data_rows`` each gets its own
    training file of that many rows (a manifest's ``train_data`` column)."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        torch.manual_seed(i)
        torch.save(MLP(IN, 8, 1, CLASSES).state_dict(), folder / f"m{i}.pt")
        row = {"path": f"m{i}.pt", "i": i}
        if own_data_rows:
            g = torch.Generator().manual_seed(i)
            x = torch.randn(own_data_rows, IN, generator=g)
            torch.save(
                {"x": x, "y": torch.randint(0, CLASSES, (own_data_rows,), generator=g)},
                folder / f"d{i}.pt",
            )
            row["train_data"] = f"d{i}.pt"
        rows.append(row)
    with open(folder / "manifest.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    syn = {"source": "synthetic", "num_samples": 64, "input_shape": [IN], "num_classes": CLASSES}
    cfg = {
        "model": {
            "target": "flatcli.demo.models:MLP",
            "kwargs": {"in_features": IN, "width": 8, "depth": 1, "num_classes": CLASSES},
        },
        "checkpoints": {"manifest": "manifest.csv"},
        "data": {"train": {**syn, "seed": 0}, "test": {**syn, "seed": 1}},
        "measure_data": {"batch_size": 64},
        "measures": measures,
        "runtime": {"device": "cpu", "seed": 0, "threads": 1},
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    return folder / "config.yaml"


def long_run(tmp: Path, units: int, warmup: int, every: int) -> tuple[dict, list[list]]:
    """Table 1: RSS of one worker over ``units`` cheap units."""
    measures = ["frobenius_norm", "spectral_norm"]
    cfg = project(tmp / "long", (units + 1) // 2, measures)
    marks: list[list] = []
    state = {"n": 0, "t0": time.perf_counter(), "t_warm": None}

    def on_unit(rec) -> None:
        state["n"] += 1
        n = state["n"]
        if n == warmup:
            state["t_warm"] = time.perf_counter()
        if n == warmup or (n > warmup and (n - warmup) % every == 0) or n == units:
            marks.append([n, round(rss_mb(), 1), len(linecache.cache)])

    t0 = time.perf_counter()
    rep = api.sweep(cfg, tmp / "long" / "out", log=lambda m: None, on_unit=on_unit)
    wall = time.perf_counter() - t0
    assert rep.computed == units and rep.errors == 0, rep.summary()
    warm = marks[0][1]
    growth = round(marks[-1][1] - warm, 1)
    after = time.perf_counter() - (state["t_warm"] or t0)
    ms = 1000 * after / max(1, units - warmup)
    summary = {
        "units": units,
        "rss_after_warmup_mb": warm,
        "rss_end_mb": marks[-1][1],
        "growth_mb": growth,
        "ms_per_unit": round(ms, 2),
        "wall_s": round(wall, 1),
    }
    return summary, marks


def own_data(tmp: Path, n: int, data_mb: float, budget_mb: float) -> list[list]:
    """Table 2: peak RSS over ``n`` checkpoints with their own training data, default data cache
    and a ``budget_mb`` one (each in a fresh process, so that peaks are their own)."""
    rows_per_file = int(data_mb * 2**20 / (4 * IN + 8))
    cfg = project(tmp / "own", n, ["frobenius_norm"], own_data_rows=rows_per_file)
    out = []
    for label, budget in (("default (1024 MB)", None), (f"{budget_mb:g} MB", budget_mb)):
        env = {**os.environ}
        env.pop("FLATCLI_DATA_CACHE_MB", None)
        if budget is not None:
            env["FLATCLI_DATA_CACHE_MB"] = str(budget)
        code = (
            "import json, resource\n"
            "from flatcli import api\n"
            "r = api.sweep({!r}, {!r}, log=lambda m: None)\n"
            "print(json.dumps([r.computed, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss]))"
        ).format(str(cfg), str(tmp / "own" / f"out-{budget}"))
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(res.stderr)
        computed, peak_kb = json.loads(res.stdout.strip().splitlines()[-1])
        out.append([label, n, data_mb, computed, round(peak_kb / 1024, 1)])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--units", type=int, default=5000)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--every", type=int, default=500)
    ap.add_argument("--limit-mb", type=float, default=50.0)
    ap.add_argument("--own-data", type=int, default=60, help="checkpoints with own data (0: skip)")
    ap.add_argument("--data-mb", type=float, default=10.0)
    ap.add_argument("--budget-mb", type=float, default=64.0)
    json_arg(ap, "sweep_memory")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="flatcli-sweep-memory-") as d:
        tmp = Path(d)
        summary, marks = long_run(tmp, a.units, a.warmup, a.every)
        own = own_data(tmp, a.own_data, a.data_mb, a.budget_mb) if a.own_data else []
    ok = summary["growth_mb"] <= a.limit_mb
    print(
        f"{summary['units']} units: RSS {summary['rss_after_warmup_mb']} MB after {a.warmup}, "
        f"{summary['rss_end_mb']} MB at the end: growth {summary['growth_mb']} MB "
        f"({'within' if ok else 'OVER'} {a.limit_mb:g} MB); {summary['ms_per_unit']} ms/unit"
    )
    for r in own:
        print(f"own train_data, cache {r[0]}: {r[1]} checkpoints × {r[2]:g} MB: peak RSS {r[4]} MB")
    tables = [
        {
            "title": f"RSS of one sweep worker over {a.units} units (frobenius_norm, spectral_norm)",
            "columns": ["units done", "RSS MB", "linecache entries"],
            "rows": marks,
            "note": (
                f"growth after {a.warmup} warm-up units: {summary['growth_mb']} MB (limit "
                f"{a.limit_mb:g} MB); {summary['ms_per_unit']} ms/unit after warm-up, "
                f"{summary['wall_s']} s in all (times on a shared machine: indicative only)"
            ),
        }
    ]
    if own:
        tables.append(
            {
                "title": "Peak RSS with per-checkpoint training data (manifest train_data)",
                "columns": ["data cache budget", "checkpoints", "MB each", "units", "peak RSS MB"],
                "rows": own,
                "note": "each row a fresh process running the whole sweep (one worker)",
            }
        )
    tables.append(table("Summary", ["quantity", "value"], [[k, v] for k, v in summary.items()]))
    write_json(
        "sweep_memory",
        "A sweep worker's memory over a long run",
        tables,
        a.json,
        command="python -m benchmarks.bench_sweep_memory " + " ".join(argv or sys.argv[1:]),
    )
    print(f"wrote {a.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
