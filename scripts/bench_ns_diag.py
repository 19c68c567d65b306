"""Normalized sharpness with each Hessian-diagonal estimator against the exact value.

    python scripts/bench_ns_diag.py                 # all cases
    python scripts/bench_ns_diag.py --cases tiny    # only the 5-4-4-3 cases

Cases (float64): the 5-4-4-3 ReLU MLP of tests/measures/test_normalized_sharpness.py with
one last-layer weight set to 0 and to 1e-6, the same with the 30% smallest
weights of every layer pruned to 0, and `flatcli.demo.models.MLP` (64-w-w-10)
trained on the bundled digits to the demo's loss target, as trained and with
50% of every layer pruned. For each: NS with hessian_diag = exact (the
reference, unit-vector HVPs), scaled (the old default, 64 samples), hutchinson
(64 samples) and auto (the new default); value, reported stderr (the
jackknife's, including its bias estimate), error in stderrs, products and
seconds (wall time on a shared machine: indicative only). A tanh MLP shows
auto's fallback to unit vectors on curved tensors. Prints a markdown table.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import torch
from torch import nn

from flatcli.api import measure_model
from flatcli.demo.models import MLP
from flatcli.demo.zoo import RECIPE
from flatcli.loading.data import digits_split
from flatcli.training import train_to_target

ESTIMATORS = [
    ("exact", {}),
    ("scaled", {"samples": 64}),
    ("hutchinson", {"samples": 64}),
    ("auto", {}),
]


def tiny(act=nn.ReLU, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), act(), nn.Linear(4, 4), act(), nn.Linear(4, 3)).double()


def tiny_data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(30, 5, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (30,), generator=g
    )


def prune(model, frac):
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):
                W = m.weight.view(-1)
                k = int(frac * W.numel())
                W[W.abs().argsort()[:k]] = 0.0
    return model


def cases(which):
    x, y = tiny_data()
    if "tiny" in which:
        for name, v in (("zero last-layer weight", 0.0), ("last-layer weight 1e-6", 1e-6)):
            m = tiny()
            with torch.no_grad():
                m[4].weight.view(-1)[1] = v
            yield name, m, (x, y), 7
        yield "pruned 30% per layer", prune(tiny(), 0.3), (x, y), 7
        yield "tanh 5-4-4-3 (curved: auto falls back to unit vectors)", tiny(nn.Tanh), (x, y), 7
    if "trained" in which:
        xd, yd = digits_split("train")
        for width, wd in ((24, 0.0), (32, 1e-4)):
            torch.manual_seed(width)
            m = MLP(64, width, 2, 10)
            res = train_to_target(m, xd, yd, dataclasses.replace(RECIPE, weight_decay=wd))
            steps, loss = res.steps, res.train_loss
            m = m.double()
            P = sum(p.numel() for p in m.parameters())
            yield (
                f"digits MLP w{width} wd{wd:g} ({P} params, {steps} steps, loss {loss:.3g})",
                m,
                (xd.double(), yd),
                256,
            )
            yield "  same, 50% pruned per layer", prune(m, 0.5), (xd.double(), yd), 256


def run(model, data, bs, est, opts):
    t = time.perf_counter()
    row = measure_model(
        model,
        data,
        [{"normalized_sharpness": {"hessian_diag": est, **opts}}],
        precision="fp64",
        batch_size=bs,
        seed=0,
    )
    r = row.results["normalized_sharpness"]
    return r, time.perf_counter() - t


def main():
    which = (
        sys.argv[sys.argv.index("--cases") + 1].split(",")
        if "--cases" in sys.argv
        else ["tiny", "trained"]
    )
    print(
        "| case | estimator | NS | stderr | ratio to exact | rel. error | error / stderr | HVPs | VJP passes | s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, model, data, bs in cases(which):
        exact = None
        for est, opts in ESTIMATORS:
            r, sec = run(model, data, bs, est, opts)
            d = r.diagnostics
            if est == "exact":
                exact = r.value
            se = r.stderr
            z = abs(r.value - exact) / se if se else float("nan")
            print(
                f"| {name} | {est} | {r.value:.4g} | {se if se is None else f'{se:.3g}'} | {r.value / exact:.3f} | "
                f"{abs(r.value - exact) / exact:.1e} | {z:.1f} | {d.get('n_hvp')} | {d.get('n_vjp')} | {sec:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
