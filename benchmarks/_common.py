"""Helpers shared by the benchmark scripts (``bench_engine.py``, ``bench_catalogue.py``).

Imports torch and torchvision only (no flatcli), so that the peer scripts the
benchmarks write and run as fresh processes can load the same model and data
from this file without paying for flatcli's imports.

* `sync`, `timed`, `device_name`: CUDA-synchronized wall times and the device in words.
* `resnet18`: torchvision's ``resnet18(num_classes=...)`` at width 64; at another
  width the same topology (7×7 stem, max-pool, four stages of two basic blocks,
  widths w, 2w, 4w, 8w) built from torchvision's own blocks, for CPU-sized runs.
* `class_structured_data`: seeded random class templates plus noise.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

T = TypeVar("T")


def sync(dev: torch.device) -> None:
    """Wait for the device's queued work (a no-op off CUDA)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(dev: torch.device, fn: Callable[[], T]) -> tuple[T, float]:
    """``(fn(), wall seconds)``, synchronized before and after on CUDA."""
    sync(dev)
    t0 = time.perf_counter()
    out = fn()
    sync(dev)
    return out, time.perf_counter() - t0


def device_name(dev: torch.device) -> str:
    """The GPU's name, or the CPU model and torch's thread count."""
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    name = platform.processor() or "CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {torch.get_num_threads()} threads"


class _NarrowResNet18(nn.Module):
    """ResNet-18's topology at base width ``width`` (torchvision's blocks and initialization)."""

    def __init__(self, width: int, num_classes: int):
        from torchvision.models.resnet import BasicBlock, ResNet

        super().__init__()
        # borrow torchvision's _make_layer: it reads these attributes
        self._norm_layer, self.inplanes, self.dilation, self.groups, self.base_width = (
            nn.BatchNorm2d,
            width,
            1,
            1,
            64,
        )
        make = ResNet._make_layer.__get__(self)
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = make(BasicBlock, width, 2)
        self.layer2 = make(BasicBlock, 2 * width, 2, stride=2)
        self.layer3 = make(BasicBlock, 4 * width, 2, stride=2)
        self.layer4 = make(BasicBlock, 8 * width, 2, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8 * width, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(width: int = 64, num_classes: int = 10) -> nn.Module:
    """``torchvision.models.resnet18(num_classes=num_classes)`` at width 64; the same
    topology with stage widths ``width, 2·width, 4·width, 8·width`` otherwise
    (the same state-dict keys)."""
    if width == 64:
        import torchvision

        return torchvision.models.resnet18(num_classes=num_classes)
    if width < 1:
        raise ValueError(f"width must be a positive int, got {width}")
    return _NarrowResNet18(width, num_classes)


def class_structured_data(
    n: int, seed: int, classes: int = 10, noise: float = 1.0, shape: tuple[int, ...] = (3, 32, 32)
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` inputs ``template[y] + noise·ε`` with ``classes`` fixed standard-normal templates,
    balanced labels in a seeded random order and standard-normal ε: (x (n, *shape), y (n,))."""
    g = torch.Generator().manual_seed(int(seed))
    templates = torch.randn(classes, *shape, generator=g)
    y = torch.arange(n) % classes
    y = y[torch.randperm(n, generator=g)]
    x = templates[y] + noise * torch.randn(n, *shape, generator=g)
    return x, y
