"""Curvature during training: `Tracker` for any PyTorch loop, its schedule and output folder, and
the callbacks of PyTorch Lightning (`flatcli.tracking.lightning_callback`) and the Hugging Face
Trainer (`flatcli.tracking.hf_callback`), which import their framework only when used.

>>> from flatcli.tracking import Tracker, TrackOptions
>>> tracker = Tracker(model, (x, y), "mse", every=10, out="runs/track")   # doctest: +SKIP
"""

from .schedule import Schedule
from .track_files import TrackStore, log_columns, numeric_columns
from .tracker import Tracker, TrackOptions, untouched

__all__ = [
    "Schedule",
    "TrackOptions",
    "TrackStore",
    "Tracker",
    "log_columns",
    "numeric_columns",
    "untouched",
]
