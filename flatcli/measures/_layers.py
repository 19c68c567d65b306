"""Helpers shared by measure families: weight matrices of a model, the class-output check.

A *weight matrix* W_l (MEASURES.md) is the weight of every ``nn.Linear``
(out × in) and every convolution reshaped to (out_channels × in_channels·kh·kw).
Biases and normalization parameters are not weight matrices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass(frozen=True)
class WeightMatrix:
    module_name: str
    param_name: str  # name in problem.names / model.named_parameters()
    module: nn.Module
    shape: tuple[int, ...]  # the parameter's own shape

    @property
    def rows(self) -> int:
        return self.shape[0]

    def as_matrix(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor shaped like the parameter, viewed as (rows × rest)."""
        return t.reshape(self.shape[0], -1)


def weight_matrices(model: nn.Module, trainable_only: bool = True) -> list[WeightMatrix]:
    out = []
    for mname, mod in model.named_modules():
        if isinstance(mod, (nn.Linear, *CONV_TYPES)) and getattr(mod, "weight", None) is not None:
            w = mod.weight
            if trainable_only and not w.requires_grad:
                continue
            pname = f"{mname}.weight" if mname else "weight"
            out.append(WeightMatrix(mname, pname, mod, tuple(w.shape)))
    return out


def class_outputs_or_error(out: torch.Tensor, y: torch.Tensor, what: str, fix: str = "") -> None:
    """Raise `ConfigError` unless ``out`` are class scores (batch, classes ≥ 2) and ``y`` integer
    labels: ``"{what} needs class outputs (batch, classes) and integer labels; the model gives
    (shape).{fix}"``."""
    from ..errors import ConfigError

    if out.ndim != 2 or out.shape[1] < 2 or y.is_floating_point():
        raise ConfigError(
            f"{what} needs class outputs (batch, classes) and integer labels; the model gives "
            f"{tuple(out.shape)}.{' ' + fix if fix else ''}"
        )
