"""Precision: one vocabulary, validated once, resolved in one place.

``precision`` (``runtime.precision`` in YAML, ``--precision`` on the CLI, ``precision=``
in Python, and the engine's own argument) is one of

* ``auto`` (default): TF32 tensor-core products on a CUDA device that has them
  (compute capability ≥ 8.0), every converged quantity verified with fp32 products at
  the end (the measures say how); fp32 elsewhere;
* ``fp32``: strict fp32 (TF32 off);
* ``tf32``: TF32 products on CUDA, no verification;
* ``bf16``: the model's forward and every curvature product in bfloat16 (weights and
  activations), while θ, the estimators' vectors and every reduction (dot products, norms,
  Lanczos recurrences, Hutchinson sums, the loss's sum over units, the LM head's softmax) stay
  float32: `Precision.dtype` is float32 and `Precision.compute_dtype` bfloat16, and the problem
  casts θ to bfloat16 inside its forward (`flatcli.engine.problem.Problem`), so autograd returns
  float32 products of bfloat16 arithmetic. Converged quantities are verified with float32
  products, as for ``auto`` on TF32 (the measures say how);
* ``fp64``: float64 parameters, data and products (exact references, tests).

``fp16`` is not offered: float16's range (largest 65504, smallest normal 6.1e-5) cannot hold
the products of a mean loss over many units without loss scaling (a gradient share of one unit
of a 10⁵-token set and its curvature products underflow, a sum of squared logits overflows),
and a dynamic loss scale for second derivatives is not built; bfloat16 has float32's range.

`Precision.of` validates and resolves it for a device; everything else asks the
resulting object (``dtype``, ``effective``, ``verify``, ``context()``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..validation import (
    FP16_REFUSED as FP16_REFUSED,  # re-exported: the vocabulary is declared there
)
from ..validation import PRECISIONS as PRECISIONS
from ..validation import validate


def has_tensor_cores(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA device with TF32 tensor cores (compute capability ≥ 8.0, Ampere on)."""
    if device.type != "cuda":
        return False
    try:
        return torch.cuda.get_device_capability(device)[0] >= 8
    except (RuntimeError, AssertionError):
        return False


@contextlib.contextmanager
def tf32_flags(matmul: bool, cudnn: bool):
    """Set torch's two TF32 switches (CUDA matmul, cuDNN) inside; the previous values are restored."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


BF16_FD_REFUSED = (
    "runtime.hvp_mode: finite_difference with runtime.precision: bf16 is unsound: bfloat16 "
    "gradients carry relative errors near 4e-3, which a difference of two gradients at a step of "
    "1e-3 turns into noise larger than the curvature; use hvp_mode auto (exact products) or "
    "precision fp32"
)


def check_precision(value: str) -> str:
    """``value`` when it is one of `PRECISIONS`, else a ValueError with the one message (the rule
    ``precision`` of `flatcli.validation`: `Precision.of` is the engine's public entry point)."""
    return validate("precision", value, error=ValueError)


@dataclass(frozen=True)
class Precision:
    """A precision resolved for a device (see the module docstring)."""

    name: str = "auto"
    device: torch.device = torch.device("cpu")

    @classmethod
    def of(cls, name: str, device: torch.device | str) -> Precision:
        """Validate ``name`` and resolve it for ``device``."""
        return cls(check_precision(name), torch.device(device))

    @property
    def dtype(self) -> torch.dtype:
        """The floating type of θ, data, the estimators' vectors and the products they receive."""
        return torch.float64 if self.name == "fp64" else torch.float32

    @property
    def compute_dtype(self) -> torch.dtype:
        """The floating type the model's forward and the products run in (bfloat16 for ``bf16``)."""
        return torch.bfloat16 if self.name == "bf16" else self.dtype

    @property
    def effective(self) -> str:
        """What products run at: ``auto`` is ``tf32`` on a tensor-core CUDA device, ``fp32`` elsewhere;
        ``tf32`` on a device without TF32 runs fp32."""
        if self.name == "auto":
            return "tf32" if has_tensor_cores(self.device) else "fp32"
        if self.name == "tf32" and self.device.type != "cuda":
            return "fp32"
        return self.name

    @property
    def low(self) -> bool:
        """Whether products run below fp32 (TF32 matrix multiplies, or bfloat16)."""
        return self.effective in ("tf32", "bf16")

    @property
    def verify(self) -> bool:
        """Whether converged quantities are re-checked with fp32 products (``auto`` running TF32,
        and ``bf16`` always)."""
        return (self.name == "auto" and self.low) or self.name == "bf16"

    @property
    def low_name(self) -> str:
        """What the fast products run at (``tf32`` or ``bf16``): the prefix of the measures' fast
        diagnostics (``tf32_value``, ``bf16_value``)."""
        return "bf16" if self.name == "bf16" else "tf32"

    def context(self):
        """TF32 matrix products on for an effective ``tf32``, off otherwise; flags restored after."""
        tf32 = self.effective == "tf32"
        return tf32_flags(tf32, tf32)
