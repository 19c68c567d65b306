"""flatcli vs hessian-eigenthings 1.0 on the same GPT-2 and the same batches.

One process, one device, side by side: the same randomly initialized GPT-2 (built from a config,
eager attention, eval mode), the same batches of token ids, the same loss (next-token
cross-entropy; every batch has the same number of scored tokens, where flatcli's token-weighted
mean and eigenthings' mean of batch means agree). For each library: λmax (value, relative
difference to a tight flatcli reference at tol 1e-7, Hessian-vector products, seconds) and the
trace (value ± standard error at equal budgets, seconds). ``--tiny`` adds the exact trace of a
1.3k-parameter GPT-2 (one HVP per parameter) as the reference both estimates are held to.
``--padded`` re-runs λmax with padded batches of unequal token counts, where the two losses
differ (eigenthings averages batch means; flatcli averages over every scored token).

    pip install -e ".[bench,transformers]"
    OMP_NUM_THREADS=1 python -m benchmarks.bench_transformers --tiny --padded

The result goes to docs/benchmarks/data/transformers.json (``--json`` elsewhere).
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from benchmarks._common import Tables, json_arg, write_json

TABLES = Tables()


def build(tf, n_layer, n_embd, vocab, seed):
    torch.manual_seed(seed)
    cfg = tf.GPT2Config(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=max(1, n_embd // 16),
        vocab_size=vocab,
        n_positions=64,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    cfg._attn_implementation = "eager"
    return tf.GPT2LMHeadModel(cfg).eval()


def batches(vocab, n_batches, rows, tokens, seed, padded=False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n_batches):
        ids = torch.randint(0, vocab, (rows, tokens), generator=g)
        mask = torch.ones_like(ids)
        if padded:  # batch i keeps tokens − 4i positions of each row
            mask[:, tokens - 4 * i :] = 0
        labels = ids.masked_fill(mask == 0, -100)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def timed(fn):
    t0 = time.perf_counter()
    r = fn()
    return r, time.perf_counter() - t0


def flatcli_measure(model, data, spec):
    from flatcli.api import measure_model
    from flatcli.engine import Batch

    batch = Batch.cat([Batch({k: v for k, v in b.items() if k != "labels"}) for b in data])
    row = measure_model(
        model,
        batch,
        [spec],
        loss="causal_lm",
        batch_size=data[0]["input_ids"].shape[0],
        precision="fp32",
    )
    (r,) = row.results.values()
    if row.status != "ok":
        raise RuntimeError(row.error)
    return r


class Counted:
    """An eigenthings operator that counts its products."""

    def __init__(self, op):
        self.op, self.n = op, 0

    def __getattr__(self, k):
        return getattr(self.op, k)

    def matvec(self, v):
        self.n += 1
        return self.op.matvec(v)


def eig_op(model, data):
    import hessian_eigenthings as he

    return Counted(he.HessianOperator(model, data, he.hf_lm_loss()))


def lambda_rows(model, data, ref, title=""):
    import hessian_eigenthings as he

    rows = []
    for tol in (1e-3, 1e-4):
        r = flatcli_measure(model, data, {"hessian_lambda_max": {"tol": tol}})
        rows.append((f"flatcli Lanczos, tol {tol:g}", r.value, r.diagnostics["n_hvp"], r.seconds))
    for steps in (10, 20, 40):
        op = eig_op(model, data)
        res, s = timed(
            lambda op=op, steps=steps: he.lanczos(op, k=1, max_iter=steps, which="LA", seed=0)
        )
        rows.append((f"eigenthings lanczos, max_iter {steps}", float(res.eigenvalues[0]), op.n, s))
    op = eig_op(model, data)
    res, s = timed(
        lambda: he.power_iteration_one(op, seed=0)
    )  # (λ, v, residual, iterations, converged)
    rows.append(("eigenthings power_iteration_one (defaults: tol 1e-4)", float(res[0]), op.n, s))
    TABLES.add(
        f"{title}λmax (reference: flatcli Lanczos at tol 1e-7 = {ref:.6g})",
        ["method", "λmax", "rel. diff", "HVPs", "seconds"],
        [
            [name, f"{v:.6g}", f"{abs(v - ref) / abs(ref):.1e}", str(n), f"{s:.2f}"]
            for name, v, n, s in rows
        ],
    )


def trace_rows(model, data, budget, exact=None, title=""):
    import hessian_eigenthings as he

    rows = []
    for method in ("hutchinson", "hutchpp"):
        r = flatcli_measure(
            model,
            data,
            {"hessian_trace": {"method": method, "min_probes": budget, "max_probes": budget}},
        )
        rows.append(
            (
                f"flatcli {method}, {budget} probes",
                r.value,
                r.stderr,
                r.diagnostics["n_hvp"],
                r.seconds,
            )
        )
    for method in ("hutchinson", "hutch++"):
        op = eig_op(model, data)
        res, s = timed(lambda op=op, m=method: he.trace(op, num_matvecs=budget, method=m, seed=0))
        rows.append((f"eigenthings {method}, {budget} matvecs", res.estimate, res.stderr, op.n, s))
    head = f"exact trace {exact:.6g}" if exact is not None else "no exact reference"
    cols = ["method", "trace", "stderr", *(["error / stderr"] if exact is not None else [])]
    cells = []
    for name, v, se, n, s in rows:
        z = [f"{abs(v - exact) / se:.2f}" if se else "–"] if exact is not None else []
        cells.append([name, f"{v:.6g}", f"{se:.3g}", *z, str(n), f"{s:.2f}"])
    TABLES.add(f"{title}trace ({head})", [*cols, "HVPs", "seconds"], cells)


def section(tf, title, n_layer, n_embd, vocab, args, exact_trace=False):
    model = build(tf, n_layer, n_embd, vocab, args.seed)
    P = sum(q.numel() for q in model.parameters())
    data = batches(vocab, args.batches, args.rows, args.tokens, args.seed)
    print(
        f"\n## {title}: GPT-2 n_layer {n_layer}, n_embd {n_embd}, vocab {vocab}, P = {P:,} (tied lm_head); "
        f"{args.batches} batches × {args.rows} rows × {args.tokens} tokens"
    )
    title = f"{title} GPT-2 (n_layer {n_layer}, n_embd {n_embd}, vocab {vocab}, P = {P:,}): "
    ref = flatcli_measure(
        model, data, {"hessian_lambda_max": {"tol": 1e-7, "max_steps": 300}}
    ).value
    lambda_rows(model, data, ref, title)
    exact = (
        flatcli_measure(model, data, {"hessian_trace": {"method": "exact"}}).value
        if exact_trace
        else None
    )
    trace_rows(model, data, args.budget, exact, title)
    return model


def padded_section(model, vocab, args):
    import hessian_eigenthings as he

    data = batches(vocab, args.batches, args.rows, args.tokens, args.seed, padded=True)
    fl = flatcli_measure(model, data, {"hessian_lambda_max": {"tol": 1e-7, "max_steps": 300}}).value
    op = eig_op(model, data)
    res = he.lanczos(op, k=1, max_iter=60, which="LA", seed=0)
    ev = float(res.eigenvalues[0])
    TABLES.add(
        "Padded batches of unequal token counts: λmax",
        ["tool", "loss", "λmax", "relative difference"],
        [
            ["flatcli", "token-weighted mean", f"{fl:.6g}", ""],
            ["eigenthings", "mean of batch means", f"{ev:.6g}", f"{abs(fl - ev) / abs(fl):.1e}"],
        ],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument(
        "--budget", type=int, default=48, help="products per trace estimate (a multiple of 3)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--tiny", action="store_true", help="also a 1.3k-parameter GPT-2 with the exact trace"
    )
    ap.add_argument(
        "--padded", action="store_true", help="also λmax on padded batches of unequal token counts"
    )
    json_arg(ap, "transformers")
    args = ap.parse_args()
    import hessian_eigenthings as he

    from flatcli.loading.hf import transformers_module

    tf = transformers_module()
    print(
        f"# flatcli vs hessian-eigenthings {he.__version__}: torch {torch.__version__}, transformers "
        f"{tf.__version__}, {platform.processor() or 'CPU'}, {torch.get_num_threads()} thread(s)"
    )
    if args.tiny:
        section(tf, "tiny", 1, 8, 39, args, exact_trace=True)
    model = section(tf, "small", args.n_layer, args.n_embd, args.vocab, args)
    if args.padded:
        padded_section(model, args.vocab, args)
    title = (
        f"flatcli vs hessian-eigenthings {he.__version__} on GPT-2 (transformers {tf.__version__})"
    )
    print(f"wrote {write_json('transformers', title, TABLES, args.json)}")


if __name__ == "__main__":
    main()
