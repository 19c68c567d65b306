"""What every entry point shares: loading a config, choosing threads, selecting measures and
checkpoints."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from ..config import Config, from_dict, load_config, parse_measures, set_path
from ..errors import ConfigError
from ..loading.jobs import Job, resolve_jobs
from ..measures import MeasureSpec, list_measures
from ..run.settings import RunOptions
from ..threads import configure_threads

RUN_FIELDS = frozenset(f.name for f in dataclasses.fields(RunOptions))
F = TypeVar("F", bound=Callable[..., Any])


def takes_run(fn: F) -> F:
    """Mark an entry point that takes ``run: RunOptions``: a call that passes one of its fields as
    a keyword of its own (``device="cpu"``, the signature before `RunOptions`) gets a TypeError
    naming ``run=RunOptions(...)`` instead of Python's bare "unexpected keyword" (or, where the
    entry point takes ``**options``, an error from deeper down). The signature is unchanged
    (``functools.wraps``: `inspect.signature` and help show the function's own)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        old = sorted(RUN_FIELDS & kwargs.keys())
        if old:
            given = ", ".join(f"{k}={kwargs[k]!r}" for k in old)
            raise TypeError(
                f"{fn.__name__}() takes the run options as one object: "
                f"run=RunOptions({given}), not {', '.join(old)}="
            )
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def load(
    config: Config | str | Path | dict | None, changes: dict[str, Any] | None = None
) -> Config:
    """A `Config` from a path, a mapping or a Config.

    Parameters
    ----------
    config : Config, str, Path, dict or None
        A YAML path, a mapping of config keys, or a Config (changed in place).
    changes : dict, optional
        Dotted keys and values (``{"runtime.seed": 3}``; None values ignored, see
        `flatcli.config.overrides`) that win over everything, as CLI flags do.

    Returns
    -------
    Config
        The validated config; each value records where it came from (``config show``).
    """
    if isinstance(config, Config):
        for k, v in (changes or {}).items():
            if v is not None:
                set_path(config, k, v, "cli")
        return config
    if isinstance(config, dict):
        return from_dict(config, overrides=changes)
    return load_config(config, changes)


def load_run(config: Config | str | Path | dict | None, run: RunOptions | None) -> Config:
    """`load` with a call's `RunOptions` as the overrides (None: the config as it is)."""
    return load(config, RunOptions.of(run).changes())


def use_threads(cfg: Config, workers: int | None = None) -> str:
    """Size torch's intra-op threads for this process from ``runtime.threads``.

    Parameters
    ----------
    cfg : Config
        The config whose ``runtime.threads`` applies (``auto``, or an int).
    workers : int, optional
        Processes sharing the cores (default ``LOCAL_WORLD_SIZE`` or 1).

    Returns
    -------
    str
        The choice in words, for the log (`flatcli.threads`: ``auto`` is ``OMP_NUM_THREADS``
        when set, else free cores ÷ workers).
    """
    return str(configure_threads(cfg.runtime.threads, workers))


def _jobs_and_specs(cfg: Config, checkpoints, measures) -> tuple[list[Job], list[MeasureSpec]]:
    """Validate what every pipeline needs; resolve the jobs and the measures to run."""
    if not cfg.model.target and cfg.model.source != "huggingface":
        raise ConfigError("config key 'model.target' is required")
    if cfg.data.train is None:
        raise ConfigError("config key 'data.train' is required")
    jobs = resolve_jobs(cfg, list(checkpoints) if checkpoints else None)
    if not jobs:
        raise ConfigError(
            "no checkpoints: list them under 'checkpoints' or pass paths on the command line"
        )
    specs = select_measures(
        cfg, measures, has_init=any(j.init_checkpoint is not None for j in jobs)
    )
    return jobs, specs


def select_measures(
    cfg: Config, names: Sequence[str] | str | None, has_init: bool | None = None
) -> list[MeasureSpec]:
    """The measures a run computes.

    Parameters
    ----------
    cfg : Config
        The config, whose ``measures`` are the default.
    names : str or sequence of str, optional
        Labels or measure names (``-m``): a configured label or measure name keeps its configured
        options, another registered name runs with defaults, ``"all"`` runs every measure.
    has_init : bool, optional
        Whether an init checkpoint exists (``all`` then includes ``distance_from_init``).

    Returns
    -------
    list of MeasureSpec
        One spec per measure to run, with its label and options.
    """
    specs = cfg.measure_specs()
    if names is None:
        if not specs:
            raise ConfigError(
                "no measures configured: add a 'measures' list to the config or pass -m NAME,..."
            )
        return specs
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    if list(names) == ["all"]:
        chosen = []
        by_name = {s.name: s for s in specs}
        for info in list_measures():
            if info.needs_init and not (has_init if has_init is not None else cfg.init_checkpoint):
                continue
            chosen.append(by_name.get(info.name, MeasureSpec(info.name, info.name)))
        return chosen
    out = []
    for n in names:
        hit = [s for s in specs if s.label == n] or [s for s in specs if s.name == n]
        out.extend(hit if hit else parse_measures([n], "-m"))
    return out


def _one_job(cfg: Config, checkpoint: str | Path | None) -> Job:
    if checkpoint is None:
        jobs = resolve_jobs(cfg)
        if len(jobs) != 1:
            raise ConfigError(
                f"check-invariance takes one checkpoint; the config lists {len(jobs)}: pass one"
            )
        return jobs[0]
    (job,) = resolve_jobs(cfg, [str(checkpoint)])
    return job
