"""Small models for the demo zoo and the tests."""

from __future__ import annotations

from torch import nn


class MLP(nn.Module):
    """ReLU MLP: ``in_features → width (× depth) → num_classes``; with ``dropout > 0`` a Dropout
    layer after each hidden ReLU (active in training only; ``dropout = 0`` adds no module, so
    checkpoints keep their keys)."""

    def __init__(
        self,
        in_features: int = 64,
        width: int = 128,
        depth: int = 2,
        num_classes: int = 10,
        bias: bool = True,
        dropout: float = 0.0,
    ):
        super().__init__()
        layers: list[nn.Module] = []
        d = in_features
        for _ in range(depth):
            layers += [nn.Linear(d, width, bias=bias), nn.ReLU()] + (
                [nn.Dropout(dropout)] if dropout > 0 else []
            )
            d = width
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(d, num_classes, bias=bias)

    def forward(self, x):
        """Logits of the flattened input."""
        return self.classifier(self.features(x.flatten(1)))
