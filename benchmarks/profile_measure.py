"""Where a ``flatcli measure`` process spends its CPU: seconds per phase (imports, config, threads,
loading, pre-flight, hashing, the measure's products, metrics, writing), from
``resource.getrusage`` (user + system, all threads), so the figures mean something on a loaded
machine too (wall seconds beside them do not).

The imports are timed as the process makes them (torch first, then the CLI, then the API); each
other phase is a public flatcli function wrapped wherever a module holds it, timed per call and
summed. Phases nest: ``measure_model`` holds the pre-flight, the products and the metrics, and
the products hold the first import of scipy (``t_factor``). Runs the command in this process::

    python -m benchmarks.profile_measure measure mlp.pt -c cfg.yaml -o out --format csv

The table goes to stderr; ``--json PATH`` (before the flatcli arguments) also writes it there.
"""

from __future__ import annotations

import functools
import importlib
import json
import resource
import runpy
import sys
import time

PHASES = {  # "module:function" -> phase (every name public)
    "flatcli.config:load_config": "config: load_config",
    "flatcli.loading.factory:check_target": "config: check_target (imports the model's module)",
    "flatcli.threads:configure_threads": "threads: configure_threads",
    "flatcli.loading.load:load_model": "loading: checkpoint",
    "flatcli.loading.data:load_split": "loading: data",
    "flatcli.keys:data_fingerprints": "hashing: data_fingerprints",
    "flatcli.keys:job_fingerprints": "hashing: job_fingerprints",
    "flatcli.run.preflight:check_loaded": "pre-flight: check_loaded (memory check)",
    "flatcli.loading.data:check_finite_data": "pre-flight: check_finite_data",
    "flatcli.run.checkpoint:problem_dims": "pre-flight: problem_dims",
    "flatcli.run.memory:check_products": "pre-flight: check_products",
    "flatcli.run.budgeting:split_budget": "pre-flight: split_budget",
    "flatcli.engine.linalg:t_factor": "measure: t_factor (first: imports scipy)",
    "flatcli.engine.linalg:hutchinson": "measure: hutchinson",
    "flatcli.engine.linalg:hutchpp": "measure: hutchpp",
    "flatcli.engine.linalg:lanczos": "measure: lanczos",
    "flatcli.run.results:write_results": "writing: write_results",
    "flatcli.run.checkpoint:measure_model": "measure_model (all of a checkpoint)",
}


def cpu() -> float:
    """CPU seconds of this process so far (user + system, all threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _wrap(f, label: str, rows: dict):
    @functools.wraps(f)
    def timed(*a, **k):
        c, w = cpu(), time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            r = rows.setdefault(label, [0.0, 0.0, 0])
            r[0] += cpu() - c
            r[1] += time.perf_counter() - w
            r[2] += 1

    return timed


def install(rows: dict) -> None:
    """Wrap every function of `PHASES` in each loaded module that holds it (a function that is
    not there, moved or renamed, is left out of the table)."""
    for spec, label in PHASES.items():
        mod, name = spec.split(":")
        try:
            orig = getattr(importlib.import_module(mod), name, None)
        except ImportError:  # moved or renamed: that phase is left out
            orig = None
        if orig is None:
            continue
        new = _wrap(orig, label, rows)
        for m in list(sys.modules.values()):
            d = getattr(m, "__dict__", None)
            for k, v in list(d.items()) if isinstance(d, dict) else ():
                if v is orig:
                    d[k] = new


def main(argv: list[str]) -> int:
    out = None
    if argv[:1] == ["--json"]:
        out, argv = argv[1], argv[2:]
    t0, w0 = cpu(), time.perf_counter()
    rows: dict[str, list] = {}
    for mod, label in (
        ("torch", "imports: torch"),
        ("flatcli.cli", "imports: flatcli.cli"),
        ("flatcli.api", "imports: flatcli.api (the rest)"),
    ):
        c, w = cpu(), time.perf_counter()
        importlib.import_module(mod)
        rows[label] = [cpu() - c, time.perf_counter() - w, 1]
    install(rows)
    sys.argv = ["flatcli", *argv]
    try:
        runpy.run_module("flatcli", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0
    else:
        code = 0
    rows["whole process"] = [cpu() - t0, time.perf_counter() - w0, 1]
    lines = [f"{'phase':52s} {'CPU s':>7s} {'wall s':>7s} {'calls':>5s}"]
    lines += [f"{k:52s} {c:7.3f} {w:7.3f} {n:5d}" for k, (c, w, n) in rows.items()]
    print("\n".join(lines), file=sys.stderr)
    if out:
        recs = [{"phase": k, "cpu_s": c, "wall_s": w, "calls": n} for k, (c, w, n) in rows.items()]
        with open(out, "w") as f:
            json.dump({"argv": argv, "phases": recs}, f, indent=1)
    return code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
