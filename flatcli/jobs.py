"""Checkpoint sets: lists, globs and manifests, with hyperparameters.

``checkpoints`` in the config is a list of paths and/or globs, a single string,
or ``{manifest: sweep.csv}``: a CSV with a ``path`` column (relative to the
manifest's folder), an optional ``init_checkpoint`` column, and any other
columns as hyperparameters. Hyperparameters may also come from
``hparams.from_path`` (a regex with named groups searched in the path) and
``hparams.from_keys`` (keys of a dict stored in the checkpoint, read later).
They become ``hp_*`` columns.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError


@dataclass(frozen=True)
class Job:
    checkpoint: str  # the path as given (or as the glob produced it)
    path: Path  # resolved
    hparams: dict[str, Any] = field(default_factory=dict)
    init_checkpoint: Path | None = None
    train_data: Path | None = None  # per-checkpoint training set (tensors file), e.g. noisy labels


def _coerce(v: str) -> Any:
    for cast in (int, float):
        try:
            return cast(v)
        except (TypeError, ValueError):
            pass
    return v


def _from_path(regex: str | None, path: str) -> dict[str, Any]:
    if not regex:
        return {}
    m = re.search(regex, path)
    return {k: _coerce(v) for k, v in (m.groupdict() if m else {}).items() if v is not None}


def _read_manifest(man: Path) -> list[dict[str, str]]:
    """The manifest's rows as ``{column: text}`` (read by pandas as text, so `_coerce` decides
    int/float/str exactly as for every other source; an empty field is ``""``, an unnamed
    column and fields beyond the header are left out)."""
    import warnings

    import pandas as pd

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", pd.errors.ParserWarning)  # a row longer than the header
            table = pd.read_csv(man, dtype=str, keep_default_na=False, index_col=False)
    except pd.errors.EmptyDataError:
        raise ConfigError(f"checkpoints.manifest: {man} needs a 'path' column (the file is empty)") from None
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"checkpoints.manifest: {man} is not a readable CSV: {first}") from None
    if "path" not in table.columns:
        raise ConfigError(f"checkpoints.manifest: {man} needs a 'path' column")
    keep = [c for c in table.columns if not re.fullmatch(r"Unnamed: \d+", str(c))]
    return table[keep].to_dict("records")


def resolve_jobs(cfg, cli_paths: list[str] | None = None) -> list[Job]:
    """Expand the config's (or the CLI's) checkpoints into jobs, in a stable order."""
    if cli_paths and isinstance(cfg.checkpoints, dict):
        # paths given on the command line keep the manifest's metadata (hparams, init, train_data)
        known = {j.path.resolve(): j for j in resolve_jobs(cfg)}
        jobs = []
        for e in cli_paths:
            p = Path(os.path.expanduser(e))
            if not p.is_file():
                raise ConfigError(f"checkpoint: file not found: {p}")
            hit = known.get(p.resolve())
            jobs.append(
                Job(e, p, hit.hparams, hit.init_checkpoint, hit.train_data)
                if hit
                else Job(e, p, _from_path(cfg.hparams.from_path, e), cfg.resolve_path(cfg.init_checkpoint) if cfg.init_checkpoint else None)
            )
        return jobs
    entries: Any = list(cli_paths) if cli_paths else cfg.checkpoints
    if isinstance(entries, str):
        entries = [entries]
    init_default = cfg.resolve_path(cfg.init_checkpoint) if cfg.init_checkpoint else None
    regex = cfg.hparams.from_path
    if regex:
        try:
            re.compile(regex)
        except re.error as e:
            raise ConfigError(f"config key 'hparams.from_path' is not a valid regex: {e}") from None
    jobs: list[Job] = []
    if isinstance(entries, dict):
        if set(entries) != {"manifest"}:
            raise ConfigError("config key 'checkpoints' as a mapping takes exactly one key, 'manifest'")
        man = cfg.resolve_path(entries["manifest"])
        if not man.is_file():
            raise ConfigError(f"checkpoints.manifest: file not found: {man}")
        for row in _read_manifest(man):
            raw = row.pop("path")
            p = Path(os.path.expanduser(raw))
            p = p if p.is_absolute() else man.parent / p
            init = row.pop("init_checkpoint", None)
            ip = None
            if init:
                ip = Path(os.path.expanduser(init))
                ip = ip if ip.is_absolute() else man.parent / ip
            td = row.pop("train_data", None)
            tp = None
            if td:
                tp = Path(os.path.expanduser(td))
                tp = tp if tp.is_absolute() else man.parent / tp
            hp = {k: _coerce(v) for k, v in row.items() if k}
            hp.update(_from_path(regex, raw))
            jobs.append(Job(raw, p, hp, ip or init_default, tp))
    else:
        if not isinstance(entries, list):
            raise ConfigError("config key 'checkpoints' must be a list of paths/globs or {manifest: file.csv}")
        for e in entries:
            if not isinstance(e, str):
                raise ConfigError(f"config key 'checkpoints' holds a non-string entry {e!r}")
            resolved = cfg.resolve_path(e) if not cli_paths else Path(os.path.expanduser(e))
            if glob.has_magic(str(e)):
                hits = sorted(glob.glob(str(resolved), recursive=True))
                if not hits:
                    raise ConfigError(f"checkpoints: the glob {e!r} matches no file")
                for h in hits:
                    jobs.append(Job(h, Path(h), _from_path(regex, h), init_default))
            else:
                if not resolved.is_file():
                    where = "checkpoint" if cli_paths else "checkpoints"
                    raise ConfigError(f"{where}: file not found: {resolved}")
                jobs.append(Job(e, resolved, _from_path(regex, e), init_default))
    for j in jobs:
        if not j.path.is_file():
            raise ConfigError(f"checkpoint not found: {j.path}")
    return jobs
