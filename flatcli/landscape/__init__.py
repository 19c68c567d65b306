"""Loss-landscape views: filter-normalized 1D/2D slices and interpolation between checkpoints.

* `slice_landscape` — L(θ* + αδ [+ βη]) along seeded, filter-normalized random
  directions (Li et al. 2018), see `flatcli.landscape.slices`;
* `interpolation_landscape` — L((1 − t)θ_a + tθ_b) and the barrier height
  (Goodfellow et al. 2015; Frankle et al. 2020), see `flatcli.landscape.interpolate`;
* `write_files` — ``landscape.csv``, ``landscape.json`` and PNG plots.

From a config and checkpoint files, use `flatcli.api.landscape` (what
``flatcli landscape`` calls).
"""

from .directions import filter_norms, normalize_direction, random_direction
from .evaluate import PointEvaluator
from .interpolate import interpolation_landscape
from .result import LandscapeResult, summarize, write_files
from .slices import axis_grid, parse_span, slice_landscape

__all__ = [
    "LandscapeResult",
    "PointEvaluator",
    "axis_grid",
    "filter_norms",
    "interpolation_landscape",
    "normalize_direction",
    "parse_span",
    "random_direction",
    "slice_landscape",
    "summarize",
    "write_files",
]
