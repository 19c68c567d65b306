"""The largest GPT-2-shaped model whose λmax fits in a given memory, per setting, from flatcli's memory
rules (`flatcli.engine.recompute.predicted_product_bytes`, measured within 0.88-1.32 of one product's
peak from 2M to 350M parameters: docs/performance.md), without building the large models.

For each width of the GPT-2 family (n_embd 768, 1024, 1280, 1600 with 12, 16, 20, 25 heads) and the
benchmark's tokens (vocabulary 8,192, ``--rows`` × ``--length``, ``causal_lm``), the counting pass of
`predicted_product_bytes` runs on models of 1 and 2 blocks (bf16: with bf16 matrix products computed
by the float32 kernel, `scripts.bench_large.matmul_mode`, which saves the same tensors); the saved
bytes and P are linear in the number of blocks L, so the peak of a λmax run with L blocks is

    base(P) + product(L) + basis(P) × P-vector,

``base``: the resident set before the first product, ``--base-mb`` + ``--base-bytes-per-param`` × P
(the defaults fit the benchmark's measured rows: 930 MB at 10.06M and 4,552 MB at 310.8M parameters,
fp32 model, tokens, Python and torch); ``product``: the rule of the setting (double backward:
S + 5Pb + W; block by block: 2S/L + 3Pb + W); ``basis``: the Lanczos basis, three ways: ``full``, 40
vectors (no restarts, as before ``runtime.max_basis_vectors``); ``certified``, thick restarts at
`certified_min_steps`(P) vectors (the least ``max_basis_vectors`` keeps); ``uncertified``, 3 (with
``min_steps`` lowered by the user, which drops the certificate). The largest L whose peak fits
``--memory-gb`` is printed per width, setting and basis.

    python scripts/bench_reach.py --memory-gb 22
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WIDTHS = {768: 12, 1024: 16, 1280: 20, 1600: 25}  # n_embd: n_head (GPT-2 small, medium, large, XL)
FAMILY = {768: 12, 1024: 24, 1280: 36, 1600: 48}  # the family's own depths
VECTOR_BYTES = 4  # θ and every P-vector stay float32 under bf16
FULL_BASIS = 40  # steps of a whole basis without restarts (random GPT-2s need 25-40 to 1e-3)


def counted(
    d: int, heads: int, layers: int, precision: str, rows: int, length: int
) -> tuple[int, int, int]:
    """(P, S + 5Pb + W, 2S/L + 3Pb + W) of a ``layers``-block model: the two product rules."""
    import torch
    import transformers

    from flatcli.engine import CurvatureEngine, Problem
    from flatcli.engine.recompute import predicted_product_bytes
    from scripts.bench_large import matmul_mode

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=8192,
        n_positions=length,
        n_embd=d,
        n_layer=layers,
        n_head=heads,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 8192, (rows, length), generator=torch.Generator().manual_seed(1))
    p = Problem(
        model,
        {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
        loss="causal_lm",
        batch_size=rows,
    )
    CurvatureEngine(p, precision=precision)  # sets the forward's dtype
    with matmul_mode("fp32" if precision == "bf16" else "native"):
        rev = predicted_product_bytes(p, p.batches[0], 1, p.device)[0]
        chain = predicted_product_bytes(p, p.batches[0], 1, p.device, by_blocks=layers)[0]
    return p.num_params, rev, chain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--memory-gb", type=float, default=22.0)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--base-mb", type=float, default=809.0)
    ap.add_argument("--base-bytes-per-param", type=float, default=12.04)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch

    from flatcli.engine.linalg import certified_min_steps

    torch.set_num_threads(args.threads)
    limit = args.memory_gb * 1e9
    for d, heads in WIDTHS.items():
        for precision in ("fp32", "bf16"):
            (P1, r1, c1), (P2, r2, c2) = (
                counted(d, heads, n, precision, args.rows, args.length) for n in (1, 2)
            )
            dP, b = P2 - P1, VECTOR_BYTES
            # rules: rev = S + 5Pb + W, chain = 2S/L + 3Pb + W; at L = 1, chain − rev = S − 2Pb
            S1 = c1 - r1 + 2 * P1 * b
            W = r1 - S1 - 5 * P1 * b
            S2 = r2 - 5 * P2 * b - W
            dS = S2 - S1

            def peak(L, scheme, basis, P1=P1, dP=dP, S1=S1, dS=dS, W=W, b=b):
                P = P1 + (L - 1) * dP
                S = S1 + (L - 1) * dS
                product = (
                    S + 5 * P * b + W if scheme == "double backward" else 2 * S / L + 3 * P * b + W
                )
                rows = (
                    certified_min_steps(P)
                    if basis == "certified"
                    else FULL_BASIS
                    if basis == "full"
                    else 3
                )
                return (
                    P,
                    args.base_mb * 1e6 + args.base_bytes_per_param * P + product + rows * P * b,
                )

            for scheme in ("double backward", "block by block"):
                row = {
                    "n_embd": d,
                    "precision": precision,
                    "scheme": scheme,
                    "S_per_block_mb": round(dS / 1e6, 1),
                    "S_two_blocks_mb": round(S2 / 1e6, 1),
                }
                for basis in ("full", "certified", "uncertified"):
                    L = 0
                    while peak(L + 1, scheme, basis)[1] <= limit and L < 400:
                        L += 1
                    P, need = peak(max(L, 1), scheme, basis)
                    row[basis] = {
                        "largest_layers": L,
                        "params": int(P) if L else 0,
                        "peak_gb": round(need / 1e9, 2) if L else None,
                        "family_peak_gb": round(peak(FAMILY[d], scheme, basis)[1] / 1e9, 2),
                    }
                row["family_depth"], row["family_params"] = (
                    FAMILY[d],
                    int(P1 + (FAMILY[d] - 1) * dP),
                )
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
