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

from ..errors import ConfigError
from .checkpoints import missing_checkpoint, natural_key


@dataclass(frozen=True)
class Job:
    """One checkpoint to measure: the path as given and resolved, its hyperparameters (the
    ``hp_*`` columns), and its own init checkpoint and training set when it has them."""

    checkpoint: str  # the path as given (or a glob's match, written as the glob is)
    path: Path  # resolved
    hparams: dict[str, Any] = field(default_factory=dict)
    init_checkpoint: Path | None = None
    train_data: Path | None = None  # per-checkpoint training set (tensors file), e.g. noisy labels


def coerce_cell(v: str) -> Any:
    """A text cell (CSV, path regex group) as the int, float or string it reads as."""
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
    return {k: coerce_cell(v) for k, v in (m.groupdict() if m else {}).items() if v is not None}


def _read_manifest(man: Path) -> list[dict[str, str]]:
    """The manifest's rows as ``{column: text}`` (read by pandas as text, so `coerce_cell` decides
    int/float/str exactly as for every other source; an empty field is ``""``, an unnamed
    column and fields beyond the header are left out)."""
    import warnings

    import pandas as pd

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", pd.errors.ParserWarning)  # a row longer than the header
            table = pd.read_csv(man, dtype=str, keep_default_na=False, index_col=False)
    except pd.errors.EmptyDataError:
        raise ConfigError(
            f"checkpoints.manifest: {man} needs a 'path' column (the file is empty)"
        ) from None
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"checkpoints.manifest: {man} is not a readable CSV: {first}") from None
    if "path" not in table.columns:
        raise ConfigError(f"checkpoints.manifest: {man} needs a 'path' column")
    keep = [c for c in table.columns if not re.fullmatch(r"Unnamed: \d+", str(c))]
    return table[keep].to_dict("records")


def resolve_jobs(cfg, cli_paths: list[str] | None = None) -> list[Job]:
    """Expand the config's (or the CLI's) checkpoints into jobs, in a stable order.

    ``cli_paths`` replace the config's list; with a manifest in the config they are files whose
    manifest rows (when they have one) supply the hyperparameters, init checkpoint and training
    set. Raises `ConfigError` for a malformed entry, a glob without matches or a missing file.
    """
    if cli_paths and isinstance(cfg.checkpoints, dict):
        return _cli_jobs_with_manifest(cfg, cli_paths)
    entries: Any = list(cli_paths) if cli_paths else cfg.checkpoints
    if isinstance(entries, str):
        entries = [entries]
    init_default = cfg.resolve_path(cfg.init_checkpoint) if cfg.init_checkpoint else None
    regex = _path_regex(cfg)
    if isinstance(entries, dict):
        jobs = _manifest_jobs(cfg, entries, regex, init_default)
    else:
        jobs = _listed_jobs(cfg, entries, regex, init_default, from_cli=bool(cli_paths))
    for j in jobs:
        if not _exists(cfg, j.path):
            raise _missing(cfg, j.path)
    return jobs


def _directories(cfg) -> bool:
    """Whether checkpoints are directories (``save_pretrained`` folders of a Hugging Face model)."""
    return getattr(cfg.model, "source", "python") == "huggingface"


def _exists(cfg, p: Path) -> bool:
    return p.is_dir() if _directories(cfg) else p.is_file()


def _missing(cfg, p: Path, where: str = ""):
    """The error for a checkpoint that is not there: a save_pretrained directory for a Hugging Face
    model, else a file (`flatcli.loading.checkpoints.missing_checkpoint` names a directory's files)."""
    if _directories(cfg):
        return ConfigError(
            f"{where}checkpoint not found: {p} (with model.source: huggingface a checkpoint "
            "is a save_pretrained directory)"
        )
    return missing_checkpoint(p, where)


def _cli_jobs_with_manifest(cfg, cli_paths: list[str]) -> list[Job]:
    """Jobs for files named on the command line when the config holds a manifest: a file that is
    in the manifest keeps its row's metadata (hparams, init, train_data); any other gets the
    config's ``hparams.from_path`` and ``init_checkpoint``."""
    known = {j.path.resolve(): j for j in resolve_jobs(cfg)}
    jobs = []
    for e in cli_paths:
        p = Path(os.path.expanduser(e))
        if not _exists(cfg, p):
            raise _missing(cfg, p)
        hit = known.get(p.resolve())
        jobs.append(
            Job(e, p, hit.hparams, hit.init_checkpoint, hit.train_data)
            if hit
            else Job(
                e,
                p,
                _from_path(cfg.hparams.from_path, e),
                cfg.resolve_path(cfg.init_checkpoint) if cfg.init_checkpoint else None,
            )
        )
    return jobs


def _path_regex(cfg) -> str | None:
    """``hparams.from_path``, checked to compile (`ConfigError` otherwise)."""
    regex = cfg.hparams.from_path
    if regex:
        try:
            re.compile(regex)
        except re.error as e:
            raise ConfigError(f"config key 'hparams.from_path' is not a valid regex: {e}") from None
    return regex


def _beside(man: Path, value: str) -> Path:
    """A path from a manifest field: ``~`` expanded, relative to the manifest's folder."""
    p = Path(os.path.expanduser(value))
    return p if p.is_absolute() else man.parent / p


def _manifest_jobs(cfg, entries: dict, regex: str | None, init_default: Path | None) -> list[Job]:
    """One job per manifest row: ``path``, optional ``init_checkpoint`` (default the config's) and
    ``train_data``; every other column, then the path regex's groups, are hyperparameters."""
    if set(entries) != {"manifest"}:
        raise ConfigError("config key 'checkpoints' as a mapping takes exactly one key, 'manifest'")
    man = cfg.resolve_path(entries["manifest"])
    if not man.is_file():
        raise ConfigError(f"checkpoints.manifest: file not found: {man}")
    jobs = []
    for row in _read_manifest(man):
        raw = row.pop("path")
        init = row.pop("init_checkpoint", None)
        td = row.pop("train_data", None)
        hp = {k: coerce_cell(v) for k, v in row.items() if k}
        hp.update(_from_path(regex, raw))
        ip = _beside(man, init) if init else None
        tp = _beside(man, td) if td else None
        jobs.append(Job(raw, _beside(man, raw), hp, ip or init_default, tp))
    return jobs


def _glob(pattern: str, root: str | os.PathLike | None) -> list[str]:
    """The matches of ``pattern``, sorted naturally (``bs16``, ``bs64``, ``bs256``: digit runs by
    value, `flatcli.loading.checkpoints.natural_key`), written as the pattern is: relative to
    ``root`` (the config's folder, for a relative pattern in the config) or to the working
    directory."""
    return sorted(glob.glob(pattern, root_dir=root, recursive=True), key=natural_key)


def _listed_jobs(
    cfg, entries: Any, regex: str | None, init_default: Path | None, *, from_cli: bool
) -> list[Job]:
    """Jobs for a list of paths and globs (globs expanded, sorted); relative paths are relative
    to the config's folder, or to the working directory for paths ``from_cli``. A job's
    ``checkpoint`` (the results' column) is the path as written, or a glob's match as the glob is
    written (``runs/*/best.pt`` in a config gives ``runs/a/best.pt``, whatever the folder)."""
    if not isinstance(entries, list):
        raise ConfigError(
            "config key 'checkpoints' must be a list of paths/globs or {manifest: file.csv}"
        )
    jobs = []
    for e in entries:
        if not isinstance(e, str):
            raise ConfigError(f"config key 'checkpoints' holds a non-string entry {e!r}")
        resolved = cfg.resolve_path(e) if not from_cli else Path(os.path.expanduser(e))
        if glob.has_magic(str(e)) and not _exists(
            cfg, resolved
        ):  # a file named `a[1].pt` is itself
            root = None if from_cli or os.path.isabs(os.path.expanduser(e)) else cfg.base_dir
            hits = _glob(os.path.expanduser(e), root)
            full = [Path(root) / h if root else Path(h) for h in hits]
            if _directories(cfg):  # save_pretrained directories only
                keep = [i for i, f in enumerate(full) if f.is_dir()]
                hits, full = [hits[i] for i in keep], [full[i] for i in keep]
            if not hits:
                raise ConfigError(
                    f"checkpoints: the glob {e!r} matches no {'directory' if _directories(cfg) else 'file'}"
                )
            jobs += [
                Job(h, f, _from_path(regex, h), init_default)
                for h, f in zip(hits, full, strict=True)
            ]
        elif not _exists(cfg, resolved):
            raise _missing(cfg, resolved, "" if from_cli else "config key 'checkpoints': ")
        else:
            jobs.append(Job(e, resolved, _from_path(regex, e), init_default))
    return _distinct_jobs(jobs)


def _distinct_jobs(jobs: list[Job]) -> list[Job]:
    """``jobs`` less any whose file an earlier one already names (a glob overlapping a path, a
    path listed twice): one file is measured once, under its first name."""
    seen: set[str] = set()
    out = []
    for j in jobs:
        key = os.path.realpath(j.path)
        if key not in seen:
            seen.add(key)
            out.append(j)
    return out
