"""Loading what a run measures: a checkpoint's model and init state, a manifest's
per-checkpoint training data, and the data cache a worker keeps between checkpoints."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from ..config import Config, DataSource
from ..engine import Batch
from ..errors import ConfigError
from .checkpoints import checkpoint_extras, extract_state_dict, load_into, read_checkpoint
from .data import load_split
from .factory import build_model, import_dirs, in_dtype, model_dtype, stored_dtype
from .hf import load_pretrained
from .jobs import Job, resolve_jobs
from .text import checkpoint_tokenizer

DATA_CACHE_MB = 1024  # default byte budget of a `DataCache`, in MiB (FLATCLI_DATA_CACHE_MB)


def batch_nbytes(batch: Batch | None) -> int:
    """The bytes held by a batch's tensors (0 for None)."""
    return 0 if batch is None else sum(t.numel() * t.element_size() for t in batch.values())


class DataCache:
    """Loads each configured split once (``cache_dir``: where the ``text`` source keeps its
    tokenized tensors across runs, ``OUTDIR/tokenized`` for measure and sweep).

    The splits stay loaded while they fit ``max_bytes`` (default `DATA_CACHE_MB` MiB, or the
    ``FLATCLI_DATA_CACHE_MB`` environment variable): past it the least recently used are dropped
    (and loaded again when asked for), so a sweep over checkpoints that each bring their own
    ``train_data`` keeps its memory flat. The split just loaded always stays."""

    def __init__(self, cfg: Config, cache_dir: Path | None = None, max_bytes: int | None = None):
        import collections
        import os

        self.cfg = cfg
        self.cache_dir = cache_dir
        mb = float(os.environ.get("FLATCLI_DATA_CACHE_MB") or DATA_CACHE_MB)
        self.max_bytes = int(mb * 2**20) if max_bytes is None else int(max_bytes)
        self._cache: collections.OrderedDict[str, Any] = collections.OrderedDict()

    def get(self, split: str, path: Path | None = None) -> Batch | None:
        """The split ``split`` as a `Batch` of named tensors, loaded once (``path``: a tensors file
        replacing it), or None when it is not configured."""
        key = split if path is None else f"{split}:{path}"
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        if path is not None:
            src = DataSource(source="tensors", path=str(path))
        else:
            src = self._with_tokenizer(getattr(self.cfg.data, split))
        self._cache[key] = (
            None
            if src is None
            else load_split(src, split, self.cfg.base_dir, self.cfg.data.normalize, self.cache_dir)
        )
        self._evict()
        return self._cache[key]

    def _evict(self) -> None:
        """Drop the least recently used splits while the cache is over its budget."""
        while (
            len(self._cache) > 1 and sum(map(batch_nbytes, self._cache.values())) > self.max_bytes
        ):
            self._cache.popitem(last=False)

    def _with_tokenizer(self, src):
        """A text source without ``tokenizer``: the first Hugging Face checkpoint folder holding one."""
        found = implied_tokenizer(self.cfg, src)
        if found is None:
            return src
        import dataclasses

        return dataclasses.replace(src, tokenizer=str(found))


def implied_tokenizer(cfg: Config, src) -> Path | None:
    """The tokenizer folder a ``text`` source without ``tokenizer`` reads: the first of the config's
    Hugging Face checkpoint folders (in the order listed) holding a saved tokenizer; None when the
    source names its tokenizer, is not text, or no folder holds one. Its files are in every key
    (`flatcli.keys.data_fingerprints`), so reordering the checkpoints or swapping that tokenizer
    recomputes."""
    if (
        src is None
        or src.source != "text"
        or src.tokenizer is not None
        or cfg.model.source != "huggingface"
    ):
        return None
    try:
        folders = [j.path for j in resolve_jobs(cfg)]
    except ConfigError:
        return None
    return checkpoint_tokenizer(folders)


def load_init_state(
    cfg: Config, job: Job, model: torch.nn.Module | None = None
) -> dict[str, torch.Tensor] | None:
    """The job's initialization state dict (None without one), shape-checked against ``model``
    (a ``save_pretrained`` directory with ``model.source: huggingface``)."""
    if job.init_checkpoint is None:
        return None
    if cfg.model.source == "huggingface":
        init_model, _ = load_model(cfg, job.init_checkpoint)
        init_state = dict(init_model.state_dict())
    else:
        init_state = extract_state_dict(
            read_checkpoint(
                job.init_checkpoint,
                cfg.runtime.allow_unsafe_pickle,
                import_dirs(cfg.model.target, cfg.base_dir),
            ),
            job.init_checkpoint,
        )
    if model is not None:
        load_into(copy.deepcopy(model), init_state, job.init_checkpoint)  # validates shapes
    return init_state


def load_model(cfg: Config, path: str | Path) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Build the config's model and load one checkpoint into it.

    Parameters
    ----------
    cfg : Config
        The config; ``model_kwargs`` stored in the checkpoint override ``model.kwargs``.
    path : str or Path
        The checkpoint file, or a ``save_pretrained`` folder with ``model.source: huggingface``
        (read offline by ``transformers``, `flatcli.loading.hf`).

    Returns
    -------
    model, extras : torch.nn.Module, dict
        The model on the CPU, and what else the checkpoint held (``model_info``, for results.json).
    """
    if cfg.model.source == "huggingface":
        model, info = load_pretrained(cfg.model.class_, path, cfg.model.kwargs, cfg.model.dtype)
        return model, {"model_info": info}
    if not cfg.model.target:
        raise ConfigError("config key 'model.target' is required")
    obj = read_checkpoint(
        path, cfg.runtime.allow_unsafe_pickle, import_dirs(cfg.model.target, cfg.base_dir)
    )
    extras = checkpoint_extras(obj)
    kwargs = dict(cfg.model.kwargs)
    if isinstance(extras.get("model_kwargs"), dict):
        kwargs.update(extras["model_kwargs"])
    model = build_model(cfg.model.target, kwargs, cfg.base_dir)
    sd = extract_state_dict(obj, path)
    load_into(model, sd, path)
    dtype = stored_dtype(sd, path) if cfg.model.dtype == "auto" else cfg.model.dtype
    model = in_dtype(model, dtype)
    return model, {**extras, "model_info": {"source": "python", "dtype": model_dtype(model)}}


def manifest_train_data(cfg: Config, path: Path) -> Path | None:
    """The manifest's ``train_data`` for ``path`` when the config's manifest lists that checkpoint."""
    if not isinstance(cfg.checkpoints, dict):
        return None
    try:
        jobs = resolve_jobs(cfg)
    except ConfigError:
        return None
    target = Path(path).resolve()
    for j in jobs:
        if j.train_data is not None and j.path.resolve() == target:
            return j.train_data
    return None
