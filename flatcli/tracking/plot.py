"""`plot_track`: a tracked run's measures against the step, with the stability thresholds.

Each measure gets a panel. For a sharpness that gradient descent at step size η keeps below 2/η
(`flatcli.measures.during_training.gd_threshold`), the panel draws 2/η from the rows' learning
rate (Cohen et al. 2021); a measure that records its own threshold (``<label>_threshold``, the
preconditioned sharpness: (2 + 2β₁)/((1 − β₁)η) for Adam) gets that line. Rows whose status is
not ``ok`` are drawn hollow.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import ConfigError
from ..measures.during_training import gd_threshold
from .track_files import JSON_NAME


def read_track(folder: str | Path) -> tuple[dict, list[dict]]:
    """(settings, rows) of a tracker's output folder (or its ``track.json``)."""
    path = Path(folder)
    path = path / JSON_NAME if path.is_dir() else path
    if not path.is_file():
        raise ConfigError(f"no tracker output at {path}")
    try:
        doc = json.loads(path.read_text())
        rows = [r["row"] for r in doc["rows"]]
        measures = {m["label"]: m["name"] for m in doc["measures"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path} is not a tracker's output ({e})") from None
    return {**doc, "labels": measures}, rows


def _figure(panels: int):
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("`plot_track` needs matplotlib: pip install 'flatcli[plot]'") from None
    fig = Figure(figsize=(7, 2.6 * panels), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _series(rows: list[dict], col: str) -> tuple[list, list]:
    pts = [(r["step"], r.get(col)) for r in rows]
    pts = [(s, v) for s, v in pts if isinstance(v, (int, float)) and math.isfinite(v)]
    return [s for s, _ in pts], [v for _, v in pts]


def _panel(ax, rows: list[dict], label: str, name: str) -> None:
    steps, vals = _series(rows, label)
    ok = {r["step"] for r in rows if r.get(f"{label}_status") == "ok"}
    ax.plot(steps, vals, "-", color="C0", lw=1, label=label)
    full = [(s, v) for s, v in zip(steps, vals, strict=True) if s in ok]
    rest = [(s, v) for s, v in zip(steps, vals, strict=True) if s not in ok]
    if full:
        ax.plot(*zip(*full, strict=True), "o", color="C0", ms=3)
    if rest:
        ax.plot(*zip(*rest, strict=True), "o", mfc="none", color="C0", ms=4, label="not ok")
    if gd_threshold(name):
        s, lr = _series(rows, "lr")
        if s:
            ax.plot(s, [2.0 / v for v in lr], "--", color="C3", lw=1, label="2/η")
    s, thr = _series(rows, f"{label}_threshold")
    if s:
        ax.plot(s, thr, "--", color="C2", lw=1, label="(2+2β₁)/((1−β₁)η)")
    ax.set_ylabel(label)
    ax.legend(loc="best", fontsize=8)


def plot_track(
    folder: str | Path, measures: list[str] | None = None, output: str | Path | None = None
) -> Path:
    """Draw a tracked run's measures against the step into a PNG.

    Parameters
    ----------
    folder : str or Path
        The tracker's output folder (or its ``track.json``).
    measures : list of str, optional
        Labels to draw (default: every measure of the run).
    output : str or Path, optional
        The PNG (default ``FOLDER/track.png``).

    Returns
    -------
    Path
        The PNG written.
    """
    fig = track_figure(folder, measures)
    base = Path(folder)
    out = (
        Path(output)
        if output is not None
        else (base if base.is_dir() else base.parent) / "track.png"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def track_figure(folder: str | Path, measures: list[str] | None = None):
    """The figure of `plot_track` (a matplotlib Figure on an Agg canvas, one panel per label)."""
    meta, rows = read_track(folder)
    labels = meta["labels"]
    chosen = list(labels) if not measures else list(measures)
    unknown = [m for m in chosen if m not in labels]
    if unknown:
        raise ConfigError(
            f"measure {unknown[0]!r} is not in this run; it has: {', '.join(labels) or '(none)'}"
        )
    if not rows:
        raise ConfigError(f"{folder} holds no rows yet")
    fig = _figure(len(chosen))
    axes = fig.subplots(len(chosen), 1, sharex=True, squeeze=False)[:, 0]
    for ax, label in zip(axes, chosen, strict=True):
        _panel(ax, rows, label, labels[label])
    axes[-1].set_xlabel("step")
    return fig
