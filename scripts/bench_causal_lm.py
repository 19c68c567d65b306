"""Peak memory and time of one Hessian- and one Gauss-Newton-vector product for a causal LM with a
32k vocabulary: flatcli's analytic softmax path against plain double backward through the loss.

Each product runs in a fresh process so that its peak is its own: the script re-runs itself with
``--one KIND``, and the child reports (seconds, peak extra resident memory). Peak extra memory is
the high-water mark of the process's resident set (``VmHWM``, reset through
``/proc/self/clear_refs`` just before the product) minus the resident set before it, with glibc's
mmap threshold pinned (``MALLOC_MMAP_THRESHOLD_``) so that every large tensor is mapped and unmapped
on its own and the resident set follows live memory. Linux only.

Kinds:
* ``flatcli-hvp``: `CurvatureEngine.hessian` with ``loss: causal_lm``: the LM head and the
  cross-entropy fused, chunked over tokens, with an analytic double backward (`flatcli.engine.lmhead`);
* ``plain-hvp``: ``autograd.grad`` of the mean next-token cross-entropy with ``create_graph``, then
  the gradient of ⟨∇L, v⟩ (double backward through ``log_softmax``);
* ``flatcli-ggn``: `CurvatureEngine.ggnvp` (JVP, the loss's analytic output Hessian chunked over
  positions, VJP);
* ``plain-ggn``: JVP, the output Hessian by ``jvp(grad(loss of the logits))`` (double
  differentiation through ``log_softmax``), VJP.

    python scripts/bench_causal_lm.py                 # vocabulary 32000, 4 × 128 tokens, width 32
    python scripts/bench_causal_lm.py --vocab 50257 --rows 2 --length 256
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jvp, vjp
from torch.func import grad as func_grad

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KINDS = ("flatcli-hvp", "plain-hvp", "flatcli-ggn", "plain-ggn")


class LM(nn.Module):
    """Embedding → two tanh layers mixing each token with the previous one → logits (B, T, V)."""

    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.mix1 = nn.Linear(2 * width, width)
        self.mix2 = nn.Linear(2 * width, width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, input_ids, attention_mask=None):
        h = self.emb(input_ids)
        for mix in (self.mix1, self.mix2):
            prev = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)
            h = torch.tanh(mix(torch.cat([h, prev], dim=-1)))
        return self.head(h)


def _status(key: str) -> int:
    """A ``/proc/self/status`` field in bytes (VmRSS, VmHWM)."""
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _setup(args):
    torch.manual_seed(0)
    model = LM(args.vocab, args.width).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.rows, args.length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, args.length // 2 :] = 0  # some padding: the labels there are ignored
    return model, ids, mask


def _plain_loss(model, ids, mask):
    names = [n for n, _ in model.named_parameters()]
    labels = ids.masked_fill(mask == 0, -100)[:, 1:].reshape(-1)

    def logits_of(params):
        return functional_call(model, params, (ids,), {"attention_mask": mask})

    def loss_of_logits(z):
        return F.cross_entropy(z[:, :-1].reshape(-1, z.shape[-1]), labels, ignore_index=-100)

    return names, logits_of, loss_of_logits


def _product(kind: str, model, ids, mask, v: torch.Tensor):
    from flatcli.engine import CurvatureEngine, Problem

    if kind.startswith("flatcli"):
        p = Problem(
            model, {"input_ids": ids, "attention_mask": mask}, loss="causal_lm", batch_size=len(ids)
        )
        eng = CurvatureEngine(p, cache_graphs=False)
        return eng.hessian()(v) if kind == "flatcli-hvp" else eng.ggn()(v)
    names, logits_of, loss_of_logits = _plain_loss(model, ids, mask)
    params = {n: q.detach() for n, q in model.named_parameters()}
    shapes = [params[n].shape for n in names]
    vs = dict(
        zip(
            names,
            [
                c.view(s)
                for c, s in zip(torch.split(v, [s.numel() for s in shapes]), shapes, strict=True)
            ],
            strict=True,
        )
    )
    if kind == "plain-hvp":
        leaves = {n: t.clone().requires_grad_(True) for n, t in params.items()}
        g = torch.autograd.grad(
            loss_of_logits(logits_of(leaves)), list(leaves.values()), create_graph=True
        )
        dot = sum((gi * vs[n]).sum() for gi, n in zip(g, names, strict=True))
        return torch.cat([h.reshape(-1) for h in torch.autograd.grad(dot, list(leaves.values()))])
    z, pull = vjp(logits_of, params)
    jv = jvp(logits_of, (params,), (vs,))[1]
    hjv = jvp(func_grad(loss_of_logits), (z.detach(),), (jv,))[1]
    return torch.cat([pull(hjv)[0][n].reshape(-1) for n in names])


def run_one(kind: str, args) -> dict:
    """One product in this process: seconds, peak extra resident memory, the product (for agreement)."""
    model, ids, mask = _setup(args)
    P = sum(q.numel() for q in model.parameters())
    v = torch.randn(P, generator=torch.Generator().manual_seed(2))
    base = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    t0 = time.perf_counter()
    out = _product(kind, model, ids, mask, v)
    secs = time.perf_counter() - t0
    peak = _status("VmHWM") - base
    torch.save(out, args.save)
    return {"kind": kind, "seconds": secs, "peak_bytes": peak, "params": P}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--one", choices=KINDS, help=argparse.SUPPRESS)
    ap.add_argument("--save", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args)))
        return
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    res, outs = {}, {}
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    for kind in KINDS:
        save = tmp / f"bench_causal_lm_{os.getpid()}_{kind}.pt"
        cmd = [
            sys.executable,
            __file__,
            "--one",
            kind,
            "--save",
            str(save),
            "--vocab",
            str(args.vocab),
            "--width",
            str(args.width),
            "--rows",
            str(args.rows),
            "--length",
            str(args.length),
        ]
        res[kind] = json.loads(
            subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
        )
        outs[kind] = torch.load(save)
        save.unlink()
    logits_mb = args.rows * args.length * args.vocab * 4 / 2**20
    print(
        f"causal LM: vocabulary {args.vocab}, width {args.width}, {args.rows} × {args.length} tokens, "
        f"{res[KINDS[0]]['params']:,} parameters; one logits tensor = {logits_mb:.0f} MiB; "
        f"torch {torch.__version__}, OMP_NUM_THREADS={env['OMP_NUM_THREADS']}"
    )
    print(f"{'product':<14}{'seconds':>9}{'peak extra MiB':>16}")
    for kind in KINDS:
        r = res[kind]
        print(f"{kind:<14}{r['seconds']:>9.2f}{r['peak_bytes'] / 2**20:>16.0f}")
    for what in ("hvp", "ggn"):
        a, b = res[f"flatcli-{what}"], res[f"plain-{what}"]
        rel = float(
            (outs[f"flatcli-{what}"] - outs[f"plain-{what}"]).norm() / outs[f"plain-{what}"].norm()
        )
        print(
            f"{what}: flatcli / plain peak memory {a['peak_bytes'] / b['peak_bytes']:.2f}, "
            f"time {a['seconds'] / b['seconds']:.2f}; relative difference of the products {rel:.1e}"
        )


if __name__ == "__main__":
    main()
