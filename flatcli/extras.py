"""The optional extras: whether one is installed, and the line that says how to install it.

At the bottom of the package (it imports nothing of flatcli): the API (``measure(plots=True)``),
the landscape's plots, the experiments and the demo ask the same question the same way.
"""

from __future__ import annotations

PLOT_HINT = "matplotlib is not installed: pip install 'flatcli[plot]' for PNG plots"


def have_matplotlib() -> bool:
    """Whether matplotlib can be imported (plots are skipped with `PLOT_HINT` otherwise)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True
