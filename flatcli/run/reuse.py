"""What a sweep worker keeps between its consecutive units of one checkpoint (`CheckpointCache`):
the loaded model and its train/test metrics, so that a checkpoint measured by several units is
loaded and evaluated once."""

from __future__ import annotations

from typing import Any

import torch

from ..config import Config
from ..loading import load
from .jobs import Job


class CheckpointCache:
    """The checkpoint a sweep worker measures now, kept between its consecutive units (measures) of
    it: the loaded model, its init state, and its train/test metrics once computed. Another
    checkpoint replaces it, the old model released before the new one loads: at most one model is
    held, as while a unit runs. The metrics are reused only with the same data and settings, which
    hold within a worker."""

    def __init__(self) -> None:
        self._key: tuple[str, ...] | None = None
        self._model: tuple[torch.nn.Module, dict[str, Any]] | None = None
        self._init: tuple[dict[str, torch.Tensor] | None] | None = None
        self.metrics: dict[str, float] | None = None

    def model(self, cfg: Config, job: Job) -> tuple[torch.nn.Module, dict[str, Any]]:
        """`load_model` of the job's checkpoint, loaded once while it is the one kept."""
        key = (str(job.path), str(job.init_checkpoint), str(job.train_data))
        if key != self._key:
            self._key, self._model, self._init, self.metrics = None, None, None, None

            self._model = load.load_model(cfg, job.path)
            self._key = key
        assert self._model is not None
        return self._model

    def init_state(self, cfg: Config, job: Job) -> dict[str, torch.Tensor] | None:
        """`load_init_state` of the kept checkpoint's job, loaded once."""
        if self._init is None:
            self._init = (load.load_init_state(cfg, job, self.model(cfg, job)[0]),)
        return self._init[0]
