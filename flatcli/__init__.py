"""flatcli: flatness and sharpness measures of trained networks, and how well they predict generalization.

The Python API (everything the command line does):

>>> import flatcli
>>> report = flatcli.measure("cfg.yaml", measures="hessian_trace")   # doctest: +SKIP
>>> flatcli.sweep("cfg.yaml", "runs/eval"); flatcli.collect("runs/eval")   # doctest: +SKIP
>>> flatcli.correlate("runs/eval/results.csv", by="lr,width")      # doctest: +SKIP
>>> flatcli.compare("runs/eval/results.csv", "relative_flatness", "hessian_trace")   # doctest: +SKIP
>>> flatcli.report("runs/eval", "runs/eval/report.html", by="lr,width")   # doctest: +SKIP
"""

from . import _cpu_mark  # noqa: F401  (the CPUs' jiffies at start-up, for `threads: auto`)
from ._version import __version__

_API = (
    "measure",
    "measure_model",
    "sweep",
    "landscape",
    "check_invariance",
    "report",
    "load",
    "MeasureReport",
    "MeasureOptions",
    "RunOptions",
    "SweepOptions",
    "Tracker",
    "TrackOptions",
)
_MEASURES = ("list_measures", "Measure", "MeasureResult")
__all__ = [
    "__version__",
    "Settings",
    "collect",
    "compare",
    "correlate",
    "read_results",
    *_API,
    *_MEASURES,
]


def __getattr__(name):  # PEP 562: each name is imported on first use
    if name in _API or name in ("correlate", "collect"):
        # the DataFrame forms of correlate and collect (the report is df.attrs["report"])
        from . import api  # lazy: `import flatcli` and the CLI's start-up load no torch

        return getattr(api, name if name in _API else f"{name}_frame")
    if name == "compare":  # paired comparison of two measures' correlations (a DataFrame)
        from .analysis.compare import compare_measures  # lazy: start-up (loads pandas, torch)

        return compare_measures
    if name == "read_results":
        from .run.results import read_results  # lazy: start-up (loads torch)

        return read_results
    if name in _MEASURES:
        from . import measures  # lazy: start-up (loads torch)

        return getattr(measures, name)
    if name == "Settings":
        from .run.settings import Settings  # lazy: start-up (loads torch)

        return Settings
    raise AttributeError(f"module 'flatcli' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
