"""The landscape views (`landscape`: slices and interpolation, `landscape_pca`, `landscape_connect`)
and `check_invariance`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..config import Config, overrides
from ..errors import ConfigError
from ..loading.data import subset
from ..pipeline import (
    DataCache,
    check_finite_model,
    check_targets,
    load_init_state,
    load_model,
    manifest_train_data,
    versions,
)
from ..results import ensure_writable_dir
from ..settings import Settings
from ._common import _one_job, load, select_measures, use_threads


def landscape(
    config: Config | str | Path | dict,
    checkpoint: str | Path,
    *,
    to: str | Path | None = None,
    dims: int = 1,
    steps: int = 25,
    span: str | Sequence[float] | None = None,
    seed: int | None = None,
    device: str | None = None, precision: str | None = None,
    bias_bn: str = "zero",
    points_per_pass: int | None = None,
    outdir: str | Path | None = None,
    plots: bool = True,
    allow_unsafe_pickle: bool | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    threads: int | str | None = None,
):
    """Loss-landscape view of one checkpoint: a 1D/2D filter-normalized slice, or with ``to`` the
    linear interpolation to a second checkpoint. See `flatcli.landscape` for the definitions.

    Train and (when ``data.test`` is configured) test loss and accuracy are evaluated at every grid
    point on ``measure_data.num_samples`` samples of each split (seed ``measure_data.seed``), in eval
    mode, at ``runtime.precision``. When the config's manifest lists ``checkpoint`` with a
    ``train_data`` column, that file is its training set. With ``outdir``, writes landscape.csv,
    landscape.json and PNG plots there. Returns a `flatcli.landscape.LandscapeResult`.
    """
    from ..landscape import interpolation_landscape, slice_landscape, write_files

    cfg = load(config, overrides(device=device, seed=seed, allow_unsafe_pickle=allow_unsafe_pickle, threads=threads, precision=precision))
    if cfg.data.train is None:
        raise ConfigError("config key 'data.train' is required")
    if to is not None and dims != 1:
        raise ConfigError("`to` interpolates along one line; `dims` 2 does not apply to it")
    if outdir is not None:
        ensure_writable_dir(outdir, "output directory")
    st = Settings.from_config(cfg)
    ckpt = Path(checkpoint).expanduser()
    model, _ = load_model(cfg, ckpt)
    model_b = load_model(cfg, Path(to).expanduser())[0] if to is not None else None
    threads_used = use_threads(cfg)
    train, test = _landscape_data(cfg, ckpt, model, model_b, st, to)
    common = dict(settings=st, points_per_pass=points_per_pass, on_progress=on_progress)
    with st.precision_context():
        if model_b is not None:
            res = interpolation_landscape(model, model_b, train, test, steps=steps, span=span, **common)
        else:
            res = slice_landscape(model, train, test, dims=dims, steps=steps, span=span, bias_bn=bias_bn, **common)
    res.meta.update(checkpoint=str(checkpoint), to=None if to is None else str(to), loss=cfg.loss,
                    measure_data=cfg.to_dict()["measure_data"], precision=cfg.runtime.precision,
                    config_hash=cfg.hash(), versions=versions(), device=st.describe_device(), threads=threads_used)
    if outdir is not None:
        write_files(res, outdir, plots=plots)
    return res


def _landscape_data(cfg: Config, ckpt: Path, model, model_b, st: Settings, to):
    """The train and test sets of a landscape view (the manifest's train_data for ``ckpt``), checked
    (labels fit the model; the loss at both checkpoints finite) and subsampled as ``measure_data``."""
    data = DataCache(cfg)
    train = data.get("train", manifest_train_data(cfg, ckpt))
    test = data.get("test")
    _check_targets(cfg, model, train, test)
    check_finite_model(model, train, st)
    if model_b is not None:
        check_finite_model(model_b, train, st, f"the checkpoint {to}")
    train = subset(train, st.num_samples, st.data_seed)
    test = subset(test, st.num_samples, st.data_seed) if test is not None else None
    return train, test


def _check_targets(cfg: Config, model, train, test) -> None:
    """Labels fit the model (one forward pass of two rows per split, on the CPU)."""
    first = next(iter(model.parameters()), None)
    cpu_dtype = first.dtype if first is not None else torch.float32
    for name, d in (("train", train), ("test", test)):
        if d is not None:
            check_targets(model, d, cfg.loss, f"data.{name}", torch.device("cpu"), cpu_dtype)


if TYPE_CHECKING:
    from ..landscape.connect import ConnectResult
    from ..landscape.trajectory import TrajectoryResult


def _view_setup(config, device, seed, allow_unsafe_pickle, outdir=None, threads=None,
                precision=None) -> tuple[Config, Settings]:
    """Config and settings for the trajectory-PCA and mode-connectivity views (torch's threads
    sized from ``runtime.threads``, see `use_threads`)."""
    cfg = load(config, overrides(device=device, seed=seed, allow_unsafe_pickle=allow_unsafe_pickle, threads=threads, precision=precision))
    if cfg.data.train is None:
        raise ConfigError("config key 'data.train' is required")
    if outdir is not None:
        ensure_writable_dir(outdir, "output directory")
    use_threads(cfg)
    return cfg, Settings.from_config(cfg)


def _view_data(cfg: Config, model: torch.nn.Module, train_path: Path | None):
    """(full train split, train measurement set, test measurement set or None), labels checked."""
    data = DataCache(cfg)
    md = cfg.measure_data
    train, test = data.get("train", train_path), data.get("test")
    _check_targets(cfg, model, train, test)
    sub = subset(train, md.num_samples, md.seed)
    return train, sub, (subset(test, md.num_samples, md.seed) if test is not None else None)


def _view_meta(cfg: Config, dev: torch.device) -> dict[str, Any]:
    from ..threads import plan_threads

    return {
        "threads": str(plan_threads(cfg.runtime.threads)),
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
    device: str | None = None, precision: str | None = None,
    points_per_pass: int | None = None,
    outdir: str | Path | None = None,
    plots: bool = True,
    allow_unsafe_pickle: bool | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    threads: int | str | None = None,
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
    from ..landscape.output import write_trajectory_files
    from ..landscape.trajectory import (
        LazyTrajectory,
        trajectory_landscape,
        trajectory_paths,
    )

    paths = trajectory_paths(checkpoints, sort=sort)
    cfg, st = _view_setup(config, device, seed, allow_unsafe_pickle, outdir, threads, precision)
    model, _ = load_model(cfg, paths[-1])
    _, train, test = _view_data(cfg, model, manifest_train_data(cfg, paths[-1]))
    traj = LazyTrajectory(paths[:-1], lambda p: load_model(cfg, p)[0], last=model)
    with st.precision_context():
        res = trajectory_landscape(
            traj, train, test, labels=[str(p) for p in paths], steps=steps, span=span, solver=solver,
            settings=st, points_per_pass=points_per_pass, on_progress=on_progress,
        )
    res.meta.update(_view_meta(cfg, st.device))
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
    device: str | None = None, precision: str | None = None,
    points_per_pass: int | None = None,
    outdir: str | Path | None = None,
    plots: bool = True,
    allow_unsafe_pickle: bool | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    threads: int | str | None = None,
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
    from ..landscape import connect_landscape, write_connect_files
    from ..loading.checkpoints import check_state

    cfg, st = _view_setup(config, device, seed, allow_unsafe_pickle, outdir, threads, precision)
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    model_a, extras = load_model(cfg, pa)
    model_b, _ = load_model(cfg, pb)
    check_state(model_b.state_dict(), model_a.state_dict(), str(b), str(a), "landscape connect")
    da, db = manifest_train_data(cfg, pa), manifest_train_data(cfg, pb)
    if da is not None and db is not None and da.resolve() != db.resolve():
        raise ConfigError(
            f"`connect`: the manifest gives the two checkpoints different training sets ({da} vs {db}); "
            "the bend is trained on one training set"
        )
    fit, train, test = _view_data(cfg, model_a, da if da is not None else db)
    with st.precision_context():
        res = connect_landscape(
            model_a, model_b, train, test, fit=fit, steps=steps, bend_steps=bend_steps,
            bend_lr=bend_lr, bend_optimizer=bend_optimizer, bend_batch_size=bend_batch_size,
            settings=st, points_per_pass=points_per_pass, labels=(str(a), str(b)), on_progress=on_progress,
        )
    res.meta.update(_view_meta(cfg, st.device))
    if outdir is not None:
        mk = extras.get("model_kwargs")
        write_connect_files(res, outdir, plots=plots, checkpoint_extras={"model_kwargs": mk} if isinstance(mk, dict) else None)
    return res




def check_invariance(
    config: Any,
    checkpoint: str | Path | None = None,
    measures: Sequence[Any] | str | None = None,
    *,
    transform: str = "both",
    scale: float = 10.0,
    seed: int | None = None,
    tol: float = 1e-6,
    device: str | None = None, precision: str | None = None,
    data: tuple[torch.Tensor, torch.Tensor] | None = None,
    loss: str = "cross_entropy",
    progress: Callable[[str, str, dict], None] | None = None,
    threads: int | str | None = None,
):
    """The invariance check for one checkpoint of a config (path, dict or `Config`), or for a model.

    With a config: the model is built and loaded as ``flatcli measure`` does (``model_kwargs``
    stored in the checkpoint win; a manifest's ``train_data`` applies), the measurement set is
    ``measure_data``, and ``measures`` defaults to the configured measures plus every measure
    that claims invariance. With an ``nn.Module`` as ``config``: pass ``data=(x, y)``; see
    `flatcli.invariance.check_invariance_model`. With a config, ``threads`` (``runtime.threads``)
    sizes torch's threads (`use_threads`; the choice is ``report.threads``). Returns an
    `flatcli.invariance.InvarianceReport`.
    """
    from ..invariance import check_invariance_model, needs_init, prepare_specs

    if isinstance(config, torch.nn.Module):
        if data is None:
            raise ConfigError("check_invariance(model, ...) needs data=(x, y)")
        return check_invariance_model(config, data, measures, loss=loss, transform=transform, scale=scale,
                                      seed=seed or 0, tol=tol, device=device or "cpu", progress=progress)
    cfg = load(config, overrides(device=device, seed=seed, threads=threads, precision=precision))
    if cfg.data.train is None:
        raise ConfigError("config key 'data.train' is required")
    threads_used = use_threads(cfg)
    job = _one_job(cfg, checkpoint)
    if measures is None:
        try:
            chosen = select_measures(cfg, None)
        except ConfigError:
            chosen = []
        specs = prepare_specs(chosen, add_invariant=True)
    else:
        specs = prepare_specs(select_measures(cfg, measures), add_invariant=False)
    if job.init_checkpoint is None:
        specs = [s for s in specs if not needs_init(s)]
    model, _ = load_model(cfg, job.path)
    init_state = load_init_state(cfg, job)
    cache = DataCache(cfg)
    report = check_invariance_model(
        model, cache.get("train", job.train_data or manifest_train_data(cfg, job.path)), specs,
        test=cache.get("test"), settings=Settings.from_config(cfg), transform=transform, scale=scale, tol=tol,
        init_state=init_state, checkpoint=job.checkpoint, progress=progress,
    )
    report.threads = threads_used
    return report
