"""Two checkouts of flatcli side by side on the engine benchmark: does a change of code move the
engine's speed?

Each checkout runs its own ``benchmarks/bench_engine.py`` (``--tasks mlp``: λmax by Lanczos and
the trace by Hutchinson and Hutch++ on the MLP of scikit-learn digits, beside PyHessian and
curvlinops in the same process) as a fresh process started in the checkout's folder, so that it
imports that checkout's flatcli. The checkouts alternate (A, B, A, B, ...) for ``--rounds``
rounds, every process with the same ``OMP_NUM_THREADS``; the table keeps each row's fastest
wall time per checkout, and the ratio B / A of flatcli's rows. PyHessian's rows run in both
processes and show the noise between them: a flatcli ratio within the spread of PyHessian's is
within noise.

    python -m benchmarks.bench_engine_ab --a /path/to/before --b . --rounds 2

The result goes to docs/benchmarks/data/engine_ab.json (``--json`` elsewhere).
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

from benchmarks._common import json_arg, write_json


def run_once(code: Path, out: Path, threads: int, extra: list[str]) -> dict:
    """One run of ``code``'s engine benchmark (the mlp task); its JSON."""
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "benchmarks.bench_engine", "--tasks", "mlp", "--device", "cpu"]
    cmd += ["--json", str(out), *extra]
    proc = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{code}: bench_engine failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(out.read_text())


def revision(code: Path) -> str:
    """The short commit of checkout ``code`` ("+" when its tree differs from it)."""
    git = ["git", "-C", str(code)]
    rev = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run([*git, "status", "--porcelain", "--", "flatcli"], capture_output=True)
    return rev.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def rows_of(result: dict) -> dict[tuple[str, str], tuple[float, str]]:
    """(quantity, tool) → (seconds, HVPs) of the first table of a bench_engine JSON."""
    table = result["tables"][0]
    cols = table["columns"]
    q, tool, t, h = (cols.index(c) for c in ("quantity", "tool", "time (s)", "HVPs"))
    return {(r[q], r[tool].replace("**", "")): (float(r[t]), r[h]) for r in table["rows"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", type=Path, required=True, help="checkout A (before)")
    ap.add_argument("--b", type=Path, required=True, help="checkout B (after)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of every process")
    ap.add_argument("--repeats", type=int, default=3, help="bench_engine's --repeats")
    ap.add_argument(
        "--engine-args",
        default="--trace-tol 0.05 --ref-probes 200 --ref-steps 150 --pyhessian-tight-iters 300",
        help="more arguments of bench_engine (default: the trace to 5%% stderr, a few minutes)",
    )
    json_arg(ap, "engine_ab")
    args = ap.parse_args(argv)
    codes = {"A": args.a.resolve(), "B": args.b.resolve()}
    best: dict[str, dict[tuple[str, str], tuple[float, str]]] = {"A": {}, "B": {}}
    order: list[tuple[str, str]] = []
    tmp = Path(tempfile.mkdtemp(prefix="flatcli-ab-"))
    for r in range(args.rounds):
        for name, code in codes.items():
            t0 = time.perf_counter()
            res = run_once(
                code,
                tmp / f"{name}{r}.json",
                args.threads,
                ["--repeats", str(args.repeats), *args.engine_args.split()],
            )
            print(f"round {r + 1} {name} ({code}): {time.perf_counter() - t0:.0f} s", flush=True)
            for key, (sec, hvps) in rows_of(res).items():
                if key not in order:
                    order.append(key)
                old = best[name].get(key)
                best[name][key] = (sec, hvps) if old is None or sec < old[0] else old
    rows = []
    for key in order:
        a, b = best["A"].get(key), best["B"].get(key)
        if a is None or b is None:
            continue
        ratio = f"{b[0] / a[0]:.2f}" if a[0] > 0 else ""
        rows.append([key[0], key[1], f"{a[0]:.2f}", a[1], f"{b[0]:.2f}", b[1], ratio])
    columns = ["quantity", "tool", "A time (s)", "A HVPs", "B time (s)", "B HVPs", "B / A"]
    note = (
        f"A: commit {revision(codes['A'])}, B: commit {revision(codes['B'])}; {args.rounds} alternating rounds of whole "
        f"processes, OMP_NUM_THREADS={args.threads}, the fastest of each; PyHessian and curvlinops "
        "rows run unchanged in both and show the noise between processes"
    )
    table = {"title": "engine benchmark, two checkouts side by side", "columns": columns}
    table |= {"rows": rows, "note": note}
    print("| " + " | ".join(columns) + " |")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
    path = write_json(
        "engine_ab", "Curvature engine: two checkouts side by side", [table], args.json
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
