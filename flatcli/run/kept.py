"""What a sweep worker keeps between its consecutive units of one checkpoint (`CheckpointCache`):
the loaded model and its train/test metrics, so that a checkpoint measured by several units is
loaded and evaluated once; and the earlier work one measurement takes instead of redoing it
(`Reuse`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..config import Config
from ..loading import load
from ..loading.jobs import Job
from ..validation import Kind, Optional, check_fields, opt
from .preflight import Checked


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


def _optional(*types: type, words: str) -> Optional:
    return Optional(Kind(*types, words=words))


@dataclass(frozen=True)
class Reuse:
    """The earlier work one measurement takes instead of redoing it (``reuse=`` of
    `flatcli.run.measuring.measure_model` and `measure_job`), validated at construction. Nothing
    (the default) measures everything afresh.

    ``results``: label → `flatcli.measures.MeasureResult` of an earlier run; those measures are not
    run again (``--resume``). ``metrics``: this model's train/test metrics on these splits from an
    earlier unit; not computed again. ``budget_among``: the measures a checkpoint's
    ``settings.budget`` is split among (a sweep unit runs one of them, with the share it has in the
    whole checkpoint). `measure_job` also reads ``checked``: the checkpoint's pre-flight
    (`flatcli.run.preflight.Checked`) when the caller already ran it (the checkpoint is then not
    loaded again), and ``keep``: a `CheckpointCache` holding the model, init state and metrics
    between a sweep worker's units of one checkpoint (its metrics then stand for ``metrics``)."""

    results: Mapping[str, Any] | None = opt(None, _optional(Mapping, words="a mapping"))
    metrics: Mapping[str, float] | None = opt(None, _optional(Mapping, words="a mapping"))
    budget_among: Sequence[Any] | None = opt(
        None, _optional(list, tuple, words="a list of MeasureSpec")
    )
    checked: Checked | None = opt(None, _optional(Checked, words="a preflight Checked"))
    keep: CheckpointCache | None = opt(None, _optional(CheckpointCache, words="a CheckpointCache"))

    def __post_init__(self):
        check_fields(self)
