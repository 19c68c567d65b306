"""The figures of the results page (`flatcli.analysis.html_report`) as inline SVG text.

matplotlib's SVG canvas (no pyplot: headless and thread-safe), written deterministically: the
ids matplotlib derives from ``svg.hashsalt`` get a fixed salt per figure (distinct figures on
one page never share an id), the ``Date`` metadata is left out and text stays text
(``svg.fonttype: none``). The XML prologue, the metadata and the namespace declarations are
dropped (inline SVG in HTML needs none of them) and ``xlink:href`` becomes ``href``, so the
figure names no external address.

* `scatter_svg`: one measure against the target, one point per checkpoint with a value, coloured
  by a hyperparameter (`ColorBy`), its marker saying the measure's status (`STATUS_MARKERS`;
  hollow when the value is a bound); every point has a ``<title>`` (its hover text) naming the
  checkpoint, its hyperparameters, the value, the target and the status.
* `ranking_svg`: Kendall τ-b per measure (with its bootstrap interval) and Ψ, best first.
"""

from __future__ import annotations

import io
import math
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

import numpy as np

from ..errors import ConfigError
from .correlation import CorrelationReport, MeasureCorrelation
from .table import ResultsTable, _natural, resolve_column, usable

SVG_NS = "http://www.w3.org/2000/svg"
XLINK_NS = "http://www.w3.org/1999/xlink"
SALT = "flatcli-report"
# a measure's status -> its marker on the scatter (other statuses: OTHER_MARKER)
STATUS_MARKERS = {
    "ok": "o",
    "budget": "v",
    "not_converged": "X",
    "near_zero": "D",
    "saturated": "P",
    "not_applicable": "s",
}
OTHER_MARKER = "*"
MAX_LEVELS = 12  # colour levels shown as a legend; more (numeric) become a colour bar


def _figure(**kwargs):
    """A matplotlib Figure on an SVG canvas; `ConfigError` with the install hint without matplotlib."""
    try:
        from matplotlib.backends.backend_svg import FigureCanvasSVG
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("the report needs matplotlib: pip install 'flatcli[report]'") from None
    fig = Figure(**kwargs)
    FigureCanvasSVG(fig)
    return fig


def _tag(name: str) -> str:
    return f"{{{SVG_NS}}}{name}"


def _points(group: ET.Element) -> list[ET.Element]:
    """The drawn markers of a path collection's group, in drawing order (not its ``<defs>``)."""
    in_defs = {id(e) for d in group.iter(_tag("defs")) for e in d.iter()}
    return [
        e for e in group.iter() if e.tag in (_tag("use"), _tag("path")) and id(e) not in in_defs
    ]


def finish_svg(text: str, titles: dict[str, list[str]] | None = None) -> str:
    """Matplotlib's SVG as inline SVG for HTML: without prologue, metadata and namespace
    declarations, ``href`` for ``xlink:href``, and a ``<title>`` for each marker of the groups
    named in ``titles`` (gid -> one text per point, in drawing order)."""
    ET.register_namespace("", SVG_NS)
    ET.register_namespace("xlink", XLINK_NS)
    root = ET.fromstring(text)
    for meta in root.findall(_tag("metadata")):
        root.remove(meta)
    for group in root.iter(_tag("g")):
        texts = (titles or {}).get(group.get("id", ""))
        if texts is None:
            continue
        points = _points(group)
        if len(points) != len(texts):  # pragma: no cover - matplotlib drew otherwise than asked
            raise RuntimeError(
                f"{len(points)} markers for {len(texts)} titles in {group.get('id')}"
            )
        for el, t in zip(points, texts, strict=True):
            title = ET.Element(_tag("title"))
            title.text = t
            el.insert(0, title)
    out = ET.tostring(root, encoding="unicode")
    out = re.sub(r'\s+xmlns(:\w+)?="[^"]*"', "", out, count=0)
    return out.replace("xlink:href=", "href=")


def to_svg(fig, key: str, titles: dict[str, list[str]] | None = None) -> str:
    """The figure as deterministic inline SVG (`finish_svg`); ``key`` salts its ids."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": f"{SALT}-{key}", "svg.fonttype": "none"}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    return finish_svg(buf.getvalue(), titles)


# ------------------------------------------------------------------ statuses
def statuses(table: ResultsTable, measure: str) -> list[str]:
    """Each row's status of ``measure``: its ``<measure>_status`` (``"not run"`` when empty),
    with the bound its value is (``"budget, lower bound"``) from ``<measure>_bound``; ``"ok"``
    for a table without status columns."""
    col = f"{measure}_status"
    if col not in table.columns:
        return ["ok"] * len(table.frame)
    bounds = (
        table.strings(f"{measure}_bound")
        if f"{measure}_bound" in table.columns
        else [""] * len(table.frame)
    )
    out = []
    for s, b in zip(table.strings(col), bounds, strict=True):
        s = s or "not run"
        out.append(f"{s}, {b}" if b and s != "not run" else s)
    return out


def marker_of(status: str) -> tuple[str, bool]:
    """(marker, hollow) of a status: hollow when the value is a bound."""
    base, _, bound = status.partition(", ")
    return STATUS_MARKERS.get(base, OTHER_MARKER), bool(bound)


# ------------------------------------------------------------------ colour
@dataclass
class ColorBy:
    """How points are coloured: by the column ``column`` (axis name ``name``), one colour per
    level when it has at most `MAX_LEVELS`, else along a colour bar (numeric columns)."""

    name: str
    column: str
    levels: list[str] = field(default_factory=list)
    numeric: bool = False

    @classmethod
    def choose(
        cls, report: CorrelationReport, table: ResultsTable, name: str | None
    ) -> ColorBy | None:
        """The colouring for ``name`` (a column, as ``--by`` names them; ``"none"``: one colour);
        default the report's first axis, else None."""
        if name is not None and name.lower() == "none":
            return None
        if name is None:
            if not report.axes:
                return None
            ax = report.axes[0]
            name, column = ax, report.axis_columns.get(ax, f"hp_{ax}")
        elif name in report.axis_columns:
            column = report.axis_columns[name]
        else:
            name, column = resolve_column(table, name, "`color_by`")
        levels = sorted({v for v in table.strings(column) if v}, key=_natural)
        numeric = len(levels) > MAX_LEVELS and bool(np.isfinite(table.numeric(column)).any())
        return cls(name, column, levels, numeric)

    def colors(self, table: ResultsTable) -> np.ndarray:
        """An RGBA row per table row (grey where the row has no value)."""
        import matplotlib

        n = len(table.frame)
        out = np.tile(np.array([0.6, 0.6, 0.6, 1.0]), (n, 1))
        if self.numeric:
            v = table.numeric(self.column)
            fin = np.isfinite(v)
            lo, hi = (float(v[fin].min()), float(v[fin].max())) if fin.any() else (0.0, 1.0)
            norm = matplotlib.colors.Normalize(lo, hi if hi > lo else lo + 1)
            out[fin] = matplotlib.colormaps["viridis"](norm(v[fin]))
            return out
        cmap = matplotlib.colormaps["viridis"].resampled(max(2, len(self.levels)))
        index = {lev: k for k, lev in enumerate(self.levels)}
        for i, s in enumerate(table.strings(self.column)):
            if s in index:
                out[i] = cmap(index[s])
        return out


# ------------------------------------------------------------------ scatter
def _fmt(v: float) -> str:
    return "nan" if not math.isfinite(v) else f"{v:+.2f}"


def point_titles(
    table: ResultsTable, report: CorrelationReport, measure: str, rows: np.ndarray
) -> list[str]:
    """The hover text of each row in ``rows``: checkpoint, hyperparameters, value, target, status."""
    names = table.row_names()
    hp = {a: table.strings(c) for a, c in report.axis_columns.items()}
    m, g = table.numeric(measure), table.numeric(report.target)
    st = statuses(table, measure)
    out = []
    for i in rows:
        axes = ", ".join(f"{a}={v[i]}" for a, v in hp.items())
        out.append(
            f"{names[i]}\n{axes + chr(10) if axes else ''}{measure} = {m[i]:.6g}, "
            f"{report.target} = {g[i]:.6g}\nstatus: {st[i]}"
        )
    return out


@dataclass
class Scatter:
    """One measure's scatter: the SVG, how many points it draws, and the rows it could not draw
    (no finite value or target, or a failed measure) by their status."""

    measure: str
    svg: str
    drawn: int
    not_drawn: dict[str, list[str]]
    status_counts: dict[str, int]


def _groups(st: list[str], rows: np.ndarray) -> dict[str, np.ndarray]:
    """Row indices of ``rows`` by status, ``ok`` first then by name."""
    keys = sorted({st[i] for i in rows}, key=lambda s: (s != "ok", s))
    return {k: np.array([i for i in rows if st[i] == k], dtype=int) for k in keys}


def _legend(ax, color: ColorBy | None, groups: dict[str, np.ndarray]) -> None:
    """A legend of the colour levels (not for a colour bar) and of the statuses drawn."""
    from matplotlib.lines import Line2D

    handles = []
    if color is not None and not color.numeric:
        cmap = _level_colors(color)
        handles += [
            Line2D([], [], ls="", marker="o", color=cmap[k], markeredgecolor="k",
                   markeredgewidth=0.3, label=f"{color.name}={lev}")
            for k, lev in enumerate(color.levels)
        ]  # fmt: skip
    for status in groups:
        marker, hollow = marker_of(status)
        handles.append(
            Line2D([], [], ls="", marker=marker, color="0.45",
                   markerfacecolor="none" if hollow else "0.6", markeredgecolor="0.2",
                   markeredgewidth=0.6, label=status)
        )  # fmt: skip
    if handles:
        ax.legend(handles=handles, fontsize=6, loc="best", framealpha=0.7)


def _level_colors(color: ColorBy) -> list:
    """The colour of each level of a categorical `ColorBy` (as `ColorBy.colors` gives them)."""
    import matplotlib

    cmap = matplotlib.colormaps["viridis"].resampled(max(2, len(color.levels)))
    return [cmap(k) for k in range(len(color.levels))]


MAX_COLOUR_GROUPS = 16  # a status's points drawn as one collection per colour up to this many


def _same_colour(colors: np.ndarray, idx: np.ndarray) -> list[tuple[np.ndarray, bool]]:
    """``idx`` split by colour, each part with True (in first-seen order; matplotlib's SVG writes
    a one-colour collection about twice as fast), or ``[(idx, False)]`` when it holds more colours
    than `MAX_COLOUR_GROUPS` (a colour bar)."""
    if not len(idx):
        return []
    _, first, inverse = np.unique(colors[idx], axis=0, return_index=True, return_inverse=True)
    if len(first) > MAX_COLOUR_GROUPS:
        return [(idx, False)]
    inverse = inverse.reshape(-1)
    return [(idx[inverse == u], True) for u in np.argsort(first)]


def scatter_svg(
    table: ResultsTable,
    report: CorrelationReport,
    mc: MeasureCorrelation,
    color: ColorBy | None,
    key: str,
) -> Scatter:
    """The scatter of ``mc.measure`` against the report's target over the rows correlate used
    (`usable`: finite value and target, not failed); ``key`` names the figure's ids."""
    m, g = table.numeric(mc.measure), table.numeric(report.target)
    ok = usable(table, mc.measure, report.target)
    st = statuses(table, mc.measure)
    names = table.row_names()
    rows = np.flatnonzero(ok)
    colors = (
        color.colors(table) if color is not None else np.tile([0.12, 0.47, 0.71, 1.0], (len(m), 1))
    )
    fig = _figure(figsize=(4.4, 3.4), dpi=100)
    ax = fig.subplots()
    groups = _groups(st, rows)
    texts = point_titles(table, report, mc.measure, np.arange(len(m)))
    titles: dict[str, list[str]] = {}
    for j, (status, idx) in enumerate(groups.items()):
        marker, hollow = marker_of(status)
        for k, (sub, one) in enumerate(_same_colour(colors, idx)):
            c = [tuple(colors[sub[0]])] if one else colors[sub]
            face, edge = ("none", c) if hollow else (c, "k")
            coll = ax.scatter(m[sub], g[sub], marker=marker, s=26, facecolors=face,
                              edgecolors=edge, linewidths=1.1 if hollow else 0.3, zorder=2)  # fmt: skip
            gid = f"{key}-p{j}-{k}"
            coll.set_gid(gid)
            titles[gid] = [texts[i] for i in sub]
    if color is not None and color.numeric:
        import matplotlib

        v = table.numeric(color.column)
        fin = v[np.isfinite(v)]
        sm = matplotlib.cm.ScalarMappable(
            norm=matplotlib.colors.Normalize(fin.min(), fin.max()), cmap="viridis"
        )
        fig.colorbar(sm, ax=ax, fraction=0.05).set_label(color.name, fontsize=7)
    _legend(ax, color, groups)
    if len(rows) and np.all(m[rows] > 0) and m[rows].max() / m[rows].min() > 100:
        ax.set_xscale("log")
    psi = f", Ψ={_fmt(mc.psi)}" if report.axes else ""
    ax.set_title(f"{mc.measure}: τ-b={_fmt(mc.kendall_tau_b)}{psi} (n={mc.n})", fontsize=8)
    ax.set_xlabel(mc.measure, fontsize=7)
    ax.set_ylabel(report.target, fontsize=7)
    ax.tick_params(labelsize=6)
    fig.tight_layout()
    not_drawn: dict[str, list[str]] = {}
    for i in np.flatnonzero(~ok):
        why = st[i] if st[i] in ("error", "not run") else "no finite value or target"
        not_drawn.setdefault(why, []).append(names[i])
    counts: dict[str, int] = {}
    for s in st:
        counts[s] = counts.get(s, 0) + 1
    return Scatter(mc.measure, to_svg(fig, key, titles), len(rows), not_drawn, counts)


# ------------------------------------------------------------------ ranking
def ranking_svg(report: CorrelationReport) -> str | None:
    """Kendall τ-b (with its bootstrap interval) and Ψ of each measure, best first; None without
    a measure."""
    k = len(report.measures)
    if not k:
        return None
    fig = _figure(figsize=(5.2, 0.28 * k + 1.1), dpi=100)
    ax = fig.subplots()
    ys = np.arange(k)[::-1]
    tau = np.array([mc.kendall_tau_b for mc in report.measures])
    lo = np.array([mc.intervals["kendall_tau_b"].lo if "kendall_tau_b" in mc.intervals else np.nan
                   for mc in report.measures])  # fmt: skip
    hi = np.array([mc.intervals["kendall_tau_b"].hi if "kendall_tau_b" in mc.intervals else np.nan
                   for mc in report.measures])  # fmt: skip
    has = np.isfinite(lo) & np.isfinite(hi) & np.isfinite(tau)
    if has.any():
        ax.errorbar(tau[has], ys[has], xerr=[tau[has] - lo[has], hi[has] - tau[has]], fmt="none",
                    ecolor="0.4", elinewidth=1, capsize=2, zorder=1)  # fmt: skip
    ax.scatter(tau, ys, marker="o", s=24, color="C0", label="Kendall τ-b", zorder=2)
    if report.axes:
        psi = np.array([mc.psi for mc in report.measures])
        ax.scatter(psi, ys, marker="D", s=20, color="C3", label="Ψ", zorder=3)
    ax.axvline(0, color="0.7", lw=0.8, zorder=0)
    ax.set_xlim(-1.05, 1.05)
    ax.set_yticks(ys, [mc.measure for mc in report.measures], fontsize=7)
    ax.tick_params(axis="x", labelsize=6)
    ax.set_xlabel(f"correlation with {report.target}", fontsize=7)
    ax.legend(fontsize=6, loc="lower right", framealpha=0.7)
    fig.tight_layout()
    return to_svg(fig, "ranking")
