"""Models of the experiments: LeNet-like CNNs for 8×8 digits and MNIST-1D, a CIFAR ResNet-18.

The MLPs are `flatcli.demo.models.MLP` (``depth: 3`` hidden ReLU layers, as in
Tsuzuku et al. 2020, Sec. 8). Every model here is made of modules that run in a
fixed order with ReLU / pooling between weight layers, so `flatcli.invariance`
finds its function-preserving rescalings.
"""

from __future__ import annotations

import torch
from torch import nn


def _dropout(p: float) -> list[nn.Module]:
    """A Dropout layer before the classifier when ``p > 0`` (none otherwise: checkpoints keep their keys)."""
    return [nn.Dropout(p)] if p > 0 else []


class LeNet8(nn.Module):
    """LeNet-like CNN for 8×8 single-channel images given flat (N, 64) or as (N, 1, 8, 8).

    conv3×3(1→c1) → ReLU → maxpool2 → conv3×3(c1→c2) → ReLU → maxpool2 → flatten (c2·2·2)
    → Linear(→ hidden) → ReLU [→ Dropout(dropout)] → Linear(→ num_classes). The last Linear is
    the classifier on the penultimate features (relative flatness's default layer).
    """

    def __init__(
        self,
        channels: tuple[int, int] | list[int] = (8, 16),
        hidden: int = 32,
        num_classes: int = 10,
        side: int = 8,
        dropout: float = 0.0,
    ):
        super().__init__()
        c1, c2 = channels
        self.side = side
        self.features = nn.Sequential(
            nn.Conv2d(1, c1, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(c2 * (side // 4) ** 2, hidden), nn.ReLU(), *_dropout(dropout),
        )  # fmt: skip
        self.classifier = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for flat or image-shaped inputs."""
        return self.classifier(self.features(x.reshape(-1, 1, self.side, self.side)))


class LeNet1D(nn.Module):
    """LeNet-like 1D CNN for MNIST-1D signals given flat (N, length) or as (N, 1, length).

    conv5(1→c1) → ReLU → maxpool2 → conv5(c1→c2) → ReLU → maxpool2 → flatten (c2·length/4)
    → Linear(→ hidden) → ReLU [→ Dropout(dropout)] → Linear(→ num_classes).
    """

    def __init__(
        self,
        channels: tuple[int, int] | list[int] = (8, 16),
        hidden: int = 32,
        num_classes: int = 10,
        length: int = 40,
        dropout: float = 0.0,
    ):
        super().__init__()
        c1, c2 = channels
        self.length = length
        self.features = nn.Sequential(
            nn.Conv1d(1, c1, 5, padding=2), nn.ReLU(), nn.MaxPool1d(2),
            nn.Conv1d(c1, c2, 5, padding=2), nn.ReLU(), nn.MaxPool1d(2),
            nn.Flatten(),
            nn.Linear(c2 * (length // 4), hidden), nn.ReLU(), *_dropout(dropout),
        )  # fmt: skip
        self.classifier = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for flat or channel-shaped signals."""
        return self.classifier(self.features(x.reshape(-1, 1, self.length)))


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.short(x))


class CifarResNet18(nn.Module):
    """ResNet-18 for 32×32 inputs (He et al. 2016, the CIFAR variant: 3×3 stem, no max-pool),
    as trained in Jiang et al. 2020-style studies; ``width`` scales every stage (64 by default)."""

    def __init__(self, num_classes: int = 10, width: int = 64):
        super().__init__()
        w = width
        self.conv1 = nn.Conv2d(3, w, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(w)
        stages, cin = [], w
        for i, cout in enumerate((w, 2 * w, 4 * w, 8 * w)):
            stride = 1 if i == 0 else 2
            stages += [_Block(cin, cout, stride), _Block(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for (N, 3, 32, 32) images."""
        out = self.layers(torch.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(self.pool(out), 1))
