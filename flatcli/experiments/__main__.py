"""``python -m flatcli.experiments NAME [--quick] [-o OUTDIR] [--jobs N] [--study S,...] [--publish DIR]``."""

from __future__ import annotations

import argparse
import os
import sys
import warnings


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run the experiment, print its summary; returns the exit code."""
    from ..errors import FlatcliError
    from . import available, default_outdir, publish, run_experiment

    ap = argparse.ArgumentParser(
        prog="python -m flatcli.experiments",
        description="Reproduce a seed paper's experiment: train to a loss target, then flatcli sweep, collect, correlate.",
    )
    ap.add_argument("name", help=f"'list', an experiment ({', '.join(available())}) or a spec YAML file")
    ap.add_argument("--quick", action="store_true", help="tiny grid, tiny models, few steps (a smoke test, seconds)")
    ap.add_argument("-o", "--outdir", default=None, help="output folder (default experiments-out/NAME[-quick])")
    ap.add_argument("--jobs", type=int, default=None,
                    help="models trained / sweep workers in parallel, one thread each; the numbers do not depend on it "
                         "(default: 1 with --quick, else the core count up to 2)")
    ap.add_argument("--study", default=None, help="run only these studies (comma-separated)")
    ap.add_argument("--publish", default=None, metavar="DIR", help="copy the small outputs into DIR/NAME/ (e.g. docs/experiments)")
    a = ap.parse_args(argv)
    if a.name == "list":
        from .spec import load_spec

        for n in available():
            s = load_spec(n)
            print(f"{n:22s} {s.title} [{', '.join(st.name + ': ' + str(len(st.points())) + ' models' for st in s.studies)}]")
        return 0
    if a.jobs is None:
        a.jobs = 1 if a.quick else min(2, os.cpu_count() or 1)
    if a.jobs < 1:
        print(f"error: --jobs must be ≥ 1; got {a.jobs}", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", message=r".*torch\.jit\.script.*", category=FutureWarning)
    try:
        rep = run_experiment(
            a.name, a.outdir or default_outdir(os.path.splitext(os.path.basename(a.name))[0], a.quick), quick=a.quick,
            jobs=a.jobs, studies=[s.strip() for s in a.study.split(",") if s.strip()] if a.study else None,
        )  # fmt: skip
        print(rep.summary.read_text())
        print(f"done in {rep.seconds:.0f}s; outputs in {rep.outdir} (summary.md)")
        if a.publish:
            files = publish(rep, a.publish)
            print(f"published {len(files)} files to {os.path.join(a.publish, rep.spec.name)}")
    except FlatcliError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted (rerun the same command to resume)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
