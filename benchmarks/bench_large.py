"""Reach on one device: GPT-2-shaped models with random weights, ``causal_lm``, λmax to a relative
residual of 1e-3 (block-1 Lanczos, as ``hessian_lambda_max``) and a 16-probe Hutchinson trace, per
setting (precision × ``runtime.recompute``), each in a fresh process.

Each setting's child process builds the model and the tokens, then runs λmax and the trace through
`flatcli.engine.CurvatureEngine` and `flatcli.engine.linalg`, and reports seconds, products and
values, and the process's peak resident memory (``VmHWM`` from ``/proc/self/status``, the whole
process: weights, tokens, Python and torch included), with glibc's mmap threshold pinned
(``MALLOC_MMAP_THRESHOLD_``) so that large tensors are returned to the system when freed. Linux only.
Gradient graphs are not cached across products (``cache_graphs=False``) in every row, so the rows
differ by the product alone.

Precisions this branch's engine does not know (``bf16`` before ``runtime.precision: bf16`` exists)
are skipped with a message.

    python -m benchmarks.bench_large --size 10M --rows 4                      # fp32, recompute off/on
    python -m benchmarks.bench_large --size 10M --size 30M --precision fp32 --precision bf16
    python -m benchmarks.bench_large --size 10M --eigenthings /tmp/he/lib

The rows go to docs/benchmarks/data/large.json (``--json`` elsewhere).

``--eigenthings DIR`` also runs hessian-eigenthings' Lanczos (``--eigenthings-steps``, default 8) on the same
model and tokens, its child process importing ``hessian_eigenthings`` from DIR (PYTHONPATH; its wheel unpacked there:
``pip download --no-deps hessian-eigenthings`` and unzip; it needs only torch, numpy, scipy and tqdm,
which flatcli's environment has), with its Hugging Face loss (``model(**batch).loss``, the same
mean over the non-padded next tokens here: one batch).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks._common import ROOT, json_arg, records_table, write_json

SIZES = {  # name -> (n_embd, n_layer, n_head); vocabulary 8192, positions = --length
    "2M": (128, 4, 4),
    "10M": (320, 6, 5),
    "30M": (512, 8, 8),
    "124M": (768, 12, 12),  # GPT-2 small's shape (vocabulary 50257 there)
    "350M": (1024, 24, 16),  # GPT-2 medium's shape
}


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def matmul_mode(kind: str):
    """A context for ``--bf16-matmul``: ``native`` does nothing; ``fp32`` is a dispatch mode under
    which every bfloat16 matrix product (``mm``, ``addmm``, ``bmm``, ``baddbmm``: ``nn.Linear``,
    GPT-2's ``Conv1D``, eager attention and their derivatives) is computed by the float32 kernel and
    rounded to bfloat16.

    For CPUs without bfloat16 matrix instructions (this project's AVX2 machine): PyTorch's reference
    bf16 kernel runs there at 0.2-0.4 GFLOP/s against 28-35 GFLOP/s in float32 (a 1024 x 1024 x 4096
    product: 41.8 s against 0.31 s), which puts one bf16 product of a 350M model past 50 minutes. The
    arithmetic is a GPU's bf16 GEMM (bf16 operands, float32 accumulation, a bf16 result) up to the
    order of summation; every tensor kept between operations has the dtype and shape it has with the
    native kernel, and the float32 copies of one product's operands live only inside it, so a peak
    memory measured under this mode bounds the native one from above (compared at 2M and 10M in
    docs/benchmarks/data/hvp_memory-350m.json). Seconds under it are not bf16 seconds."""
    import contextlib

    if kind != "fp32":
        return contextlib.nullcontext()
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map

    aten = torch.ops.aten
    ops = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}

    def up(t):
        return t.float() if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 else t

    class Fp32Matmuls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in ops and any(
                isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args
            ):
                return func(*tree_map(up, args), **tree_map(up, kwargs)).to(torch.bfloat16)
            return func(*args, **kwargs)

    return Fp32Matmuls()


def build(size: str, vocab: int, rows: int, length: int):
    """(model, batch): a GPT-2 LM head model with random weights (seed 0), eager attention, and
    ``rows`` × ``length`` random tokens (seed 1), the last quarter of the first row padded."""
    import torch
    import transformers

    d, layers, heads = SIZES[size]
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=vocab,
        n_positions=length,
        n_embd=d,
        n_layer=layers,
        n_head=heads,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    model = transformers.GPT2LMHeadModel(cfg).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 3 * length // 4 :] = 0
    return model, {"input_ids": ids, "attention_mask": mask}


def run_one(args) -> dict:
    """One setting in this process."""
    import torch

    from flatcli.engine import CurvatureEngine, Problem, linalg
    from flatcli.engine.precision import PRECISIONS

    if args.precision not in PRECISIONS:
        return {
            "skipped": f"runtime.precision {args.precision!r} is not in this engine ({', '.join(PRECISIONS)})"
        }
    torch.set_num_threads(args.threads)
    model, batch = build(args.size, args.vocab, args.rows, args.length)
    p = Problem(model, batch, loss="causal_lm", batch_size=args.rows)
    eng = CurvatureEngine(p, cache_graphs=False, precision=args.precision, recompute=args.recompute)
    base = _status("VmRSS")
    g = torch.Generator().manual_seed(3)
    with matmul_mode(args.bf16_matmul):
        t0 = time.perf_counter()
        lz = linalg.lanczos(
            eng.hessian(),
            k=1,
            block=1,
            stop=linalg.KrylovStop(tol=args.tol, max_steps=args.max_steps),
            generator=g,
        )
        t1 = time.perf_counter()
        tr = (
            linalg.hutchinson(
                eng.hessian(),
                generator=g,
                stop=linalg.ProbeStop(min_probes=args.probes, max_probes=args.probes),
                settings=linalg.EstimatorSettings(block_size=4),
            )
            if args.probes
            else None
        )
        t2 = time.perf_counter()
    return {
        "size": args.size,
        "params": p.num_params,
        "precision": args.precision,
        "recompute": args.recompute,
        "recompute_active": eng.state.route().recompute,
        "lambda_max": float(lz.eigenvalues[0]),
        "lambda_rel_residual": float(lz.residuals[0] / abs(lz.eigenvalues[0])),
        "lanczos_steps": lz.steps,
        "lambda_seconds": t1 - t0,
        "trace": tr and tr.estimate,
        "trace_stderr": tr and tr.stderr,
        "trace_seconds": t2 - t1,
        "seconds_per_product": (t1 - t0) / lz.steps,
        "peak_rss_bytes": _status("VmHWM"),
        "rss_before_bytes": base,
        "threads": args.threads,
        "bf16_matmul": args.bf16_matmul,
        "block_by_block": eng.state.chain is not None,
        "predicted_peak_bytes": _predicted_peak(p, eng, base, lz.steps, args.bf16_matmul),
    }


def _predicted_peak(p, eng, base: int, steps: int, bf16_matmul: str = "native") -> int:
    """The resident set before the measurement, one product (`predicted_product_bytes`, the rule of the
    product that ran) and the Lanczos basis (``steps`` + 2 P-vectors of θ's type, on the device: CPU)."""
    import torch

    from flatcli.engine.recompute import predicted_product_bytes

    blocks = len(eng.state.chain.blocks) if eng.state.chain is not None else 0
    with matmul_mode(
        bf16_matmul
    ):  # the counting pass runs the forward in the problem's compute type
        product = predicted_product_bytes(p, p.batches[0], 1, p.device, by_blocks=blocks)[0]
    return int(base + product + (steps + 2) * p.num_params * (torch.finfo(p.dtype).bits // 8))


EIGENTHINGS = r"""
import json, sys, time, torch
from benchmarks.bench_large import build, _status
from hessian_eigenthings import HessianOperator, hf_lm_loss, lanczos
torch.set_num_threads({threads})
model, batch = build({size!r}, {vocab}, {rows}, {length})
batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
op = HessianOperator(model, [batch], hf_lm_loss())
t0 = time.perf_counter()
res = lanczos(op, k=1, max_iter={steps}, which="LA", seed=0)
secs = time.perf_counter() - t0
print(json.dumps({{"lambda_max": float(res.eigenvalues[0]), "seconds": secs, "steps": res.iterations,
                  "seconds_per_product": secs / max(res.iterations, 1), "peak_rss_bytes": _status("VmHWM")}}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--size", action="append", choices=list(SIZES), help="model size (repeatable; default 10M)"
    )
    ap.add_argument(
        "--precision", action="append", help="runtime.precision (repeatable; default fp32)"
    )
    ap.add_argument(
        "--recompute", action="append", choices=["false", "true"], help="(repeatable; default both)"
    )
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--tol", type=float, default=1e-3)
    ap.add_argument("--max-steps", type=int, default=40)
    ap.add_argument("--probes", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--bf16-matmul",
        choices=["native", "fp32"],
        default="native",
        help="fp32: bf16 matrix products by the float32 kernel, rounded to bf16 (matmul_mode)",
    )
    ap.add_argument(
        "--eigenthings", help="a folder holding the hessian_eigenthings package (an unpacked wheel)"
    )
    ap.add_argument("--eigenthings-steps", type=int, default=8)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    json_arg(ap, "large")
    args = ap.parse_args()
    if args.one:
        args.size, args.precision, args.recompute = (
            args.size[0],
            args.precision[0],
            args.recompute[0],
        )
        print(json.dumps(run_one(args)))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # children: python -m from ROOT
    rows: list[dict] = []
    common = [
        "--vocab",
        args.vocab,
        "--rows",
        args.rows,
        "--length",
        args.length,
        "--tol",
        args.tol,
        "--max-steps",
        args.max_steps,
        "--probes",
        args.probes,
        "--threads",
        args.threads,
        "--bf16-matmul",
        args.bf16_matmul,
    ]
    for size in args.size or ["10M"]:
        for prec in args.precision or ["fp32"]:
            for rec in args.recompute or ["false", "true"]:
                cmd = [
                    sys.executable,
                    "-m",
                    "benchmarks.bench_large",
                    "--one",
                    "--size",
                    size,
                    "--precision",
                    prec,
                    "--recompute",
                    rec,
                    *common,
                ]
                out = subprocess.run(
                    [str(c) for c in cmd],
                    env=env,
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                    check=False,
                )
                line = (
                    out.stdout.strip().splitlines()[-1]
                    if out.stdout.strip()
                    else json.dumps({"error": out.stderr[-2000:]})
                )
                rows.append({"size": size, "precision": prec, "recompute": rec, **json.loads(line)})
                print(json.dumps(rows[-1]), flush=True)
        if args.eigenthings:
            code = EIGENTHINGS.format(
                threads=args.threads,
                size=size,
                vocab=args.vocab,
                rows=args.rows,
                length=args.length,
                steps=args.eigenthings_steps,
            )
            he_env = {**env, "PYTHONPATH": args.eigenthings}  # the unpacked wheel
            out = subprocess.run(
                [sys.executable, "-c", code],
                env=he_env,
                cwd=ROOT,
                capture_output=True,
                text=True,
                check=False,
            )
            line = (
                out.stdout.strip().splitlines()[-1]
                if out.stdout.strip()
                else json.dumps({"error": out.stderr[-2000:]})
            )
            rows.append({"size": size, "tool": "hessian-eigenthings", **json.loads(line)})
            print(json.dumps(rows[-1]), flush=True)
    title = "λmax and trace of GPT-2 shapes per setting: peak memory and seconds"
    tab = records_table("One row per setting, each in a fresh process", rows)
    print(f"wrote {write_json('large', title, [tab], args.json)}")


if __name__ == "__main__":
    main()
