"""The pre-flight: what is checked of a checkpoint's model before any data is loaded, the same in
every command (`measure`, `sweep`, the landscape views, the invariance check). The ``params``
selection must match the model's parameters, a text split's ``max_length`` must fit its positions
(both a `ConfigError`: exit code 2), and with ``runtime.check_memory`` the memory the measures
need is counted (`flatcli.run.prediction.memory.check_model`). `flatcli.run.measuring.preflight` loads the checkpoint
and runs these checks; the run goes on with the model it loaded."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..loading.hf import check_positions
from .prediction.memory import MemoryVerdict, check_model
from .settings import Settings


@dataclass
class Checked:
    """A checkpoint after its pre-flight: the model (on the CPU) and its extras, and the memory
    verdict for the measures ``labels`` (None: not checked)."""

    model: torch.nn.Module
    extras: dict[str, Any]
    memory: MemoryVerdict | None = None
    labels: tuple[str, ...] = ()

    @property
    def fits(self) -> bool:
        """Whether the measures fit in memory (True when not checked)."""
        return self.memory is None or self.memory.fits

    def memory_for(self, specs: Sequence[Any], settings: Settings) -> MemoryVerdict:
        """The memory verdict for ``specs``: the pre-flight's when it counted the same measures."""
        if self.memory is not None and self.labels == tuple(s.label for s in specs):
            return self.memory
        return check_model(self.model, specs, settings)


def check_settings(cfg, model: torch.nn.Module, path, settings: Settings, train_data=None) -> None:
    """A `ConfigError` when the ``params`` selection matches none of ``model``'s parameters, or a
    text split's ``max_length`` exceeds its positions (a Hugging Face model's ``n_positions`` or
    ``max_position_embeddings``; not for a train split that ``train_data`` replaces)."""
    settings.params.select(model)
    for split in ("train", "test"):
        src = getattr(cfg.data, split)
        if src is not None and src.source == "text" and (split == "test" or train_data is None):
            check_positions(model, f"data.{split}.max_length", src.max_length, path)


def check_loaded(
    cfg,
    path: str | Path,
    train_data: Path | None,
    loaded: tuple[torch.nn.Module, dict[str, Any]],
    specs: Sequence[Any],
    settings: Settings,
) -> Checked:
    """The pre-flight of a loaded checkpoint (``loaded``: what `flatcli.loading.load.load_model`
    returned for ``path``): `check_settings`, then with ``settings.check_memory`` the memory
    ``specs`` need, returned in `Checked.memory` (not raised)."""
    model, extras = loaded
    check_settings(cfg, model, path, settings, train_data)
    verdict = check_model(model, specs, settings) if settings.check_memory else None
    return Checked(model, extras, verdict, tuple(s.label for s in specs))
