"""flatcli: flatness and sharpness measures of trained networks, and how well they predict generalization.

The Python API (everything the command line does):

>>> import flatcli
>>> report = flatcli.measure("cfg.yaml", measures="hessian_trace")   # doctest: +SKIP
>>> flatcli.sweep("cfg.yaml", "runs/eval"); flatcli.collect("runs/eval")   # doctest: +SKIP
>>> flatcli.correlate("runs/eval/results.csv", by="lr,width")      # doctest: +SKIP
>>> flatcli.compare("runs/eval/results.csv", "relative_flatness", "hessian_trace")   # doctest: +SKIP
"""

from ._version import __version__

_API = (
    "measure",
    "measure_model",
    "sweep",
    "landscape",
    "check_invariance",
    "load",
    "MeasureReport",
    "MeasureOptions",
    "RunOptions",
)
_MEASURES = ("list_measures", "register", "MeasureResult")
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


def __getattr__(name):  # lazy, so `import flatcli` stays cheap
    if name in _API:
        from . import api

        return getattr(api, name)
    if name in ("correlate", "collect"):  # the DataFrame forms (the report is df.attrs["report"])
        from . import api

        return getattr(api, f"{name}_frame")
    if name == "compare":  # paired comparison of two measures' correlations (a DataFrame)
        from .analysis.compare import compare_measures

        return compare_measures
    if name == "read_results":
        from .run import results

        return results.read_results
    if name in _MEASURES:
        from . import measures

        return getattr(measures, name)
    if name == "Settings":
        from .run.settings import Settings

        return Settings
    raise AttributeError(f"module 'flatcli' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
