"""Time cost of host offload of Lanczos bases (`flatcli.engine.linalg._store`): λmax of a diagonal
operator (a product costs one elementwise multiply, so the reorthogonalization dominates) with the
basis all on the device against ``max_device_vectors`` = 4 and 16, on CPU (where "device" and host
are the same memory, so this measures the chunking and the copies, not a PCIe link).

    python scripts/bench_basis_store.py --dim 1000000 --steps 40
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flatcli.engine import linalg  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=1_000_000)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    d = torch.linspace(0, 1, args.dim)  # eigenvalues 0..1, evenly spaced: Lanczos runs every step
    ref = None
    for cap in (None, 16, 4):
        g = torch.Generator().manual_seed(0)
        t0 = time.perf_counter()
        r = linalg.lanczos(
            linalg.as_operator(lambda V: V * d, args.dim, max_device_vectors=cap),
            generator=g,
            stop=linalg.KrylovStop(tol=1e-12, min_steps=args.steps, max_steps=args.steps),
        )
        secs = time.perf_counter() - t0
        ref = r.eigenvalues[0] if ref is None else ref
        print(
            f"max_device_vectors={cap}: {secs:.2f} s, {r.steps} steps, lambda_max {r.eigenvalues[0]:.12f} "
            f"(diff from all-on-device {abs(r.eigenvalues[0] - ref):.1e}), peak device vectors {r.device_vectors}"
        )


if __name__ == "__main__":
    main()
