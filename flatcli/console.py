"""Terminal output shared by the CLI and the pipelines below it: tables, progress, warnings.

Everything here renders; nothing computes. Modules below the CLI (the demo, the
sweep worker) import from here, never from `flatcli.cli`.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

# set by ``--debug`` for the command's process and the workers it starts: third-party progress
# bars (transformers' "Loading weights") show only then
DEBUG_ENV = "FLATCLI_DEBUG"

console = Console()
err_console = Console(stderr=True)


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def as_text(value) -> str:
    """``value`` as text inside rich markup: square brackets escaped (a path holding ``[/x]`` or
    ``[bold]`` prints as it is) and control characters shown as ``\\xNN`` (never sent to the
    terminal). Every user-controlled string (a path, a name, an error) goes through it before a
    print that renders markup; text, never a markup tag, follows it."""
    from rich.markup import escape

    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(value))
    # rich's escape doubles a final backslash (for a tag that would follow): it is printed twice
    # before plain text, which is what follows here
    return escape(text + " ")[:-1]


def fmt(v) -> str:
    """A value for a table cell: 4 significant digits for floats, '' for None."""
    if v is None:
        return ""
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:.4g}"
    return str(v)


# ------------------------------------------------------------------ tables that fit the terminal
@dataclass
class Column:
    """One column of a table that may have to fit a narrow terminal: its header and cells (rich
    markup allowed), alignment, ``priority`` (when the table is too wide, columns leave by
    decreasing priority, the rightmost first; priority 0 always stays) and ``fold`` (a name or
    path that may wrap onto several lines, counted at ``min_width`` when fitting)."""

    header: str
    cells: list[str]
    justify: str = "right"
    priority: int = 0
    fold: bool = False
    min_width: int = 12


def _cell_len(text: str) -> int:
    from rich.text import Text

    return max((Text.from_markup(line).cell_len for line in text.split("\n")), default=0)


def wrap_name(name: str, width: int) -> str:
    """``name`` on lines of at most ``width`` cells, broken after ``_``, ``/``, ``-`` or at spaces (a
    piece longer than ``width`` stays whole): ``hessian_lambda_max`` at 12 → ``hessian_\nlambda_max``."""
    import re

    pieces = [p for p in re.split(r"(?<=[_/ -])", name) if p]
    lines = [""]
    for piece in pieces:
        if lines[-1] and len((lines[-1] + piece).rstrip()) > width:
            lines.append("")
        lines[-1] += piece
    return "\n".join(line.rstrip() for line in lines)


def _natural(col: Column, wrap: bool = True) -> tuple[str, int]:
    """The column's header (with ``wrap``, wrapped to its cells' width) and its width when nothing
    is cut."""
    cells = max((_cell_len(c) for c in col.cells), default=0)
    header = wrap_name(col.header, max(cells, 6)) if wrap and not col.fold else col.header
    width = max(cells, _cell_len(header))
    return header, (min(width, col.min_width) if col.fold else width)


def fit_columns(cols: list[Column], width: int | None) -> tuple[list[Column], list[Column]]:
    """The columns that fit ``width`` terminal cells in rich's default box (each column takes its
    width + 3), and those left out: by decreasing priority, the rightmost first. None keeps all."""
    if width is None:
        return list(cols), []
    widths = {id(c): _natural(c)[1] for c in cols}
    kept = list(cols)
    order = sorted(cols, key=lambda c: (c.priority, cols.index(c)), reverse=True)
    for c in order:
        if sum(widths[id(k)] + 3 for k in kept) + 1 <= width or c.priority == 0:
            break
        kept.remove(c)
    return kept, [c for c in cols if c not in kept]


def _fold_width(kept: list[Column], width: int | None) -> int | None:
    """The width each folding column gets: the room the others leave, shared (None: unlimited)."""
    folds = [c for c in kept if c.fold]
    if width is None or not folds:
        return None
    room = width - 1 - sum(_natural(c)[1] + 3 for c in kept if not c.fold) - 3 * len(folds)
    return max(min(c.min_width for c in folds), room // len(folds))


def build_table(cols: list[Column], width: int | None = None, **table_kwargs) -> Table:
    """A rich Table of the columns that fit ``width`` (`fit_columns`; None: all of them), headers
    wrapped at ``_`` to their cells' width, numbers never cut, names and paths wrapped at ``_``
    and ``/`` into the room left; the caption names what was left out (``--wide`` shows it)."""
    kept, dropped = fit_columns(cols, width)
    fold = _fold_width(kept, width)
    t = Table(**table_kwargs)
    for c in kept:
        header, w = _natural(c, wrap=width is not None)
        t.add_column(
            header,
            justify=c.justify,
            no_wrap=not c.fold,
            overflow="fold" if c.fold else "ellipsis",
            min_width=None if c.fold else w,
            max_width=fold if c.fold else None,
        )
    for i in range(max((len(c.cells) for c in kept), default=0)):
        t.add_row(*[wrap_name(c.cells[i], fold) if c.fold and fold else c.cells[i] for c in kept])
    if dropped:
        left = ", ".join(c.header.replace("\n", " ") for c in dropped)
        note = f"not shown at {width} columns: {left} (--wide shows every column)"
        t.caption = f"{t.caption}; {note}" if t.caption else note
        t.caption_justify = "left"
    return t


def fit_width(console, wide: bool = False) -> int | None:
    """The width tables must fit: the terminal's; None (every column, natural width) with ``wide``
    and when the output is not a terminal (a file or a pipe gets full-width tables, see `print_table`)."""
    return None if wide or not console.is_terminal else console.width


def common_dir(names: list[str]) -> str:
    """The folder every name in ``names`` lies in ('' when they share none)."""
    import os

    try:
        d = os.path.commonpath([os.path.dirname(n) for n in names]) if names else ""
    except ValueError:  # absolute and relative paths mixed
        return ""
    return d


def _value_cell(res) -> str:
    """A measure's table cell: value ± stderr (status); an error in red."""
    if res is None:
        return "[red]error[/red]"
    s = fmt(res.value)
    if res.stderr:
        s += f" ± {res.stderr:.2g}"
    if res.status != "ok":
        s += f" ({status_text(res)})"
    return s


def status_text(res) -> str:
    """A result's status with the bound its value is, when it is one (``budget, lower bound``)."""
    bound = (res.diagnostics or {}).get("bound")
    return f"{res.status}, {bound}" if bound else res.status


def render_rows(rows, labels: list[str], width: int | None = None) -> Table:
    """The per-checkpoint results table: value ± stderr (status) per measure, then the metrics.

    With ``width`` (a terminal's), it fits: checkpoints are shown relative to the folder they
    share (named in the caption) and wrap, headers wrap at ``_``, and the last measures and the
    accuracies leave first (gen_gap, and a language model's loss_gap, stay after the first
    measure); the caption names them."""
    names = [r.checkpoint for r in rows]
    where = common_dir(names) if width is not None and len(names) > 0 else ""
    if where:
        import os

        names = [os.path.relpath(n, where) for n in names]
    cols = [
        Column("checkpoint", [as_text(n) for n in names], justify="left", fold=True, min_width=16),
        Column(
            "status",
            [r.status if r.status in ("ok", "budget") else "[red]error[/red]" for r in rows],
            justify="left",
        ),
    ]
    cols += [
        Column(
            as_text(lab),
            [_value_cell(r.results.get(lab)) for r in rows],
            priority=1 if i == 0 else 3 + i,
        )
        for i, lab in enumerate(labels)
    ]
    per_token = any("train_ppl" in r.metrics for r in rows)  # a language model: its loss gap
    for m, prio in (("train_acc", 100), ("test_acc", 100), ("gen_gap", 2), ("loss_gap", 2)):
        if any(m in r.metrics for r in rows) and (m != "loss_gap" or per_token):
            cols.append(Column(m, [fmt(r.metrics.get(m)) for r in rows], priority=prio))
    return build_table(
        cols,
        width,
        show_header=True,
        header_style="bold",
        caption=f"checkpoints in {as_text(where)}/" if where else None,
    )


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

    return Progress(
        TextColumn(label, markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[detail]}", markup=False),
        console=err_console,
        transient=True,
    )


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
            self.status.update(
                f"{stage} network: " + (describe_progress(label, info) if label else "measuring")
            )
        elif not label:
            k = self.stages.index(stage) + 1 if stage in self.stages else 0
            print(
                f"[{k}/{len(self.stages)}] measuring the {stage} network ({time.perf_counter() - self.t0:.1f}s)",
                file=sys.stderr,
                flush=True,
            )

    def __enter__(self):
        if self.status is not None:
            self.status.start()
        return self

    def __exit__(self, *exc):
        if self.status is not None:
            self.status.stop()


class GridProgress:
    """Progress over a count of work (grid points, steps, measures): ``update(done, total)``. On a
    terminal a transient bar; in logs (stderr not a terminal) a line every ``every`` seconds and
    one at the end (``label: k/N (p%), Ts elapsed, about Rs left``), so long piped runs are not
    silent."""

    def __init__(self, label: str, every: float = 10.0, clock=None):
        import time

        self.label = label
        self.bar = progress_bar(label) if err_console.is_terminal else None
        self.task = None
        self.every = every
        self.clock = clock or time.monotonic
        self.t0 = self.last = self.clock()

    def update(self, done: int, total: int) -> None:
        """Work done so far of ``total``."""
        if self.bar is None:
            self._log(done, total)
            return
        if self.task is None:
            self.bar.start()
            self.task = self.bar.add_task(self.label, total=total, detail="")
        self.bar.update(self.task, completed=done, total=total)

    def _log(self, done: int, total: int) -> None:
        now = self.clock()
        if done < total and now - self.last < self.every:
            return
        self.last = now
        spent = now - self.t0
        left = f", about {spent * (total - done) / done:.0f}s left" if 0 < done < total else ""
        pct = f" ({100 * done / total:.0f}%)" if total else ""
        print(
            f"{self.label}: {done}/{total}{pct}, {spent:.0f}s elapsed{left}",
            file=sys.stderr,
            flush=True,
        )

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()


class CheckpointProgress:
    """Progress over checkpoints: on a terminal a bar (k/N, elapsed, ETA, the running measure's
    products and estimate), in logs one line per checkpoint on stderr (``[k/N] name status time``)."""

    def __init__(self, verb: str, message=None):
        self.verb = verb
        self.message = message or (lambda text: text)  # the CLI's wording of an error (its flags)
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

    def measure(self, row, label: str, reused: bool = False) -> None:
        """A measure is done (``on_measure``): in logs one line (`measure_line`); on a terminal
        the bar's detail is cleared for the next one."""
        if self.bar is not None:
            self.bar.update(self.task, detail="")
        else:
            print(measure_line(row, label, reused), file=sys.stderr, flush=True)

    def row(self, i: int, n: int, row) -> None:
        """A checkpoint is done (``on_row``): one line, above the bar on a terminal."""
        if self.bar is not None:
            self.bar.advance(self.task)
        secs = sum(r.seconds for r in row.results.values())
        line = f"[{i + 1}/{n}] {row.checkpoint} {row.status} {secs:.1f}s"
        if row.status != "ok":
            line += f" {self.message(row.error)}"
        if self.bar is not None:
            self.bar.console.print(line, highlight=False, soft_wrap=True)
        else:
            print(line, file=sys.stderr, flush=True)

    def stop(self) -> None:
        """Remove the bar (it is transient)."""
        if self.bar is not None:
            self.bar.stop()


def _products(counts: dict) -> list[str]:
    """``12 HVPs``, ``3 grads``: the products in ``counts`` that were spent."""
    out = []
    if counts.get("n_hvp"):
        out.append(f"{int(counts['n_hvp']):,} HVPs")
    if counts.get("n_grad"):
        out.append(f"{fmt(float(counts['n_grad']))} grads")
    return out


def measure_line(row, label: str, reused: bool = False) -> str:
    """One log line for a finished measure: ``checkpoint · label · 1.2s · 15 HVPs · value ±
    stderr · status`` (a failed one: ``error: message``; ``reused`` from ``--resume``)."""
    res = row.results.get(label)
    if res is None:
        return f"{row.checkpoint} · {label} · error: {row.errors.get(label, row.error)}"
    parts = [row.checkpoint, label, f"{res.seconds:.2f}s", *_products(res.diagnostics)]
    value = fmt(res.value) + (f" ± {res.stderr:.2g}" if res.stderr else "")
    parts += [value, status_text(res) + (" (reused)" if reused else "")]
    return " · ".join(parts)


def _time_left(info: dict) -> str | None:
    """``≤ 12s left``: the most HVPs the estimate expects, at the pace so far (None before the first
    product or without an estimate)."""
    planned, done, spent = info.get("planned_hvps"), info.get("n_hvp"), info.get("seconds")
    if not planned or not done or spent is None:
        return None
    left = max(planned[1] - done, 0) * spent / done
    return f"≤ {left:.0f}s left"


def describe_progress(label: str, info: dict) -> str:
    """One short line for a running measure: its label, products so far (of the most planned),
    the estimator's running value with its standard error or residual when it reports them, and
    the time left at most (the planned products at the pace so far)."""
    parts = [label]
    planned = info.get("planned_hvps")
    if info.get("n_hvp"):
        parts.append(f"{int(info['n_hvp']):,}" + (f"/{planned[1]:,}" if planned else "") + " HVPs")
    if info.get("n_grad"):
        parts.append(f"{fmt(float(info['n_grad']))} grads")
    if "value" in info:
        v = f"≈ {fmt(float(info['value']))}"
        if info.get("stderr") is not None:
            v += f" ± {float(info['stderr']):.2g}"
        elif info.get("residual") is not None:
            v += f" (residual {float(info['residual']):.1e})"
        parts.append(v)
    left = _time_left(info)
    if left:
        parts.append(left)
    return " · ".join(parts)


def print_table(console, table, wide: bool = False) -> None:
    """Print a rich table without truncating columns when the output is not a terminal
    (a file or a pipe gets the table's natural width instead of 80 columns), or with ``wide``
    (``--wide``: lines longer than the terminal rather than squeezed columns)."""
    if console.is_terminal and not wide:
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

    warnings.filterwarnings(
        "ignore", message=r"`torch\.jit\.script` is deprecated", category=FutureWarning
    )
