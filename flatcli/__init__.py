"""flatcli: flatness and sharpness measures of trained networks, and how well they predict generalization."""

__version__ = "0.1.0"


def __getattr__(name):  # lazy, so `import flatcli` stays cheap
    if name in ("measure", "measure_model", "load", "MeasureReport"):
        from . import api

        return getattr(api, name)
    if name in ("correlate", "collect"):  # the DataFrame forms (the report is df.attrs["report"])
        from . import api

        return getattr(api, f"{name}_frame")
    if name == "read_results":
        from . import results

        return results.read_results
    if name in ("list_measures", "register", "MeasureResult"):
        from . import measures

        return getattr(measures, name)
    raise AttributeError(name)
