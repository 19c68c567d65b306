"""Helpers shared by measure families: weight matrices of a model, the class-output check.

A *weight matrix* W_l (MEASURES.md) is the weight of every ``nn.Linear``
(out × in), every convolution reshaped to (out_channels × in_channels·kh·kw), and
the weight of every Hugging Face ``Conv1D`` (``transformers.pytorch_utils.Conv1D``,
GPT-2's attention and MLP projections: ``y = x W + b`` with W stored as (in × out),
so its matrix is Wᵀ, rows = outputs). Biases, normalization parameters and
embedding tables are not weight matrices.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError

CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def is_hf_conv1d(mod: nn.Module) -> bool:
    """Whether ``mod`` is Hugging Face's ``Conv1D`` (a Linear whose weight is stored (in × out)),
    recognized without importing transformers."""
    cls = type(mod)
    return (
        cls.__name__ == "Conv1D"
        and cls.__module__.startswith("transformers")
        and hasattr(mod, "nf")
    )


@dataclass(frozen=True)
class WeightMatrix:
    """One weight matrix: its module, its parameter's name and shape, and whether the parameter
    is stored transposed (``Conv1D``: (in × out))."""

    module_name: str
    param_name: str  # name in problem.names / model.named_parameters()
    module: nn.Module
    shape: tuple[int, ...]  # the parameter's own shape
    transposed: bool = False

    @property
    def rows(self) -> int:
        """Output nodes (channels)."""
        return self.shape[1] if self.transposed else self.shape[0]

    @property
    def columns(self) -> int:
        """Entries per row (inputs × kernel positions)."""
        return int(torch.Size(self.shape).numel()) // self.rows

    def as_matrix(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor shaped like the parameter, viewed as (rows × rest)."""
        return t.T if self.transposed else t.reshape(self.shape[0], -1)

    def from_matrix(self, m: torch.Tensor) -> torch.Tensor:
        """The inverse of `as_matrix`: a (rows × rest) matrix shaped like the parameter."""
        return m.T if self.transposed else m.reshape(self.shape)


def weight_matrices(
    model: nn.Module, selected: Collection[str] | None = None, *, frozen: bool = False
) -> list[WeightMatrix]:
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
        conv1d = is_hf_conv1d(mod)
        if not (isinstance(mod, (nn.Linear, *CONV_TYPES)) or conv1d) or not isinstance(
            w, torch.Tensor
        ):
            continue
        pname = canonical.get(id(w))
        if pname is None or id(w) in seen:
            continue
        if (pname not in selected) if selected is not None else not (w.requires_grad or frozen):
            continue
        seen.add(id(w))
        out.append(
            WeightMatrix(mname, pname, mod, tuple(w.shape), transposed=conv1d and w.ndim == 2)
        )
    return out


def class_outputs_or_error(out: torch.Tensor, y: torch.Tensor, what: str, fix: str = "") -> None:
    """Raise `ConfigError` unless ``out`` are class scores (batch, classes ≥ 2) and ``y`` integer
    labels: ``"{what} needs class outputs (batch, classes) and integer labels; the model gives
    (shape).{fix}"``."""
    if out.ndim != 2 or out.shape[1] < 2 or y.is_floating_point():
        raise ConfigError(
            f"{what} needs class outputs (batch, classes) and integer labels; the model gives "
            f"{tuple(out.shape)}.{' ' + fix if fix else ''}"
        )


def selected(problem) -> Collection[str] | None:
    """The parameter names a measure over weight matrices restricts to: None (every weight matrix,
    frozen ones included) without a parameter selection, else the selected names."""
    return None if problem.selection.everything else set(problem.names)
