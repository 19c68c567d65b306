"""PNG plots of landscapes (optional: needs matplotlib, ``pip install flatcli[plot]``).

Figures are drawn with matplotlib's object-oriented API on the Agg canvas, so
they render headless and never touch pyplot's global state.

* 1D slice and interpolation: a line plot of train (solid) and test (dashed)
  loss on a log axis, accuracy on a second axis; the interpolation marks
  t = 0 and t = 1 and states the barrier height.
* 2D slice: a filled contour of the train loss (log-spaced levels) and a 3D
  surface of log10 of the train loss.
* `compare_1d`: several 1D slices on one axis (e.g. a sharp and a flat model).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..extras import PLOT_HINT as PLOT_HINT  # re-exported: the landscape's plots skip with it
from ..extras import have_matplotlib

if TYPE_CHECKING:  # annotations only: output.py imports both
    from .loss_grid import LandscapeResult

FILES = {
    "1d": {"line": "slice_1d.png"},
    "2d": {"contour": "slice_2d_contour.png", "surface": "slice_2d_surface.png"},
    "interpolation": {"line": "interpolation.png"},
}


def _figure(w: float = 6.0, h: float = 4.4):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _positive(a: np.ndarray) -> np.ndarray:
    """Values for a log axis: non-positive or non-finite entries become NaN (gaps)."""
    a = np.asarray(a, dtype=float)
    return np.where(np.isfinite(a) & (a > 0), a, np.nan)


def _line(ax, res: LandscapeResult, label: str = "", color=None, acc: bool = True):
    ax.set_yscale("log")
    line = ax.plot(
        res.alpha, _positive(res.train_loss), "-", color=color, label=f"{label}train loss"
    )[0]
    color = line.get_color()
    if res.test_loss is not None:
        ax.plot(res.alpha, _positive(res.test_loss), "--", color=color, label=f"{label}test loss")
    return color


def plot_line(res: LandscapeResult, path: Path, title: str | None = None) -> Path:
    """Line plot of a 1D slice or an interpolation."""
    fig = _figure()
    ax = fig.add_subplot()
    _line(ax, res, color="C0")
    xlabel = (
        "t   (θ = (1 − t)·θ_a + t·θ_b)"
        if res.kind == "interpolation"
        else "α   (θ* + α·δ, filter-normalized δ)"
    )
    ax.set_xlabel(xlabel)
    ax.set_ylabel("loss")
    if not np.all(np.isnan(res.train_acc)):
        ax2 = ax.twinx()
        ax2.plot(res.alpha, res.train_acc, "-", color="C1", alpha=0.7, label="train acc")
        if res.test_acc is not None:
            ax2.plot(res.alpha, res.test_acc, "--", color="C1", alpha=0.7, label="test acc")
        ax2.set_ylabel("accuracy", color="C1")
        ax2.set_ylim(0, 1.02)
        h2, l2 = ax2.get_legend_handles_labels()
    else:
        h2, l2 = [], []
    h1, l1 = ax.get_legend_handles_labels()
    ax.legend(
        h1 + h2,
        l1 + l2,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.16),
        ncol=4,
        fontsize=8,
        frameon=False,
    )
    if res.kind == "interpolation":
        for t in (0.0, 1.0):
            ax.axvline(t, color="grey", lw=0.8, ls=":")
        b = res.summary.get("train_loss_barrier")
        default = f"interpolation: train-loss barrier {b:.3g}" if b is not None else "interpolation"
    else:
        default = f"1D slice (seed {res.meta.get('seed', '?')})"
    ax.set_title(title or default, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _levels(z: np.ndarray, n: int = 20) -> tuple[np.ndarray, bool]:
    zf = z[np.isfinite(z)]
    lo, hi = float(zf.min()), float(zf.max())
    if hi <= lo:
        return np.array([lo, lo + 1.0]), False
    if lo > 0 and hi / lo > 10:
        return np.geomspace(lo, hi, n), True
    return np.linspace(lo, hi, n), False


def _loss_contours(fig, ax, alpha, beta, train_loss) -> None:
    """Filled contours of the train loss over the (α, β) grid, with white lines and a colour bar
    (log-spaced levels when the loss spans more than a decade; non-finite cells drawn as the top)."""
    from matplotlib.colors import LogNorm

    z = np.asarray(train_loss, dtype=float)
    A, B = np.meshgrid(alpha, beta, indexing="ij")
    levels, log = _levels(z)
    zc = np.where(np.isfinite(z), z, levels[-1])
    cs = ax.contourf(
        A,
        B,
        zc,
        levels=levels,
        cmap="viridis",
        norm=LogNorm(levels[0], levels[-1]) if log else None,
        extend="max",
    )
    ax.contour(A, B, zc, levels=levels[::3], colors="white", linewidths=0.4)
    fig.colorbar(cs, ax=ax, label="train loss", format="%.3g")


def plot_contour(res: LandscapeResult, path: Path, title: str | None = None) -> Path:
    """Filled contour of the train loss over (α, β), the checkpoint marked at (0, 0)."""
    fig = _figure(5.2, 4.4)
    ax = fig.add_subplot()
    _loss_contours(fig, ax, res.alpha, res.beta, res.train_loss)
    ax.plot([0], [0], "r+", ms=10)
    ax.set_xlabel("α (direction δ)")
    ax.set_ylabel("β (direction η)")
    ax.set_aspect("equal")
    ax.set_title(title or f"2D slice, train loss (seed {res.meta.get('seed', '?')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_surface(res: LandscapeResult, path: Path, title: str | None = None) -> Path:
    """3D surface of log10(train loss) over (α, β)."""
    fig = _figure(5.5, 4.5)
    ax = fig.add_subplot(projection="3d")
    A, B = np.meshgrid(res.alpha, res.beta, indexing="ij")
    z = np.log10(_positive(res.train_loss))
    ax.plot_surface(A, B, z, cmap="viridis", linewidth=0, antialiased=True, rcount=60, ccount=60)
    ax.set_xlabel("α")
    ax.set_ylabel("β")
    ax.set_zlabel("log10 train loss")
    ax.tick_params(labelsize=7)
    ax.set_title(title or "2D slice, train loss", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    return path


def draw_if_available(res, draw, path: Path) -> dict[str, Path]:
    """``{"plot": draw(res, path)}``, or {} with `PLOT_HINT` in ``res.meta`` without matplotlib."""
    if not have_matplotlib():
        res.meta["plots"] = PLOT_HINT
        return {}
    return {"plot": draw(res, path)}


def plot_result(res: LandscapeResult, outdir: str | Path) -> dict[str, Path]:
    """Every plot for ``res`` into ``outdir``; {} (and a note in ``res.meta``) without matplotlib."""
    if not have_matplotlib():
        res.meta["plots"] = PLOT_HINT
        return {}
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    names = FILES[res.kind]
    if res.kind == "2d":
        return {
            "contour": plot_contour(res, outdir / names["contour"]),
            "surface": plot_surface(res, outdir / names["surface"]),
        }
    return {"line": plot_line(res, outdir / names["line"])}


def compare_1d(
    results: Sequence[LandscapeResult], labels: Sequence[str], path: str | Path, title: str = ""
) -> Path:
    """Several 1D slices (or interpolations) on one log-loss axis, e.g. a sharp and a flat model."""
    fig = _figure()
    ax = fig.add_subplot()
    for i, (r, lab) in enumerate(zip(results, labels, strict=True)):
        _line(ax, r, label=f"{lab}: ", color=f"C{i}")
    ax.set_xlabel("α   (θ* + α·δ, filter-normalized δ)")
    ax.set_ylabel("loss")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8, frameon=False)
    ax.set_title(title or "1D slices", fontsize=10)
    fig.tight_layout()
    fig.savefig(Path(path))
    return Path(path)
