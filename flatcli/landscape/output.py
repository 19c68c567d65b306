"""Writing a landscape view's files: its tables, its JSON index and (with matplotlib) its plots.

The result types (`LandscapeResult`, `TrajectoryResult`, `ConnectResult`) know nothing of files
or plots; this module is the one place that joins them to `flatcli.landscape.plots` and
`flatcli.landscape.pathplots`, so no result module imports a plotting module.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..run.results import atomic_write
from .connect import ConnectResult
from .loss_grid import LandscapeResult
from .pathplots import plot_connect, plot_trajectory
from .pca import TrajectoryResult
from .plots import draw_if_available, plot_result


def write_files(res: LandscapeResult, outdir: str | Path, plots: bool = True) -> dict[str, Path]:
    """Write landscape.csv, landscape.json and (with matplotlib) the PNG plots; return the paths."""
    outdir = Path(outdir)
    files = {"csv": outdir / "landscape.csv", "json": outdir / "landscape.json"}
    atomic_write(files["csv"], res.to_csv())
    if plots:
        files.update(plot_result(res, outdir))
    return write_index(res, files)


def write_index(res, files: dict[str, Path]) -> dict[str, Path]:
    """Record ``files`` on ``res`` (any landscape view's result) and write its JSON,
    ``files["json"]``, with the list of every file written; return ``files``."""
    res.files = files
    atomic_write(
        files["json"],
        json.dumps({**res.to_json(), "files": {k: str(v) for k, v in files.items()}}, indent=2),
    )
    return files


def write_trajectory_files(
    res: TrajectoryResult, outdir: str | Path, plots: bool = True
) -> dict[str, Path]:
    """Write ``pca_grid.csv``, ``pca_path.csv``, ``pca.json`` and (with matplotlib) ``pca.png``."""
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    files = {
        "grid": outdir / "pca_grid.csv",
        "path": outdir / "pca_path.csv",
        "json": outdir / "pca.json",
    }
    atomic_write(files["grid"], res.grid_frame().to_csv(index=False))
    atomic_write(files["path"], res.path_frame().to_csv(index=False))
    if plots:
        files.update(draw_if_available(res, plot_trajectory, outdir / "pca.png"))
    return write_index(res, files)


def write_connect_files(
    res: ConnectResult,
    outdir: str | Path,
    plots: bool = True,
    checkpoint_extras: Mapping[str, Any] | None = None,
) -> dict[str, Path]:
    """Write ``connect.csv`` (both paths along t), ``connect_fit.csv`` (the bend training),
    ``bend.pt``, ``connect.json`` and (with matplotlib) ``connect.png``.

    ``bend.pt`` is a checkpoint like the endpoints' (``{"state_dict": …}``
    plus ``checkpoint_extras``, e.g. ``model_kwargs``, and a ``curve`` entry
    naming the endpoints): θ_c in place of the trainable parameters, the
    other tensors (frozen parameters, buffers) θ_a's. The bend is a control
    point, not a point on the curve; its buffers have no meaning of their own.
    """
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    files = {
        "csv": outdir / "connect.csv",
        "fit": outdir / "connect_fit.csv",
        "bend": outdir / "bend.pt",
        "json": outdir / "connect.json",
    }
    atomic_write(files["csv"], res.frame().to_csv(index=False))
    atomic_write(files["fit"], res.history_frame().to_csv(index=False))
    obj = {
        **dict(checkpoint_extras or {}),
        "state_dict": res.bend_state,
        "curve": {"kind": "quadratic_bezier", "endpoints": res.meta.get("checkpoints")},
    }
    tmp = files["bend"].with_suffix(".pt.tmp")
    torch.save(obj, tmp)
    tmp.replace(files["bend"])
    if plots:
        files.update(draw_if_available(res, plot_connect, outdir / "connect.png"))
    return write_index(res, files)
