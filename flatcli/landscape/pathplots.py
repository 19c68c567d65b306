"""PNG plots of the trajectory-PCA and mode-connectivity views (matplotlib, headless Agg).

* `plot_trajectory`: filled contours of the train loss over the PCA plane
  (log-spaced levels when the loss spans more than a decade), the projected
  checkpoints joined in training order, the explained variance of each
  direction on its axis and in the title.
* `plot_connect`: train (solid) and test (dashed) loss along t for the line
  and the fitted curve on a log axis, and the train/test error beside it; the
  title states both barrier heights.

This module imports `flatcli.landscape.plots` (figure helpers); only
`flatcli.landscape.output` imports it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .connect import ConnectResult
from .pca import TrajectoryResult
from .plots import _figure, _loss_contours, _positive


def plot_trajectory(res: TrajectoryResult, path: str | Path, title: str | None = None) -> Path:
    """Contours of the train loss over the plane of the two PCA directions, with the projected path."""
    s = res.surface
    r1, r2 = (float(r) for r in res.explained_variance_ratio)
    fig = _figure(5.8, 4.6)
    ax = fig.add_subplot()
    _loss_contours(fig, ax, s.alpha, s.beta, s.train_loss)
    pa, pb = np.asarray(res.path["alpha"]), np.asarray(res.path["beta"])
    ax.plot(pa, pb, "-", color="red", lw=1.2, label="trajectory (projected)")
    ax.plot(pa, pb, "o", color="red", ms=2.5)
    ax.plot(pa[:1], pb[:1], "o", color="white", mec="red", ms=6, label="first checkpoint")
    ax.plot([0], [0], "*", color="yellow", mec="black", ms=11, label="last checkpoint θ_T")
    ax.set_xlim(s.alpha[0], s.alpha[-1])
    ax.set_ylim(s.beta[0], s.beta[-1])
    ax.set_xlabel(f"PC1 ({100 * r1:.1f}% of the variance)")
    ax.set_ylabel(f"PC2 ({100 * r2:.1f}% of the variance)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, fontsize=7, frameon=False)
    ax.set_title(
        title
        or f"trajectory PCA ({len(pa)} checkpoints): explained variance {100 * r1:.1f}% + {100 * r2:.1f}%",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(Path(path))
    return Path(path)


def _barrier(summary: dict, key: str) -> str:
    v = summary.get(key)
    return "–" if v is None else f"{v:.3g}"


def plot_connect(res: ConnectResult, path: str | Path, title: str | None = None) -> Path:
    """Loss and error along t for the straight line and the fitted Bezier curve."""
    fig = _figure(8.4, 3.9)
    ax, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    ax.set_yscale("log")
    have_acc = False
    for color, name, r in (("C0", "line", res.line), ("C3", "curve", res.curve)):
        t = r.alpha
        ax.plot(t, _positive(r.train_loss), "-", color=color, label=f"{name}: train")
        if r.test_loss is not None:
            ax.plot(t, _positive(r.test_loss), "--", color=color, label=f"{name}: test")
        if not np.all(np.isnan(r.train_acc)):
            have_acc = True
            ax2.plot(t, 1 - r.train_acc, "-", color=color, label=f"{name}: train")
            if r.test_acc is not None:
                ax2.plot(t, 1 - r.test_acc, "--", color=color, label=f"{name}: test")
    ax.set_xlabel("t")
    ax.set_ylabel("loss")
    ax.legend(fontsize=7, frameon=False)
    if have_acc:
        ax2.set_xlabel("t")
        ax2.set_ylabel("error (1 − accuracy)")
        ax2.set_ylim(bottom=0)
        ax2.legend(fontsize=7, frameon=False)
    else:
        ax2.set_axis_off()
    sm = res.summary
    fig.suptitle(
        title
        or (
            "mode connectivity: train-loss barrier "
            f"line {_barrier(sm, 'line_train_loss_barrier')}, "
            f"Bezier curve {_barrier(sm, 'curve_train_loss_barrier')}"
        ),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(Path(path))
    return Path(path)
