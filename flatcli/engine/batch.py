"""Batches of named tensors: what a measurement set, a split and a product's batch are.

A `Batch` maps names to tensors that share their first dimension (the rows:
samples, or sequences for a language model). How a batch meets the model:

* ``x`` is passed positionally, as flatcli always did (``model(x)``);
* ``y`` or ``labels`` is the target: never passed to the model, read by the loss;
* every other key (``input_ids``, ``attention_mask``, ``token_type_ids``,
  ``pixel_values``, ...) is passed by keyword (``model(input_ids=..., attention_mask=...)``).

A model output may be a tensor, a tuple or list (its first element is used) or an
object or dict with ``logits`` (a Hugging Face ``ModelOutput``): see `model_output`.

``Batch.of((x, y))`` and ``Batch.of(x, y)`` keep the historical ``(x, y)`` form working
everywhere a batch is accepted.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from ..errors import ConfigError

TARGET_KEYS = ("y", "labels")
POSITIONAL_KEY = "x"


class Batch(Mapping):
    """Named tensors with a common first dimension (see the module docstring).

    Parameters
    ----------
    tensors : mapping of name → tensor; at least one tensor, every one with the same
        length along dimension 0.
    where : what to name in an error (a file, a config key).
    """

    __slots__ = ("_t",)

    def __init__(self, tensors: Mapping[str, torch.Tensor], where: str = "the batch"):
        if not tensors:
            raise ConfigError(f"{where} holds no tensors")
        t: dict[str, torch.Tensor] = {}
        for k, v in tensors.items():
            if not isinstance(v, torch.Tensor):
                raise ConfigError(
                    f"{where}: '{k}' must be a tensor. Got {type(v).__name__} instead."
                )
            if v.ndim == 0:
                raise ConfigError(
                    f"{where}: '{k}' is a scalar; every tensor needs a first (row) dimension"
                )
            t[str(k)] = v
        lens = {k: len(v) for k, v in t.items()}
        if len(set(lens.values())) > 1:
            sizes = ", ".join(f"{k}: {n}" for k, n in lens.items())
            raise ConfigError(f"{where}: the tensors differ in their first dimension ({sizes})")
        self._t = t

    # ------------------------------------------------------------ construction
    @classmethod
    def of(cls, data: Any, y: torch.Tensor | None = None, where: str = "the data") -> Batch:
        """A batch from a `Batch`, a mapping of tensors, an ``(x, y)`` pair, or ``x`` and ``y``."""
        if y is not None:
            return cls({POSITIONAL_KEY: data, "y": y}, where)
        if isinstance(data, Batch):
            return data
        if isinstance(data, Mapping):
            return cls(data, where)
        if isinstance(data, (tuple, list)) and len(data) == 2:
            return cls({POSITIONAL_KEY: data[0], "y": data[1]}, where)
        if isinstance(data, torch.Tensor):
            return cls({POSITIONAL_KEY: data}, where)
        raise ConfigError(
            f"{where} must be named tensors, an (x, y) pair or a tensor. Got {type(data).__name__} instead."
        )

    @staticmethod
    def cat(batches: Sequence[Batch]) -> Batch:
        """The rows of ``batches`` one after the other (same keys in each)."""
        keys = list(batches[0].keys())
        return Batch({k: torch.cat([b[k] for b in batches]) for k in keys})

    # ------------------------------------------------------------ mapping
    def __getitem__(self, key: str) -> torch.Tensor:
        return self._t[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._t)

    def __len__(self) -> int:
        """The number of keys (a Mapping); use `rows` for the number of rows."""
        return len(self._t)

    @property
    def rows(self) -> int:
        """The number of rows (samples, or sequences)."""
        return len(next(iter(self._t.values())))

    def __repr__(self) -> str:
        shapes = ", ".join(
            f"{k}: {tuple(v.shape)} {str(v.dtype).replace('torch.', '')}"
            for k, v in self._t.items()
        )
        return f"Batch({shapes})"

    # ------------------------------------------------------------ rows
    def select(self, index: slice | torch.Tensor | Sequence[int]) -> Batch:
        """The rows ``index`` (a slice, an index tensor or a list of row numbers)."""
        if not isinstance(index, slice):
            index = torch.as_tensor(index, dtype=torch.long)
        out = {}
        for k, v in self._t.items():
            idx = index if isinstance(index, slice) else index.to(v.device)
            out[k] = v[idx]
        return Batch(out)

    def split(self, size: int) -> list[Batch]:
        """Consecutive batches of ``size`` rows (the last one may be shorter)."""
        n = self.rows
        return [self.select(slice(i, i + size)) for i in range(0, n, max(1, int(size)))]

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> Batch:
        """Moved to ``device``; floating tensors cast to ``dtype`` (integer ids and masks keep theirs)."""
        out = {}
        for k, v in self._t.items():
            v = v.to(device) if device is not None else v
            if dtype is not None and v.is_floating_point():
                v = v.to(dtype)
            out[k] = v
        return Batch(out)

    def replace(self, **tensors: torch.Tensor) -> Batch:
        """A copy with some tensors replaced or added (e.g. labels drawn from the model)."""
        return Batch({**self._t, **tensors})

    # ------------------------------------------------------------ meeting the model
    @property
    def target(self) -> torch.Tensor | None:
        """The target tensor (``y``, else ``labels``), or None."""
        for k in TARGET_KEYS:
            if k in self._t:
                return self._t[k]
        return None

    @property
    def target_key(self) -> str | None:
        """The name of the target tensor, or None."""
        return next((k for k in TARGET_KEYS if k in self._t), None)

    def model_inputs(self) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
        """``(args, kwargs)`` of the model call: ``x`` positionally, every non-target key by keyword."""
        args = (self._t[POSITIONAL_KEY],) if POSITIONAL_KEY in self._t else ()
        kwargs = {k: v for k, v in self._t.items() if k != POSITIONAL_KEY and k not in TARGET_KEYS}
        return args, kwargs

    @property
    def input(self) -> torch.Tensor:
        """The first model input (``x``, else the first keyword input): the tensor whose
        dtype and shape describe the data in messages and estimates."""
        args, kwargs = self.model_inputs()
        if args:
            return args[0]
        if kwargs:
            return next(iter(kwargs.values()))
        raise ConfigError("the batch holds no model input (only a target)")


def model_output(out: Any) -> torch.Tensor:
    """The tensor of a model output: the output itself, the first element of a tuple or list,
    or ``.logits`` / ``["logits"]`` of a ``ModelOutput`` or dict."""
    if isinstance(out, torch.Tensor):
        return out
    logits = out.get("logits") if isinstance(out, Mapping) else getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise ConfigError(
        f"the model returned {type(out).__name__}; flatcli needs a tensor, a tuple whose first element "
        "is a tensor, or an object with 'logits'"
    )
