"""The cost of a bounded Lanczos basis (``runtime.max_basis_vectors``: thick restarts) against full
reorthogonalization with the whole basis: products, λmax and its relative residual, seconds, the most
basis vectors kept, on the same operator, start vector and tolerance.

Models: ``clustered`` (a 3,000 × 3,000 float64 matrix with a clustered top, see `clustered`), ``mlp`` (`flatcli.demo.models.MLP` 64-32-32-10 at its random initialization, cross-entropy on
the 1,257 scikit-learn digits training inputs) and ``gpt2-2M`` / ``gpt2-10M`` (scripts/bench_large.py's
GPT-2 shapes, random weights, ``causal_lm`` on ``--rows`` × 128 tokens). Random initializations are
the hard case for Lanczos: the top of their spectrum is not separated, so it needs many steps.

    python scripts/bench_restart.py --model mlp --model gpt2-2M --cap none --cap 32 --cap 16
    python scripts/bench_restart.py --model clustered --k 3 --cap none --cap 12 --tol 1e-6
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def clustered(n: int = 3000):
    """A float64 operator with eigenvalues 10, 9.9, 9.8, −5, −4.95 over a bulk uniform in [−3, 6.5]
    (seeded), the shape of tests/engine/test_thick_restart.py at n = 3,000: a clustered top."""
    import torch

    from flatcli.engine import linalg

    g = torch.Generator().manual_seed(0)
    ev = torch.cat(
        [
            torch.tensor([10.0, 9.9, 9.8, -5.0, -4.95], dtype=torch.float64),
            torch.rand(n - 5, generator=g, dtype=torch.float64) * 9.5 - 3,
        ]
    )
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    A = (Q * ev) @ Q.T
    return linalg.as_operator(lambda V: V @ A, n, dtype=torch.float64)


def problem(name: str, rows: int):
    import torch

    from flatcli.engine import Problem

    if name == "mlp":
        from sklearn.datasets import load_digits

        from flatcli.demo.models import MLP

        X, y = load_digits(return_X_y=True)
        torch.manual_seed(0)
        model = MLP(64, 32, 2, 10)
        x = torch.as_tensor(X[:1257] / 16.0, dtype=torch.float32)
        return Problem(model, x, torch.as_tensor(y[:1257]), loss="cross_entropy", batch_size=1257)
    from scripts.bench_large import build

    model, batch = build(name.split("-")[1], 8192, rows, 128)
    return Problem(model, batch, loss="causal_lm", batch_size=rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", choices=["mlp", "gpt2-2M", "gpt2-10M", "clustered"])
    ap.add_argument("--k", type=int, default=1, help="eigenpairs that must converge")
    ap.add_argument("--cap", action="append", help="max_basis_vectors: an int or none (repeatable)")
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--max-steps", type=int, default=300)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch

    from flatcli.engine import CurvatureEngine, linalg

    torch.set_num_threads(args.threads)
    for name in args.model or ["mlp"]:
        if name == "clustered":
            op, P = clustered(), 3000
        else:
            p = problem(name, args.rows)
            op, P = CurvatureEngine(p).hessian(), p.num_params
        for cap in args.cap or ["none", "32", "16"]:
            mb = None if cap == "none" else int(cap)
            t0 = time.perf_counter()
            r = linalg.lanczos(
                op,
                k=args.k,
                generator=torch.Generator().manual_seed(3),
                stop=linalg.KrylovStop(tol=args.tol, max_steps=args.max_steps, max_basis=mb),
            )
            lam = float(r.eigenvalues[0])
            print(
                json.dumps(
                    {
                        "model": name,
                        "P": P,
                        "k": args.k,
                        "cap": cap,
                        "lambda_max": lam,
                        "rel_residual": float(r.residuals[0] / abs(lam)),
                        "converged": bool(r.converged),
                        "products": r.steps,
                        "restarts": r.restarts,
                        "basis_vectors": r.basis_vectors,
                        "seconds": round(time.perf_counter() - t0, 2),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
