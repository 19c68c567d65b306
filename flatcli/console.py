"""Terminal output shared by the CLI and the pipelines below it: tables, progress, warnings.

Everything here renders; nothing computes. Modules below the CLI (the demo, the
sweep worker) import from here, never from `flatcli.cli`.
"""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table

console = Console()
err_console = Console(stderr=True)


def fmt(v) -> str:
    """A value for a table cell: 4 significant digits for floats, '' for None."""
    if v is None:
        return ""
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:.4g}"
    return str(v)


def render_rows(rows, labels: list[str]) -> Table:
    """The per-checkpoint results table: value ± stderr (status) per measure, then the metrics."""
    t = Table(show_header=True, header_style="bold")
    t.add_column("checkpoint", overflow="fold")
    t.add_column("status")
    for lab in labels:
        t.add_column(lab, justify="right")
    extra = [m for m in ("train_acc", "test_acc", "gen_gap") if any(m in r.metrics for r in rows)]
    for m in extra:
        t.add_column(m, justify="right")
    for r in rows:
        vals = []
        for lab in labels:
            res = r.results.get(lab)
            if res is None:
                vals.append("[red]error[/red]")
            else:
                s = fmt(res.value)
                if res.stderr:
                    s += f" ± {res.stderr:.2g}"
                if res.status != "ok":
                    s += f" ({res.status})"
                vals.append(s)
        status = "ok" if r.status == "ok" else "[red]error[/red]"
        t.add_row(r.checkpoint, status, *vals, *[fmt(r.metrics.get(m)) for m in extra])
    return t


def progress_bar(label: str):
    """A transient rich progress bar on stderr (only used on a terminal): label, bar, k/N,
    elapsed, remaining (ETA), and a detail field (``task.fields['detail']``: what runs now)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[detail]}"),
                    console=err_console, transient=True)


def describe_progress(label: str, info: dict) -> str:
    """One short line for a running measure: its label, products so far, and the estimator's
    running value with its standard error or residual when it reports them."""
    parts = [label]
    if info.get("n_hvp"):
        parts.append(f"{info['n_hvp']} HVPs")
    if info.get("n_grad"):
        parts.append(f"{fmt(float(info['n_grad']))} grads")
    if "value" in info:
        v = f"≈ {fmt(float(info['value']))}"
        if info.get("stderr") is not None:
            v += f" ± {float(info['stderr']):.2g}"
        elif info.get("residual") is not None:
            v += f" (residual {float(info['residual']):.1e})"
        parts.append(v)
    return " · ".join(parts)


def print_table(console, table) -> None:
    """Print a rich table without truncating columns when the output is not a terminal
    (a file or a pipe gets the table's natural width instead of 80 columns)."""
    if console.is_terminal:
        console.print(table)
        return
    old = console.width
    try:
        from rich.measure import Measurement

        need = Measurement.get(console, console.options.update_width(1000), table).maximum
        console.width = max(old, need)
        console.print(table)
    finally:
        console.width = old


def quiet_torch_warnings() -> None:
    """Hide torch's internal deprecation notice raised by torch.func's forward mode (not actionable)."""
    import warnings

    warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated", category=FutureWarning)
