"""The landscape result: the grid, its summary, and its CSV / JSON files.

``landscape.csv`` holds one row per grid point with the columns
``alpha[, beta], train_loss, train_acc, test_loss, test_acc`` (for an
interpolation ``alpha`` is t; the test columns are empty when no test data is
configured; accuracy is empty for non-class outputs). 2D grids list ``beta``
fastest. ``landscape.json`` holds the summary and how the grid was made.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..run.results import jsonable

CSV_METRICS = ("train_loss", "train_acc", "test_loss", "test_acc")


@dataclass
class LandscapeResult:
    """A 1D slice, a 2D slice or an interpolation.

    ``alpha`` (and ``beta`` for 2D) are the grid axes; the metric arrays have
    shape ``(len(alpha),)`` or ``(len(alpha), len(beta))``; ``test_*`` are None
    without test data. ``summary`` holds the numbers the CLI prints (see
    `summarize`), ``meta`` how the grid was made, ``files`` what was written.
    """

    kind: str  # "1d" | "2d" | "interpolation"
    alpha: np.ndarray
    beta: np.ndarray | None
    train_loss: np.ndarray
    train_acc: np.ndarray
    test_loss: np.ndarray | None = None
    test_acc: np.ndarray | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)
    seconds: float = 0.0

    def metric(self, name: str) -> np.ndarray | None:
        """The metric array ``name`` (e.g. "test_loss"); None for a split without data."""
        return getattr(self, name)

    def rows(self) -> list[dict[str, float | None]]:
        """One dict per grid point, in CSV order."""
        out = []
        if self.kind == "2d":
            idx = [(i, j) for i in range(len(self.alpha)) for j in range(len(self.beta))]
        else:
            idx = [(i,) for i in range(len(self.alpha))]
        for ij in idx:
            row: dict[str, float | None] = {"alpha": float(self.alpha[ij[0]])}
            if self.kind == "2d":
                row["beta"] = float(self.beta[ij[1]])
            for m in CSV_METRICS:
                arr = self.metric(m)
                row[m] = None if arr is None else float(arr[ij])
            out.append(row)
        return out

    def to_csv(self) -> str:
        """``landscape.csv`` as text: one row per grid point (see the module docstring); NaN and
        missing values are empty cells, numbers are written with ``repr`` (round-trip exact)."""
        cols = ["alpha"] + (["beta"] if self.kind == "2d" else []) + list(CSV_METRICS)
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=cols, lineterminator="\n")
        w.writeheader()
        for r in self.rows():
            w.writerow(
                {
                    k: ("" if v is None or (isinstance(v, float) and math.isnan(v)) else repr(v))
                    for k, v in r.items()
                }
            )
        return buf.getvalue()

    def to_json(self) -> dict[str, Any]:
        """``landscape.json`` as a JSON-ready dict: kind, summary, seconds and the meta entries."""
        return jsonable(
            {"kind": self.kind, "summary": self.summary, "seconds": self.seconds, **self.meta}
        )


def _at(axis: np.ndarray, value: float) -> int:
    return int(np.argmin(np.abs(axis - value)))


def summarize(res: LandscapeResult) -> dict[str, Any]:
    """Summary numbers for each configured split ``s`` in (train, test).

    1D slice: ``s_loss_center`` (α = 0, the checkpoint), ``s_loss_min`` and where
    (``s_loss_argmin``), ``s_loss_max``, and ``s_loss_rise = max − center`` over
    the span (a crude sharpness of the curve: how much the loss grows within
    the span). 2D: the same without ``rise``; ``argmin`` is ``[alpha, beta]``.

    Interpolation θ(t) = (1 − t)θ_a + tθ_b: ``s_loss_a``, ``s_loss_b`` and the
    barrier height

        barrier = max_{t ∈ [0, 1]} L(θ(t)) − max(L(θ_a), L(θ_b)),

    over the grid points in [0, 1] (both endpoints included), so barrier ≥ 0 and
    barrier = 0 means the straight path never climbs above the worse endpoint.
    ``s_error_barrier`` is the same for the error 1 − accuracy. (Frankle et al.
    2020 measure error against the mean of the endpoints instead; with the max
    the barrier is 0 for a monotone path between minima of different depth.)
    """
    out: dict[str, Any] = {}
    for s in ("train", "test"):
        loss, acc = res.metric(f"{s}_loss"), res.metric(f"{s}_acc")
        if loss is None:
            continue
        if res.kind == "interpolation":
            inside = (res.alpha >= 0) & (res.alpha <= 1)
            ia, ib = _at(res.alpha, 0.0), _at(res.alpha, 1.0)
            la, lb = float(loss[ia]), float(loss[ib])
            out[f"{s}_loss_a"], out[f"{s}_loss_b"] = la, lb
            out[f"{s}_loss_max"] = float(np.max(loss[inside]))
            out[f"{s}_loss_barrier"] = out[f"{s}_loss_max"] - max(la, lb)
            if not np.all(np.isnan(acc)):
                err = 1.0 - acc
                out[f"{s}_acc_a"], out[f"{s}_acc_b"] = float(acc[ia]), float(acc[ib])
                out[f"{s}_error_barrier"] = float(np.max(err[inside])) - max(
                    float(err[ia]), float(err[ib])
                )
            continue
        if res.kind == "1d":
            center = float(loss[_at(res.alpha, 0.0)])
            amin = float(res.alpha[int(np.nanargmin(loss))])
        else:
            center = float(loss[_at(res.alpha, 0.0), _at(res.beta, 0.0)])
            i, j = np.unravel_index(int(np.nanargmin(loss)), loss.shape)
            amin = [float(res.alpha[i]), float(res.beta[j])]
        out[f"{s}_loss_center"] = center
        out[f"{s}_loss_min"] = float(np.nanmin(loss))
        out[f"{s}_loss_argmin"] = amin
        out[f"{s}_loss_max"] = float(np.nanmax(loss))
        if res.kind == "1d":
            out[f"{s}_loss_rise"] = out[f"{s}_loss_max"] - center
    return out
