"""Commands that look at results and landscapes: landscape slice|interpolate|pca|connect,
correlate (with --compare) and check-invariance."""

from __future__ import annotations

import functools
import inspect
import math
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ..console import (
    GridProgress,
    StageProgress,
    console,
    err_console,
    fit_width,
    fmt,
    print_table,
)
from ._app import (
    BiasBN,
    ConfigOpt,
    DebugOpt,
    DeviceOpt,
    FitHelp,
    PrecisionOpt,
    ThreadsOpt,
    Transform,
    UnsafePickleOpt,
    WideOpt,
    _value,
    app,
    handle_errors,
    landscape_app,
    log_line,
    run_options,
)

# ------------------------------------------------------------------ landscape slice|interpolate|pca|connect
StepsOpt = Annotated[int, typer.Option("--steps", help="Grid points per axis.")]
SpanOpt = Annotated[
    str | None,
    typer.Option(
        "--span", show_default=False, help="Grid range 'a,b' (default -1,1; interpolate -0.5,1.5)."
    ),
]

# The options every view takes, declared once (name, annotation, default): `view_command` appends
# them to each view's own parameters, so the four commands do not repeat them.
_SHARED = (
    ("config", ConfigOpt, ...),
    (
        "outdir",
        Annotated[
            Path,
            typer.Option("--outdir", "-o", help="Write the view's CSV, JSON and PNG files here."),
        ],
        ...,
    ),
    (
        "seed",
        Annotated[
            int | None,
            typer.Option(
                "--seed",
                show_default=False,
                help="Seed of the random directions (slice), the randomized solver (pca) or the bend training (connect); default runtime.seed.",
            ),
        ],
        None,
    ),
    ("device", DeviceOpt, None),
    ("precision", PrecisionOpt, None),
    ("threads", ThreadsOpt, None),
    ("allow_unsafe_pickle", UnsafePickleOpt, False),
    (
        "points_per_pass",
        Annotated[
            int | None,
            typer.Option(
                "--points-per-pass",
                min=1,
                show_default=False,
                help="Grid points per vmapped forward pass (1 = loop; default: 1 for conv nets, else 8).",
            ),
        ],
        None,
    ),
    (
        "plots",
        Annotated[
            bool, typer.Option("--plots/--no-plots", help="Write PNG plots (needs matplotlib).")
        ],
        True,
    ),
    ("debug", DebugOpt, False),
)


def view_command(view: str):
    """Register ``flatcli landscape VIEW`` from a function of the view's own parameters (its
    checkpoints and options) returning ``(checkpoints, options)``: the command's signature is
    those parameters followed by the shared ones of `_SHARED` (``inspect.Signature``, which Typer
    reads), and it runs `flatcli.api.landscape` with one `flatcli.api.RunOptions` and renders."""

    def register(fn):
        own = list(inspect.signature(fn, eval_str=True).parameters.values())
        shared = [
            inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, annotation=t, default=d)
            for n, t, d in _SHARED
        ]

        @functools.wraps(fn)
        def command(**kw):
            common = {n: kw.pop(n) for n, _, _ in _SHARED}
            checkpoints, options = fn(**kw)
            _show_view(view, checkpoints, options, **common)

        command.__signature__ = inspect.Signature(own + shared)
        landscape_app.command(view, cls=FitHelp)(handle_errors(command))
        return command

    return register


@view_command("slice")
def landscape_slice(
    checkpoint: Annotated[
        str, typer.Argument(help="The checkpoint at the centre of the slice.", show_default=False)
    ],
    dims: Annotated[
        int,
        typer.Option("--dims", min=1, max=2, help="1 or 2 filter-normalized random directions."),
    ] = 1,
    steps: StepsOpt = 25,
    span: SpanOpt = None,
    bias_bn: Annotated[
        BiasBN,
        typer.Option(
            "--bias-bn", help="Direction on biases and norm layers: zero (Li et al.) or keep."
        ),
    ] = BiasBN.zero,
):
    """1D/2D slice of the loss along filter-normalized random directions (Li et al. 2018)."""
    return [checkpoint], dict(dims=dims, steps=steps, span=span, bias_bn=_value(bias_bn))


@view_command("interpolate")
def landscape_interpolate(
    a: Annotated[str, typer.Argument(help="θ_a, the start (t = 0).", show_default=False)],
    b: Annotated[str, typer.Argument(help="θ_b, the end (t = 1).", show_default=False)],
    steps: StepsOpt = 25,
    span: SpanOpt = None,
):
    """The loss along the line (1-t)·θ_a + t·θ_b between two checkpoints, with its barrier."""
    return [a, b], dict(steps=steps, span=span)


@view_command("pca")
def landscape_pca(
    checkpoints: Annotated[
        list[str],
        typer.Argument(
            help="A training run's checkpoints (≥ 3; files or globs, sorted naturally).",
            show_default=False,
        ),
    ],
    steps: StepsOpt = 25,
    span: SpanOpt = None,
    solver: Annotated[
        str,
        typer.Option(
            "--solver",
            help="auto, full (scikit-learn PCA) or randomized (randomized SVD, for large models).",
        ),
    ] = "auto",
    keep_order: Annotated[
        bool,
        typer.Option(
            "--keep-order",
            help="Keep the checkpoints in the order given instead of sorting them naturally.",
        ),
    ] = False,
):
    """Trajectory PCA (Li et al. 2018): the loss over the plane of a training run's top-2 PCA directions around its last checkpoint, with the path."""
    return checkpoints, dict(steps=steps, span=span, solver=solver, sort=not keep_order)


@view_command("connect")
def landscape_connect(
    a: Annotated[str, typer.Argument(help="Endpoint A.", show_default=False)],
    b: Annotated[str, typer.Argument(help="Endpoint B.", show_default=False)],
    steps: StepsOpt = 25,
    bend_steps: Annotated[
        int, typer.Option("--bend-steps", help="Optimizer steps for the bend (the step budget).")
    ] = 1000,
    bend_lr: Annotated[
        float | None,
        typer.Option(
            "--bend-lr",
            show_default=False,
            help="Learning rate (default 1e-3 for adam, 1e-2 for sgd).",
        ),
    ] = None,
    bend_optimizer: Annotated[
        str, typer.Option("--bend-optimizer", help="adam or sgd (momentum 0.9).")
    ] = "adam",
    bend_batch_size: Annotated[
        int, typer.Option("--bend-batch-size", help="Minibatch size of the bend training.")
    ] = 128,
):
    """Mode connectivity (Garipov et al. 2018): train the bend of a quadratic Bezier curve between A and B; loss and barrier along the curve and the line."""
    return [a, b], dict(
        steps=steps,
        bend_steps=bend_steps,
        bend_lr=bend_lr,
        bend_optimizer=bend_optimizer,
        bend_batch_size=bend_batch_size,
    )


def _show_view(
    view: str,
    checkpoints: list[str],
    options: dict,
    *,
    config,
    outdir,
    seed,
    device,
    precision,
    threads,
    allow_unsafe_pickle,
    points_per_pass,
    plots,
    debug,
) -> None:
    """Run one landscape view through `flatcli.api.landscape` and print its summary."""
    from .. import api  # lazy: CLI start-up (loads torch)

    run = run_options(
        device=device,
        precision=precision,
        seed=seed,
        threads=threads,
        allow_unsafe_pickle=allow_unsafe_pickle,
    )
    with GridProgress("landscape") as shown:
        res = api.landscape(
            config,
            checkpoints,
            view,
            run=run,
            outdir=outdir,
            plots=plots,
            points_per_pass=points_per_pass,
            on_progress=shown.update,
            **options,
        )
    _print_view(_view_title(view, checkpoints, res), res)
    for split, d in res.meta.get("evaluator", {}).items():
        if view in ("slice", "interpolate") and d.get("vmap_fallback"):
            err_console.print(
                f"note: vmap failed on {split} ({d['vmap_fallback']}); evaluated point by point",
                highlight=False,
                markup=False,
            )


def _view_title(view: str, checkpoints: list[str], res) -> str:
    """The title of a view's summary table."""
    if view == "pca":
        grid = f"{len(res.surface.alpha)}×{len(res.surface.beta)}"
        return f"trajectory PCA of {len(res.meta['checkpoints'])} checkpoints ({grid} points, {res.meta['solver']} SVD)"
    if view == "connect":
        return (
            f"mode connectivity {checkpoints[0]} → {checkpoints[1]} ({len(res.curve.alpha)} points, "
            f"{res.meta['bend_steps']} bend steps)"
        )
    what = {"1d": "1D slice", "2d": "2D slice", "interpolation": "interpolation"}[res.kind]
    grid = f"{len(res.alpha)}" + (f"×{len(res.beta)}" if res.beta is not None else "")
    return (
        f"{what} of {checkpoints[0]}"
        + (f" → {checkpoints[1]}" if view == "interpolate" else "")
        + f" ({grid} points)"
    )


def _print_view(title: str, res) -> None:
    """A landscape view's summary table, its plots and files."""
    log_line(res.meta.get("threads"))
    t = Table(title=title, header_style="bold")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    for k, v in res.summary.items():
        t.add_row(k, ", ".join(fmt(x) for x in v) if isinstance(v, list) else fmt(v))
    print_table(console, t)
    if res.meta.get("plots"):
        err_console.print(res.meta["plots"], highlight=False)
    files = ", ".join(str(p) for p in res.files.values())
    console.print(
        f"wrote {files} ({res.seconds:.1f}s)", highlight=False, soft_wrap=True, markup=False
    )


# ------------------------------------------------------------------ sweep / collect / correlate


@app.command(cls=FitHelp)
@handle_errors
def correlate(
    results: Annotated[
        Path,
        typer.Argument(
            help="A table with one row per checkpoint: a results.csv from 'flatcli measure' or 'flatcli collect', or any CSV."
        ),
    ],
    target: Annotated[
        str | None,
        typer.Option(
            "--target",
            help="What to predict: a column (gen_gap, loss_gap, test_loss...), a derived gap (loss_gap = "
            "test_loss - train_loss, gen_gap, train_ppl, test_ppl) or an expression of columns such as "
            "'test_loss - train_loss' or 'test_acc / train_acc' (+ - * / **, log, exp, sqrt, abs). "
            "Default: gen_gap for classifiers, loss_gap for language models.",
        ),
    ] = None,
    by: Annotated[
        str | None,
        typer.Option(
            "--by",
            help="Hyperparameter axes for Ψ and CMI: columns of any name, e.g. lr,width (hp_lr is found by lr; default: every hp_* column that forms a grid axis).",
        ),
    ] = None,
    outdir: Annotated[
        Path | None,
        typer.Option("--outdir", "-o", help="Write correlations.csv (and plots/) here."),
    ] = None,
    plots: Annotated[
        bool,
        typer.Option(
            "--plots",
            help="Scatter per measure and a ψ heatmap in OUTDIR/plots (needs matplotlib and -o OUTDIR).",
        ),
    ] = False,
    sort: Annotated[
        str | None,
        typer.Option(
            "--sort", help="Rank by psi, kendall_tau_b, jiang_tau, spearman, pearson or cmi."
        ),
    ] = None,
    measures: Annotated[
        str | None,
        typer.Option(
            "--measures",
            "-m",
            help="Measure columns, any numeric columns (default: the measures flatcli recorded, else every numeric column that is not the target, a metric or a hyperparameter).",
        ),
    ] = None,
    where: Annotated[
        str | None,
        typer.Option(
            "--where",
            help="Keep only the rows matching this condition, e.g. 'hp_lr < 0.1 and train_acc >= 0.99' or \"opt in ['sgd', 'adam']\": "
            "comparisons of columns, numbers and quoted text, in [...], and, or, not (never run as code); backquote names that are not identifiers.",
        ),
    ] = None,
    max_train_loss: Annotated[
        float | None,
        typer.Option(
            "--max-train-loss",
            help="Keep only the rows with train_loss ≤ this (models at a minimum; Jiang et al. use 0.01).",
        ),
    ] = None,
    bootstrap: Annotated[
        int | None,
        typer.Option(
            "--bootstrap",
            help="Resamples of the checkpoints for percentile intervals of Pearson, Spearman and Kendall τ-b (e.g. 1000).",
        ),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the bootstrap resampling.")] = 0,
    confidence: Annotated[
        float, typer.Option("--confidence", help="Level of the bootstrap intervals.")
    ] = 0.95,
    wide: WideOpt = False,
    color_by: Annotated[
        str | None,
        typer.Option(
            "--color-by",
            help="Column colouring the scatter plots (default the first axis; 'none' for one colour).",
        ),
    ] = None,
    marker_by: Annotated[
        str | None,
        typer.Option(
            "--marker-by",
            help="Column choosing the markers of the scatter plots (default the next axis; 'none' for one marker).",
        ),
    ] = None,
    compare: CompareOpt = None,
    debug: DebugOpt = False,
):
    """Rank measures by how well they predict the gap: Pearson, Spearman, Kendall τ-b, Jiang τ, granulated Ψ, CMI."""
    from .. import api  # lazy: CLI start-up (loads torch)
    from ..analysis import rendering  # lazy: CLI start-up (loads pandas)

    with GridProgress("correlate: measures bootstrapped" if bootstrap else "correlate") as shown:
        rep = api.correlate_report(
            results,
            target=target,
            by=by,
            outdir=outdir,
            plots=plots,
            sort=sort,
            measures=measures,
            color_by=color_by,
            marker_by=marker_by,
            where=where,
            max_train_loss=max_train_loss,
            bootstrap=bootstrap,
            run=run_options(seed=seed),
            confidence=confidence,
            progress=shown.update if bootstrap else None,
        )
    print_table(console, rendering.render_table(rep, fit_width(console, wide)), wide)
    rows = f"{rep.n_rows} checkpoints" + (
        f" (of {rep.n_input}, after the filters)" if rep.filters else ""
    )
    console.print(
        f"{rows}; measures from {rep.measures_source}; n = checkpoints used "
        "(ψ groups and CMI pairs in correlations.csv)",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
    for n in rendering.notes(rep):
        err_console.print(f"note: {n}", highlight=False, soft_wrap=True, markup=False)
    for w in rep.warnings:
        err_console.print(
            f"warning: {w}", style="yellow", highlight=False, soft_wrap=True, markup=False
        )
    if rep.csv_path is not None:
        console.print(
            f"wrote {rep.csv_path}"
            + (f" and {len(rep.plots)} plots in {rep.plots[0].parent}" if rep.plots else ""),
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
    if compare:
        _print_comparison(
            results,
            compare,
            target=rep.target if target is None else target,
            bootstrap=bootstrap,
            seed=seed,
            confidence=confidence,
            where=where,
            max_train_loss=max_train_loss,
            outdir=outdir,
        )


# ------------------------------------------------------------------ correlate --compare
CompareOpt = Annotated[
    str | None,
    typer.Option(
        "--compare",
        help="A,B: paired bootstrap over the checkpoints of the difference of A's and B's correlations with the target "
        "(Kendall τ-b, Spearman, Pearson; Zou's interval for Pearson); says 'A ranks above B' only when the interval "
        "excludes 0, else 'tied'. Uses --bootstrap (default 2000), --seed and --confidence.",
    ),
]


def _print_comparison(
    results, compare: str, *, target, bootstrap, seed, confidence, where, max_train_loss, outdir
) -> None:
    """Run `flatcli.analysis.compare.compare_measures` for ``A,B`` and print one line per statistic
    (and write comparison.csv beside correlations.csv)."""
    from ..analysis.compare import (  # lazy: CLI start-up (loads pandas)
        compare_measures,
        compare_pair,
        describe,
    )

    names = compare_pair(compare)  # the page's --compare reads A,B the same way
    df = compare_measures(
        results,
        names[0],
        names[1],
        target=target,
        bootstrap=bootstrap or 2000,
        seed=seed,
        confidence=confidence,
        where=where,
        max_train_loss=max_train_loss,
    )
    console.print(
        f"paired comparison with {target} ({names[0]} vs {names[1]}):",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
    for line in describe(df):
        console.print("  " + line, highlight=False, soft_wrap=True, markup=False)
    if outdir is not None:
        path = Path(outdir) / "comparison.csv"
        df.to_csv(path, index=False)
        console.print(f"wrote {path}", highlight=False, soft_wrap=True, markup=False)


# ------------------------------------------------------------------ check-invariance
@app.command("check-invariance", cls=FitHelp)
@handle_errors
def check_invariance_cmd(
    checkpoint: Annotated[Path, typer.Argument(help="The checkpoint to rescale.")],
    config: ConfigOpt = ...,
    measures: Annotated[
        str | None,
        typer.Option(
            "--measures",
            "-m",
            help="Comma-separated measures or labels (default: the configured ones plus every measure that claims invariance).",
        ),
    ] = None,
    scale: Annotated[
        float, typer.Option("--scale", min=1.0, help="Rescaling factors range over [1/A, A].")
    ] = 10.0,
    transform: Annotated[
        Transform,
        typer.Option("--transform", help="node, layer or both (node-wise then layer-wise)."),
    ] = Transform.both,
    tol: Annotated[
        float,
        typer.Option(
            "--tol",
            min=0.0,
            help="Relative change up to which a claimed invariance holds (float64).",
        ),
    ] = 1e-6,
    seed: Annotated[
        int | None,
        typer.Option(
            "--seed",
            help="Seed of the rescaling and of every stochastic measure (equal for both runs).",
        ),
    ] = None,
    device: DeviceOpt = None,
    threads: ThreadsOpt = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            help="Also write the verdicts as JSON here (e.g. SWEEP/invariance.json: 'flatcli report' shows them).",
        ),
    ] = None,
    debug: DebugOpt = False,
):
    """Rescale the network without changing its function; show which measures stay put (exit 0 if every claimed invariance holds)."""
    from rich.markup import escape

    from ..api import check_invariance  # lazy: CLI start-up (loads torch)
    from ..invariance import InvarianceOptions  # lazy: CLI start-up (loads torch)

    with StageProgress("check-invariance: rescaling") as shown:
        opts = InvarianceOptions(_value(transform), scale, tol, progress=shown.update)
        rep = check_invariance(
            config,
            checkpoint,
            measures,
            options=opts,
            run=run_options(seed=seed, device=device, threads=threads),
        )
    log_line(rep.threads)
    console.print(
        f"[bold]{escape(rep.checkpoint)}[/bold]: {escape(rep.describe())}",
        highlight=False,
        soft_wrap=True,
    )
    console.print(
        f"network output changed by {rep.output_rel_change:.2g} (relative, float64)",
        highlight=False,
    )
    print_table(console, _invariance_table(rep))
    for r in rep.results:
        if r.note:
            console.print(f"* {r.label}: {r.note}", highlight=False, soft_wrap=True, markup=False)
        if r.error:
            err_console.print(
                f"[red]error:[/red] {escape(r.error)}", highlight=False, soft_wrap=True
            )
    ref = next((r for r in rep.results if r.label == rep.reference), None)
    if ref is not None and ref.original and math.isfinite(ref.rescaled):
        console.print(
            f"the Hessian trace changed by a factor {ref.rescaled / ref.original:.3g}",
            highlight=False,
        )
    if output is not None:
        rep.write_json(output)
        console.print(f"wrote {output}", highlight=False, soft_wrap=True)
    claimed = [r for r in rep.results if r.claims_invariance]
    bad = [r.label for r in claimed if not r.held]
    if bad:
        err_console.print(
            f"[red]invariance violated[/red] (tolerance {rep.tol:g}): {', '.join(bad)}",
            highlight=False,
        )
    else:
        console.print(
            f"all {len(claimed)} measure(s) claiming invariance held it within {rep.tol:g}",
            highlight=False,
        )
    raise typer.Exit(rep.exit_code)


def _invariance_table(rep) -> Table:
    """The per-measure table of ``check-invariance``."""
    from rich import box

    t = Table(
        show_header=True, header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1)
    )
    t.add_column("measure", no_wrap=True)
    for col, just in (
        ("claims\ninvariance", "left"),
        ("original", "right"),
        ("rescaled", "right"),
        ("rel.\nchange", "right"),
        ("held?", "left"),
    ):
        t.add_column(col, justify=just, no_wrap=True)
    for r in rep.results:
        name = r.label + ("*" if r.note else "")
        claims = "yes" if r.claims_invariance else "no"
        if r.held is None:
            held = "[dim]ref.[/dim]" if r.label == rep.reference else "-"
        else:
            held = "[green]yes[/green]" if r.held else "[red]NO[/red]"
        rel = "[red]error[/red]" if r.error else fmt(r.rel_change)
        t.add_row(name, claims, fmt(r.original), fmt(r.rescaled), rel, held)
    return t


# ------------------------------------------------------------------ sweep worker (hidden)


@app.command("plot-track", cls=FitHelp)
@handle_errors
def plot_track_cmd(
    folder: Annotated[Path, typer.Argument(help="A tracker's output folder (track.json).")],
    measures: Annotated[
        str | None,
        typer.Option("--measures", "-m", help="Labels to draw, comma-separated (default: all)."),
    ] = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="PNG to write (default FOLDER/track.png).")
    ] = None,
    debug: DebugOpt = False,
):
    """Draw a tracked training run's measures against the step, with 2/η and the preconditioned
    threshold where they apply."""
    from ..tracking.plot import plot_track  # lazy: CLI start-up (loads torch, matplotlib)

    labels = [m.strip() for m in measures.split(",") if m.strip()] if measures else None
    out = plot_track(folder, labels, output)
    console.print(f"wrote {out}", highlight=False, soft_wrap=True)
