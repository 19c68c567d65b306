"""Loss-landscape views: slices, interpolation, trajectory PCA and mode connectivity.

* `slice_landscape` — L(θ* + αδ [+ βη]) along seeded, filter-normalized random
  directions (Li et al. 2018), see `flatcli.landscape.slices`;
* `interpolation_landscape` — L((1 − t)θ_a + tθ_b) and the barrier height
  (Goodfellow et al. 2015; Frankle et al. 2020), see `flatcli.landscape.interpolate`;
* `write_files` — ``landscape.csv``, ``landscape.json`` and PNG plots (every view's
  writer is in `flatcli.landscape.output`, the one module that joins results to plots);
* `trajectory_landscape` — the top-2 PCA directions of a training trajectory,
  its projection and the loss over their plane (Li et al. 2018, Sec. 7), see
  `flatcli.landscape.pca`; files by `write_trajectory_files`;
* `connect_landscape` — a trained quadratic Bezier curve between two
  checkpoints against the line, with BatchNorm statistics recomputed along
  both (Garipov et al. 2018; Draxler et al. 2018), see
  `flatcli.landscape.connect`; files by `write_connect_files`.

From a config and checkpoint files, use `flatcli.api.landscape` (what
``flatcli landscape`` calls).
"""

from .connect import ConnectResult, ConnectView, connect_landscape
from .directions import filter_norms, normalize_direction, random_direction
from .evaluate import PointEvaluator, ViewOptions
from .interpolate import InterpolateView, interpolation_landscape
from .loss_grid import LandscapeResult, summarize
from .output import write_connect_files, write_files, write_trajectory_files
from .pca import (
    LazyTrajectory,
    PCAView,
    TrajectoryResult,
    trajectory_landscape,
    trajectory_paths,
    trajectory_pca,
)
from .slices import SliceView, axis_grid, parse_span, slice_landscape

__all__ = [
    "ConnectResult",
    "ConnectView",
    "InterpolateView",
    "LandscapeResult",
    "LazyTrajectory",
    "PCAView",
    "PointEvaluator",
    "SliceView",
    "ViewOptions",
    "TrajectoryResult",
    "axis_grid",
    "connect_landscape",
    "filter_norms",
    "interpolation_landscape",
    "normalize_direction",
    "parse_span",
    "random_direction",
    "slice_landscape",
    "summarize",
    "trajectory_landscape",
    "trajectory_paths",
    "trajectory_pca",
    "write_connect_files",
    "write_files",
    "write_trajectory_files",
]
