"""The Python entry points: `measure`, `sweep`, `collect`, `correlate`, `landscape`, `check_invariance`.

Every entry point that takes a config takes ``run=RunOptions(device=..., precision=..., seed=...,
threads=..., allow_unsafe_pickle=..., budget=...)`` (`flatcli.run.settings.RunOptions`: the config's
``runtime.*`` overrides, what the CLI's shared flags build) instead of separate keywords.

Everything the CLI does goes through here; the CLI only parses and renders. One module per
concern: `_common` (configs, threads, selections), `measure`, `plan` (dry runs), `views`
(landscapes, the invariance check), `analysis` (sweeps, collect, correlate); every public name is
here.

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
from ..run.checkpoint import (  # noqa: F401  (re-exported: the Python API)
    as_specs,
    check_finite_model,
    measure_job,
    measure_model,
    versions,
)
from ..run.settings import MeasureOptions, RunOptions
from ._common import load, select_measures, use_threads
from .analysis import collect, collect_frame, correlate, correlate_frame, sweep
from .measure import (
    REUSABLE,
    MeasureInterrupted,
    MeasureReport,
    Reporting,
    measure,
    measure_keys,
    previous_results,
)
from .plan import CostPlan, plan_costs
from .views import ConnectView, InterpolateView, PCAView, SliceView, check_invariance, landscape

__all__ = [
    "ConnectView",
    "CostPlan",
    "InterpolateView",
    "MeasureInterrupted",
    "MeasureOptions",
    "MeasureReport",
    "PCAView",
    "REUSABLE",
    "Reporting",
    "RunOptions",
    "SliceView",
    "check_invariance",
    "collect",
    "collect_frame",
    "correlate",
    "correlate_frame",
    "landscape",
    "load",
    "load_model",
    "measure",
    "measure_keys",
    "measure_model",
    "plan_costs",
    "previous_results",
    "select_measures",
    "sweep",
    "use_threads",
]
