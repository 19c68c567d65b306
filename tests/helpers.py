"""Small builders shared by tests: tiny models, data, checkpoints and configs."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml
from torch import nn


class TinyBN(nn.Module):
    """MLP with BatchNorm and dropout: its eval-mode function differs from train mode."""

    def __init__(self, d=6, h=5, c=3):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.bn = nn.BatchNorm1d(h)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(h, c)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


def tiny_mlp(d=6, h=5, c=3, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, c)).to(dtype)


def tiny_data(n=23, d=6, c=3, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=dtype), torch.randint(0, c, (n,), generator=g)


def write_project(tmp: Path, *, width=8, n_ckpt=2, measures=None, extra=None) -> Path:
    """A config + checkpoints of `flatcli.demo.models.MLP` on synthetic data; returns the config path."""
    from flatcli.demo.models import MLP

    tmp.mkdir(parents=True, exist_ok=True)
    for i in range(n_ckpt):
        torch.manual_seed(i)
        torch.save(MLP(16, width, 1, 4).state_dict(), tmp / f"m{i}.pt")
    cfg = {
        "model": {
            "target": "flatcli.demo.models:MLP",
            "kwargs": {"in_features": 16, "width": width, "depth": 1, "num_classes": 4},
        },
        "checkpoints": [f"m{i}.pt" for i in range(n_ckpt)],
        "data": {
            "train": {
                "source": "synthetic",
                "num_samples": 40,
                "input_shape": [16],
                "num_classes": 4,
            },
            "test": {
                "source": "synthetic",
                "num_samples": 30,
                "input_shape": [16],
                "num_classes": 4,
            },
        },
        "measure_data": {"split": "train", "num_samples": "all", "batch_size": 16, "seed": 0},
        "measures": measures
        or [
            {"hessian_lambda_max": {"tol": 1e-3}},
            # a cheap fixed count, at a tolerance 8 probes meet (ok only when it is met)
            {"hessian_trace": {"min_probes": 8, "max_probes": 8, "tol": 0.5}},
            "frobenius_norm",
        ],
        "runtime": {"device": "cpu", "seed": 0},
        "output": {"dir": "out"},
    }
    for k, v in (extra or {}).items():
        cfg[k] = v
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


class ConvBN(nn.Module):
    """Conv (no bias) → BatchNorm2d → ReLU → flatten → Linear, on 1 × 6 × 6 inputs."""

    def __init__(self, channels=4):
        super().__init__()
        self.conv = nn.Conv2d(1, channels, 3, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.fc = nn.Linear(channels * 16, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def conv_bn_setup(seed=0, n=64):
    """A `ConvBN` (float64, eval mode) with running statistics from its data, random γ, β,
    and labels it predicts itself: (model, x, y)."""
    torch.manual_seed(seed)
    m = ConvBN().double()
    g = torch.Generator().manual_seed(seed + 1)
    x = 3 * torch.randn(n, 1, 6, 6, generator=g, dtype=torch.float64)
    with torch.no_grad():
        m.train()
        m.bn.momentum = None  # cumulative average: the statistics of x
        m(x)
        m.bn.weight.uniform_(0.5, 1.5)
        m.bn.bias.uniform_(-0.2, 0.2)
        m.eval()
        y = m(x).argmax(1)
    return m, x, y


def rescale_conv_bn(model, c):
    """A copy computing the same eval-mode function: conv weights × c, running mean × c,
    running variance and BatchNorm's ε × c² (so that √(σ² + ε) scales exactly by c)."""
    import copy

    r = copy.deepcopy(model)
    with torch.no_grad():
        r.conv.weight.mul_(c)
        r.bn.running_mean.mul_(c)
        r.bn.running_var.mul_(c * c)
    r.bn.eps = model.bn.eps * c * c
    return r


def conv_bn_folded_by_hand(model):
    """The same function without BatchNorm: Conv with W' = diag(s) W and bias b' = −s∘μ + β,
    s = γ/√(σ² + ε), then ReLU → flatten → Linear; parameters in the same order as a folded copy."""
    import copy

    class Plain(nn.Module):
        def __init__(self, ch):
            super().__init__()
            self.conv = nn.Conv2d(1, ch, 3, bias=True)
            self.bn = nn.Identity()
            self.fc = copy.deepcopy(model.fc)

        def forward(self, x):
            return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))

    bn = model.bn
    plain = Plain(model.conv.out_channels).double()
    with torch.no_grad():
        s = bn.weight / torch.sqrt(bn.running_var + bn.eps)
        plain.conv.weight.copy_(model.conv.weight * s[:, None, None, None])
        plain.conv.bias.copy_(bn.bias - s * bn.running_mean)
    return plain.eval()


def record_tf32_flags(monkeypatch, bias: float = 0.0) -> list[bool]:
    """Record ``torch.backends.cuda.matmul.allow_tf32`` inside every Hessian product (the list
    returned grows as products run). ``bias`` simulates a TF32 product on the CPU, where the flag
    changes nothing: while the flag is on, products come out as (1 + bias)·H v."""
    from flatcli.engine.curvatures import Curvature

    seen: list[bool] = []
    real = Curvature._matmat

    def matmat(self, V):
        out = real(self, V)
        if self.name != "hessian":
            return out
        on = bool(torch.backends.cuda.matmul.allow_tf32)
        seen.append(on)
        return out * (1 + bias) if on and bias else out

    monkeypatch.setattr(Curvature, "_matmat", matmat)
    return seen


def cli_output(res) -> str:
    """A CliRunner result's stdout and, where the runner keeps it apart, stderr."""
    text = res.output
    try:
        text += res.stderr
    except (ValueError, AttributeError):
        pass
    return text


def measured(outdir):
    """The first row of OUTDIR/results.json, which must be ``ok``."""
    row = json.loads((Path(outdir) / "results.json").read_text())["rows"][0]
    assert row["status"] == "ok", row
    return row


def rel(a, b):
    """|a − b| / |b|."""
    return abs(a - b) / abs(b)
