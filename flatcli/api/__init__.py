"""The Python entry points: `measure`, `sweep`, `collect_report`, `correlate_report`, `landscape`,
`check_invariance`, `estimate_costs`.

Every entry point that takes a config takes ``run=RunOptions(device=..., precision=..., seed=...,
threads=..., allow_unsafe_pickle=..., budget=...)`` (`flatcli.run.settings.RunOptions`: the config's
``runtime.*`` overrides, what the CLI's shared flags build) instead of separate keywords.

Everything the CLI does goes through here; the CLI only parses and renders. One module per
concern: `_setup` (configs, threads, selections), `measure`, `costs` (dry runs), `geometry`
(landscapes, the invariance check), `sweeps` (sweep, collect, correlate), `report_page` (the HTML
results page); every public name is here.

>>> import flatcli
>>> report = flatcli.measure("configs/cifar_resnet18.yaml", measures="hessian_trace")  # doctest: +SKIP
>>> report.rows[0].results["hessian_trace"].value                  # doctest: +SKIP
"""

from __future__ import annotations

from ..loading.load import (  # noqa: F401  (re-exported: the Python API)
    DataCache,
    load_init_state,
    load_model,
    manifest_train_data,
)
from ..run.measuring import (  # noqa: F401  (re-exported: the Python API)
    as_specs,
    check_finite_model,
    measure_job,
    measure_model,
    versions,
)
from ..run.settings import MeasureOptions, RunOptions
from ..tracking import Tracker, TrackOptions  # curvature during training
from ._setup import load, select_measures, use_threads
from .costs import CostEstimate, estimate_costs
from .geometry import ConnectView, InterpolateView, PCAView, SliceView, check_invariance, landscape
from .measure import (
    REUSABLE,
    MeasureInterrupted,
    MeasureReport,
    Reporting,
    measure,
    measure_keys,
    previous_results,
)
from .report_page import ReportPage, report
from .sweeps import (
    SweepInterrupted,
    SweepOptions,
    collect_frame,
    collect_report,
    correlate_frame,
    correlate_report,
    sweep,
)

__all__ = [
    "Tracker",
    "TrackOptions",
    "ConnectView",
    "CostEstimate",
    "InterpolateView",
    "MeasureInterrupted",
    "MeasureOptions",
    "MeasureReport",
    "PCAView",
    "REUSABLE",
    "ReportPage",
    "Reporting",
    "RunOptions",
    "SliceView",
    "SweepInterrupted",
    "SweepOptions",
    "check_invariance",
    "collect_frame",
    "collect_report",
    "correlate_frame",
    "correlate_report",
    "estimate_costs",
    "landscape",
    "load",
    "load_model",
    "measure",
    "measure_keys",
    "measure_model",
    "previous_results",
    "report",
    "select_measures",
    "sweep",
    "use_threads",
]
