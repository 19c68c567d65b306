r"""Trajectory PCA: the loss over the plane of a training trajectory's two main directions.

Li, Xu, Taylor, Studer, Goldstein, "Visualizing the Loss Landscape of Neural
Nets", NeurIPS 2018, Sec. 7 ("Visualizing optimization paths"). Random
directions are nearly orthogonal to an optimization path in high dimension, so
the path is drawn in the plane of its own principal directions. With
checkpoints θ_1, …, θ_T of one training run (θ_T the last) and the T × P matrix

.. math:: M = [\theta_1 - \theta_T; \;\dots;\; \theta_T - \theta_T]

(one row per checkpoint, P trainable parameters; the last row is zero, as in
Li et al.'s code, which lists the final model among the path's files), the
directions v_1, v_2 are the top two principal components of M: the leading
right singular vectors of the column-centred matrix M − 1μᵀ, μ the row mean,
exactly what scikit-learn's ``PCA(n_components=2)`` returns (the sign of each
component is fixed so that its largest-magnitude entry is positive). Centring
makes them the principal directions of the trajectory points themselves. Each
direction explains the variance

.. math:: \lambda_k = \frac{s_k^2}{T - 1}, \qquad
          r_k = \lambda_k \Big/ \frac{\lVert M - 1\mu^\top \rVert_F^2}{T - 1},

s_k the k-th singular value (``explained_variance`` and
``explained_variance_ratio``, as in scikit-learn). Three checkpoints are the
least that define two directions. The directions are the raw, unit-norm
principal components over every trainable parameter (no filter normalization:
they come from the data, not from a random draw).

Checkpoint t projects to the plane at

.. math:: (\alpha_t, \beta_t) = \big((\theta_t - \theta_T)\cdot v_1,\;
          (\theta_t - \theta_T)\cdot v_2\big),

θ_T at the origin; ``distance_to_plane`` is the norm of what the plane misses,
‖θ_t − θ_T − α_t v_1 − β_t v_2‖. The surface is the 2D slice of
`flatcli.landscape.slices` with these directions,

.. math:: f(\alpha, \beta) = L(\theta_T + \alpha v_1 + \beta v_2),

evaluated by the same vmapped evaluator on a ``steps × steps`` grid that by
default covers the projected path with a margin of `PATH_MARGIN` of its extent
on each side (α = β = 0 is always on the grid). BatchNorm running statistics
along the plane are θ_T's, as in the slices; each checkpoint's own loss (the
path CSV) is evaluated with its own parameters and buffers.

Solvers (``solver``): ``"full"`` is scikit-learn's ``PCA(svd_solver="full",
copy=False)`` (exact; LAPACK works on one copy of M and returns a T × P factor);
``"randomized"`` is scikit-learn's ``randomized_svd`` (Halko, Martinsson, Tropp
2011) on M centred in place, with 10 oversamples and 7 power iterations: no
copy of M at all, and exact to rounding when T ≤ 12 (the sketch then spans
every row). ``"auto"`` uses "full" up to `FULL_MAX_ENTRIES` entries of M and
"randomized" beyond. M is float64 and is built once (8·T·P bytes).
"""

from __future__ import annotations

import copy
import glob
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..engine import Problem, eval_mode
from ..errors import ConfigError, MeasurementError
from ..loading.checkpoints import check_state, missing_checkpoint, natural_key
from ..run.results import jsonable
from ..run.settings import Settings
from ..validation import Bool, Integral, OneOf, check_fields, opt
from .evaluate import Progress, ViewOptions, evaluate_splits, problem_kwargs, split_problems
from .loss_grid import LandscapeResult, summarize
from .slices import axis_grid, direction_chunks, grid_coefficients, parse_span

PCA_SOLVERS = ("auto", "full", "randomized")
FULL_MAX_ENTRIES = 10_000_000  # T·P up to which "auto" runs the full SVD
PATH_MARGIN = 0.25  # default grid: the path's extent plus this fraction of it on each side
MIN_CHECKPOINTS = 3


# ------------------------------------------------------------------ checkpoint lists
def trajectory_paths(
    checkpoints: str | Path | Sequence[str | Path], sort: bool = True
) -> list[Path]:
    """The checkpoint files of a trajectory, in training order.

    Every entry with glob characters (``*?[``) is expanded; with ``sort``
    (default) the whole list is then sorted naturally, so both a quoted glob
    and a shell-expanded one (which the shell sorts as text: epoch_10 before
    epoch_2) come out in training order. ``sort=False`` keeps the order given
    (each glob's own matches still sorted naturally). Raises `ConfigError` for
    a glob that matches nothing, a missing file, or fewer than 3 checkpoints.
    """
    entries = [checkpoints] if isinstance(checkpoints, (str, Path)) else list(checkpoints)
    out: list[Path] = []
    for e in entries:
        s = str(Path(e).expanduser())
        if glob.has_magic(s):
            hits = sorted(glob.glob(s), key=natural_key)
            if not hits:
                raise ConfigError(f"`pca`: the glob {str(e)!r} matches no file")
            out += [Path(h) for h in hits]
        else:
            out.append(Path(s))
    if sort:
        out.sort(key=natural_key)
    for p in out:
        if not p.is_file():
            raise missing_checkpoint(p, "`pca`: ")
    if len(out) < MIN_CHECKPOINTS:
        raise ConfigError(
            f"`pca` needs at least {MIN_CHECKPOINTS} checkpoints. Got {len(out)} instead."
            + (f" ({', '.join(str(p) for p in out)})" if out else "")
        )
    return out


class LazyTrajectory(Sequence):
    """A trajectory whose items are loaded when accessed: ``loader(path)`` for each of ``paths``,
    then ``last`` (θ_T, already loaded) when given. Nothing is cached, so one checkpoint is in
    memory at a time besides ``last``."""

    def __init__(
        self,
        paths: Sequence[str | Path],
        loader: Callable[[Path], torch.nn.Module | Mapping[str, torch.Tensor]],
        last: torch.nn.Module | Mapping[str, torch.Tensor] | None = None,
    ):
        self.paths = [Path(p) for p in paths]
        self.loader = loader
        self.last = last

    def __len__(self) -> int:
        return len(self.paths) + (self.last is not None)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.last if i == len(self.paths) else self.loader(self.paths[i])


# ------------------------------------------------------------------ PCA
@dataclass
class TrajectoryPCA:
    """The two principal directions of a trajectory matrix (see the module docstring).

    ``components``: (2, P) unit rows; ``explained_variance`` λ_k and
    ``explained_variance_ratio`` r_k; ``singular_values`` s_k; ``mean`` μ (P,);
    ``solver``: "full" or "randomized".
    """

    components: np.ndarray
    explained_variance: np.ndarray
    explained_variance_ratio: np.ndarray
    singular_values: np.ndarray
    mean: np.ndarray
    solver: str


def _flip_signs(vt: np.ndarray) -> np.ndarray:
    """Make the largest-magnitude entry of each row positive (scikit-learn's ``svd_flip`` on Vᵀ)."""
    idx = np.argmax(np.abs(vt), axis=1)
    signs = np.sign(vt[np.arange(vt.shape[0]), idx])
    signs[signs == 0] = 1.0
    return vt * signs[:, None]


def trajectory_pca(matrix: np.ndarray, solver: str = "auto", seed: int = 0) -> TrajectoryPCA:
    """Top two principal directions of the rows of ``matrix`` (T × P, T ≥ 3).

    Parameters
    ----------
    matrix : float64 array, C-contiguous. It is centred **in place** (its
        columns' mean subtracted) and not copied, so that a large trajectory
        is held once; afterwards it holds M − 1μᵀ.
    solver : "auto" (default), "full" (scikit-learn PCA, exact) or
        "randomized" (randomized SVD, no copy of the matrix).
    seed : seed of the randomized sketch.

    Returns
    -------
    `TrajectoryPCA`.
    """
    if solver not in PCA_SOLVERS:
        raise ConfigError(
            f"`solver` must be one of {', '.join(PCA_SOLVERS)}. Got {solver!r} instead."
        )
    if matrix.ndim != 2 or matrix.shape[0] < MIN_CHECKPOINTS:
        raise ConfigError(
            f"`pca` needs at least {MIN_CHECKPOINTS} checkpoints. Got {matrix.shape[0] if matrix.ndim == 2 else 0} instead."
        )
    if matrix.dtype != np.float64 or not matrix.flags.c_contiguous:
        raise ValueError(
            "trajectory_pca needs a C-contiguous float64 matrix (it is centred in place)"
        )
    t, p = matrix.shape
    if solver == "auto":
        solver = "full" if t * p <= FULL_MAX_ENTRIES else "randomized"
    mean = matrix.mean(axis=0)
    matrix -= mean
    total = float(np.einsum("ij,ij->", matrix, matrix)) / (t - 1)
    if not total > 0:
        raise ConfigError(
            f"`pca`: all {t} checkpoints hold the same parameters; there is no path to project"
        )
    if solver == "full":
        from sklearn.decomposition import PCA

        pca = PCA(n_components=2, svd_solver="full", copy=False).fit(matrix)
        mean = mean + pca.mean_  # the rounding-level mean PCA removed again
        comps = np.asarray(pca.components_, dtype=np.float64)
        sv = np.asarray(pca.singular_values_, dtype=np.float64)
    else:
        from sklearn.utils.extmath import randomized_svd

        _, sv, vt = randomized_svd(
            matrix, n_components=2, n_oversamples=10, n_iter=7, random_state=int(seed)
        )
        comps = _flip_signs(vt)
    ev = sv**2 / (t - 1)
    return TrajectoryPCA(
        components=np.ascontiguousarray(comps),
        explained_variance=ev,
        explained_variance_ratio=ev / total,
        singular_values=sv,
        mean=mean,
        solver=solver,
    )


# ------------------------------------------------------------------ result
@dataclass
class TrajectoryResult:
    """A trajectory PCA view.

    ``surface``: the 2D `LandscapeResult` over (α, β) (``alpha`` along v_1,
    ``beta`` along v_2). ``path``: one entry per checkpoint, in order:
    ``checkpoint`` (label), ``alpha``, ``beta``, ``distance_to_plane``, the
    checkpoint's own ``train_loss``, ``train_acc`` (and ``test_*``), and
    ``plane_train_loss`` (the loss at its projection on the plane).
    ``explained_variance`` / ``explained_variance_ratio``: of v_1 and v_2;
    ``components``: v_1 and v_2 as the rows of a (2, P) array, in the order of
    the model's trainable parameters (``named_parameters``).
    """

    surface: LandscapeResult
    path: dict[str, list | np.ndarray]
    explained_variance: np.ndarray
    explained_variance_ratio: np.ndarray
    components: np.ndarray
    summary: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)
    seconds: float = 0.0
    kind: str = "pca"

    def grid_frame(self):
        """The grid as a pandas DataFrame: alpha, beta, train_loss, train_acc, test_loss, test_acc."""
        import pandas as pd

        return pd.DataFrame(self.surface.rows())

    def path_frame(self):
        """The projected path as a pandas DataFrame, one row per checkpoint."""
        import pandas as pd

        cols = [
            "checkpoint",
            "alpha",
            "beta",
            "distance_to_plane",
            "train_loss",
            "train_acc",
            "test_loss",
            "test_acc",
            "plane_train_loss",
        ]
        n = len(self.path["checkpoint"])
        return pd.DataFrame({c: self.path.get(c, [None] * n) for c in cols})

    def to_json(self) -> dict[str, Any]:
        """``pca.json`` as a JSON-ready dict: kind, summary, explained variance (and its ratio),
        seconds and the meta entries."""
        return jsonable(
            {
                "kind": self.kind,
                "summary": self.summary,
                "explained_variance": self.explained_variance,
                "explained_variance_ratio": self.explained_variance_ratio,
                "seconds": self.seconds,
                **self.meta,
            }
        )


# ------------------------------------------------------------------ helpers
def _state(item: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if isinstance(item, torch.nn.Module):
        return dict(item.state_dict())
    if isinstance(item, Mapping):
        return dict(item)
    raise TypeError(
        f"a trajectory item must be an nn.Module or a state dict. Got {type(item).__name__} instead."
    )


def _auto_span(c: np.ndarray, margin: float) -> tuple[float, float]:
    lo, hi = float(min(c.min(), 0.0)), float(max(c.max(), 0.0))
    width = hi - lo
    if width <= 0:
        return -1.0, 1.0
    return lo - margin * width, hi + margin * width


def _nan_check(values: np.ndarray, what: str, where: Callable[[int], str]) -> None:
    bad = np.flatnonzero(np.isnan(np.asarray(values, dtype=float).ravel()))
    if len(bad):
        raise MeasurementError(
            f"the {what} is NaN at {len(bad)} of {np.asarray(values).size} points (first at {where(int(bad[0]))})"
        )


# ------------------------------------------------------------------ steps of the view
@dataclass(frozen=True)
class PCAView(ViewOptions):
    """``view="pca"`` (`trajectory_landscape`), validated at construction: ``steps`` per axis;
    ``span`` (a, b) or "a,b" for both axes (default: the path plus `PATH_MARGIN` on each side);
    ``solver`` "auto", "full" or "randomized" (seeded by ``seed``); ``sort`` the files naturally
    (epoch_2 before epoch_10, `trajectory_paths`); ``points_per_pass``, ``on_progress``: `ViewOptions`."""

    steps: int = opt(25, Integral(2), "grid points per axis")
    span: str | Sequence[float] | None = None
    solver: str = opt("auto", OneOf(*PCA_SOLVERS), "the PCA's solver")
    sort: bool = opt(True, Bool(), "sort the checkpoint files naturally")

    def __post_init__(self):
        check_fields(self)
        parse_span(self.span, (-1.0, 1.0))


def _check_labels(n_ck: int, labels: Sequence[str] | None) -> list[str]:
    """The labels (default "0", "1", …); `ConfigError` for too few checkpoints, else `ValueError`."""
    if n_ck < MIN_CHECKPOINTS:
        raise ConfigError(
            f"`pca` needs at least {MIN_CHECKPOINTS} checkpoints. Got {n_ck} instead."
        )
    labels = [str(i) for i in range(n_ck)] if labels is None else [str(s) for s in labels]
    if len(labels) != n_ck:
        raise ValueError(f"{len(labels)} labels for {n_ck} checkpoints")
    return labels


def _centre_model(
    trajectory: Sequence[torch.nn.Module | Mapping[str, torch.Tensor]],
    model: torch.nn.Module | None,
    labels: list[str],
) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A private copy of ``model`` (default: the last item) holding θ_T, and θ_T's state dict."""
    last = trajectory[len(trajectory) - 1]
    if model is None:
        if not isinstance(last, torch.nn.Module):
            raise ValueError("model is required when the trajectory holds state dicts")
        model = last
    centre_state = _state(last)
    work = copy.deepcopy(model)
    check_state(centre_state, work.state_dict(), labels[-1], "the model", "landscape pca")
    work.load_state_dict(centre_state)
    return work, centre_state


@dataclass
class _Checkpoints:
    """The trajectory's items with θ_T's state read once; every other item is read when asked
    for and not kept."""

    items: Sequence[torch.nn.Module | Mapping[str, torch.Tensor]]
    centre_state: dict[str, torch.Tensor]
    labels: list[str]

    def __len__(self) -> int:
        return len(self.items)

    def state(self, i: int) -> dict[str, torch.Tensor]:
        """The state dict of checkpoint ``i``."""
        return self.centre_state if i == len(self.items) - 1 else _state(self.items[i])


@dataclass
class _Plane:
    """The PCA plane of a trajectory: the principal directions, each checkpoint's coordinates
    (α_t, β_t) (a (T, 2) array, θ_T at the origin) and its ``distance_to_plane`` (T,)."""

    pca: TrajectoryPCA
    coords: np.ndarray
    dist: np.ndarray


def _flat(state: Mapping[str, torch.Tensor], names: Sequence[str]) -> torch.Tensor:
    """The tensors ``names`` of ``state`` as one float64 CPU vector."""
    return torch.cat([state[n].detach().reshape(-1).to("cpu", torch.float64) for n in names])


def _trajectory_matrix(
    ck: _Checkpoints,
    ref_state: Mapping[str, torch.Tensor],
    names: Sequence[str],
    progress: Progress,
) -> np.ndarray:
    """The dense T × P float64 matrix M of rows θ_t − θ_T (trainable parameters ``names``), filled
    row by row; each checkpoint is checked against ``ref_state`` first."""
    theta_t = _flat(ck.centre_state, names)
    mat = np.empty((len(ck), theta_t.numel()), dtype=np.float64)
    for i in range(len(ck)):
        st = ck.state(i)
        check_state(st, ref_state, ck.labels[i], ck.labels[-1], "landscape pca")
        row = _flat(st, names)
        mat[i] = (row - theta_t).numpy()
        del st, row
        progress.advance(1)
    return mat


def _project(mat: np.ndarray, pca: TrajectoryPCA) -> tuple[np.ndarray, np.ndarray]:
    """Each checkpoint's coordinates (θ_t − θ_T)·v_k and distance to the plane, from the rows of
    M as `trajectory_pca` left them (centred)."""
    comps = pca.components
    coords = mat @ comps.T + pca.mean @ comps.T  # (θ_t − θ_T)·v_k, from the centred rows
    coords[-1] = 0.0  # θ_T − θ_T = 0 exactly (the centring leaves rounding there)
    dist = np.zeros(len(mat))
    for i in range(len(mat) - 1):
        resid = mat[i] + pca.mean - coords[i, 0] * comps[0] - coords[i, 1] * comps[1]
        dist[i] = float(np.sqrt(resid @ resid))
    return coords, dist


def _trajectory_plane(
    ck: _Checkpoints,
    ref_state: Mapping[str, torch.Tensor],
    names: Sequence[str],
    solver: str,
    seed: int,
    progress: Progress,
) -> _Plane:
    """The PCA plane of the trajectory and the path's projection on it (M is freed on return)."""
    mat = _trajectory_matrix(ck, ref_state, names, progress)
    pca = trajectory_pca(mat, solver=solver, seed=seed)
    coords, dist = _project(mat, pca)
    return _Plane(pca, coords, dist)


@dataclass(frozen=True)
class _Grid:
    """The (α, β) grid over the plane: the axes, the spans they cover, whether the spans were
    chosen automatically, and the steps per axis asked for."""

    alpha: np.ndarray
    beta: np.ndarray
    spans: tuple[tuple[float, float], tuple[float, float]]
    auto: bool
    steps: int

    @property
    def span_lists(self) -> list[list[float]]:
        """The spans as lists, as ``meta`` records them."""
        return [list(self.spans[0]), list(self.spans[1])]


def _plane_grid(coords: np.ndarray, fixed_span: tuple[float, float] | None, steps: int) -> _Grid:
    """The grid over ``fixed_span`` on both axes, or by default over each axis's projected path
    plus `PATH_MARGIN` of its extent on each side."""
    if fixed_span is not None:
        spans = (fixed_span, fixed_span)
    else:
        spans = (_auto_span(coords[:, 0], PATH_MARGIN), _auto_span(coords[:, 1], PATH_MARGIN))
    return _Grid(
        alpha=axis_grid(spans[0], steps),
        beta=axis_grid(spans[1], steps),
        spans=spans,
        auto=fixed_span is None,
        steps=steps,
    )


def _surface_metrics(
    problems: dict[str, Problem],
    dirs: list[dict[str, torch.Tensor]],
    grid: _Grid,
    points_per_pass: int | None,
    progress: Progress,
) -> tuple[dict[str, np.ndarray], dict[str, dict]]:
    """Loss and accuracy of every split over the grid, shaped (len(alpha), len(beta)), and the
    evaluator's diagnostics; `MeasurementError` where a loss is NaN."""
    alpha, beta = grid.alpha, grid.beta
    coeffs = grid_coefficients(alpha, beta)
    metrics, diags = evaluate_splits(
        problems,
        direction_chunks(problems["train"].params, dirs, coeffs),
        len(coeffs),
        points_per_pass,
        progress.advance,
    )
    metrics = {k: v.reshape((len(alpha), len(beta))) for k, v in metrics.items()}
    for split in problems:
        _nan_check(
            metrics[f"{split}_loss"],
            f"{split} loss on the PCA plane",
            lambda k: f"alpha={alpha[k // len(beta)]:.4g}, beta={beta[k % len(beta)]:.4g}",
        )
    return metrics, diags


def _checkpoint_metrics(
    problems: dict[str, Problem],
    ck: _Checkpoints,
    points_per_pass: int | None,
    progress: Progress,
) -> dict[str, np.ndarray]:
    """Each checkpoint's own loss and accuracy (its parameters and floating-point buffers) on every
    split; `MeasurementError` where a loss is NaN."""
    pt = problems["train"]
    keys = pt.names + [n for n, v in pt.buffers.items() if v.is_floating_point()]

    def own(first: int, stop: int) -> dict[str, torch.Tensor]:
        sts = [ck.state(i) for i in range(first, stop)]
        return {n: torch.stack([s[n].detach() for s in sts]).to(pt.device, pt.dtype) for n in keys}

    metrics, _ = evaluate_splits(problems, own, len(ck), points_per_pass, progress.advance)
    for split in problems:
        _nan_check(
            metrics[f"{split}_loss"], f"{split} loss of a checkpoint", lambda k: ck.labels[k]
        )
    return metrics


def _surface(metrics: dict[str, np.ndarray], grid: _Grid) -> LandscapeResult:
    """The 2D `LandscapeResult` over the plane, with its meta and summary."""
    surface = LandscapeResult(kind="2d", alpha=grid.alpha, beta=grid.beta, **metrics)
    surface.meta = {"directions": "pca", "span": grid.span_lists, "steps": grid.steps}
    surface.summary = summarize(surface)
    return surface


def _path_table(
    labels: list[str],
    plane: _Plane,
    path_metrics: dict[str, np.ndarray],
    plane_metrics: dict[str, np.ndarray],
) -> dict[str, list | np.ndarray]:
    """`TrajectoryResult.path`: one entry per checkpoint, in order."""
    return {
        "checkpoint": labels,
        "alpha": plane.coords[:, 0],
        "beta": plane.coords[:, 1],
        "distance_to_plane": plane.dist,
        **path_metrics,
        "plane_train_loss": plane_metrics["train_loss"],
    }


def _trajectory_summary(
    plane: _Plane, surface: LandscapeResult, path_metrics: dict[str, np.ndarray]
) -> dict[str, Any]:
    """`TrajectoryResult.summary`: the explained variance ratios, the grid's summary, the first
    and last checkpoints' own train loss and the largest distance to the plane."""
    ratio = [float(r) for r in plane.pca.explained_variance_ratio]
    return {
        "explained_variance_ratio_1": ratio[0],
        "explained_variance_ratio_2": ratio[1],
        **surface.summary,
        "path_train_loss_first": float(path_metrics["train_loss"][0]),
        "path_train_loss_last": float(path_metrics["train_loss"][-1]),
        "path_max_distance_to_plane": float(plane.dist.max()),
    }


def _trajectory_meta(
    labels: list[str],
    plane: _Plane,
    grid: _Grid,
    seed: int,
    problems: dict[str, Problem],
    diags: dict[str, dict],
) -> dict[str, Any]:
    """`TrajectoryResult.meta`: how the plane and the grid were made."""
    pt = problems["train"]
    return {
        "checkpoints": labels,
        "solver": plane.pca.solver,
        "seed": int(seed),
        "span": grid.span_lists,
        "span_auto": grid.auto,
        "steps": grid.steps,
        "num_params": pt.num_params,
        "n_train": pt.n,
        "n_test": problems["test"].n if "test" in problems else None,
        "singular_values": plane.pca.singular_values,
        "evaluator": diags,
    }


# ------------------------------------------------------------------ the view
def trajectory_landscape(
    trajectory: Sequence[torch.nn.Module | Mapping[str, torch.Tensor]],
    train,
    test=None,
    *,
    model: torch.nn.Module | None = None,
    labels: Sequence[str] | None = None,
    options: PCAView | None = None,
    settings: Settings | None = None,
    **fields,
) -> TrajectoryResult:
    """PCA directions of a training trajectory, its projection, and the loss over their plane.

    Parameters
    ----------
    trajectory : T ≥ 3 checkpoints in training order, each an ``nn.Module``
        or a state dict (name → tensor); the last is θ_T, the centre. Items
        are read one at a time and not kept, so a lazy sequence that loads a
        file on ``__getitem__`` holds one checkpoint in memory at a time (each
        item is read once for the matrix and once per split for its own loss).
    train, test : (x, y) data; every grid point and checkpoint gets train
        (and test) loss and accuracy.
    model : the network whose code evaluates the points (default: the last
        item, which must then be a module). Not modified.
    labels : a name per checkpoint for the path table (default "0", "1", …).
    options : the `PCAView` (``steps``, ``span``, ``solver``, ``points_per_pass``,
        ``on_progress``; its ``sort`` applies to file lists); default ``PCAView()``.
    settings : the `flatcli.run.settings.Settings` (loss, batch size, device, precision, ``seed``: the
        seed of the randomized solver); its fields may be given as keywords.

    Returns
    -------
    `TrajectoryResult`; ``summary`` holds the explained variance ratios, the
    grid's ``train_loss_center`` (θ_T), ``train_loss_min``/``max`` and the
    first and last checkpoints' own train loss.

    References
    ----------
    Li, Xu, Taylor, Studer, Goldstein, "Visualizing the Loss Landscape of
    Neural Nets", NeurIPS 2018, Sec. 7.

    Examples
    --------
    >>> res = trajectory_landscape([m1, m2, m3], (x, y), options=PCAView(steps=21))  # doctest: +SKIP
    >>> res.explained_variance_ratio, res.surface.train_loss.shape  # doctest: +SKIP
    (array([0.93, 0.05]), (21, 21))
    """
    st = Settings.build(settings, **fields)
    seed = st.seed
    n_ck = len(trajectory)
    opts = options if options is not None else PCAView()
    labels, solver, points_per_pass = _check_labels(n_ck, labels), opts.solver, opts.points_per_pass
    fixed_span = parse_span(opts.span, (-1.0, 1.0)) if opts.span is not None else None
    steps_n = opts.steps
    t0 = time.perf_counter()
    work, centre_state = _centre_model(trajectory, model, labels)
    ck = _Checkpoints(trajectory, centre_state, labels)
    with eval_mode(work):
        problems = split_problems(work, train, test, **problem_kwargs(st))
        pt = problems["train"]
        # loading, grid (steps² points until the grid is known), own losses, plane points
        progress = opts.progress(n_ck + (steps_n**2 + n_ck) * len(problems) + n_ck)
        plane = _trajectory_plane(ck, work.state_dict(), pt.names, solver, seed, progress)
        dirs = [
            pt.unflatten(torch.as_tensor(c, dtype=pt.dtype, device=pt.device))
            for c in plane.pca.components
        ]
        grid = _plane_grid(plane.coords, fixed_span, steps_n)
        progress.total += (len(grid.alpha) * len(grid.beta) - steps_n**2) * len(problems)
        metrics, diags = _surface_metrics(problems, dirs, grid, points_per_pass, progress)
        plane_chunks = direction_chunks(pt.params, dirs, plane.coords)
        plane_metrics, _ = evaluate_splits(
            {"train": pt}, plane_chunks, n_ck, points_per_pass, progress.advance
        )
        path_metrics = _checkpoint_metrics(problems, ck, points_per_pass, progress)
    surface = _surface(metrics, grid)
    res = TrajectoryResult(
        surface=surface,
        path=_path_table(labels, plane, path_metrics, plane_metrics),
        explained_variance=plane.pca.explained_variance,
        explained_variance_ratio=plane.pca.explained_variance_ratio,
        components=plane.pca.components,
    )
    res.summary = _trajectory_summary(plane, surface, path_metrics)
    res.meta = _trajectory_meta(labels, plane, grid, seed, problems, diags)
    res.seconds = time.perf_counter() - t0
    return res
