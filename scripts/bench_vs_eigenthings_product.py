"""One Hessian-vector product, flatcli against hessian-eigenthings, side by side in one process, on a
GPT-2-shaped model (`scripts/bench_large.py`'s ``build``: random weights, ``causal_lm``), rounds
alternating which tool goes first (the first product of a process pays for fresh pages; glibc keeps
freed memory for the next one, so a fixed order favours the second).

flatcli: `CurvatureEngine.hessian` with gradient graphs not cached (a forward, a ``create_graph`` backward
and a backward per product, as eigenthings); eigenthings: ``HessianOperator(model, [batch],
hf_lm_loss()).matvec`` (``model(**batch).loss``, the same mean over the scored next tokens on one
batch). ``hessian_eigenthings`` is imported from ``--eigenthings DIR`` (its wheel unpacked there, see
scripts/bench_large.py). Prints seconds per product, their ratio and the products' relative difference.

    python scripts/bench_vs_eigenthings_product.py --size 10M --rounds 4 --eigenthings /tmp/he27b/lib
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="10M")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--eigenthings", required=True, help="a folder holding the hessian_eigenthings package"
    )
    args = ap.parse_args()
    sys.path.insert(0, args.eigenthings)
    import torch
    from hessian_eigenthings import HessianOperator, hf_lm_loss

    from flatcli.engine import CurvatureEngine, Problem
    from scripts.bench_large import build

    torch.set_num_threads(args.threads)
    model, batch = build(args.size, args.vocab, args.rows, args.length)
    eng = CurvatureEngine(
        Problem(model, dict(batch), loss="causal_lm", batch_size=args.rows), cache_graphs=False
    )
    labelled = {
        **batch,
        "labels": batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100),
    }
    op = HessianOperator(model, [labelled], hf_lm_loss())
    v = torch.randn(eng.problem.num_params, generator=torch.Generator().manual_seed(3))
    H = eng.hessian()
    tools = {"flatcli": lambda: H(v[None])[0], "eigenthings": lambda: op.matvec(v)}
    for r in range(args.rounds):
        order = ["flatcli", "eigenthings"] if r % 2 == 0 else ["eigenthings", "flatcli"]
        secs, out = {}, {}
        for name in order:
            t0 = time.perf_counter()
            out[name] = tools[name]()
            secs[name] = time.perf_counter() - t0
        diff = float((out["flatcli"] - out["eigenthings"]).norm() / out["eigenthings"].norm())
        print(
            f"round {r} ({order[0]} first): flatcli {secs['flatcli']:.2f} s, eigenthings {secs['eigenthings']:.2f} s, "
            f"ratio {secs['flatcli'] / secs['eigenthings']:.2f}, rel. difference {diff:.1e}",
            flush=True,
        )


if __name__ == "__main__":
    main()
