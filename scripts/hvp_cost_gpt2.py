"""Cost of one Hessian-vector product on GPT-2-small-sized random weights (README "Transformers").

Builds ``GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257))`` from
its config (random initialization, nothing downloaded, eager attention), a batch of ``--rows`` ×
``--tokens`` random token ids, and times one exact HVP of the ``causal_lm`` loss through flatcli's
engine (after one warm-up product, which builds the cached gradient graph), each variant in a fresh
process so that the peak resident memory (``ru_maxrss``) is its own:

* ``fused``: flatcli's default for ``causal_lm``: the LM head and the cross-entropy fused, chunked
  over tokens, with an analytic double backward (`flatcli.engine.lmhead`);
* ``double_backward``: the plain reverse-over-reverse product through ``log_softmax``
  (``Problem(..., fused_head=False)``).

    OMP_NUM_THREADS=2 python scripts/hvp_cost_gpt2.py            # both variants, one line each
    python scripts/hvp_cost_gpt2.py --variant fused --threads 1 --rows 2 --tokens 128
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def one(variant: str, rows: int, tokens: int, threads: int, seed: int) -> dict:
    import torch

    from flatcli.engine import Batch, CurvatureEngine, Problem, eval_mode
    from flatcli.loading.hf import transformers_module

    torch.set_num_threads(threads)
    tf = transformers_module()
    torch.manual_seed(seed)
    cfg = tf.GPT2Config(
        n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024, use_cache=False
    )
    cfg._attn_implementation = "eager"
    model = tf.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(
        0, cfg.vocab_size, (rows, tokens), generator=torch.Generator().manual_seed(seed)
    )
    batch = Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with eval_mode(model):
        prob = Problem(
            model, batch, loss="causal_lm", batch_size=rows, fused_head=variant == "fused"
        )
        eng = CurvatureEngine(prob)
        v = torch.randn(prob.num_params, generator=torch.Generator().manual_seed(seed + 1))
        t0 = time.perf_counter()
        eng.hessian()(v)  # first product: forward, gradient graph, one pull-back
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        hv = eng.hessian()(
            v
        )  # a product through the cached graph (what every Lanczos step after the first costs)
        again = time.perf_counter() - t0
    return {
        "variant": variant,
        "parameters": prob.num_params,
        "rows": rows,
        "tokens": tokens,
        "threads": threads,
        "first_hvp_s": round(first, 2),
        "cached_hvp_s": round(again, 2),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "model_rss_gib": round(rss0 / 2**20, 2),
        "vhv": float(v @ hv),
        "torch": torch.__version__,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", choices=["fused", "double_backward", "both"], default="both")
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.variant != "both":
        print(json.dumps(one(a.variant, a.rows, a.tokens, a.threads, a.seed)))
        return
    for variant in ("fused", "double_backward"):
        cmd = [
            sys.executable,
            __file__,
            "--variant",
            variant,
            "--rows",
            str(a.rows),
            "--tokens",
            str(a.tokens),
            "--threads",
            str(a.threads),
            "--seed",
            str(a.seed),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        print(out.stdout.strip() or out.stderr.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
