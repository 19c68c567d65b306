"""``flatcli report``: a sweep's results as one self-contained HTML page (`flatcli.api.report`).

The options it shares with ``flatcli correlate`` (target, axes, measures, sort, filters,
bootstrap, ``--compare``) are correlate's own parameters, read from its signature, so the two
commands take the same flags with the same meaning and help."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Annotated

import typer

from ..console import StageProgress, console, err_console
from . import explore
from ._app import DebugOpt, FitHelp, app, handle_errors, run_options

# correlate's options that the page takes as they are
SHARED = (
    "target",
    "by",
    "measures",
    "sort",
    "where",
    "max_train_loss",
    "bootstrap",
    "seed",
    "confidence",
    "compare",
)


def _own(
    results: Annotated[
        Path,
        typer.Argument(
            help="A results CSV (from 'flatcli measure' or 'flatcli collect', or any table with one row per "
            "checkpoint), a folder holding results.csv, or a sweep folder (its units are collected; unfinished "
            "ones are named)."
        ),
    ],
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            help="The HTML file to write (default: report.html in the results' folder).",
        ),
    ] = None,
    color_by: Annotated[
        str | None,
        typer.Option(
            "--color-by",
            help="Column colouring the scatters (default the first hyperparameter axis; 'none' for one colour).",
        ),
    ] = None,
    debug: DebugOpt = False,
):
    """The report command's own parameters (a signature only; `report` below runs)."""


def _signature() -> inspect.Signature:
    """``_own``'s parameters, then correlate's `SHARED` ones (keyword-only, as Typer reads them)."""
    own = list(inspect.signature(_own, eval_str=True).parameters.values())
    theirs = inspect.signature(explore.correlate, eval_str=True).parameters
    shared = [theirs[n].replace(kind=inspect.Parameter.KEYWORD_ONLY) for n in SHARED]
    kw = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own[1:]]
    return inspect.Signature([own[0], *kw[:-1], *shared, kw[-1]])  # --debug last


def report(**kw) -> None:
    """Write a sweep's results as one HTML page: ranking, scatter per measure, statuses, config (offline, self-contained)."""
    from .. import api  # lazy: CLI start-up (loads torch)

    seed, debug = kw.pop("seed"), kw.pop("debug")
    del debug  # handle_errors reads it
    results, output = kw.pop("results"), kw.pop("output")
    with StageProgress("report: correlating and drawing"):
        page = api.report(results, output, run=run_options(seed=seed), **kw)
    rep = page.correlation
    console.print(
        f"wrote {page.path} ({len(page.html.encode()) / 1e6:.2f} MB): {len(rep.measures)} measures, "
        f"{rep.n_rows} checkpoints",
        highlight=False,
        soft_wrap=True,
    )
    for p in page.problems:
        err_console.print(f"note: not drawn: {p}", highlight=False, soft_wrap=True, markup=False)


report.__signature__ = _signature()
app.command("report", cls=FitHelp)(handle_errors(report))
