"""Peak resident memory and seconds of one Hessian-vector product per product scheme, on GPT-2-shaped
models with random weights (`benchmarks.bench_large`'s ``build``), ``causal_lm``, each setting in a
fresh process.

Schemes: ``reverse`` (double backward through the gradient's graph, the default on CPU),
``forward`` (``torch.func`` jvp of grad, ``runtime.hvp_mode: forward``), ``recompute``
(``runtime.recompute: true``: block by block, `flatcli.engine.segments`, on these chains of
blocks) and ``checkpoint`` (``runtime.recompute: true`` on a model that is not a chain: per-block
checkpointing under the double backward, forced here by hiding the chain). A fifth scheme,
checkpointed forward-over-reverse with `torch.autograd.forward_ad` dual tensors over a plain
backward, was measured and dropped (more memory, not less: docs/benchmarks/data/hvp_memory-schemes.json).
Each child builds the model and tokens, runs ``--products`` products of one vector
(gradient graphs are not cached across products, except in the scheme ``cached``: the engine's
default, which keeps the first backward's graph across the products at one θ when it fits, as a
Lanczos run does; its first product builds the graph, the later ones reuse it), and reports seconds per product (each), the peak
resident set of the whole process (``VmHWM``) and the resident set before the first product, and
the relative difference of its last product from ``--check``'s (the reverse product, when given).

    python -m benchmarks.bench_hvp_memory --size 10M --size 30M --precision fp32 --precision bf16

``--eigenthings DIR``: the child running hessian-eigenthings imports it from DIR (PYTHONPATH; its
wheel unpacked there). The rows go to docs/benchmarks/data/hvp_memory.json (``--json``
elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks._common import ROOT, json_arg, records_table, write_json

SCHEMES = ("reverse", "forward", "recompute", "checkpoint")
CACHED = "cached"  # reverse with the engine's default cache_graphs (None: the gradient graph kept across products at one θ)
PEER = "eigenthings"  # hessian-eigenthings' HessianOperator.matvec, with --eigenthings DIR


def run_one(args) -> dict:
    """One scheme in this process."""
    import torch

    from benchmarks.bench_large import _status, build, matmul_mode
    from flatcli.engine import CurvatureEngine, Problem

    torch.set_num_threads(args.threads)
    if args.scheme == PEER:
        return _run_peer(args)
    if (
        args.scheme == "checkpoint"
    ):  # the fallback of recompute: true, as on a model that is not a chain
        from flatcli.engine import segments

        segments.BlockChain.find = classmethod(
            lambda cls, problem: (None, "hidden by the benchmark")
        )
    model, batch = build(args.size, args.vocab, args.rows, args.length)
    p = Problem(model, batch, loss="causal_lm", batch_size=args.rows)
    eng = CurvatureEngine(
        p,
        cache_graphs=None if args.scheme == CACHED else False,
        precision=args.precision,
        recompute=args.scheme in ("recompute", "checkpoint"),
        hvp_mode="forward" if args.scheme == "forward" else "reverse",
    )
    v = torch.randn(1, p.num_params, generator=torch.Generator().manual_seed(3))
    base = _status("VmRSS")
    secs, hv = [], None
    for _ in range(args.products):
        t0 = time.perf_counter()
        with matmul_mode(args.bf16_matmul):
            hv = eng.hessian()(v)
        secs.append(time.perf_counter() - t0)
    out = {
        "bf16_matmul": args.bf16_matmul,
        "params": p.num_params,
        "seconds": secs,
        "peak_rss_bytes": _status("VmHWM"),
        "rss_before_bytes": base,
        "fallbacks": eng.counters()["fallbacks"],
        "vHv": float(v[0] @ hv[0]),
        "block_by_block": eng.state.chain is not None,
    }
    if args.scheme in (
        "reverse",
        "recompute",
        CACHED,
    ):  # the rules of predicted_product_bytes, after the peak was read
        from flatcli.engine.recompute import predicted_product_bytes

        blocks = len(eng.state.chain.blocks) if eng.state.chain is not None else 0
        with matmul_mode(args.bf16_matmul):  # its counting pass runs the bf16 forward too
            out["predicted_bytes"] = predicted_product_bytes(
                p, p.batches[0], 1, p.device, by_blocks=blocks
            )[0]
    if args.save:
        torch.save(hv, args.save)
    return out


def _run_peer(args) -> dict:
    """One product of hessian-eigenthings 1.0 (``HessianOperator(model, [batch], hf_lm_loss()).matvec``:
    ``model(**batch).loss``, the mean over the scored next tokens, as flatcli's), the same model, tokens
    and vector; fp32 only."""
    import torch
    from hessian_eigenthings import HessianOperator, hf_lm_loss  # from --eigenthings (PYTHONPATH)

    from benchmarks.bench_large import _status, build

    model, batch = build(args.size, args.vocab, args.rows, args.length)
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    op = HessianOperator(model, [batch], hf_lm_loss())
    P = sum(q.numel() for q in model.parameters())
    v = torch.randn(1, P, generator=torch.Generator().manual_seed(3))
    base = _status("VmRSS")
    secs, hv = [], None
    for _ in range(args.products):
        t0 = time.perf_counter()
        hv = op.matvec(v[0])
        secs.append(time.perf_counter() - t0)
    hv = torch.as_tensor(hv).reshape(1, -1)
    out = {
        "params": P,
        "seconds": secs,
        "peak_rss_bytes": _status("VmHWM"),
        "rss_before_bytes": base,
        "vHv": float(v[0] @ hv[0]),
    }
    if args.save:
        torch.save(hv, args.save)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--size",
        action="append",
        help="model size of benchmarks/bench_large.py (repeatable; default 10M)",
    )
    ap.add_argument(
        "--precision", action="append", help="runtime.precision (repeatable; default fp32)"
    )
    ap.add_argument(
        "--scheme",
        action="append",
        choices=[*SCHEMES, CACHED, PEER],
        help="(repeatable; default the four of flatcli; eigenthings needs --eigenthings)",
    )
    ap.add_argument(
        "--eigenthings",
        help="a folder holding the hessian_eigenthings package (its wheel unpacked)",
    )
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--products", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--bf16-matmul",
        choices=["native", "fp32"],
        default="native",
        help="fp32: bf16 matrix products by the float32 kernel, rounded to bf16 (bench_large.matmul_mode)",
    )
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--save", help=argparse.SUPPRESS)
    json_arg(ap, "hvp_memory")
    args = ap.parse_args()
    if args.one:
        args.size, args.precision, args.scheme = args.size[0], args.precision[0], args.scheme[0]
        print(json.dumps(run_one(args)))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # children: python -m from ROOT
    if args.eigenthings:  # the unpacked wheel, for the eigenthings child
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.eigenthings, env.get("PYTHONPATH")]))
    rows: list[dict] = []
    common = [
        "--vocab",
        args.vocab,
        "--rows",
        args.rows,
        "--length",
        args.length,
        "--products",
        args.products,
        "--threads",
        args.threads,
        "--bf16-matmul",
        args.bf16_matmul,
    ]
    for size in args.size or ["10M"]:
        for prec in args.precision or ["fp32"]:
            ref = None
            for scheme in args.scheme or SCHEMES:
                save = f"/tmp/bench_hvp_{os.getpid()}_{scheme}.pt"
                cmd = [
                    sys.executable,
                    "-m",
                    "benchmarks.bench_hvp_memory",
                    "--one",
                    "--size",
                    size,
                    "--precision",
                    prec,
                    "--scheme",
                    scheme,
                    "--save",
                    save,
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
                row = {"size": size, "precision": prec, "scheme": scheme, **json.loads(line)}
                if os.path.exists(save):
                    import torch

                    hv = torch.load(save, weights_only=True)
                    os.remove(save)
                    ref = hv if ref is None else ref
                    row["rel_diff_vs_first"] = float((hv - ref).norm() / ref.norm())
                print(json.dumps(row), flush=True)
                rows.append(row)
    title = "One Hessian-vector product per scheme on GPT-2 shapes: peak memory and seconds"
    tab = records_table("One row per scheme, each in a fresh process", rows)
    print(f"wrote {write_json('hvp_memory', title, [tab], args.json)}")


if __name__ == "__main__":
    main()
