"""The spectral-density plot of ``hessian_spectrum`` (`plot_esd`, `esd_figure`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..engine import linalg

ESD_FLOOR = 1e-6  # density plots show values above this fraction of the peak


def plot_esd(result, path: str | Path, *, title: str | None = None) -> Path:
    """Plot the spectral density of a `hessian_spectrum` result to a PNG file.

    ``result`` is the `MeasureResult` (or its diagnostics dict). Draws the SLQ
    density on a log axis (recomputed on a fine grid from the stored nodes and
    weights when present), clipped to densities above 1e-6 of the peak (below that the
    Gaussian smoothing's tails run down to 1e-300 and say nothing about the spectrum), and
    marks the top-k eigenvalues (dashed) with λmax written beside the first. Needs matplotlib
    (``pip install 'flatcli[plot]'``); uses the Agg canvas, never pyplot.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("plot_esd needs matplotlib: pip install 'flatcli[plot]'") from e
    diag = result if isinstance(result, dict) else result.diagnostics
    if "density" not in diag:
        raise ValueError(
            "plot_esd needs a hessian_spectrum result (no 'density' in its diagnostics)"
        )
    grid = np.asarray(diag["density_grid"], dtype=np.float64)
    dens = np.asarray(diag["density"], dtype=np.float64)
    if diag.get("slq_nodes"):
        s = linalg.SLQResult(
            [np.asarray(t) for t in diag["slq_nodes"]],
            [np.asarray(w) for w in diag["slq_weights"]],
            dim=1,
        )
        grid = np.linspace(grid[0], grid[-1], 2000)
        dens = s.density(grid, 2 * (grid[1] - grid[0]))
    fig = esd_figure(grid, dens, diag, title)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out


def esd_figure(grid: np.ndarray, dens: np.ndarray, diag: dict, title: str | None = None):
    """The figure of `plot_esd` (a matplotlib Figure on the Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.0, 4.2), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    floor = ESD_FLOOR * float(np.nanmax(dens)) if np.any(dens > 0) else 0.0
    shown = np.where(
        dens > floor, dens, np.nan
    )  # below 1e-6 of the peak: Gaussian tails, not spectrum
    ax.semilogy(grid, shown, "-", lw=1.2, label="SLQ density")
    if floor > 0:
        ax.set_ylim(floor, 2.0 * float(np.nanmax(dens)))
    for i, v in enumerate(diag.get("top_eigenvalues", [])):
        ax.axvline(
            v, color="C3", lw=0.6, alpha=0.6, ls="--", label="top-k eigenvalues" if i == 0 else None
        )
    top = diag.get("top_eigenvalues") or []
    if top:
        ax.annotate(
            f"λmax = {top[0]:.4g}",
            xy=(top[0], 1),
            xycoords=("data", "axes fraction"),
            xytext=(-4, -12),
            textcoords="offset points",
            ha="right",
            fontsize=8,
            color="C3",
        )
    ax.set_xlabel("eigenvalue")
    ax.set_ylabel("density")
    neff = diag.get("z")
    ax.set_title(
        title
        or (
            f"Hessian spectral density (N_eff at z={neff:g})"
            if neff is not None
            else "Hessian spectral density"
        )
    )
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    return fig
