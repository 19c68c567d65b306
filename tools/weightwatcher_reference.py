"""Reference values of WeightWatcher 0.7.7 for tests/measures/test_weightwatcher.py.

Builds layers with closed-form weights (orthonormal DCT bases and Pareto-quantile spectra:
no random numbers, so every platform builds the same matrices), runs
``weightwatcher.WeightWatcher(model).analyze()`` with its defaults, and writes the
per-layer α, x_min, D, σ and tail size to tests/data/weightwatcher_0.7.7.json. The sizes
cover both of its fits (below and from 20 eigenvalues), its ``min_evals`` cut (8), a
rank-deficient layer (eigenvalues under its 1e-5 threshold), tied eigenvalues and a pooled
convolution.

    pip install weightwatcher==0.7.7
    python tools/weightwatcher_reference.py          # rewrites the JSON
"""

from __future__ import annotations

import json
import logging
import math
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

VERSION = "0.7.7"
OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / f"weightwatcher_{VERSION}.json"


def dct(n: int) -> np.ndarray:
    """The orthonormal DCT-II matrix (n × n)."""
    k, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    C = np.sqrt(2.0 / n) * np.cos(math.pi * (j + 0.5) * k / n)
    C[0] /= math.sqrt(2.0)
    return C


def spectrum(m: int, alpha: float = 2.5, rank: int | None = None, ties: int = 0) -> np.ndarray:
    """The m squared singular values: a tail of Pareto(α) quantiles (2/3 of them) above a flat bulk in
    [0.05, 0.5] (so that x_min has to be chosen), the last ``m − rank`` set to 0, the top ``ties``
    repeated in pairs."""
    t = m - m // 3
    tail = (1.0 - (np.arange(t) + 0.5) / t) ** (-1.0 / (alpha - 1.0))
    lam = np.concatenate([tail[::-1], np.linspace(0.5, 0.05, m - t)])
    for t in range(ties):
        lam[2 * t + 1] = lam[2 * t]
    if rank is not None:
        lam[rank:] = 0.0
    return lam


def matrix(out: int, inp: int, **kw) -> torch.Tensor:
    """W (out × in) = U diag(√λ) Vᵀ with DCT bases, λ from `spectrum` (min(out, in) of them)."""
    m = min(out, inp)
    s = np.sqrt(spectrum(m, **kw))
    W = dct(out)[:, :m] @ np.diag(s) @ dct(inp)[:m, :]
    return torch.tensor(W, dtype=torch.float64)


LINEAR = {  # name: (out, in, spectrum options)
    "lin4": (4, 6, {}),  # 4 eigenvalues: below min_evals = 8
    "lin8": (8, 12, {}),
    "lin10": (10, 40, {"alpha": 2.0}),  # a 10-class head
    "lin12_rank6": (12, 16, {"rank": 6}),  # 6 eigenvalues above 1e-5: no tail of 8
    "lin16_ties": (16, 20, {"ties": 4}),
    "lin19": (19, 25, {"alpha": 3.5}),
    "lin20": (20, 30, {}),
    "lin30": (30, 50, {"alpha": 2.2}),
    "lin64": (64, 100, {"alpha": 3.0}),
}


def reference_model() -> nn.Module:
    """A container of the layers above and one Conv2d(3 → 4, 2 × 2) (3 × 4 pooled eigenvalues)."""
    model = nn.Module()
    for name, (out, inp, kw) in LINEAR.items():
        lin = nn.Linear(inp, out, bias=False).double()
        with torch.no_grad():
            lin.weight.copy_(matrix(out, inp, **kw))
        setattr(model, name, lin)
    conv = nn.Conv2d(3, 4, 2, bias=False).double()
    with torch.no_grad():
        for p, (i, j) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
            conv.weight[:, :, i, j] = matrix(4, 3, alpha=2.0 + 0.5 * p)
    model.conv = conv
    return model


def weightwatcher_values(model: nn.Module) -> dict:
    """Per layer name, WeightWatcher's alpha, xmin, D, sigma, num_pl_spikes (layers it fits)."""
    import weightwatcher as ww

    logging.getLogger("weightwatcher").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        df = ww.WeightWatcher(model=model, log_level=logging.ERROR).analyze(plot=False)
    cols = ("alpha", "xmin", "D", "sigma", "num_pl_spikes")
    return {str(r["name"]): {c: float(r[c]) for c in cols} for _, r in df.iterrows()}


def main() -> int:
    import weightwatcher as ww

    if ww.__version__ != VERSION:
        print(
            f"weightwatcher {ww.__version__} installed; the reference is for {VERSION}",
            file=sys.stderr,
        )
        return 1
    vals = weightwatcher_values(reference_model())
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(
        json.dumps({"weightwatcher": VERSION, "layers": vals}, indent=1, sort_keys=True) + "\n"
    )
    summary = ", ".join(f"{k} α={v['alpha']:.5g}" for k, v in vals.items())
    print(f"wrote {OUT}: {summary}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
