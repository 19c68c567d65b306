"""The results page: a `CorrelationReport` (and what was found beside its table) as one
self-contained HTML file.

The page is a Jinja2 template (``templates/report.html.j2``, autoescaped) with the figures of
`flatcli.analysis.html_figures` inlined as SVG and the landscape images as ``data:`` URIs: no
script, style or image is loaded from anywhere, so the file works offline, from disk or as an
e-mail attachment. Its numbers are the report's (the ranking table's cells are
`flatcli.analysis.rendering`'s, each with its exact value in ``data-value``), so the page and
``flatcli correlate``'s table cannot disagree. The same inputs give the same bytes, apart from
the line with the date (``<p class="date">``).

``pip install 'flatcli[report]'`` (matplotlib and Jinja2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError
from . import html_figures, rendering
from .compare import describe
from .correlation import CorrelationReport

MAX_MATRIX_ROWS = 300  # status matrix rows shown; beyond, the rows with a status other than ok
MAX_NAMES = 20  # names listed in a sentence
TEMPLATE = "report.html.j2"
# matplotlib's markers (`html_figures.STATUS_MARKERS`) as characters, for the page's legend
GLYPHS = {"o": "●", "v": "▼", "X": "✖", "D": "◆", "P": "✚", "s": "■", "*": "★"}


@dataclass
class PageInputs:
    """Everything on the page: the correlation report, the table's source as given, results.json's
    metadata, the sweep's completeness, the ``--compare`` table, the colouring, what was found
    beside the results, the command that reproduces the page and the date line."""

    report: CorrelationReport
    source: str
    meta: dict[str, Any]
    completeness: Any  # flatcli.api.report_page.Completeness
    command: str
    date: str
    comparison: Any = None  # DataFrame of flatcli.analysis.compare.compare_measures
    color_by: str | None = None
    landscapes: list = field(default_factory=list)  # flatcli.api.report_page.Landscape
    invariance: list = field(default_factory=list)  # flatcli.api.report_page.Invariance
    input_rows: int = 0


# ------------------------------------------------------------------ pieces
def _value(v: Any) -> str:
    """A number's exact text for ``data-value`` (``repr``: round-trips), ``nan`` when undefined."""
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else "nan"
    return str(v)


def ranking_rows(report: CorrelationReport) -> tuple[list[str], list[list[dict[str, str]]]]:
    """The ranking table: the terminal table's header and cells (`rendering`), each cell with the
    exact value of its statistic (``value``) and its column key."""
    header = rendering._header(report)
    rows = []
    for r in report.to_rows():
        rows.append(
            [
                {
                    "key": key,
                    "text": rendering._cell(r, key),
                    "value": _value(r[key]),
                    "shade": _shade(r[key]) if key not in ("rank", "n", "measure") else "",
                }
                for _, key in header
            ]
        )
    return [name for name, _ in header], rows


def _shade(v: Any) -> str:
    """A background for a correlation in [-1, 1]: blue for positive, red for negative."""
    if not isinstance(v, float) or not math.isfinite(v):
        return ""
    a = min(1.0, abs(v)) * 0.45
    return f"rgba(33,102,172,{a:.2f})" if v > 0 else f"rgba(178,24,43,{a:.2f})"


def _names(names: list[str]) -> str:
    more = f", … ({len(names) - MAX_NAMES} more)" if len(names) > MAX_NAMES else ""
    return ", ".join(names[:MAX_NAMES]) + more


def status_matrix(report: CorrelationReport) -> dict[str, Any]:
    """Checkpoint × measure statuses of the correlated rows: at most `MAX_MATRIX_ROWS` rows (the
    rows with a status other than ok first when there are more) and the count of each status per
    measure."""
    table = report.table
    measures = [mc.measure for mc in report.measures]
    names = table.row_names() if table is not None else []
    cols = {m: html_figures.statuses(table, m) for m in measures} if table is not None else {}
    rows = [(n, [cols[m][i] for m in measures]) for i, n in enumerate(names)]
    hidden = 0
    if len(rows) > MAX_MATRIX_ROWS:
        flagged = [r for r in rows if any(s != "ok" for s in r[1])]
        shown = flagged[:MAX_MATRIX_ROWS]
        hidden = len(rows) - len(shown)
        rows = shown
    counts = {m: {} for m in measures}
    for m in measures:
        for s in cols[m]:
            counts[m][s] = counts[m].get(s, 0) + 1
    return {
        "measures": measures,
        "rows": [(n, [(s, _css(s)) for s in st]) for n, st in rows],
        "hidden": hidden,
        "counts": {
            m: ", ".join(f"{k} {v}" for k, v in sorted(c.items())) for m, c in counts.items()
        },
    }


def _css(status: str) -> str:
    base, _, bound = status.partition(", ")
    return "st-" + base.replace(" ", "-") + (" st-bound" if bound else "")


def header_facts(inp: PageInputs) -> list[tuple[str, str]]:
    """The header's facts: source, target, checkpoints, measures, units and the metadata."""
    rep, meta, comp = inp.report, inp.meta, inp.completeness
    rows = f"{rep.n_rows}" + (f" of {rep.n_input} (after the filters)" if rep.filters else "")
    units = f"{comp.finished} of {comp.planned} finished" + (
        f" ({comp.source})" if comp.source else ""
    )
    facts = [
        ("results", inp.source),
        ("target", rep.caption.removeprefix("target: ") or rep.target),
        ("checkpoints correlated", rows),
        ("measures", f"{len(rep.measures)} (from {rep.measures_source})"),
        ("hyperparameter axes", ", ".join(rep.axes) or "none"),
        ("units (checkpoint × measure)", units),
        ("config hash", str(meta.get("config_hash") or "not recorded")),
        ("device", str(meta.get("device") or "not recorded")),
    ]
    versions = meta.get("versions")
    if isinstance(versions, dict) and versions:
        facts.append(("versions", ", ".join(f"{k} {v}" for k, v in versions.items())))
    else:
        facts.append(("versions", "not recorded"))
    return facts


def _config_text(meta: dict[str, Any]) -> str:
    cfg = meta.get("config")
    if not cfg:
        return ""
    import yaml

    return yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True)


def comparison_lines(df) -> list[tuple[str, str]]:
    """``--compare``: (verdict, the line `flatcli correlate --compare` prints) per statistic."""
    if df is None:
        return []
    return [(str(v), line) for v, line in zip(df["verdict"], describe(df), strict=True)]


def missing_units(table, measures: list[str]) -> list[tuple[str, str]]:
    """The (checkpoint, measure) cells of a table without a status: not run."""
    names = table.row_names()
    return [
        (names[i], m)
        for m in measures
        for i, s in enumerate(html_figures.statuses(table, m))
        if s == "not run"
    ]


# ------------------------------------------------------------------ the page
def _environment():
    try:
        import jinja2
    except ImportError:
        raise ConfigError("the report needs Jinja2: pip install 'flatcli[report]'") from None
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def scatters(inp: PageInputs) -> tuple[list[html_figures.Scatter], str]:
    """Every measure's scatter (ranked order) and the colouring in words."""
    rep = inp.report
    table = rep.table
    color = html_figures.ColorBy.choose(rep, table, inp.color_by)
    out = [
        html_figures.scatter_svg(table, rep, mc, color, f"s{k}")
        for k, mc in enumerate(rep.measures)
    ]
    words = (
        "one colour"
        if color is None
        else f"coloured by {color.name}" + (" (colour bar)" if color.numeric else "")
    )
    return out, words


def render_page(inp: PageInputs) -> tuple[str, list[str]]:
    """The page's HTML and the list of what it could not draw (each said on the page too)."""
    rep = inp.report
    if rep.table is None:
        raise ConfigError("the report page needs the table the correlations were computed from")
    problems: list[str] = []
    n_target = int(np.isfinite(rep.table.numeric(rep.target)).sum())
    if n_target < 3:
        problems.append(
            f"only {n_target} checkpoint(s) with a finite {rep.target}: no correlation is "
            "defined (it needs ≥ 3)"
        )
    plots, colouring = scatters(inp)
    for s in plots:
        if not s.drawn:
            problems.append(f"{s.measure}: no checkpoint with a finite value and target to draw")
    ranked = [mc for mc in rep.measures if math.isfinite(mc.get(rep.sort))]
    if len(ranked) < len(rep.measures):
        problems.append(
            f"{len(rep.measures) - len(ranked)} measure(s) without a defined "
            f"{rendering.TITLES[rep.sort]}: ranked last ({_names([mc.measure for mc in rep.measures if mc not in ranked])})"
        )
    header, rows = ranking_rows(rep)
    html = (
        _environment()
        .get_template(TEMPLATE)
        .render(
            inp=inp,
            rep=rep,
            title=rendering.title(rep),
            facts=header_facts(inp),
            config_text=_config_text(inp.meta),
            missing_text=_names([f"{c} × {m}" for c, m in inp.completeness.missing]),
            notes=rendering.notes(rep),
            header=header,
            rows=rows,
            ranking_svg=html_figures.ranking_svg(rep),
            comparison=comparison_lines(inp.comparison),
            scatters=plots,
            colouring=colouring,
            not_drawn_text={
                s.measure: "; ".join(f"{why}: {_names(n)}" for why, n in s.not_drawn.items())
                for s in plots
            },
            matrix=status_matrix(rep),
            markers={s: GLYPHS[m] for s, m in html_figures.STATUS_MARKERS.items()},
            problems=problems,
        )
    )
    return html, problems
