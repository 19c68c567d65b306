"""The landscape views (`landscape`: slice, interpolate, pca and connect, chosen by ``view``)
and `check_invariance`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..config import Config
from ..errors import ConfigError
from ..invariance import InvarianceOptions, check_invariance_model, needs_init, prepare_specs
from ..landscape import (
    ConnectResult,
    ConnectView,
    InterpolateView,
    LazyTrajectory,
    PCAView,
    SliceView,
    TrajectoryResult,
    connect_landscape,
    interpolation_landscape,
    slice_landscape,
    trajectory_landscape,
    trajectory_paths,
    write_connect_files,
    write_files,
    write_trajectory_files,
)
from ..loading.checkpoints import check_state
from ..loading.data import subset
from ..loading.load import DataCache, load_init_state, load_model, manifest_train_data
from ..run.measuring import check_finite_model, check_targets, versions
from ..run.preflight import check_settings
from ..run.results import ensure_writable_dir
from ..run.settings import RunOptions, Settings
from ..threads import thread_choice
from ._setup import _one_job, load_run, select_measures, takes_run, use_threads

VIEWS: dict[str, type] = {
    "slice": SliceView,
    "interpolate": InterpolateView,
    "pca": PCAView,
    "connect": ConnectView,
}
_ARITY = {
    "slice": (1, "one checkpoint"),
    "interpolate": (2, "two checkpoints, A and B"),
    "connect": (2, "exactly two checkpoints, A and B"),
}


def _view_spec(view: str, options: dict[str, Any]):
    """The view's options object (its defaults filled in); a `ConfigError` naming the first
    option that does not belong to the view, or the view when it is unknown."""
    if view not in VIEWS:
        raise ConfigError(f"`view` must be one of {', '.join(VIEWS)}. Got {view!r} instead.")
    cls = VIEWS[view]
    allowed = [f.name for f in dataclasses.fields(cls)]
    bad = [k for k in options if k not in allowed]
    if bad:
        raise ConfigError(
            f"`{bad[0]}` does not apply to the {view} view (its options: {', '.join(allowed)})"
        )
    return cls(**options)


def _view_checkpoints(view: str, checkpoints) -> list:
    """The checkpoints as a list, their number checked for a view that takes a fixed number."""
    given = [checkpoints] if isinstance(checkpoints, (str, Path)) else list(checkpoints)
    if view in _ARITY and len(given) != _ARITY[view][0]:
        raise ConfigError(f"`{view}` takes {_ARITY[view][1]}. Got {len(given)} instead.")
    return given


@takes_run
def landscape(
    config: Config | str | Path | dict,
    checkpoints: str | Path | Sequence[str | Path],
    view: str = "slice",
    *,
    run: RunOptions | None = None,
    outdir: str | Path | None = None,
    plots: bool = True,
    **options: Any,
):
    """A loss-landscape view of checkpoints: one API for the four views, chosen by ``view``.

    Train and (when ``data.test`` is configured) test loss and accuracy are evaluated at every
    grid point on ``measure_data.num_samples`` samples of each split, in eval mode, at
    ``runtime.precision`` (connect: BatchNorm statistics recomputed at every t). A manifest's
    ``train_data`` column gives a checkpoint its own training set.

    Parameters
    ----------
    config : Config, str, Path or dict
        The config (see `measure`).
    checkpoints : str, Path or sequence of them
        ``"slice"``: one checkpoint; ``"interpolate"`` and ``"connect"``: two, ``[a, b]``;
        ``"pca"``: a training run's checkpoints (files and/or globs, at least 3).
    view : {"slice", "interpolate", "pca", "connect"}
        ``slice``: a 1D/2D filter-normalized slice (`SliceView`); ``interpolate``: the line
        between two checkpoints (`InterpolateView`); ``pca``: the top two PCA directions of
        {θ_t − θ_T}, the path projected on them and the loss over their plane (`PCAView`);
        ``connect``: a trained quadratic Bezier curve against the straight line, each with its
        barrier (`ConnectView`).
    run : RunOptions, optional
        Overrides of the config's ``runtime.*`` keys (device, precision, seed, threads,
        allow_unsafe_pickle, budget), what the CLI's shared flags build.
        ``run.seed`` seeds the slice's random directions, the PCA's randomized solver and the
        bend training.
    outdir : str or Path, optional
        Writes the view's files: landscape.csv, landscape.json and PNG plots (slice,
        interpolate); pca_grid.csv, pca_path.csv, pca.json, pca.png (pca); connect.csv,
        connect_fit.csv, bend.pt, connect.json, connect.png (connect).
    plots : bool
        Draw the PNG plots (needs matplotlib).
    **options
        The view's options (the view classes hold the defaults and check the values when built),
        among them every view's ``points_per_pass`` (grid points per vmapped forward pass) and
        ``on_progress`` (``on_progress(done, total)`` over the grid points); another view's option
        is a `flatcli.errors.ConfigError` naming it.

    Returns
    -------
    LandscapeResult, TrajectoryResult or ConnectResult
        `flatcli.landscape.LandscapeResult` (slice, interpolate),
        `flatcli.landscape.pca.TrajectoryResult` (pca) or
        `flatcli.landscape.connect.ConnectResult` (connect).
    """
    spec = _view_spec(view, options)
    given = _view_checkpoints(view, checkpoints)
    if view == "pca":
        given = trajectory_paths(given, sort=spec.sort)
    cfg, st, threads_used = _view_setup(config, run, outdir)
    if view == "pca":
        return _pca(cfg, st, spec, given, (outdir, plots))
    if view == "connect":
        return _connect(cfg, st, spec, given, (outdir, plots))
    return _slice(cfg, st, spec, given, (outdir, plots), threads_used)


def _view_setup(config, run: RunOptions | None, outdir) -> tuple[Config, Settings, str]:
    """Config, settings and the threads chosen (in words) of a landscape view: the config
    loaded with the run options, ``data.train`` required, the output directory writable, torch's
    threads sized from ``runtime.threads`` (`use_threads`)."""
    cfg = load_run(config, run)
    if cfg.data.train is None:
        raise ConfigError("config key 'data.train' is required")
    if outdir is not None:
        ensure_writable_dir(outdir, "output directory")
    threads_used = use_threads(cfg)
    return cfg, Settings.from_config(cfg), threads_used


def _slice(cfg: Config, st: Settings, spec, given: list, out: tuple, threads_used: str):
    """The slice and interpolation views (``spec`` a `SliceView` or an `InterpolateView`; ``given``
    [θ] or [θ_a, θ_b]); ``out`` = (outdir or None, plots)."""
    ckpt = Path(given[0]).expanduser()
    to = given[1] if len(given) > 1 else None
    model, _ = load_model(cfg, ckpt)
    model_b = load_model(cfg, Path(to).expanduser())[0] if to is not None else None
    _preflight(cfg, st, (model, ckpt), (model_b, to))
    train, test = _landscape_data(cfg, ckpt, model, model_b, st, to)
    with st.precision_context():
        if model_b is not None:
            res = interpolation_landscape(model, model_b, train, test, options=spec, settings=st)
        else:
            res = slice_landscape(model, train, test, options=spec, settings=st)
    res.meta.update(
        checkpoint=str(given[0]),
        to=None if to is None else str(to),
        loss=cfg.loss,
        measure_data=cfg.to_dict()["measure_data"],
        precision=cfg.runtime.precision,
        config_hash=cfg.hash(),
        versions=versions(),
        device=st.describe_device(),
        threads=threads_used,
    )
    if out[0] is not None:
        write_files(res, out[0], plots=out[1])
    return res


def _preflight(cfg: Config, st: Settings, *models) -> None:
    """The pre-flight of a view's checkpoints before any data is loaded (`flatcli.run.preflight`:
    the ``params`` selection and a text split's ``max_length``); ``models``: (model, path) pairs,
    a None model skipped."""
    for model, path in models:
        if model is not None:
            check_settings(cfg, model, path, st, manifest_train_data(cfg, Path(path)))


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


def _view_data(cfg: Config, model: torch.nn.Module, train_path: Path | None):
    """(full train split, train measurement set, test measurement set or None), labels checked."""
    data = DataCache(cfg)
    md = cfg.measure_data
    train, test = data.get("train", train_path), data.get("test")
    _check_targets(cfg, model, train, test)
    sub = subset(train, md.num_samples, md.seed)
    return train, sub, (subset(test, md.num_samples, md.seed) if test is not None else None)


def _view_meta(cfg: Config, dev: torch.device) -> dict[str, Any]:

    return {
        "threads": str(thread_choice(cfg.runtime.threads)),
        "loss": cfg.loss,
        "measure_data": cfg.to_dict()["measure_data"],
        "precision": cfg.runtime.precision,
        "config_hash": cfg.hash(),
        "versions": versions(),
        "device": str(dev)
        + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""),
    }


def _pca(
    cfg: Config, st: Settings, spec: PCAView, paths: list[Path], out: tuple
) -> TrajectoryResult:
    """The trajectory-PCA view of ``paths`` (in training order); ``out`` = (outdir or None, plots)."""
    model, _ = load_model(cfg, paths[-1])
    _preflight(cfg, st, (model, paths[-1]))
    _, train, test = _view_data(cfg, model, manifest_train_data(cfg, paths[-1]))
    traj = LazyTrajectory(paths[:-1], lambda p: load_model(cfg, p)[0], last=model)
    with st.precision_context():
        res = trajectory_landscape(
            traj,
            train,
            test,
            labels=[str(p) for p in paths],
            options=spec,
            settings=st,
        )
    res.meta.update(_view_meta(cfg, st.device))
    if out[0] is not None:
        write_trajectory_files(res, out[0], plots=out[1])
    return res


def _connect(
    cfg: Config, st: Settings, spec: ConnectView, given: list, out: tuple
) -> ConnectResult:
    """The mode-connectivity view between ``given`` = [a, b]; ``out`` = (outdir or None, plots)."""
    a, b = given
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    model_a, extras = load_model(cfg, pa)
    model_b, _ = load_model(cfg, pb)
    check_state(model_a.state_dict(), model_a.state_dict(), str(a), str(a), "landscape connect")
    check_state(model_b.state_dict(), model_a.state_dict(), str(b), str(a), "landscape connect")
    _preflight(cfg, st, (model_a, pa), (model_b, pb))
    da, db = manifest_train_data(cfg, pa), manifest_train_data(cfg, pb)
    if da is not None and db is not None and da.resolve() != db.resolve():
        raise ConfigError(
            f"`connect`: the manifest gives the two checkpoints different training sets ({da} vs {db}); "
            "the bend is trained on one training set"
        )
    fit, train, test = _view_data(cfg, model_a, da if da is not None else db)
    with st.precision_context():
        res = connect_landscape(
            model_a,
            model_b,
            train,
            test,
            fit=fit,
            options=spec,
            settings=st,
        )
    res.meta.update(_view_meta(cfg, st.device), checkpoints=[str(a), str(b)])
    if out[0] is not None:
        mk = extras.get("model_kwargs")
        write_connect_files(
            res,
            out[0],
            plots=out[1],
            checkpoint_extras={"model_kwargs": mk} if isinstance(mk, dict) else None,
        )
    return res


@takes_run
def check_invariance(
    config: Any,
    checkpoint: str | Path | None = None,
    measures: Sequence[Any] | str | None = None,
    *,
    options: InvarianceOptions | None = None,
    run: RunOptions | None = None,
    data: tuple[torch.Tensor, torch.Tensor] | None = None,
    loss: str = "cross_entropy",
):
    """Rescale a network without changing its function and recompute the measures.

    Parameters
    ----------
    config : Config, str, Path, dict or torch.nn.Module
        A config (the model is built and loaded as ``flatcli measure`` does; the measurement set
        is ``measure_data``), or a model (then pass ``data``; see
        `flatcli.invariance.check_invariance_model`).
    checkpoint : str or Path, optional
        The checkpoint, with a config (default: the config's only checkpoint).
    measures : str or sequence, optional
        Default: the configured measures plus every measure that claims invariance.
    options : InvarianceOptions, optional
        `flatcli.invariance.InvarianceOptions`: ``transform`` ("both", "node" or "layer"),
        ``scale`` (the factors α range over [1/scale, scale]), ``tol`` (the relative change below
        which an invariance claim holds) and ``progress(stage, label, info)`` while the measures
        run; default ``InvarianceOptions()``.
    run : RunOptions, optional
        Overrides of the config's ``runtime.*`` keys (device, precision, seed, threads,
        allow_unsafe_pickle, budget), what the CLI's shared flags build.
        ``run.seed`` seeds the rescaling and every stochastic measure (equal for both runs);
        with a model only ``run.seed`` (default 0) and ``run.device`` (default ``"cpu"``) apply.
    data : tuple of torch.Tensor, optional
        ``(x, y)`` when ``config`` is a model.
    loss : str
        The loss when ``config`` is a model.

    Returns
    -------
    flatcli.invariance.InvarianceReport
        Each measure's value before and after, its relative change and whether its claim held.
    """
    if isinstance(config, torch.nn.Module):
        if data is None:
            raise ConfigError("check_invariance(model, ...) needs data=(x, y)")
        opts = RunOptions.of(run)
        return check_invariance_model(
            config,
            data,
            measures,
            options=options,
            loss=loss,
            seed=opts.seed or 0,
            device=opts.device or "cpu",
        )
    cfg = load_run(config, run)
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
    check_settings(cfg, model, job.path, Settings.from_config(cfg), job.train_data)
    init_state = load_init_state(cfg, job)
    cache = DataCache(cfg)
    report = check_invariance_model(
        model,
        cache.get("train", job.train_data or manifest_train_data(cfg, job.path)),
        specs,
        test=cache.get("test"),
        settings=Settings.from_config(cfg),
        options=options,
        init_state=init_state,
        checkpoint=job.checkpoint,
    )
    report.threads = threads_used
    return report
