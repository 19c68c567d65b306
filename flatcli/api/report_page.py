"""The results page: `report` writes a sweep's results as one self-contained HTML file.

The correlations are `correlate_report`'s and the paired comparison `compare_measures`', called
with the same options as ``flatcli correlate`` takes, so the page and the terminal table never
disagree; `flatcli.analysis.html_report` renders them.
"""

from __future__ import annotations

import base64
import datetime
import json
import shlex
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..run.results import atomic_write, ensure_writable_dir, json_matches_csv
from ..run.settings import RunOptions
from ..sweep import PLAN_FILE, UNITS_DIR, collect
from ._setup import takes_run
from .sweeps import correlate_report

LANDSCAPE_JSON = ("landscape.json", "pca.json", "connect.json")
INVARIANCE_JSON = "invariance.json"
MAX_LANDSCAPES = 12  # landscape views embedded (their PNGs), the first found in path order
MAX_IMAGE_BYTES = 4 * 2**20  # a larger PNG is named, not embedded


@dataclass
class Completeness:
    """How much of the sweep the table holds: ``planned`` units (checkpoint × measure),
    ``finished`` ones, the unfinished ``(checkpoint, measure)`` pairs and where that was read."""

    planned: int
    finished: int
    missing: list[tuple[str, str]] = field(default_factory=list)
    source: str = ""

    @property
    def complete(self) -> bool:
        """Whether every planned unit finished."""
        return not self.missing and self.finished >= self.planned


@dataclass
class Landscape:
    """A landscape view found beside the results: its JSON file, kind, summary lines and images
    (``(file name, data: URI)``)."""

    path: str
    kind: str
    summary: list[str]
    images: list[tuple[str, str]]


@dataclass
class Invariance:
    """A check-invariance verdict found beside the results (``invariance.json``)."""

    path: str
    checkpoint: str
    describe: str
    passed: bool
    rows: list[dict[str, Any]]


@dataclass
class ReportPage:
    """What `report` made: the page's ``html``, where it was written (``path``, None when not),
    the `flatcli.analysis.CorrelationReport` behind it, the ``--compare`` table (or None) and
    what the page could not draw (``problems``, each also said on the page)."""

    html: str
    path: Path | None
    correlation: Any
    comparison: Any = None
    problems: list[str] = field(default_factory=list)


@dataclass
class _Source:
    """The table to correlate (a path, a DataFrame or a `ResultsTable`), the words naming it, the
    folder searched for landscapes, results.json's metadata and the sweep's completeness when
    read from a plan."""

    table: Any
    name: str
    folder: Path | None
    meta: dict[str, Any]
    completeness: Any = None


# ------------------------------------------------------------------ what RESULTS names
def _meta_beside(csv: Path) -> dict[str, Any]:
    """The results.json written with ``csv`` (``{}`` without one, or for another CSV)."""
    for j in (csv.with_suffix(".json"), csv.parent / "results.json"):
        if j.is_file():
            try:
                doc = json.loads(j.read_text())
            except (OSError, ValueError):
                return {}
            if isinstance(doc, dict) and json_matches_csv(doc, csv):
                return {k: v for k, v in doc.items() if k != "rows"}
            return {}
    return {}


def _is_sweep(folder: Path) -> bool:
    return (folder / PLAN_FILE).is_file() or (folder / UNITS_DIR).is_dir()


def _collected(folder: Path, load) -> tuple[Any, dict[str, Any], Completeness]:
    """The sweep folder's units collected into a temporary results pair (the folder is not
    written) and read with ``load`` (`flatcli.analysis.table.load_results`): its table named by
    the folder, results.json's metadata and the completeness."""
    with tempfile.TemporaryDirectory(prefix="flatcli-report-") as tmp:
        col = collect(folder, Path(tmp) / "results.csv")
        table = load(col.csv_path)
        meta = _meta_beside(col.csv_path)
    table.path = folder
    planned = len(col.rows) * len(col.labels)
    done = Completeness(
        planned, planned - len(col.missing), list(col.missing), f"the units of {folder}"
    )
    return table, meta, done


def _source(results, load) -> _Source:
    """What ``results`` names: a DataFrame or table as it is; a CSV with the results.json beside
    it; a folder's results.csv (completeness from its plan when it is a sweep folder) or, in a
    sweep folder without one, its units collected (``load`` reads a CSV)."""
    if not isinstance(results, (str, Path)):
        return _Source(results, "a DataFrame", None, {})
    path = Path(results).expanduser()
    if path.is_dir():
        csv = path / "results.csv"
        if csv.is_file():
            done = _collected(path, load)[2] if _is_sweep(path) else None
            return _Source(csv, str(path), path, _meta_beside(csv), done)
        if _is_sweep(path):
            table, meta, done = _collected(path, load)
            return _Source(table, f"{path} (its units, collected)", path, meta, done)
        raise ConfigError(
            f"results {path}: a folder without results.csv, plan.json or units/ (give a results CSV or a sweep folder)"
        )
    if not path.is_file():
        raise ConfigError(f"results file not found: {path}")
    return _Source(path, str(path), path.parent, _meta_beside(path))


# ------------------------------------------------------------------ found beside the results
def _data_uri(png: Path) -> str | None:
    try:
        data = png.read_bytes()
    except OSError:
        return None
    if len(data) > MAX_IMAGE_BYTES or not data.startswith(b"\x89PNG"):
        return None
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def _summary_lines(doc: dict[str, Any]) -> list[str]:
    summary = doc.get("summary")
    if isinstance(summary, dict):
        return [f"{k}: {v}" for k, v in summary.items() if isinstance(v, (str, int, float))]
    return []


def landscapes(folder: Path | None) -> list:
    """The landscape views (landscape.json, pca.json, connect.json) under ``folder`` (3 levels
    deep), each with its PNGs inlined."""
    if folder is None:
        return []
    found = []
    for name in LANDSCAPE_JSON:
        for depth in ("", "*/", "*/*/", "*/*/*/"):
            found += folder.glob(depth + name)
    out = []
    for j in sorted(set(found))[:MAX_LANDSCAPES]:
        try:
            doc = json.loads(j.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict):
            continue
        images = []
        for png in sorted(j.parent.glob("*.png")):
            uri = _data_uri(png)
            if uri is not None:
                images.append((png.name, uri))
        kind = str(doc.get("kind") or j.stem)
        out.append(Landscape(str(j.relative_to(folder)), kind, _summary_lines(doc), images))
    return out


def invariance_checks(folder: Path | None) -> list:
    """The check-invariance verdicts (``invariance.json``, written by ``flatcli check-invariance
    -o``) under ``folder`` (3 levels deep)."""
    if folder is None:
        return []
    found = []
    for depth in ("", "*/", "*/*/", "*/*/*/"):
        found += folder.glob(depth + INVARIANCE_JSON)
    out = []
    for j in sorted(set(found)):
        try:
            doc = json.loads(j.read_text())
            rows = [
                {**r, "held_text": "-" if r.get("held") is None else "yes" if r["held"] else "NO"}
                for r in doc["results"]
            ]
            out.append(
                Invariance(
                    str(j.relative_to(folder)),
                    str(doc["checkpoint"]),
                    str(doc.get("describe", "")),
                    bool(doc["passed"]),
                    rows,
                )
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return out


# ------------------------------------------------------------------ the command line
_FLAGS = (
    ("target", "--target"),
    ("by", "--by"),
    ("measures", "-m"),
    ("sort", "--sort"),
    ("where", "--where"),
    ("max_train_loss", "--max-train-loss"),
    ("bootstrap", "--bootstrap"),
    ("confidence", "--confidence"),
    ("color_by", "--color-by"),
    ("compare", "--compare"),
)


def command_line(results, output: Path | None, seed: int, options: dict[str, Any]) -> str:
    """The ``flatcli report`` command that makes this page again (the options as given)."""
    words = ["flatcli", "report", str(results)]
    if output is not None:
        words += ["-o", str(output)]
    for key, flag in _FLAGS:
        v = options.get(key)
        if v is None or (key == "confidence" and v == 0.95):
            continue
        if isinstance(v, (list, tuple)):
            v = ",".join(str(x) for x in v)
        words += [flag, str(v)]
    if seed:
        words += ["--seed", str(seed)]
    return " ".join(shlex.quote(w) for w in words)


# ------------------------------------------------------------------ the entry point
@takes_run
def report(
    results,
    output: str | Path | None = None,
    *,
    color_by: str | None = None,
    compare: str | tuple[str, str] | None = None,
    run: RunOptions | None = None,
    date: str | None = None,
    **table_options: Any,
) -> ReportPage:
    """The results page: one self-contained HTML file (``flatcli report``).

    Parameters
    ----------
    results : str, Path or pandas.DataFrame
        A results CSV (results.json beside it adds the config, versions and device), a folder
        holding results.csv, or a sweep folder (its units are collected without writing there;
        the plan names the unfinished units), or a DataFrame.
    output : str or Path, optional
        Where the page goes; default ``report.html`` in the results' folder (not written for
        a DataFrame without ``output``).
    color_by : str, optional
        The column colouring the scatters (default the first hyperparameter axis; ``"none"``).
    compare : str or (str, str), optional
        ``"A,B"``: the paired comparison of ``flatcli correlate --compare`` (``bootstrap``
        resamples, default 2000).
    run : RunOptions, optional
        Only ``run.seed`` applies: the seed of the bootstraps (default 0).
    date : str, optional
        The date line (default now, UTC): the one line that differs between two runs.
    **table_options
        `correlate_report`'s (``target``, ``by``, ``measures``, ``sort``, ``where``,
        ``max_train_loss``, ``bootstrap``, ``confidence``).

    Returns
    -------
    ReportPage
        The HTML, its path, the correlation report behind it and what it could not draw.

    Examples
    --------
    >>> page = flatcli.report("runs/eval", "runs/eval/report.html", by="lr,width")  # doctest: +SKIP
    >>> page.correlation.measures[0].measure, page.problems                          # doctest: +SKIP
    """
    from ..analysis import compare as cmp  # lazy: pandas, scipy, matplotlib, jinja2
    from ..analysis import html_report, table  # lazy: as above

    src = _source(results, table.load_results)
    out = _output(results, output, src)
    seed = RunOptions.of(run).seed or 0
    table_options.pop("outdir", None)
    table_options.pop("plots", None)
    rep = correlate_report(src.table, run=RunOptions(seed=seed), **table_options)
    comparison = _comparison(cmp, src.table, compare, rep, seed, table_options)
    if src.completeness is not None:
        done = src.completeness
    else:
        measures = [mc.measure for mc in rep.measures]
        missing = html_report.missing_units(table.as_table(src.table), measures)
        planned = rep.n_input * len(measures)
        done = Completeness(planned, planned - len(missing), missing, "the table's status columns")
    inputs = html_report.PageInputs(
        report=rep,
        source=src.name,
        meta=src.meta,
        completeness=done,
        command=command_line(
            results if src.folder is not None else "RESULTS.csv",
            out,
            seed,
            {**table_options, "color_by": color_by, "compare": compare},
        ),
        date=date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        comparison=comparison,
        color_by=color_by,
        landscapes=landscapes(src.folder),
        invariance=invariance_checks(src.folder),
    )
    html, problems = html_report.render_page(inputs)
    if out is not None:
        atomic_write(out, html)
    return ReportPage(html, out, rep, comparison, problems)


def _output(results, output, src: _Source) -> Path | None:
    """The page's path (its folder checked writable first), or None (a DataFrame, no output)."""
    if output is None:
        if src.folder is None:
            return None
        folder = Path(results).expanduser()
        output = (folder if folder.is_dir() else folder.parent) / "report.html"
    out = Path(output).expanduser()
    if out.is_dir():
        raise ConfigError(f"`output` {out} is a folder; name the page's file (e.g. report.html)")
    ensure_writable_dir(out.parent, "the folder of --output")
    return out


def _comparison(cmp, table, compare, rep, seed: int, options: dict[str, Any]):
    """``flatcli correlate --compare``'s table for ``compare`` (None without); ``cmp`` is
    `flatcli.analysis.compare`."""
    if not compare:
        return None
    a, b = cmp.compare_pair(compare)
    return cmp.compare_measures(
        table,
        a,
        b,
        target=rep.target if options.get("target") is None else options["target"],
        bootstrap=options.get("bootstrap") or 2000,
        seed=seed,
        confidence=options.get("confidence", 0.95),
        where=options.get("where"),
        max_train_loss=options.get("max_train_loss"),
    )
