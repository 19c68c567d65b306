"""The bias of ``runtime.precision: bf16`` against float32: λmax and the Hessian trace of GPT-2/BERT
models whose weights are stored in bfloat16 (random weights from configs, cast to bfloat16; the float32
run measures the same bfloat16 values upcast, so only the arithmetic differs).

Per model, as ``hessian_lambda_max`` and ``hessian_trace`` do it with ``precision: bf16``: λmax by
Lanczos (tol 1e-3) with bf16 products, the float32 Rayleigh quotient of its Ritz vector, and Lanczos
with float32 products continued from that vector to tol 1e-3 (the float32 λmax; the tests check both
against dense Hessians on the tiny models); the trace's bias from paired probes (the same Rademacher
probes through bf16 and float32 products, as the measure's control sample), beside the float32
Hutchinson estimate of those probes and its standard error, and, for models under 5,000 parameters,
the exact float32 trace (the relative bias is taken against it when there is one, else against the
estimate); seconds per product in each precision and the process's peak resident memory.

    python -m benchmarks.bench_bf16                  # the tests' tiny GPT-2 and BERT, and a 10M GPT-2
    python -m benchmarks.bench_bf16 --models gpt2-10m --probes 8

The result goes to docs/benchmarks/data/bf16.json (``--json`` elsewhere).
"""

from __future__ import annotations

import argparse
import platform
import resource
import time

import torch

from benchmarks._common import json_arg, table, write_json
from benchmarks.bench_large import matmul_mode
from flatcli.engine import CurvatureEngine, Problem, linalg
from flatcli.loading.hf import transformers_module


def tiny_gpt2(tf):
    """The shape of tests/hf_models.save_gpt2(n_embd=4): 1 layer, 2 heads, a 31-token vocabulary."""
    cfg = tf.GPT2Config(
        vocab_size=31, n_positions=16, n_embd=4, n_layer=1, n_head=2, attn_implementation="eager"
    )
    return tf.GPT2LMHeadModel(cfg), "causal_lm", 31, (5, 12)


def tiny_bert(tf):
    """The shape of tests/hf_models.save_bert(hidden=4): 1 layer, 2 heads, 2 labels."""
    cfg = tf.BertConfig(
        vocab_size=31,
        hidden_size=4,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=8,
        max_position_embeddings=16,
        type_vocab_size=2,
        num_labels=2,
        attn_implementation="eager",
    )
    return tf.BertForSequenceClassification(cfg), "cross_entropy", 31, (5, 12)


def gpt2_10m(tf):
    """GPT-2 of 10.0M parameters: 6 layers of width 320, 5 heads, vocabulary 8,192, 2 × 32 tokens."""
    cfg = tf.GPT2Config(
        vocab_size=8192,
        n_positions=64,
        n_embd=320,
        n_layer=6,
        n_head=5,
        attn_implementation="eager",
    )
    return tf.GPT2LMHeadModel(cfg), "causal_lm", 8192, (2, 32)


def gpt2_124m(tf):
    """GPT-2 small's blocks (12 layers of width 768, 12 heads) with vocabulary 8,192: 91.4M parameters,
    2 × 32 tokens."""
    cfg = tf.GPT2Config(
        vocab_size=8192,
        n_positions=64,
        n_embd=768,
        n_layer=12,
        n_head=12,
        attn_implementation="eager",
    )
    return tf.GPT2LMHeadModel(cfg), "causal_lm", 8192, (2, 32)


EXACT_BELOW = 5000  # parameters: the exact trace is computed for models up to this size
MODELS = {
    "gpt2-tiny": tiny_gpt2,
    "bert-tiny": tiny_bert,
    "gpt2-10m": gpt2_10m,
    "gpt2-124m": gpt2_124m,
}


def data_for(loss: str, vocab: int, shape: tuple[int, int], seed: int = 0) -> dict:
    """Random tokens (the first row padded after two thirds), labels 0/1 for a classifier."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, shape, generator=g)
    mask = torch.ones_like(ids)
    mask[0, 2 * shape[1] // 3 :] = 0
    out = {"input_ids": ids, "attention_mask": mask}
    if loss == "cross_entropy":
        out["labels"] = torch.arange(shape[0]) % 2
    return out


def timed_products(eng: CurvatureEngine, fn):
    """(fn(), seconds per product) over the engine's products during fn."""
    n0, t = eng.counters()["n_hvp"], time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t) / max(eng.counters()["n_hvp"] - n0, 1)


def paired_probes(eng: CurvatureEngine, probes: int, seed: int = 2) -> dict:
    """The same Rademacher probes z through bf16 and float32 products: the Hutchinson trace of the
    float32 quadratic forms z^T H z (mean ± stderr) and the bf16 bias, the mean of z^T (H_bf16 − H) z
    ± its stderr (what ``hessian_trace``'s control sample reports)."""
    g = torch.Generator().manual_seed(seed)
    Z = (torch.randint(0, 2, (probes, eng.problem.num_params), generator=g) * 2 - 1).float()
    qf = (Z * eng.hessian().matmat_rows(Z)).sum(1).double()
    (q32, sec32) = timed_products(
        eng, lambda: (Z * eng.hessian(precision="fp32").matmat_rows(Z)).sum(1).double()
    )
    d = qf - q32
    se = probes**-0.5
    return {
        "trace_fp32": float(q32.mean()),
        "trace_stderr": float(q32.std() * se),
        "trace_bias": float(d.mean()),
        "trace_bias_se": float(d.std() * se),
        "sec_fp32": sec32,
    }


def measure(name: str, probes: int, tol: float) -> dict:
    """Every number of one model's row (module docstring)."""
    tf = transformers_module("bench_bf16")
    torch.manual_seed(0)
    model, loss, vocab, shape = MODELS[name](tf)
    model = model.to(torch.bfloat16).float().eval()  # stored in bfloat16, its values upcast exactly
    data = data_for(loss, vocab, shape)
    eng = CurvatureEngine(Problem(model, data, loss=loss, batch_size=shape[0]), precision="bf16")
    out = {"model": name, "P": eng.problem.num_params, "tokens": shape[0] * shape[1]}
    r, out["sec_bf16"] = timed_products(
        eng,
        lambda: linalg.lanczos(
            eng.hessian(),
            k=1,
            stop=linalg.KrylovStop(tol=tol, max_steps=60),
            generator=torch.Generator().manual_seed(1),
            return_vectors=True,
        ),
    )
    H32 = eng.hessian(precision="fp32")
    out["lam_bf16"], out["steps_bf16"], out["restarts_bf16"] = (
        float(r.eigenvalues[0]),
        r.steps,
        r.restarts,
    )
    out["lam_bf16_rq32"] = linalg.verify_eigenpair(H32, r.ritz_vectors[0])[0]
    r32 = linalg.lanczos(
        H32,
        k=1,
        v0=r.ritz_vectors[0],
        stop=linalg.KrylovStop(tol=tol, min_steps=1, max_steps=60),
        generator=torch.Generator().manual_seed(1),
    )
    out["lam_fp32"], out["steps_fp32"] = float(r32.eigenvalues[0]), r32.steps
    out["basis_vectors"] = r.basis_vectors
    out.update(paired_probes(eng, probes))
    if (
        eng.problem.num_params <= EXACT_BELOW
    ):  # the exact float32 trace (one product per parameter) as the scale
        with eng.full_precision():
            out["trace_exact"] = float(
                linalg.exact_diagonal(
                    eng.hessian(), settings=linalg.EstimatorSettings(block_size=64)
                ).sum()
            )
    out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out


def main() -> None:
    """Print one table row per model."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS)
    )
    ap.add_argument("--probes", type=int, default=8, help="Rademacher probes of the trace control")
    ap.add_argument("--tol", type=float, default=1e-3, help="Lanczos' relative residual to stop at")
    ap.add_argument(
        "--bf16-matmul",
        choices=["native", "fp32"],
        default="native",
        help="fp32: bf16 matrix products by the float32 kernel, rounded to bf16 "
        "(benchmarks/bench_large.py's matmul_mode; for CPUs without bf16 matrix units)",
    )
    json_arg(ap, "bf16")
    args = ap.parse_args()

    print(
        f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, CPU"
    )
    columns = [
        "model",
        "P",
        "tokens",
        "λmax fp32",
        "λmax bf16 (rel. bias)",
        "fp32 RQ of the bf16 vector",
        "trace fp32 ± stderr",
        "bf16 trace bias ± se (rel.)",
        "s/product fp32 / bf16",
        "peak RSS",
    ]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    rows, notes = [], []
    for name in args.models.split(","):
        with matmul_mode(args.bf16_matmul):
            r = measure(name.strip(), args.probes, args.tol)
        rel = (r["lam_bf16"] - r["lam_fp32"]) / abs(r["lam_fp32"])
        scale = r.get("trace_exact", r["trace_fp32"])
        rel_tr = abs(r["trace_bias"]) / abs(scale)
        exact = f" (exact {r['trace_exact']:.5g})" if "trace_exact" in r else ""
        rows.append(
            [
                r["model"],
                f"{r['P']:,}",
                str(r["tokens"]),
                f"{r['lam_fp32']:.5g}",
                f"{r['lam_bf16']:.5g} ({rel:+.2e})",
                f"{r['lam_bf16_rq32']:.5g}",
                f"{r['trace_fp32']:.5g} ± {r['trace_stderr']:.2g}{exact}",
                f"{r['trace_bias']:+.3g} ± {r['trace_bias_se']:.2g} ({rel_tr:.1e})",
                f"{r['sec_fp32']:.3f} / {r['sec_bf16']:.3f}",
                f"{r['peak_rss_gib']:.2f} GiB",
            ]
        )
        print("| " + " | ".join(rows[-1]) + " |", flush=True)
        steps = {k: r[k] for k in ("steps_bf16", "restarts_bf16", "basis_vectors", "steps_fp32")}
        notes.append(f"{r['model']}: {steps}")
        print("#", steps, flush=True)
    tab = table("bf16 against float32: λmax and the trace", columns, rows, "; ".join(notes))
    path = write_json("bf16", "bfloat16 products: the bias against float32", [tab], args.json)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
