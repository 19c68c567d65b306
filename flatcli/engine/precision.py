"""Precision: one vocabulary, validated once, resolved in one place.

``precision`` (``runtime.precision`` in YAML, ``--precision`` on the CLI, ``precision=``
in Python, and the engine's own argument) is one of

* ``auto`` (default): TF32 tensor-core products on a CUDA device that has them
  (compute capability ≥ 8.0), every converged quantity verified with fp32 products at
  the end (the measures say how); fp32 elsewhere;
* ``fp32``: strict fp32 (TF32 off);
* ``tf32``: TF32 products on CUDA, no verification;
* ``fp64``: float64 parameters, data and products (exact references, tests).

`Precision.of` validates and resolves it for a device; everything else asks the
resulting object (``dtype``, ``effective``, ``verify``, ``context()``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

PRECISIONS = ("auto", "fp32", "tf32", "fp64")


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


def check_precision(value: str) -> str:
    """``value`` when it is one of `PRECISIONS`, else a ValueError with the one message."""
    if value not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {value!r}")
    return value


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
        """The floating type of parameters, data and products."""
        return torch.float64 if self.name == "fp64" else torch.float32

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
        """Whether products use TF32 matrix multiplies."""
        return self.effective == "tf32"

    @property
    def verify(self) -> bool:
        """Whether converged quantities are re-checked with fp32 products (``auto`` running TF32)."""
        return self.name == "auto" and self.low

    def context(self):
        """TF32 matrix products on for an effective ``tf32``, off otherwise; flags restored after."""
        return tf32_flags(self.low, self.low)
