"""Predicted against measured seconds (``--dry-run``'s prediction, `flatcli.run.predict`) for
hessian_lambda_max, hessian_trace and hessian_spectrum on three models.

For each model: the products are timed as ``flatcli measure --dry-run`` times them
(`flatcli.run.predict.time_products`: a forward pass, a gradient, HVPs of one vector and of one block
over the measurement set), every measure gets its predicted seconds (least–most, from its declared
counts), then the three measures run (`flatcli.measure_model`) and their wall seconds are set
beside the prediction. ``ratio`` is measured / predicted at the products the run actually spent
(interpolated between the range's ends: the time model alone, without the range of the count); ``in ×2`` says whether the measured
seconds lie within [least/2, 2·most].

Models: an MLP (784-128-10 on 256 samples), ResNet-18 at width 8 (torchvision's blocks, CIFAR-sized
inputs, 16 samples), a tiny GPT-2 from a config with random weights (2 layers, width 32, vocabulary
100, 16 sequences of 32 tokens, ``causal_lm``).

    OMP_NUM_THREADS=1 python -m benchmarks.bench_predict     # a few minutes on one CPU core
    python -m benchmarks.bench_predict --device cuda

The result goes to docs/benchmarks/data/predict.json (``--json`` elsewhere).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from benchmarks._common import (
    class_structured_data,
    device_name,
    json_arg,
    resnet18,
    table,
    write_json,
)

COLUMNS = [
    "model",
    "P",
    "measure",
    "HVPs predicted",
    "HVPs ran",
    "seconds predicted",
    "seconds measured",
    "measured / predicted at the HVPs ran",
    "within ×2 of the range",
]

MEASURES = [
    ("hessian_lambda_max", {}),
    ("hessian_trace", {"max_probes": 64}),
    ("hessian_spectrum", {}),
]


def mlp_case():
    """784-128-10 MLP, 256 samples of class-structured data."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
    x, y = class_structured_data(256, 0, shape=(1, 28, 28))
    return (
        "MLP 784-128-10, 256 samples",
        model,
        (x, y),
        {"loss": "cross_entropy", "batch_size": 256},
    )


def resnet_case():
    """ResNet-18 at width 8 on 16 CIFAR-sized samples (BatchNorm in eval mode)."""
    torch.manual_seed(0)
    model = resnet18(width=8, num_classes=10)
    x, y = class_structured_data(16, 0)
    return (
        "ResNet-18 width 8, 16 samples",
        model,
        (x, y),
        {"loss": "cross_entropy", "batch_size": 16},
    )


def gpt2_case():
    """A 2-layer GPT-2 of width 32, vocabulary 100, random weights; 16 sequences of 32 tokens."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=100,
        n_positions=64,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    cfg._attn_implementation = "eager"
    model = tf.GPT2LMHeadModel(cfg).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (16, 32), generator=g)
    data = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return (
        "GPT-2 2×32, vocab 100, 16×32 tokens",
        model,
        data,
        {"loss": "causal_lm", "batch_size": 16},
    )


def run_case(case, device: str) -> list[dict]:
    """Predict, then measure, the three measures on one model."""
    from flatcli.engine import Batch
    from flatcli.measures import MeasureSpec
    from flatcli.run.measuring import measure_model, problem_dims
    from flatcli.run.predict import predict, time_products
    from flatcli.run.settings import Settings

    name, model, data, fields = case
    st = Settings.build(None, device=device, precision="fp32", **fields)
    batch = Batch.of(data, where="bench")
    specs = [MeasureSpec(m, m, dict(o)) for m, o in MEASURES]
    dims = problem_dims(model, batch, st)
    t0 = time.perf_counter()
    with st.precision_context():
        times, problem = time_products(model, batch, st)
    timing = time.perf_counter() - t0
    out = []
    for spec in specs:
        pred = predict(spec, dims, times, problem)
        row = measure_model(model, batch, [spec], settings=st)
        res = row.results[spec.label]
        if row.status != "ok":
            raise RuntimeError(row.error)
        lo, hi = pred.seconds
        ran = res.diagnostics["n_hvp"]
        span = pred.hvps[1] - pred.hvps[0]  # the prediction at the products ran, between its ends
        at_count = lo + (hi - lo) * ((ran - pred.hvps[0]) / span if span else 0.0)
        out.append(
            {
                "model": name,
                "P": dims.P,
                "measure": spec.name,
                "hvps": f"{pred.hvps[0]}–{pred.hvps[1]}",
                "ran": int(res.diagnostics["n_hvp"]),
                "predicted": f"{lo:.2f}–{hi:.2f}",
                "measured": res.seconds,
                "ratio": res.seconds / at_count if at_count else float("nan"),
                "inside": lo / 2 <= res.seconds <= 2 * hi,
                "timing": timing,
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--models", default="mlp,resnet,gpt2", help="comma-separated: mlp, resnet, gpt2"
    )
    json_arg(ap, "predict")
    args = ap.parse_args()
    cases = {"mlp": mlp_case, "resnet": resnet_case, "gpt2": gpt2_case}
    dev = torch.device(args.device)
    print(f"device: {device_name(dev)}; torch {torch.__version__}")
    print("| " + " | ".join(COLUMNS) + " |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---|")
    t0 = time.perf_counter()
    cells, timing = [], []
    for key in args.models.split(","):
        rows = run_case(cases[key](), args.device)
        for r in rows:
            cells.append(
                [
                    r["model"],
                    f"{r['P']:,}",
                    r["measure"],
                    str(r["hvps"]),
                    str(r["ran"]),
                    str(r["predicted"]),
                    f"{r['measured']:.2f}",
                    f"{r['ratio']:.2f}",
                    "yes" if r["inside"] else "no",
                ]
            )
            print("| " + " | ".join(cells[-1]) + " |", flush=True)
        timing.append(f"{rows[0]['model']}: products timed in {rows[0]['timing']:.1f} s")
        print(f"<!-- {timing[-1]} -->", flush=True)
    total = f"total {time.perf_counter() - t0:.0f} s"
    print(total)
    note = "; ".join([*timing, total])
    path = write_json(
        "predict",
        "Predicted seconds (--dry-run) against measured",
        [table("Predicted against measured seconds", COLUMNS, cells, note)],
        args.json,
        dev=dev,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
