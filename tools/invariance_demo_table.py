"""The demo-zoo table of docs/invariance.md: `flatcli check-invariance` on every demo checkpoint.

Usage: ``python tools/invariance_demo_table.py flatcli-demo`` (after ``flatcli demo``); prints a
Markdown table: normalized sharpness and relative flatness (normalized features), each with its
value and relative change, and the factors by which the Hessian trace and λmax changed.
"""

from __future__ import annotations

import sys
from pathlib import Path

from flatcli import api

MEASURES = "hessian_lambda_max,hessian_trace,frobenius_norm,normalized_sharpness,relative_flatness"


def main(demo: str) -> None:
    """Print the table for every checkpoint of the demo folder ``demo``."""
    cfg = Path(demo) / "config.yaml"
    print(
        "| checkpoint | NS → rel. change | RF (normalized) → rel. change | trace factor | λmax factor | held |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for ck in sorted((Path(demo) / "checkpoints").glob("*.pt"), reverse=True):
        if ck.stem.endswith(".init"):  # the initializations kept for distance_from_init
            continue
        rep = api.check_invariance(cfg, ck, MEASURES, run=api.RunOptions(seed=0))
        r = {x.name: x for x in rep.results}
        ns, rf = r["normalized_sharpness"], r["relative_flatness"]

        def factor(x):
            return f"{abs(x.rescaled / x.original):.3g}"

        held = all(x.held for x in rep.results if x.claims_invariance)
        print(
            f"| {ck.stem} | {ns.original:.4g} → {ns.rel_change:.2g} | {rf.original:.4g} → {rf.rel_change:.2g} | "
            f"{factor(r['hessian_trace'])} | {factor(r['hessian_lambda_max'])} | {'yes' if held else 'no'} |"
        )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "flatcli-demo")
