"""The results page of a large sweep: seconds, page size and memory of ``flatcli report`` on a
10,000-row results table, and the seconds headless Chromium takes to open it.

    python -m benchmarks.bench_report [--rows 10000] [--measures 8] [--json PATH]

The table is synthetic and seeded: checkpoints on a grid of hyperparameters (lr × wd × seed),
``--measures`` measure columns that follow the gap with noise, each with a ``<measure>_status``
column mixing every status the page marks (ok, budget with a lower bound, not_converged,
near_zero, error), a ``results.json`` naming the measures. Each size runs in a fresh process
(`flatcli.api.report` after the imports, no bootstrap), which reports its wall and CPU seconds
(the CPU time says more on a busy machine), the page's size and the process's peak resident memory (``ru_maxrss``) with the part the report
added over the imports. With ``/usr/bin/chromium`` the page is then opened headless, network
off (``tools/check_report_browser.py``), and timed to its screenshot.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ._common import ROOT, Tables, json_arg, write_json

STATUSES = ["ok"] * 90 + ["budget"] * 4 + ["not_converged"] * 3 + ["near_zero"] * 2 + ["error"]

CHILD = r"""
import json, resource, sys, time
from pathlib import Path
import flatcli.api as api
import flatcli.analysis.html_report, matplotlib.figure, jinja2   # the imports, before the baseline
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
csv, out = Path(sys.argv[1]), Path(sys.argv[2])
r0 = resource.getrusage(resource.RUSAGE_SELF)
t0 = time.perf_counter()
page = api.report(csv, out, by="lr,wd")
sec = time.perf_counter() - t0
r1 = resource.getrusage(resource.RUSAGE_SELF)
cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
peak = r1.ru_maxrss / 1024
print(json.dumps({"seconds": sec, "cpu_seconds": cpu, "page_mb": out.stat().st_size / 1e6, "peak_rss_mb": peak,
                  "report_rss_mb": peak - base, "problems": len(page.problems)}))
"""


def make_table(folder: Path, rows: int, measures: int, seed: int = 0) -> Path:
    """A seeded synthetic results.csv (+ results.json naming the measures) with ``rows`` rows."""
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(seed)
    lr = np.tile(
        np.repeat([0.1, 0.05, 0.02, 0.01, 0.005, 0.002, 0.001, 5e-4, 2e-4, 1e-4], 10),
        rows // 100 + 1,
    )[:rows]
    wd = np.tile([0, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3], rows // 10 + 1)[:rows]
    gap = 0.05 + 0.1 * np.log10(0.1 / lr) / 3 + rng.normal(0, 0.02, rows)
    df = pd.DataFrame(
        {"checkpoint": [f"runs/ckpt_{i:05d}.pt" for i in range(rows)], "status": "ok"}
    )
    names = [f"measure_{k}" for k in range(measures)]
    for k, name in enumerate(names):
        value = np.exp(gap * (k + 1) + rng.normal(0, 0.05 * (k + 1), rows))
        status = rng.choice(STATUSES, rows)
        value[status == "error"] = np.nan
        df[name] = value
        df[f"{name}_status"] = status
        df[f"{name}_bound"] = np.where(status == "budget", "lower bound", "")
    df["train_acc"] = 1.0
    df["test_acc"] = 1.0 - gap
    df["gen_gap"] = gap
    df["hp_lr"], df["hp_wd"], df["hp_seed"] = lr, wd, np.arange(rows) // 100
    folder.mkdir(parents=True, exist_ok=True)
    csv = folder / "results.csv"
    df.to_csv(csv, index=False)
    (folder / "results.json").write_text(json.dumps({"labels": names}))
    return csv


def browser_seconds(page: Path) -> float | str:
    """Seconds for tools/check_report_browser.py to open, screenshot and dump the page (both runs)."""
    if not Path("/usr/bin/chromium").is_file():
        return "no chromium"
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "check_report_browser.py"), str(page),
         "--screenshot", str(page.with_suffix(".png")), "--wait", "0", "--timeout", "300"],
        capture_output=True, text=True,
    )  # fmt: skip
    sec = time.perf_counter() - t0
    return sec if r.returncode == 0 else f"failed: {r.stdout[-300:]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--measures", type=int, default=8)
    ap.add_argument("--no-browser", action="store_true")
    json_arg(ap, "report")
    a = ap.parse_args()
    tables = Tables()
    out_rows = []
    with tempfile.TemporaryDirectory(prefix="flatcli-bench-report-") as tmp:
        for n in a.rows:
            csv = make_table(Path(tmp) / f"r{n}", n, a.measures)
            page = csv.with_name("report.html")
            r = subprocess.run(
                [sys.executable, "-c", CHILD, str(csv), str(page)],
                capture_output=True, text=True, check=True, cwd=ROOT,
            )  # fmt: skip
            res = json.loads(r.stdout.strip().splitlines()[-1])
            res["browser_seconds"] = "skipped" if a.no_browser else browser_seconds(page)
            out_rows.append(
                [
                    n,
                    a.measures,
                    *(
                        res[k]
                        for k in (
                            "seconds",
                            "cpu_seconds",
                            "page_mb",
                            "peak_rss_mb",
                            "report_rss_mb",
                            "browser_seconds",
                        )
                    ),
                ]
            )
    tables.add(
        "flatcli report on a synthetic results table",
        [
            "rows",
            "measures",
            "report s",
            "report CPU s",
            "page MB",
            "peak RSS MB",
            "RSS added by the report MB",
            "Chromium s (screenshot + DOM)",
        ],
        out_rows,
        note="Fresh process per size; the CPU seconds say more than the wall seconds on a busy machine; the peak resident memory includes Python, torch and matplotlib; "
        "'added by the report' is the peak over the resident memory after the imports.",
    )
    print(f"wrote {write_json('report', 'The results page of a large sweep', tables, a.json)}")


if __name__ == "__main__":
    main()
