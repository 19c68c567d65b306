"""Terminal output shared by the CLI and the pipelines below it: tables, progress, warnings.

Everything here renders; nothing computes. Modules below the CLI (the demo, the
sweep worker) import from here, never from `flatcli.cli`.
"""

from __future__ import annotations

import math
import sys

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


class StageProgress:
    """Progress of a run in stages (``update(stage, label, info)``, an empty label when a stage
    starts): a status line on a terminal; in logs one line per stage with the elapsed time."""

    def __init__(self, text: str, stages: tuple[str, ...] = ("original", "rescaled")):
        import time

        self.stages = stages
        self.t0 = time.perf_counter()
        self.status = err_console.status(text) if err_console.is_terminal else None

    def update(self, stage: str, label: str, info: dict) -> None:
        """A stage starts (empty ``label``) or a measure in it reports progress."""
        import time

        if self.status is not None:
            self.status.update(f"{stage} network: " + (describe_progress(label, info) if label else "measuring"))
        elif not label:
            k = self.stages.index(stage) + 1 if stage in self.stages else 0
            print(f"[{k}/{len(self.stages)}] measuring the {stage} network ({time.perf_counter() - self.t0:.1f}s)",
                  file=sys.stderr, flush=True)

    def __enter__(self):
        if self.status is not None:
            self.status.start()
        return self

    def __exit__(self, *exc):
        if self.status is not None:
            self.status.stop()


class GridProgress:
    """A transient bar over grid points on a terminal (``update(done, total)``); nothing in logs."""

    def __init__(self, label: str):
        self.label = label
        self.bar = progress_bar(label) if err_console.is_terminal else None
        self.task = None

    def update(self, done: int, total: int) -> None:
        """Points evaluated so far of ``total``."""
        if self.bar is None:
            return
        if self.task is None:
            self.bar.start()
            self.task = self.bar.add_task(self.label, total=total, detail="")
        self.bar.update(self.task, completed=done, total=total)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()


class CheckpointProgress:
    """Progress over checkpoints: on a terminal a bar (k/N, elapsed, ETA, the running measure's
    products and estimate), in logs one line per checkpoint on stderr (``[k/N] name status time``)."""

    def __init__(self, verb: str):
        self.verb = verb
        self.is_tty = err_console.is_terminal
        self.bar = None
        self.task = None

    def start(self, i: int, n: int, job) -> None:
        """A checkpoint starts (``on_start`` of `flatcli.api.measure`)."""
        if not self.is_tty:
            return
        if self.bar is None:
            self.bar = progress_bar("{task.description}")
            self.bar.start()
            self.task = self.bar.add_task(self.verb, total=n, detail="")
        self.bar.update(self.task, description=f"{self.verb} {job.checkpoint}", detail="")

    def detail(self, label: str, info: dict) -> None:
        """The running measure's progress (``on_progress``)."""
        if self.bar is not None:
            self.bar.update(self.task, detail=describe_progress(label, info))

    def row(self, i: int, n: int, row) -> None:
        """A checkpoint is done (``on_row``): one line, above the bar on a terminal."""
        if self.bar is not None:
            self.bar.advance(self.task)
        secs = sum(r.seconds for r in row.results.values())
        line = f"[{i + 1}/{n}] {row.checkpoint} {row.status} {secs:.1f}s"
        if row.status != "ok":
            line += f" {row.error}"
        if self.bar is not None:
            self.bar.console.print(line, highlight=False, soft_wrap=True)
        else:
            print(line, file=sys.stderr, flush=True)

    def stop(self) -> None:
        """Remove the bar (it is transient)."""
        if self.bar is not None:
            self.bar.stop()


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
