"""The Python entry points: `measure`, `measure_model`, and helpers.

Everything the CLI does goes through here; the CLI only parses and renders.

>>> import flatcli
>>> report = flatcli.measure("configs/digits_mlp.yaml")            # doctest: +SKIP
>>> report.rows[0].results["hessian_trace"].value                  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import copy
import math
import platform
import re
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from . import __version__
from .config import Config, from_dict, load_config, parse_measures
from .engine import CurvatureEngine, Problem, eval_mode
from .errors import ConfigError, FlatcliError, MeasurementError
from .jobs import Job, resolve_jobs
from .loading.checkpoints import checkpoint_extras, extract_state_dict, load_into, read_checkpoint
from .loading.data import load_split, subset
from .loading.models import build_model
from .measures import MeasureContext, MeasureSpec, run_measure
from .results import Row, write_results

DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "fp64": torch.float64}


def resolve_device(name: str | torch.device | None) -> torch.device:
    """'auto' → cuda if available else cpu; validates cuda:N."""
    if isinstance(name, torch.device):
        return name
    name = name or "auto"
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"runtime.device is {name!r} but no CUDA device is visible; use --device cpu")
        dev = torch.device(name)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"runtime.device {name!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
        return dev
    try:
        return torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"runtime.device: {e}") from None


@contextlib.contextmanager
def _precision(precision: str):
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def as_specs(measures) -> list[MeasureSpec]:
    """Measure specs from names (a list or 'a,b'), ``{name: options}`` entries or specs."""
    if measures is None:
        return []
    if isinstance(measures, str):
        measures = [m.strip() for m in measures.split(",") if m.strip()]
    if all(isinstance(m, MeasureSpec) for m in measures):
        return list(measures)
    return parse_measures(list(measures), "measures")


def _check_labels(model, x, y, loss: str, where: str, device, dtype) -> None:
    if loss != "cross_entropy" or y.is_floating_point():
        return
    with torch.no_grad(), eval_mode(model):
        xb = x[:2].to(device)
        out = model(xb.to(dtype) if xb.is_floating_point() else xb)
    if out.ndim != 2:
        raise ConfigError(f"loss 'cross_entropy' needs outputs of shape (batch, classes); the model gives {tuple(out.shape)}")
    c = out.shape[1]
    lo, hi = int(y.min()), int(y.max())
    if lo < 0 or hi >= c:
        raise ConfigError(f"{where}: label {hi if hi >= c else lo} is outside the model's {c} outputs")


def _metrics(model, data, loss, batch_size, device, dtype) -> tuple[float, float]:
    x, y = data
    prob = Problem(model, x, y, loss=loss, batch_size=batch_size, device=device, dtype=dtype)
    return prob.evaluate()


def _check_deterministic(problem: Problem) -> None:
    x, y = problem.batches[0]
    with torch.no_grad():
        a = problem.batch_loss_sum(problem.params, x, y)
        b = problem.batch_loss_sum(problem.params, x, y)
    if not torch.equal(a, b) and not torch.allclose(a, b, rtol=1e-6, atol=0):
        raise MeasurementError(
            "the loss differs between two identical evaluations in eval mode "
            f"({float(a):.6g} vs {float(b):.6g}); remove randomness from forward() (dropout via F.dropout(training=True), noise)"
        )


def measure_model(
    model: torch.nn.Module,
    train: tuple[torch.Tensor, torch.Tensor],
    measures: Sequence[Any] | str,
    *,
    test: tuple[torch.Tensor, torch.Tensor] | None = None,
    loss: str = "cross_entropy",
    split: str = "train",
    num_samples: int | str = "all",
    batch_size: int = 256,
    data_seed: int = 0,
    seed: int = 0,
    device: str | torch.device | None = "cpu",
    precision: str = "fp32",
    init_state: dict[str, torch.Tensor] | None = None,
    hvp_mode: str = "auto",
    block_size: int | None = None,
    checkpoint: str = "<model>",
    hparams: dict[str, Any] | None = None,
    debug: bool = False,
) -> Row:
    """Measure one model. Returns a `Row` (a failed measure is recorded, not raised).

    Parameters
    ----------
    model : the network (not modified; its train/eval mode is restored).
    train, test : (x, y) tensors of the train and optional test split.
    measures : names, ``{name: options}`` entries or `MeasureSpec` objects.
    split, num_samples, batch_size, data_seed : the measurement set
        (``measure_data`` in YAML).
    seed : seed of every stochastic measure without its own ``seed``.
    precision : "fp32", "tf32" or "fp64" (float64, for exact checks).
    init_state : state dict at initialization (for ``distance_from_init``).
    """
    specs = as_specs(measures)
    dev = resolve_device(device)
    dtype = DTYPES.get(precision)
    if dtype is None:
        raise ConfigError(f"runtime.precision must be fp32, tf32 or fp64; got {precision!r}")
    data = {"train": train, "test": test}
    if data.get(split) is None:
        raise ConfigError(f"measure_data.split is {split!r} but no {split} data is configured")
    row = Row(checkpoint=checkpoint, labels=[s.label for s in specs], hparams=dict(hparams or {}))
    original = next(iter(model.parameters()), None)
    orig_device = original.device if original is not None else torch.device("cpu")
    orig_dtype = original.dtype if original is not None else torch.float32
    # Work on a copy when the model must change device or dtype: never mutate the caller's model.
    work = model if (orig_device == dev and orig_dtype == dtype) else copy.deepcopy(model).to(dev, dtype)
    with _precision(precision), eval_mode(work):
        for split_name, d in data.items():
            if d is not None:
                _check_labels(work, d[0], d[1], loss, f"data.{split_name}", dev, dtype)
        mx, my = subset(*data[split], num_samples, data_seed)
        problem = Problem(work, mx, my, loss=loss, batch_size=batch_size, device=dev, dtype=dtype)
        engine = CurvatureEngine(problem, hvp_mode=hvp_mode, block_size=block_size)
        init_params = None
        if init_state is not None:
            init_params = {
                n: init_state[n].to(dev, dtype) for n in problem.names if n in init_state
            }
        try:
            engine.check_finite()
            _check_deterministic(problem)
        except FlatcliError as e:
            row.status, row.error = "error", str(e)
            return row
        for spec in specs:
            ctx = MeasureContext(
                problem=problem,
                engine=engine,
                seed=seed if spec.seed is None else spec.seed,
                init_params=init_params,
                extra={"test": test, "train": train, "loss": loss, "batch_size": batch_size, "init_state": init_state},
            )
            try:
                row.results[spec.label] = run_measure(spec, ctx)
            except ConfigError as e:  # e.g. a measure that needs an init checkpoint nobody gave
                msg = f"config: {spec.label}: {e}"
                row.errors[spec.label] = msg
                row.status = "error"
                row.error = row.error or msg
            except Exception as e:  # one failed measure never loses the others
                if debug:
                    traceback.print_exc()
                msg = f"{spec.label}: {type(e).__name__}: {e}" if not isinstance(e, FlatcliError) else f"{spec.label}: {e}"
                row.errors[spec.label] = msg
                row.status = "error"
                row.error = row.error or msg
        tr = _metrics(work, train, loss, batch_size, dev, dtype)
        row.metrics["train_loss"], row.metrics["train_acc"] = tr
        if test is not None:
            te = _metrics(work, test, loss, batch_size, dev, dtype)
            row.metrics["test_loss"], row.metrics["test_acc"] = te
            if not (math.isnan(tr[1]) or math.isnan(te[1])):
                row.metrics["gen_gap"] = tr[1] - te[1]
    return row


@dataclass
class MeasureReport:
    rows: list[Row]
    config: Config
    meta: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        codes = [0]
        for r in self.rows:
            if r.status == "error":
                codes.append(2 if r.error.startswith("config:") else 1)
        return max(codes)


def versions() -> dict[str, str]:
    import numpy
    import scipy

    return {
        "flatcli": __version__,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "scipy": scipy.__version__,
        "python": platform.python_version(),
    }


class DataCache:
    """Loads each configured split once per call."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self._cache: dict[str, Any] = {}

    def get(self, split: str, path: Path | None = None):
        key = split if path is None else f"{split}:{path}"
        if key not in self._cache:
            if path is not None:
                from .config import DataSource

                src = DataSource(source="tensors", path=str(path))
            else:
                src = getattr(self.cfg.data, split)
            self._cache[key] = (
                None if src is None else load_split(src, split, self.cfg.base_dir, self.cfg.data.normalize)
            )
        return self._cache[key]


def _read_hparams_from_keys(extras: dict, keys: list[str] | None) -> dict[str, Any]:
    if not keys:
        return {}
    pool = dict(extras)
    for nest in ("hparams", "hyperparameters", "config", "args"):
        if isinstance(extras.get(nest), dict):
            pool.update(extras[nest])
    return {k: pool[k] for k in keys if k in pool and isinstance(pool[k], (int, float, str, bool))}


def measure_job(cfg: Config, job: Job, specs: list[MeasureSpec], data: DataCache, device, debug=False) -> Row:
    """Load one checkpoint and measure it. Config errors for this checkpoint become an error row
    whose message starts with 'config:' (exit code 2), so other checkpoints still complete."""
    labels = [s.label for s in specs]
    try:
        model, extras = load_model(cfg, job.path)
        hp = dict(job.hparams)
        hp.update(_read_hparams_from_keys(extras, cfg.hparams.from_keys))
        init_state = None
        if job.init_checkpoint is not None:
            init_state = extract_state_dict(read_checkpoint(job.init_checkpoint, cfg.runtime.allow_unsafe_pickle), job.init_checkpoint)
            load_into(copy.deepcopy(model), init_state, job.init_checkpoint)  # validates shapes
        md = cfg.measure_data
        return measure_model(
            model,
            data.get("train", job.train_data),
            specs,
            test=data.get("test"),
            loss=cfg.loss,
            split=md.split,
            num_samples=md.num_samples,
            batch_size=md.batch_size,
            data_seed=md.seed,
            seed=cfg.runtime.seed,
            device=device,
            precision=cfg.runtime.precision,
            init_state=init_state,
            hvp_mode=cfg.runtime.hvp_mode,
            block_size=cfg.runtime.block_size,
            checkpoint=job.checkpoint,
            hparams=hp,
            debug=debug,
        )
    except ConfigError as e:
        return Row(checkpoint=job.checkpoint, status="error", error=f"config: {e}", labels=labels, hparams=dict(job.hparams))
    except Exception as e:
        if debug:
            traceback.print_exc()
        return Row(checkpoint=job.checkpoint, status="error", error=f"{type(e).__name__}: {e}", labels=labels, hparams=dict(job.hparams))


def load(config: Config | str | Path | dict | None, overrides: dict[str, Any] | None = None) -> Config:
    """A `Config` from a path, a mapping or a Config; ``overrides`` ({"runtime.seed": 3, ...},
    None values ignored) win over everything, as CLI flags do."""
    if isinstance(config, Config):
        from .config import _set_path

        for k, v in (overrides or {}).items():
            if v is not None:
                _set_path(config, k, v, "cli")
        return config
    if isinstance(config, dict):
        return from_dict(config, overrides=overrides)
    return load_config(config, overrides)



def _plan(cfg: Config, checkpoints, measures) -> tuple[list[Job], list[MeasureSpec]]:
    """Validate what every pipeline needs; resolve the jobs and the measures to run."""
    if not cfg.model.target:
        raise ConfigError("config key 'model.target' is required")
    if cfg.data.train is None:
        raise ConfigError("config key 'data.train' is required")
    jobs = resolve_jobs(cfg, list(checkpoints) if checkpoints else None)
    if not jobs:
        raise ConfigError("no checkpoints: list them under 'checkpoints' or pass paths on the command line")
    specs = select_measures(cfg, measures, has_init=any(j.init_checkpoint is not None for j in jobs))
    return jobs, specs

def select_measures(cfg: Config, names: Sequence[str] | str | None, has_init: bool | None = None) -> list[MeasureSpec]:
    """The config's measures, or those named (``-m``): a configured label or measure name keeps
    its configured options; another registered name runs with defaults; 'all' runs every measure."""
    specs = cfg.measure_specs()
    if names is None:
        if not specs:
            raise ConfigError("no measures configured: add a 'measures' list to the config or pass -m NAME,...")
        return specs
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    if list(names) == ["all"]:
        from .measures import list_measures

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


def measure(
    config: Config | str | Path | dict,
    checkpoints: Sequence[str] | None = None,
    *,
    measures: Sequence[str] | str | None = None,
    device: str | None = None,
    seed: int | None = None,
    outdir: str | Path | None = None,
    allow_unsafe_pickle: bool | None = None,
    on_row: Callable[[int, int, Row], None] | None = None,
    on_start: Callable[[int, int, Job], None] | None = None,
    debug: bool = False,
    plots: bool = False,
) -> MeasureReport:
    """Measure every checkpoint of a config; write results when ``outdir`` is given.

    With ``plots`` (needs matplotlib and an output directory), every measure that
    draws artifacts (e.g. a spectral-density plot) writes them as
    ``OUTDIR/plots/<NNN>_<checkpoint stem>_<label>.png`` (NNN the checkpoint's
    position); the paths are in ``report.meta["plots"]``.

    Returns a `MeasureReport`; its ``exit_code`` is 0 when every row is ok, 2 when a
    checkpoint failed on bad input (file, state dict), 1 when a measurement failed.
    """
    if plots:
        from .landscape.plots import PLOT_HINT, have_matplotlib

        if not have_matplotlib():
            raise ConfigError(f"--plots: {PLOT_HINT}")
    overrides = {"runtime.device": device, "runtime.seed": seed, "output.dir": str(outdir) if outdir else None}
    if allow_unsafe_pickle:
        overrides["runtime.allow_unsafe_pickle"] = True
    cfg = load(config, overrides)
    write = outdir is not None or cfg.provenance.get("output.dir", "default") != "default"
    if plots and not write:
        raise ConfigError("--plots needs an output directory (-o OUTDIR)")
    jobs, specs = _plan(cfg, checkpoints, measures)
    dev = resolve_device(cfg.runtime.device)
    data = DataCache(cfg)
    data.get("train")
    data.get("test")
    t0 = time.perf_counter()
    rows: list[Row] = []
    for i, job in enumerate(jobs):
        if on_start:
            on_start(i, len(jobs), job)
        row = measure_job(cfg, job, specs, data, dev, debug)
        rows.append(row)
        if on_row:
            on_row(i, len(jobs), row)
    meta = {
        "config": cfg.to_dict(),
        "config_hash": cfg.hash(),
        "versions": versions(),
        "device": str(dev) + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""),
        "measure_data": cfg.to_dict()["measure_data"],
    }
    report = MeasureReport(rows=rows, config=cfg, meta=meta, seconds=time.perf_counter() - t0)
    if write:
        out = Path(cfg.output.dir if outdir is None else outdir)
        write_results(out, rows, meta)
        if plots:
            report.meta["plots"] = [str(q) for q in _artifacts(rows, specs, out / "plots")]
    return report


def _artifacts(rows: list[Row], specs, folder: Path) -> list[Path]:
    """Every measure's artifacts (its registry hook), ``NNN_<checkpoint stem>_<label>.*`` in ``folder``."""
    from .measures import get_measure

    hooks = [(s.label, get_measure(s.name).artifacts) for s in specs]
    paths: list[Path] = []
    for i, row in enumerate(rows):
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(row.checkpoint).stem) or "model"
        for lab, hook in hooks:
            res = row.results.get(lab)
            if hook is None or res is None or res.status == "error":
                continue
            paths += hook(res, folder / f"{i:03d}_{stem}_{lab}", f"{Path(row.checkpoint).name}: {lab}")
    return paths


def load_model(cfg: Config, path: str | Path) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Build the config's model and load one checkpoint into it (``model_kwargs`` stored in the
    checkpoint override ``model.kwargs``). Returns ``(model, extras)``; the model is on the CPU."""
    if not cfg.model.target:
        raise ConfigError("config key 'model.target' is required")
    obj = read_checkpoint(path, cfg.runtime.allow_unsafe_pickle)
    extras = checkpoint_extras(obj)
    kwargs = dict(cfg.model.kwargs)
    if isinstance(extras.get("model_kwargs"), dict):
        kwargs.update(extras["model_kwargs"])
    model = build_model(cfg.model.target, kwargs, cfg.base_dir)
    load_into(model, extract_state_dict(obj, path), path)
    return model, extras


def _manifest_train_data(cfg: Config, path: Path) -> Path | None:
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


def landscape(
    config: Config | str | Path | dict,
    checkpoint: str | Path,
    *,
    to: str | Path | None = None,
    dims: int = 1,
    steps: int = 25,
    span: str | Sequence[float] | None = None,
    seed: int | None = None,
    device: str | None = None,
    bias_bn: str = "zero",
    points_per_pass: int | None = None,
    outdir: str | Path | None = None,
    plots: bool = True,
    allow_unsafe_pickle: bool | None = None,
    on_progress: Callable[[int, int], None] | None = None,
):
    """Loss-landscape view of one checkpoint: a 1D/2D filter-normalized slice, or with ``to`` the
    linear interpolation to a second checkpoint. See `flatcli.landscape` for the definitions.

    Train and (when ``data.test`` is configured) test loss and accuracy are evaluated at every grid
    point on ``measure_data.num_samples`` samples of each split (seed ``measure_data.seed``), in eval
    mode, at ``runtime.precision``. When the config's manifest lists ``checkpoint`` with a
    ``train_data`` column, that file is its training set. With ``outdir``, writes landscape.csv,
    landscape.json and PNG plots there. Returns a `flatcli.landscape.LandscapeResult`.
    """
    from .landscape import interpolation_landscape, slice_landscape, write_files

    overrides: dict[str, Any] = {"runtime.device": device, "runtime.seed": seed}
    if allow_unsafe_pickle:
        overrides["runtime.allow_unsafe_pickle"] = True
    cfg = load(config, overrides)
    if cfg.data.train is None:
        raise ConfigError("config key 'data.train' is required")
    if to is not None and dims != 1:
        raise ConfigError("--to interpolates along one line; --dims 2 does not apply to it")
    dev = resolve_device(cfg.runtime.device)
    dtype = DTYPES[cfg.runtime.precision]
    ckpt = Path(checkpoint).expanduser()
    model, _ = load_model(cfg, ckpt)
    model_b = load_model(cfg, Path(to).expanduser())[0] if to is not None else None
    data = DataCache(cfg)
    md = cfg.measure_data
    train = data.get("train", _manifest_train_data(cfg, ckpt))
    test = data.get("test")
    first = next(iter(model.parameters()), None)
    cpu_dtype = first.dtype if first is not None else torch.float32
    for name, d in (("train", train), ("test", test)):
        if d is not None:
            _check_labels(model, d[0], d[1], cfg.loss, f"data.{name}", torch.device("cpu"), cpu_dtype)
    train = subset(*train, md.num_samples, md.seed)
    test = subset(*test, md.num_samples, md.seed) if test is not None else None
    common = dict(
        loss=cfg.loss, batch_size=md.batch_size, device=dev, dtype=dtype,
        points_per_pass=points_per_pass, on_progress=on_progress,
    )
    with _precision(cfg.runtime.precision):
        if model_b is not None:
            res = interpolation_landscape(model, model_b, train, test, steps=steps, span=span, **common)
        else:
            res = slice_landscape(
                model, train, test, dims=dims, steps=steps, span=span, seed=cfg.runtime.seed, bias_bn=bias_bn, **common
            )
    res.meta.update(
        {
            "checkpoint": str(checkpoint),
            "to": None if to is None else str(to),
            "loss": cfg.loss,
            "measure_data": cfg.to_dict()["measure_data"],
            "precision": cfg.runtime.precision,
            "config_hash": cfg.hash(),
            "versions": versions(),
            "device": str(dev) + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""),
        }
    )
    if outdir is not None:
        write_files(res, outdir, plots=plots)
    return res


if TYPE_CHECKING:
    from .landscape.connect import ConnectResult
    from .landscape.trajectory import TrajectoryResult


def _view_setup(config, device, seed, allow_unsafe_pickle):
    """Config, device and dtype for the trajectory-PCA and mode-connectivity views."""
    overrides: dict[str, Any] = {"runtime.device": device, "runtime.seed": seed}
    if allow_unsafe_pickle:
        overrides["runtime.allow_unsafe_pickle"] = True
    cfg = load(config, overrides)
    if cfg.data.train is None:
        raise ConfigError("config key 'data.train' is required")
    return cfg, resolve_device(cfg.runtime.device), DTYPES[cfg.runtime.precision]


def _view_data(cfg: Config, model: torch.nn.Module, train_path: Path | None):
    """(full train split, train measurement set, test measurement set or None), labels checked."""
    data = DataCache(cfg)
    md = cfg.measure_data
    train, test = data.get("train", train_path), data.get("test")
    first = next(iter(model.parameters()), None)
    cpu_dtype = first.dtype if first is not None else torch.float32
    for name, d in (("train", train), ("test", test)):
        if d is not None:
            _check_labels(model, d[0], d[1], cfg.loss, f"data.{name}", torch.device("cpu"), cpu_dtype)
    sub = subset(*train, md.num_samples, md.seed)
    return train, sub, (subset(*test, md.num_samples, md.seed) if test is not None else None)


def _view_meta(cfg: Config, dev: torch.device) -> dict[str, Any]:
    return {
        "loss": cfg.loss,
        "measure_data": cfg.to_dict()["measure_data"],
        "precision": cfg.runtime.precision,
        "config_hash": cfg.hash(),
        "versions": versions(),
        "device": str(dev) + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""),
    }


def landscape_pca(
    config: Config | str | Path | dict,
    checkpoints: str | Path | Sequence[str | Path],
    *,
    steps: int = 25,
    span: str | Sequence[float] | None = None,
    solver: str = "auto",
    sort: bool = True,
    seed: int | None = None,
    device: str | None = None,
    points_per_pass: int | None = None,
    outdir: str | Path | None = None,
    plots: bool = True,
    allow_unsafe_pickle: bool | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> TrajectoryResult:
    """Trajectory PCA (Li et al. 2018, Sec. 7): the top two PCA directions of {θ_t − θ_T} over a
    training run's checkpoints, the path projected on them and the loss over their plane around
    θ_T (the last checkpoint). See `flatcli.landscape.trajectory` for the definitions.

    ``checkpoints``: files and/or globs, sorted naturally (epoch_2 before epoch_10) unless
    ``sort=False``; at least 3. The model, data and measurement sets come from ``config`` as for
    `landscape` (a manifest's ``train_data`` for the last checkpoint is its training set).
    ``seed`` (default ``runtime.seed``) seeds the randomized solver. With ``outdir``, writes
    pca_grid.csv, pca_path.csv, pca.json and pca.png. Returns a
    `flatcli.landscape.trajectory.TrajectoryResult`.
    """
    from .landscape.trajectory import (
        LazyTrajectory,
        trajectory_landscape,
        trajectory_paths,
        write_trajectory_files,
    )

    paths = trajectory_paths(checkpoints, sort=sort)
    cfg, dev, dtype = _view_setup(config, device, seed, allow_unsafe_pickle)
    model, _ = load_model(cfg, paths[-1])
    _, train, test = _view_data(cfg, model, _manifest_train_data(cfg, paths[-1]))
    traj = LazyTrajectory(paths[:-1], lambda p: load_model(cfg, p)[0], last=model)
    md = cfg.measure_data
    with _precision(cfg.runtime.precision):
        res = trajectory_landscape(
            traj, train, test, labels=[str(p) for p in paths], steps=steps, span=span,
            solver=solver, seed=cfg.runtime.seed, loss=cfg.loss, batch_size=md.batch_size,
            device=dev, dtype=dtype, points_per_pass=points_per_pass, on_progress=on_progress,
        )
    res.meta.update(_view_meta(cfg, dev))
    if outdir is not None:
        write_trajectory_files(res, outdir, plots=plots)
    return res


def landscape_connect(
    config: Config | str | Path | dict,
    a: str | Path,
    b: str | Path,
    *,
    steps: int = 25,
    bend_steps: int = 1000,
    bend_lr: float | None = None,
    bend_optimizer: str = "adam",
    bend_batch_size: int = 128,
    seed: int | None = None,
    device: str | None = None,
    points_per_pass: int | None = None,
    outdir: str | Path | None = None,
    plots: bool = True,
    allow_unsafe_pickle: bool | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> ConnectResult:
    """Mode connectivity (Garipov et al. 2018; Draxler et al. 2018): train the bend of a quadratic
    Bezier curve between checkpoints ``a`` and ``b`` on the training split, then evaluate the loss
    and accuracy along the curve and along the straight line, each with its barrier height. See
    `flatcli.landscape.connect` for the definitions.

    The bend trains on the whole training split (``data.train``, or a manifest's ``train_data`` for
    ``a``) with ``bend_steps`` steps of ``bend_optimizer`` (seed ``seed``, default
    ``runtime.seed``); both paths are evaluated on the measurement sets, BatchNorm statistics
    recomputed at every t on the train measurement set. With ``outdir``, writes connect.csv,
    connect_fit.csv, bend.pt, connect.json and connect.png. Returns a
    `flatcli.landscape.connect.ConnectResult`.
    """
    from .landscape.connect import connect_landscape, write_connect_files
    from .landscape.trajectory import check_state

    cfg, dev, dtype = _view_setup(config, device, seed, allow_unsafe_pickle)
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    model_a, extras = load_model(cfg, pa)
    model_b, _ = load_model(cfg, pb)
    check_state(model_b.state_dict(), model_a.state_dict(), str(b), str(a), "--connect")
    da, db = _manifest_train_data(cfg, pa), _manifest_train_data(cfg, pb)
    if da is not None and db is not None and da.resolve() != db.resolve():
        raise ConfigError(
            f"--connect: the manifest gives the two checkpoints different training sets ({da} vs {db}); "
            "the bend is trained on one training set"
        )
    fit, train, test = _view_data(cfg, model_a, da if da is not None else db)
    md = cfg.measure_data
    with _precision(cfg.runtime.precision):
        res = connect_landscape(
            model_a, model_b, train, test, fit=fit, steps=steps, bend_steps=bend_steps,
            bend_lr=bend_lr, bend_optimizer=bend_optimizer, bend_batch_size=bend_batch_size,
            seed=cfg.runtime.seed, loss=cfg.loss, batch_size=md.batch_size, device=dev, dtype=dtype,
            points_per_pass=points_per_pass, labels=(str(a), str(b)), on_progress=on_progress,
        )
    res.meta.update(_view_meta(cfg, dev))
    if outdir is not None:
        mk = extras.get("model_kwargs")
        write_connect_files(res, outdir, plots=plots, checkpoint_extras={"model_kwargs": mk} if isinstance(mk, dict) else None)
    return res


# ------------------------------------------------------------------ sweeps, collect, correlate
def sweep(
    config: Config | str | Path | dict,
    outdir: str | Path | None = None,
    *,
    checkpoints: Sequence[str] | None = None,
    measures: Sequence[str] | str | None = None,
    device: str | None = None,
    seed: int | None = None,
    gpus: str | None = None,
    workers: int | None = None,
    shard: str | tuple[int, int] | None = None,
    executor: str = "local",
    resume: bool = True,
    retry_failed: bool = False,
    dry_run: bool = False,
    lock_timeout: float = 600.0,
    tasks: int | None = None,
    slurm: dict[str, Any] | None = None,
    cluster: str = "slurm",
    wait: bool = False,
    allow_unsafe_pickle: bool | None = None,
    log: Callable[[str], None] | None = None,
    on_unit: Callable[[dict[str, Any]], None] | None = None,
    debug: bool = False,
):
    """Measure every checkpoint of a config as resumable units of work in ``outdir``.

    One unit = one checkpoint × one measure, keyed by (checkpoint fingerprint, resolved
    measure config hash, flatcli version); each finished unit is one atomically written
    file, so rerunning skips finished units (``resume=False`` recomputes, ``retry_failed``
    reruns error units). ``gpus`` ("all" or "0,1") runs one worker per GPU, ``workers`` N CPU
    workers; ``shard=(i, n)`` or "i/n" runs one deterministic part of the units;
    ``executor="slurm"`` submits a job array through submitit (``cluster="local"`` or
    "debug" run submitit's local backends). Returns a `flatcli.sweep.SweepReport`; merge
    the rows with `collect`.
    """
    from .sweep.runner import _default_log, run_sweep
    from .sweep.store import parse_shard

    overrides = {"runtime.device": device, "runtime.seed": seed}
    if allow_unsafe_pickle:
        overrides["runtime.allow_unsafe_pickle"] = True
    cfg = load(config, overrides)
    jobs, specs = _plan(cfg, checkpoints, measures)
    if outdir is None:
        outdir = cfg.resolve_path(cfg.output.dir) if cfg.provenance.get("output.dir") == "yaml" else Path(cfg.output.dir)
    sh = parse_shard(shard) if isinstance(shard, str) else shard
    return run_sweep(
        cfg, specs, jobs, outdir, gpus=gpus, workers=workers, shard=sh, executor=executor, resume=resume,
        retry_failed=retry_failed, dry_run=dry_run, lock_timeout=lock_timeout, tasks=tasks, slurm=slurm,
        cluster=cluster, wait=wait, log=_default_log if log is None else log, on_unit=on_unit, debug=debug,
    )


def collect(outdir: str | Path, output: str | Path | None = None):
    """Merge a sweep directory's unit files into ``results.csv`` and ``results.json`` (the
    columns of `measure`'s results.csv). Returns a `flatcli.sweep.CollectReport`."""
    from .sweep.runner import collect as _collect

    return _collect(outdir, output)


def correlate(
    results: str | Path,
    *,
    target: str = "gen_gap",
    by: Sequence[str] | str | None = None,
    outdir: str | Path | None = None,
    plots: bool = False,
    sort: str | None = None,
    measures: Sequence[str] | str | None = None,
    color_by: str | None = None,
):
    """Correlate each measure of a results.csv with ``target``: Pearson, Spearman, Kendall τ-b,
    Jiang's τ, granulated Kendall Ψ with every ψ_i over the hyperparameter axes ``by``
    (default: every hp_* column that forms a grid axis) and the PGDL conditional mutual
    information. Writes ``correlations.csv`` (and plots) into ``outdir`` when given.
    Returns a `flatcli.analysis.CorrelationReport`, best measure first."""
    from .analysis.correlation import correlate_table, load_results
    from .analysis.report import write_csv

    table = load_results(results)
    if isinstance(measures, str):
        measures = [m.strip() for m in measures.split(",") if m.strip()]
    report = correlate_table(table, target=target, by=by, sort=sort, measures=list(measures) if measures else None)
    if outdir is not None:
        out = Path(outdir)
        report.csv_path = write_csv(report, out / "correlations.csv")
        if plots:
            from .analysis.plots import plot_report

            report.plots = plot_report(report, table, out / "plots", color_by=color_by)
    elif plots:
        raise ConfigError("--plots needs an output directory (-o OUTDIR)")
    return report
