"""Helpers shared by measure families: weight matrices of a model, the class-output check.

A *weight matrix* W_l (MEASURES.md) is the weight of every ``nn.Linear``
(out × in) and every convolution reshaped to (out_channels × in_channels·kh·kw).
Biases and normalization parameters are not weight matrices.
"""

from __future__ import annotations

from collections.abc import Collection
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


def weight_matrices(model: nn.Module, selected: Collection[str] | None = None, *,
                    frozen: bool = False) -> list[WeightMatrix]:
    """The model's weight matrices (module docstring), each once: those whose parameter is in
    ``selected`` (names as ``named_parameters()`` gives them; a tied weight by its first name),
    or, when ``selected`` is None, every trainable one (every one with ``frozen``)."""
    canonical: dict[int, str] = {}
    for n, q in model.named_parameters():
        canonical.setdefault(id(q), n)
    seen: set[int] = set()
    out = []
    for mname, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        if not isinstance(mod, (nn.Linear, *CONV_TYPES)) or not isinstance(w, torch.Tensor):
            continue
        pname = canonical.get(id(w))
        if pname is None or id(w) in seen:
            continue
        if (pname not in selected) if selected is not None else not (w.requires_grad or frozen):
            continue
        seen.add(id(w))
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


def selected(problem) -> Collection[str] | None:
    """The parameter names a measure over weight matrices restricts to: None (every weight matrix,
    frozen ones included) without a parameter selection, else the selected names."""
    return None if problem.selection.everything else set(problem.names)
