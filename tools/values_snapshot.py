"""Every measure of the catalogue on three tiny models in float64, written as JSON.

A refactor of the engine must not change a value: run this script before and after and compare
the files byte for byte (``cmp before.json after.json``). The models are built from fixed seeds
(no download): an MLP, a small CNN with BatchNorm (eval mode) and a one-layer GPT-2 built from a
config (``causal_lm``; skipped when transformers is absent); the MLP also with
``hvp_mode: finite_difference``, so the finite-difference curvature is covered. Options are small so the run takes
a few minutes on a CPU; timings and memory are left out of the JSON, everything else a measure
returns (value, stderr, status, diagnostics) is kept with full float precision.

Example::

    python tools/values_snapshot.py --out values.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from torch import nn

from flatcli.api import measure_model
from flatcli.measures import list_measures

SMALL = {
    "hessian_trace": {"min_probes": 8, "max_probes": 8},
    "weightwatcher_alpha": {"min_evals": 3},
    "sharpness_worst": {"steps": 2},
    "pacbayes_flatness": {"samples": 2, "depth": 3},
    "hessian_spectrum": {"slq_runs": 2, "slq_steps": 5},
    "local_entropy": {"slq_runs": 2, "slq_steps": 5},
    "ns_bound": {"mc_samples": 5},
    "feature_robustness": {"samples": 2, "curve": 1},
}
_UNSTABLE = ("seconds", "time", "peak", "bytes", "memory", "threads")


def _mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x, y = torch.randn(12, 4, dtype=torch.float64), torch.randint(0, 3, (12,))
    return model, (x, y), {}


def _cnn():
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(1, 3, 3),
        nn.BatchNorm2d(3),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(12, 3),
    ).double()
    with torch.no_grad():  # non-trivial running statistics, as after training
        model[1].running_mean.uniform_(-0.2, 0.2)
        model[1].running_var.uniform_(0.5, 1.5)
    x, y = torch.randn(10, 1, 6, 6, dtype=torch.float64), torch.randint(0, 3, (10,))
    return model, (x, y), {}


def _gpt2():
    try:
        import transformers as tf
    except ImportError:
        return None
    torch.manual_seed(2)
    cfg = tf.GPT2Config(
        vocab_size=13, n_positions=8, n_embd=8, n_layer=1, n_head=2, attn_implementation="eager"
    )
    model = tf.GPT2LMHeadModel(cfg).double().eval()
    ids = torch.randint(0, 13, (6, 5))
    data = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    return model, data, {"loss": "causal_lm"}


def _mlp_fd():
    model, data, _ = _mlp()
    return model, data, {"hvp_mode": "finite_difference"}


MODELS = {"mlp": _mlp, "mlp_finite_difference": _mlp_fd, "cnn_bn": _cnn, "gpt2": _gpt2}


def _clean(x):
    """JSON-able, floats kept exactly (repr round-trips), unstable keys dropped."""
    if isinstance(x, dict):
        return {
            str(k): _clean(v)
            for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))
            if not any(u in str(k).lower() for u in _UNSTABLE)
        }
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, torch.Tensor):
        return _clean(x.tolist())
    if hasattr(x, "item") and callable(x.item):  # numpy scalars
        return _clean(x.item())
    if isinstance(x, float):
        return repr(x) if not math.isfinite(x) else x
    if isinstance(x, (int, str, bool)) or x is None:
        return x
    return repr(x)


def snapshot() -> dict:
    """Every measure's result on every model (label → value, stderr, status, diagnostics)."""
    out = {}
    specs = [{m.name: SMALL.get(m.name, {})} for m in list_measures()]
    for name, build in MODELS.items():
        built = build()
        if built is None:
            out[name] = "skipped: transformers is not installed"
            continue
        model, data, kw = built
        init = {k: v + 0.1 if v.is_floating_point() else v for k, v in model.state_dict().items()}
        row = measure_model(
            model, data, specs, precision="fp64", batch_size=4, init_state=init, seed=0, **kw
        )
        out[name] = {
            "status": row.status,
            "errors": dict(sorted(row.errors.items())),
            "results": {
                label: {
                    "value": r.value,
                    "stderr": r.stderr,
                    "status": r.status,
                    "diagnostics": r.diagnostics,
                }
                for label, r in sorted(row.results.items())
            },
        }
    return _clean(out)


def main() -> None:
    """Write the snapshot to ``--out``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("values.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    args.out.write_text(json.dumps(snapshot(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
