"""The default trace's choice and its near-zero rule, in products and statuses (no timings).

1. ``hessian_trace`` with ``method: auto`` against Hutchinson alone, on 4-h-3 MLPs over 64 rows
   from P = 67 to 2,499 parameters (ReLU under MSE against 5·randn targets: indefinite Hessians
   whose trace Hutchinson needs thousands of probes for; tanh under cross-entropy) and on two
   quadratic losses with an easy trace (eigenvalues evenly in [1, 1.1]): the estimator auto
   ran, its products (the check's included) and status, and Hutchinson's.
2. The trace of a 64-64-10 tanh MLP trained on the digits (P = 4,810) by ``auto``, Hutchinson
   and Hutch++ at the defaults.
3. ``near_zero`` in 20 seeds per true ratio Tr H / Tr|H| (P = 300, eigenvalues of magnitudes
   uniform on [0.05, 1], half negative and scaled to the ratio, Hutchinson with at most 400
   probes), at ``tol`` 0.01 and 0.05.

Counts only, the same on any machine::

    python -m benchmarks.bench_trace_auto [--json PATH]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from torch import nn

from benchmarks._common import Tables, json_arg, write_json

DT = torch.float64
SIZES = [  # (hidden width, activation, loss): P = 7h + 3 + ... (4 inputs, 3 outputs)
    (8, nn.ReLU, "mse"),
    (20, nn.ReLU, "mse"),
    (50, nn.Tanh, "cross_entropy"),
    (100, nn.ReLU, "mse"),
    (150, nn.Tanh, "cross_entropy"),
    (237, nn.ReLU, "mse"),
    (312, nn.Tanh, "cross_entropy"),
]
RATIOS = (0.0, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.10)


def mlp(h: int, act, loss: str):
    """A 4-h-3 MLP on 64 seeded rows, float64: a flatcli `Problem`."""
    from flatcli.engine import Problem

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, h), act(), nn.Linear(h, 3)).to(DT)
    x = torch.randn(64, 4, dtype=DT)
    y = 5 * torch.randn(64, 3, dtype=DT) if loss == "mse" else torch.randint(0, 3, (64,))
    return Problem(m, x, y, loss=loss, batch_size=64, dtype=DT)


def measure(p, **options):
    """``hessian_trace`` with ``options`` on ``p`` (seed 0)."""
    from flatcli.engine import CurvatureEngine
    from flatcli.measures import MeasureContext, MeasureSpec, run_measure

    spec = MeasureSpec("hessian_trace", "t", {"per_layer": "none", **options})
    return run_measure(spec, MeasureContext(p, CurvatureEngine(p), seed=0))


class Quadratic(nn.Module):
    """f(θ) = ½θᵀAθ at θ = 0 for every row: under MSE against −1 the loss Hessian is 2·A."""

    def __init__(self, A: torch.Tensor):
        super().__init__()
        self.register_buffer("A", A)
        self.theta = nn.Parameter(torch.zeros(A.shape[0], dtype=A.dtype))

    def forward(self, x):
        return (0.5 * self.theta @ (self.A @ self.theta)).expand(x.shape[0], 1) + 0 * x[:, :1]


def rotated(eigs: np.ndarray, seed: int = 1) -> torch.Tensor:
    """Q diag(eigs) Qᵀ for a seeded random orthogonal Q."""
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(len(eigs), len(eigs), generator=g, dtype=DT))
    return (Q * torch.as_tensor(eigs, dtype=DT)) @ Q.T


def quadratic(P: int):
    """A loss whose Hessian is 2·A, A with eigenvalues evenly in [1, 1.1] (an easy trace)."""
    from flatcli.engine import Problem

    x, y = torch.zeros(4, 1, dtype=DT), -torch.ones(4, 1, dtype=DT)
    m = Quadratic(rotated(np.linspace(1.0, 1.1, P)))
    return Problem(m, x, y, loss="mse", batch_size=4, dtype=DT)


def auto_rows() -> list[list]:
    rows = []
    problems = [(mlp(h, act, loss), f"{act.__name__}, {loss}") for h, act, loss in SIZES]
    problems += [(quadratic(P), "quadratic, λ in [1, 1.1]") for P in (300, 1500)]
    for p, name in problems:
        a, b = measure(p), measure(p, method="hutchinson")
        d = a.diagnostics
        rows.append(
            [
                p.num_params,
                name,
                d["method"],
                round(d["check_predicted_probes"]) if "check_predicted_probes" in d else "",
                d["n_hvp"],
                a.status,
                b.diagnostics["n_hvp"],
                b.status,
            ]
        )
        print(rows[-1], flush=True)
    return rows


def digits_rows() -> list[list]:
    """A 64-64-10 tanh MLP trained on the digits (Adam, 300 full-batch steps): each method's
    products and status at the defaults."""
    from flatcli.engine import Problem
    from flatcli.loading.data import digits_split

    x, y = digits_split("train")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for _ in range(300):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
    p = Problem(m.eval(), x, y, loss="cross_entropy", batch_size=len(y))
    rows = []
    for method in ("auto", "hutchinson", "hutchpp"):
        r = measure(p, method=method)
        d = r.diagnostics
        rows.append(
            [p.num_params, round(float(loss), 4), method, d["method"], d["n_hvp"], r.status]
            + [r.value, r.stderr, d.get("sketch", "")]
        )
        print(rows[-1], flush=True)
    return rows


def ratio_spectrum(ratio: float, P: int = 300) -> np.ndarray:
    """As ``tests/measures/test_fidelity.py``: Tr H / Tr|H| exactly ``ratio``."""
    m = np.random.default_rng(0).uniform(0.05, 1.0, P)
    pos, neg = m[: P // 2], m[P // 2 :]
    c = pos.sum() * (1 - ratio) / (neg.sum() * (1 + ratio))
    return np.concatenate([pos, -c * neg])


def near_zero_rows() -> list[list]:
    from flatcli.engine import linalg

    rows = []
    for tol in (0.01, 0.05):
        row = [tol]
        for ratio in RATIOS:
            A = rotated(ratio_spectrum(ratio))
            op = linalg.as_operator(lambda V, A=A: V @ A, 300, dtype=DT)
            row.append(
                sum(
                    linalg.hutchinson(
                        op,
                        stop=linalg.ProbeStop(tol=tol, max_probes=400),
                        generator=torch.Generator().manual_seed(seed),
                        settings=linalg.EstimatorSettings(block_size=64),
                    ).near_zero
                    for seed in range(20)
                )
            )
        rows.append(row)
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    json_arg(ap, "trace_auto")
    args = ap.parse_args()
    tables = Tables()
    tables.add(
        "method: auto against Hutchinson alone (defaults: tol 0.01, 16 to 1,000 probes)",
        [
            "P",
            "model",
            "auto ran",
            "check's predicted probes",
            "auto products",
            "auto status",
            "Hutchinson products",
            "Hutchinson status",
        ],
        auto_rows(),
        note="auto spends at most P plus its 16-probe check (or the near-zero floor's 40); "
        "above 2,080 parameters it runs Hutch++ (a sketch of at most 256 MiB) or Hutchinson, "
        "without a check.",
    )
    tables.add(
        "A trained digits MLP (64-64-10 tanh, 1,257 rows): the three stochastic choices",
        ["P", "train loss", "method", "ran", "products", "status", "trace", "stderr", "sketch"],
        digits_rows(),
        note="above the check's range auto runs Hutch++ when its largest sketch takes at most "
        "256 MiB; its sketch grows while the residual's spread says it pays.",
    )
    tables.add(
        "Runs that end near_zero, of 20 seeds, by true Tr H / Tr|H|",
        ["tol", *[f"{r:.0%}" for r in RATIOS]],
        near_zero_rows(),
        note="near_zero needs |value| + 2·stderr ≤ 5% of abs_trace − 2·abs_trace_stderr.",
    )
    path = write_json(
        "trace_auto",
        "The default trace's choice and near-zero rule",
        tables,
        args.json,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
