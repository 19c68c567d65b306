"""Benchmark the whole measure catalogue on a trained ResNet-18, and flatcli against PyHessian.

The problem (issue 10): torchvision ``resnet18(num_classes=10)`` trained in this
script on n random *class-structured* inputs (10 fixed standard-normal 3×32×32
templates plus unit noise, balanced labels, all seeded) until the eval-mode
train cross-entropy is at most 0.01 (Adam, mini-batches, a step cap), or loaded
from ``--checkpoint`` (a state dict; the data and the initialization are
regenerated from their seeds). The initialization is kept for
``distance_from_init``. GPU default: n = 5,000 in batches of 500. On a CPU (or
with ``--cpu-small``) a scaled-down problem: the same ResNet-18 topology at
base width 8 (stage widths 8-16-32-64, 177k parameters instead of 11.2M) on
64 inputs in batches of 32, because one Hessian-vector product of the full
ResNet-18 takes seconds on two CPU cores.

Stages, all in one process on one device, with the same model and data (the
same batches), timings CUDA-synchronized:

1. **Catalogue.** Every registered measure (``flatcli.measures.list_measures()``,
   or ``--measures``), each in its own ``flatcli.run.measuring.measure_model`` call
   with default options and ``Settings(precision=--precision)``, so the engine
   counters are per measure. Per measure: the measure's own seconds, the wall
   time of the call (set-up checks and the train-metrics pass included), HVPs,
   gradients and forward passes (full-set equivalents, from the result's
   diagnostics), status and value. Measures that would start after
   ``--budget-s`` seconds of catalogue time are skipped and listed as skipped.
2. **Peers.** (a) 64-probe Hutchinson trace: PyHessian
   ``hessian(model, CrossEntropyLoss(), dataloader=batches).trace(maxIter=64,
   tol=-inf)`` (exactly 64 probes: with ``tol=-inf`` its stopping test can never
   pass) against flatcli's ``hessian_trace`` with ``min_probes = max_probes = 64``,
   in two regimes: *torch defaults* (cuDNN TF32 on, matmul TF32 off: PyHessian as
   users run it) vs flatcli at ``--precision`` (``auto``: TF32 products on tensor-core
   GPUs; there also at plain ``tf32``, without ``auto``'s fp32 checks), and *strict
   fp32* (both TF32 flags off) vs flatcli ``fp32``; flatcli sets its own TF32 flags
   from its precision, the regime's flags apply to PyHessian. Compute
   seconds (PyHessian: its object and ``trace()``; flatcli: the measure's own
   seconds) and the ratio PyHessian / flatcli (> 1: flatcli is faster).
   (b) λmax: PyHessian's default ``eigenvalues()`` (power iteration, 100
   iterations at most, stop on 1e-3 relative change) in both regimes vs flatcli's
   ``hessian_lambda_max`` with ``tol: 1e-4`` at ``auto`` and at ``fp32``: seconds,
   HVPs, and the relative residual ‖Hv − λv‖/|λ| of each returned vector with
   strict-fp32 products (`flatcli.engine.linalg.verify_eigenpair` on the engine's
   Hessian operator; flatcli's Ritz vector is captured from the measure's own
   Lanczos call), plus the relative difference of flatcli's λmax at ``auto`` (and of
   its TF32 Ritz value, ``tf32_value``, where ``auto`` verifies it in fp32) from fp32's.
   (c) Whole processes: a fresh ``flatcli measure`` process (config, checkpoint and
   tensors file in a temporary folder; ``hessian_trace`` with 64 fixed probes at
   ``--precision``) vs a fresh PyHessian script process computing the same trace
   (torch defaults), each timed end to end, with the measurement's own seconds
   as each process reports them. PyHessian is optional: its rows are skipped
   with a note when it is not installed.

Output: a Markdown table (catalogue rows with their total, then peer rows with
ratios) printed and written as JSON to ``--json`` (default
docs/benchmarks/data/catalogue.json) and, with ``--out``, as ``catalogue.md``
there, rewritten after every row so a run cut short keeps its rows; the header names the device (GPU name, or CPU model and thread count),
torch version, n, batch size and precision. A benchmark, not a test: nothing
here asserts a time.

Examples::

    python -m benchmarks.bench_catalogue --device cuda --out /tmp/cat --save-checkpoint /tmp/r18.pt
    python -m benchmarks.bench_catalogue --device cuda --checkpoint /tmp/r18.pt --budget-s 120
    OMP_NUM_THREADS=2 python -m benchmarks.bench_catalogue --device cpu --out /tmp/cat-cpu  # scaled down
    python -m benchmarks.bench_catalogue --device cpu --n 32 --batch-size 16 \\
        --measures hessian_trace,hessian_lambda_max,frobenius_norm --skip-process     # smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import _common
from benchmarks._common import (
    class_structured_data,
    device_name,
    json_arg,
    resnet18,
    timed,
    write_json,
)
from flatcli import __version__
from flatcli.engine import CurvatureEngine, Problem, eval_mode, linalg
from flatcli.engine.precision import tf32_flags
from flatcli.measures import get_measure, list_measures
from flatcli.run.measuring import measure_model
from flatcli.run.settings import Settings

COMMON = Path(_common.__file__)
CATALOGUE_COLUMNS = [
    "measure",
    "seconds",
    "wall (s)",
    "HVPs",
    "gradients",
    "forwards",
    "status",
    "value",
    "note",
]
PEER_COLUMNS = [
    "comparison",
    "regime",
    "tool",
    "seconds",
    "HVPs",
    "value",
    "rel. residual (fp32 HVP)",
    "PyHessian / flatcli time",
    "note",
]
GPU_DEFAULTS = {"n": 5000, "batch_size": 500, "width": 64}
CPU_DEFAULTS = {"n": 64, "batch_size": 32, "width": 8}
# (matmul.allow_tf32, cudnn.allow_tf32)
REGIMES = {"torch defaults": (False, True), "strict fp32": (False, False)}
# PyHessian calls loss.backward(create_graph=True) and says so on every run; we reset .grad after it
warnings.filterwarnings("ignore", message=r"Using backward\(\) with create_graph=True")


# ---------------------------------------------------------------------------- time and flags
class Clock:
    """Wall time since the start, and the deadline after which no new row starts."""

    def __init__(self, deadline_s: float):
        self.t0 = time.perf_counter()
        self.deadline_s = deadline_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def past_deadline(self) -> bool:
        return self.elapsed() >= self.deadline_s


def _zero_grads(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


# ---------------------------------------------------------------------------- the problem
@dataclass
class Bench:
    """The trained model, its initialization and the measurement set, all on ``device``."""

    model: nn.Module
    init_state: dict[str, torch.Tensor]
    x: torch.Tensor
    y: torch.Tensor
    batch_size: int
    width: int
    device: torch.device
    training: dict[str, Any]

    @property
    def batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The batches flatcli's `Problem` forms: consecutive slices in the set's order."""
        b = self.batch_size
        return [(self.x[i : i + b], self.y[i : i + b]) for i in range(0, len(self.x), b)]

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def model_name(self) -> str:
        if self.width == 64:
            return "torchvision resnet18(num_classes=10)"
        w = self.width
        return f"ResNet-18 topology at width {w} (stages {w}-{2 * w}-{4 * w}-{8 * w})"


@torch.no_grad()
def eval_loss(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int
) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) in eval mode over (x, y)."""
    with eval_mode(model):
        loss, correct = 0.0, 0
        for i in range(0, len(x), batch_size):
            out = model(x[i : i + batch_size])
            loss += float(F.cross_entropy(out, y[i : i + batch_size], reduction="sum"))
            correct += int((out.argmax(1) == y[i : i + batch_size]).sum())
    return loss / len(x), correct / len(x)


def train_to_target(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    target: float,
    max_steps: int,
    batch_size: int,
    lr: float,
    eval_batch: int,
    seed: int,
    eval_every: int = 20,
) -> dict[str, Any]:
    """Adam on shuffled mini-batches (train mode) until the eval-mode train CE ≤ ``target``,
    checked every ``eval_every`` steps, or ``max_steps``."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    n, step, t0 = len(x), 0, time.perf_counter()
    loss, acc = eval_loss(model, x, y, eval_batch)
    while step < max_steps and loss > target:
        order = torch.randperm(n, generator=g).to(x.device)
        for i in range(0, n, batch_size):
            idx = order[i : i + batch_size]
            model.train()
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            step += 1
            if step % eval_every == 0 or step >= max_steps:
                loss, acc = eval_loss(model, x, y, eval_batch)
                if loss <= target or step >= max_steps:
                    break
    model.eval()
    return {
        "source": "trained in the script",
        "steps": step,
        "train_ce": loss,
        "train_acc": acc,
        "target": target,
        "reached": loss <= target,
        "seconds": time.perf_counter() - t0,
        "optimizer": f"Adam lr {lr:g}, batch {batch_size}",
    }


def build_bench(args: argparse.Namespace, dev: torch.device, log: Callable[[str], None]) -> Bench:
    x, y = class_structured_data(args.n, args.data_seed)
    x, y = x.to(dev), y.to(dev)
    torch.manual_seed(args.model_seed)
    model = resnet18(args.width, num_classes=10)
    init_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.to(dev)
    if args.checkpoint is not None:
        state = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
        model.load_state_dict(state.get("state_dict", state) if isinstance(state, dict) else state)
        model.eval()
        loss, acc = eval_loss(model, x, y, args.batch_size)
        training = {
            "source": f"checkpoint {args.checkpoint}",
            "train_ce": loss,
            "train_acc": acc,
            "target": args.target_loss,
            "reached": loss <= args.target_loss,
        }
    else:
        log(
            f"training the width-{args.width} ResNet-18 on {args.n} inputs to eval-mode train CE ≤ {args.target_loss:g} ..."
        )
        training = train_to_target(
            model,
            x,
            y,
            target=args.target_loss,
            max_steps=args.train_steps,
            batch_size=min(args.train_batch, args.n),
            lr=args.lr,
            eval_batch=args.batch_size,
            seed=args.model_seed,
        )
    if args.save_checkpoint is not None:
        args.save_checkpoint.parent.mkdir(parents=True, exist_ok=True)
        torch.save(
            {k: v.detach().cpu() for k, v in model.state_dict().items()}, args.save_checkpoint
        )
        training["saved_to"] = str(args.save_checkpoint)
    log(
        "model: "
        + ", ".join(
            f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in training.items()
        )
    )
    return Bench(model.eval(), init_state, x, y, args.batch_size, args.width, dev, training)


def warm_up(bench: Bench) -> None:
    """One gradient and HVPs (one vector, a block) on the first batch before anything is timed
    (CUDA context, library handles, kernels), and PyHessian's product when installed."""
    x, y = bench.batches[0]
    with eval_mode(bench.model):
        eng = CurvatureEngine(Problem(bench.model, x, y, batch_size=len(x), device=bench.device))
        eng.loss_grad()[1]
        eng.hessian()(torch.ones(eng.problem.num_params, device=bench.device))
        eng.hessian()(torch.ones(2, eng.problem.num_params, device=bench.device))
    pyh = pyhessian_class()
    if pyh is not None:
        h = pyh(
            bench.model,
            nn.CrossEntropyLoss(),
            dataloader=[(x, y)],
            cuda=bench.device.type == "cuda",
        )
        h.dataloader_hv_product([torch.ones_like(p) for p in h.params])
        _zero_grads(bench.model)
    timed(bench.device, lambda: None)


# ---------------------------------------------------------------------------- rows and report
@dataclass
class MeasureRow:
    measure: str
    status: str
    seconds: float = math.nan
    wall: float = math.nan
    n_hvp: float = math.nan
    n_grad: float = math.nan
    n_forward: float = math.nan
    value: float = math.nan
    note: str = ""


@dataclass
class PeerRow:
    comparison: str
    regime: str
    tool: str
    seconds: float = math.nan
    n_hvp: float = math.nan
    value: float = math.nan
    residual: float = math.nan
    ratio: float = math.nan  # PyHessian seconds / flatcli seconds, on the PyHessian row
    note: str = ""


def _f(v: Any, fmt: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    return format(v, fmt)


def _count(v: float) -> str:
    return "" if math.isnan(v) else (f"{int(v)}" if float(v).is_integer() else f"{v:.2f}")


@dataclass
class Report:
    """Everything printed and saved; `write` rewrites the JSON and, with ``out``, catalogue.md."""

    meta: dict[str, Any]
    out: Path | None
    json_path: Path | None = None
    catalogue: list[MeasureRow] = field(default_factory=list)
    peers: list[PeerRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, row: MeasureRow | PeerRow) -> None:
        if isinstance(row, MeasureRow):
            self.catalogue.append(row)
            print(
                f"  {row.measure}: {row.status}, {row.seconds:.2f} s, {_count(row.n_hvp)} HVPs, "
                f"value {row.value:.6g} {row.note}",
                flush=True,
            )
        else:
            self.peers.append(row)
            print(
                f"  {row.comparison} [{row.regime}] {row.tool}: {row.seconds:.2f} s, "
                f"{_count(row.n_hvp)} HVPs, value {row.value:.6g} {row.note}",
                flush=True,
            )
        self.write()

    def note(self, msg: str) -> None:
        print(msg, flush=True)
        self.notes.append(msg)
        self.write()

    def header(self) -> list[str]:
        m = self.meta
        tr = m["training"]
        train = (
            f"{tr['source']}: {tr.get('steps', '?')} steps ({tr.get('optimizer', '')}), "
            if "steps" in tr
            else f"{tr['source']}: "
        )
        train += f"eval-mode train CE {tr['train_ce']:.4g} (target {tr['target']:g}"
        train += ")" if tr["reached"] else ", NOT reached)"
        if "seconds" in tr:
            train += f", {tr['seconds']:.1f} s"
        return [
            f"- device: {m['device']}; torch {m['torch']}; flatcli {m['flatcli']}; python {m['python']}",
            f"- model: {m['model']}, P = {m['num_params']:,}; {train}",
            f"- data: n = {m['n']} class-structured 3×32×32 inputs (data seed {m['data_seed']}), "
            f"batch size {m['batch_size']}",
            f"- precision: {m['precision']} (effective {m['effective_precision']}); "
            f"TF32 flags at start: matmul {m['tf32_at_start'][0]}, cuDNN {m['tf32_at_start'][1]}",
        ]

    def catalogue_rows(self) -> list[list[str]]:
        out = [
            [
                r.measure,
                _f(r.seconds, ".2f"),
                _f(r.wall, ".2f"),
                _count(r.n_hvp),
                _count(r.n_grad),
                _count(r.n_forward),
                r.status,
                _f(r.value, ".6g"),
                r.note,
            ]
            for r in self.catalogue
        ]
        ran = [r for r in self.catalogue if not math.isnan(r.seconds)]
        skipped = [r.measure for r in self.catalogue if r.status.startswith("skipped")]

        def total(key: str) -> str:
            return _count(sum(getattr(r, key) for r in ran if not math.isnan(getattr(r, key))))

        out.append(
            [
                f"**total** ({len(ran)} run, {len(skipped)} skipped)",
                f"{sum(r.seconds for r in ran):.2f}",
                f"{sum(r.wall for r in ran):.2f}",
                total("n_hvp"),
                total("n_grad"),
                total("n_forward"),
                "",
                "",
                "skipped: " + ", ".join(skipped) if skipped else "",
            ]
        )
        return out

    def peer_rows(self) -> list[list[str]]:
        return [
            [
                r.comparison,
                r.regime,
                r.tool,
                _f(r.seconds, ".2f"),
                _count(r.n_hvp),
                _f(r.value, ".6g"),
                _f(r.residual, ".1e"),
                _f(r.ratio, ".2f"),
                r.note,
            ]
            for r in self.peers
        ]

    def catalogue_table(self) -> list[str]:
        return _markdown(CATALOGUE_COLUMNS, self.catalogue_rows())

    def peer_table(self) -> list[str]:
        return _markdown(PEER_COLUMNS, self.peer_rows())

    def tables(self) -> list[dict[str, Any]]:
        """The JSON tables (`benchmarks._common.table`): the catalogue, then the peers."""
        setup = "\n".join(self.header() + [f"- {n}" for n in self.notes])
        out = []
        if self.catalogue:
            out.append(
                _common.table(
                    "Catalogue (one measure_model call per measure, default options)",
                    CATALOGUE_COLUMNS,
                    self.catalogue_rows(),
                    setup,
                )
            )
        if self.peers:
            out.append(
                _common.table(
                    "flatcli vs PyHessian (same process, same device, same batches)",
                    PEER_COLUMNS,
                    self.peer_rows(),
                    "" if out else setup,
                )
            )
        return out

    def markdown(self) -> str:
        parts = ["# flatcli catalogue benchmark", "", *self.header(), ""]
        if self.catalogue:
            parts += [
                "## Catalogue (one measure_model call per measure, default options)",
                "",
                *self.catalogue_table(),
                "",
            ]
        if self.peers:
            parts += [
                "## flatcli vs PyHessian (same process, same device, same batches)",
                "",
                *self.peer_table(),
                "",
            ]
        if self.notes:
            parts += ["## Notes", "", *[f"- {n}" for n in self.notes], ""]
        return "\n".join(parts)

    def write(self) -> None:
        if self.json_path is not None:
            write_json(
                "catalogue",
                f"Every measure once, and flatcli vs PyHessian: {self.meta['model']}, "
                f"n = {self.meta['n']}",
                self.tables(),
                self.json_path,
                dev=torch.device(self.meta["device_type"]),
                command=self.meta["command"],
            )
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "catalogue.md").write_text(self.markdown())


def _markdown(columns: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] + [
        "| " + " | ".join(r) + " |" for r in rows
    ]


# ---------------------------------------------------------------------------- catalogue
def measure_once(bench: Bench, entry: Any, settings: Settings):
    """One `measure_model` call on the bench problem; (Row, wall seconds)."""
    return timed(
        bench.device,
        lambda: measure_model(
            bench.model, (bench.x, bench.y), [entry], settings=settings, init_state=bench.init_state
        ),
    )


def run_catalogue(
    bench: Bench,
    names: list[str],
    settings: Settings,
    budget_s: float,
    clock: Clock,
    report: Report,
) -> None:
    spent = 0.0
    for name in names:
        if spent >= budget_s or clock.past_deadline():
            why = f"budget {budget_s:g} s spent" if spent >= budget_s else "deadline"
            report.add(MeasureRow(name, f"skipped ({why})"))
            continue
        row, wall = measure_once(bench, name, settings)
        spent += wall
        res = row.results.get(name)
        if res is None:
            report.add(MeasureRow(name, "error", wall=wall, note=row.errors.get(name, row.error)))
            continue
        d = res.diagnostics
        note = []
        if res.stderr is not None:
            note.append(f"stderr {res.stderr:.3g}")
        for key in ("steps", "probes", "converged", "residual"):
            if key in d and isinstance(d[key], (int, float, bool)):
                note.append(
                    f"{key} {d[key]:.2g}" if isinstance(d[key], float) else f"{key} {d[key]}"
                )
        report.add(
            MeasureRow(
                name,
                res.status,
                res.seconds,
                wall,
                float(d.get("n_hvp", math.nan)),
                float(d.get("n_grad", math.nan)),
                float(d.get("n_forward", math.nan)),
                res.value,
                "; ".join(note),
            )
        )


# ---------------------------------------------------------------------------- peers
def pyhessian_class():
    """PyHessian's `hessian` class, or None when it is not installed."""
    try:
        from pyhessian import hessian
    except ImportError:
        return None
    return hessian


def regime_label(regime: str, dev: torch.device) -> str:
    return regime if dev.type == "cuda" else f"{regime} (no TF32 on CPU)"


def pyhessian_trace(bench: Bench, probes: int) -> tuple[list[float], float]:
    """PyHessian's Hutchinson over the bench batches with exactly ``probes`` probes: (samples, seconds)."""
    pyh = pyhessian_class()
    torch.manual_seed(0)

    def run() -> list[float]:
        h = pyh(
            bench.model,
            nn.CrossEntropyLoss(),
            dataloader=bench.batches,
            cuda=bench.device.type == "cuda",
        )
        return h.trace(maxIter=probes, tol=-math.inf)  # tol=-inf: its stopping test never passes

    vals, dt = timed(bench.device, run)
    _zero_grads(bench.model)
    if len(vals) != probes:
        raise RuntimeError(f"PyHessian's trace returned {len(vals)} samples, expected {probes}")
    return vals, dt


def flatcli_trace_row(
    bench: Bench, comp: str, label: str, precision: str, probes: int, base: Settings
) -> PeerRow:
    """One ``hessian_trace`` run with ``probes`` fixed probes at ``precision``, as a peer row."""
    entry = {"hessian_trace": {"min_probes": probes, "max_probes": probes}}
    row, wall = measure_once(bench, entry, base.replace(precision=precision))
    res = row.results.get("hessian_trace")
    tool = f"flatcli hessian_trace ({precision})"
    if res is None:
        return PeerRow(comp, label, tool, note=row.error)
    return PeerRow(
        comp,
        label,
        tool,
        res.seconds,
        res.diagnostics.get("n_hvp", math.nan),
        res.value,
        note=f"stderr {res.stderr / abs(res.value):.1%}; measure_model wall {wall:.2f} s",
    )


def peer_trace(
    bench: Bench, regime: str, precisions: list[str], probes: int, base: Settings, report: Report
) -> None:
    """Compare flatcli's ``hessian_trace`` with ``probes`` fixed probes (at each of ``precisions``;
    the ratio is taken against the first) and PyHessian's, in one regime."""
    label = regime_label(regime, bench.device)
    comp = f"trace, {probes} probes"
    with tf32_flags(*REGIMES[regime]):
        mine = [
            flatcli_trace_row(bench, comp, label, prec, probes, base)
            for prec in dict.fromkeys(precisions)
        ]
        for r in mine:
            report.add(r)
        if pyhessian_class() is None:
            report.note(
                f"{comp} [{label}]: PyHessian is not installed (pip install pyhessian): skipped"
            )
            return
        vals, dt = pyhessian_trace(bench, probes)
    est = float(np.mean(vals))
    se = float(np.std(vals, ddof=1) / math.sqrt(len(vals)))
    note = f"stderr {se / abs(est):.1%}; dataloader mode"
    for r in mine[1:]:
        note += f"; {dt / r.seconds:.2f}× {r.tool}"
    report.add(
        PeerRow(
            comp,
            label,
            f"PyHessian trace(maxIter={probes})",
            dt,
            len(vals),
            est,
            ratio=dt / mine[0].seconds,
            note=note,
        )
    )


@contextlib.contextmanager
def captured_lanczos() -> Iterator[list]:
    """Make every `linalg.lanczos` call inside also return its Ritz vectors, and collect the
    results, so the vector of the measure's own run can be checked (vectors cost one
    small product at the end)."""
    orig = linalg.lanczos
    results: list = []

    def wrapped(*args: Any, **kwargs: Any):
        kwargs["return_vectors"] = True
        r = orig(*args, **kwargs)
        results.append(r)
        return r

    linalg.lanczos = wrapped
    try:
        yield results
    finally:
        linalg.lanczos = orig


def fp32_residual(bench: Bench, v: torch.Tensor) -> tuple[float, float]:
    """(Rayleigh quotient, ‖Hv − λv‖/|λ|) of ``v`` with strict fp32 products over the bench set."""
    with eval_mode(bench.model), tf32_flags(False, False):
        p = Problem(bench.model, bench.x, bench.y, batch_size=bench.batch_size, device=bench.device)
        eng = CurvatureEngine(p, precision="fp32", cache_graphs=False)
        return linalg.verify_eigenpair(eng.hessian(precision="fp32"), v.reshape(-1))


def pyhessian_lambda(bench: Bench) -> tuple[float, torch.Tensor, int, float]:
    """PyHessian's default power iteration over the bench batches: (λ, vector, HVPs, seconds)."""
    pyh = pyhessian_class()
    torch.manual_seed(0)
    count = [0]

    def run():
        h = pyh(
            bench.model,
            nn.CrossEntropyLoss(),
            dataloader=bench.batches,
            cuda=bench.device.type == "cuda",
        )
        orig = h.dataloader_hv_product

        def counted(v):
            count[0] += 1
            return orig(v)

        h.dataloader_hv_product = counted
        return h.eigenvalues()

    (ev, vecs), dt = timed(bench.device, run)
    _zero_grads(bench.model)
    v = torch.cat([t.detach().reshape(-1) for t in vecs[0]])
    return float(ev[0]), v, count[0], dt


def peer_lambda(bench: Bench, tol: float, precision: str, base: Settings, report: Report) -> None:
    """λmax: flatcli at ``precision`` and fp32 (torch-default flags around them), PyHessian in both regimes."""
    dev = bench.device
    comp = f"λmax (flatcli tol {tol:g})"
    lams: dict[str, float] = {}
    mine: dict[str, PeerRow] = {}
    for prec in dict.fromkeys([precision, "fp32"]):
        regime = f"flatcli precision {prec}"
        tool = f"flatcli hessian_lambda_max ({prec})"
        with tf32_flags(*REGIMES["torch defaults"]), captured_lanczos() as runs:
            row, wall = measure_once(
                bench, {"hessian_lambda_max": {"tol": tol}}, base.replace(precision=prec)
            )
        res = row.results.get("hessian_lambda_max")
        if res is None or not runs:
            report.add(PeerRow(comp, regime, tool, note=row.error))
            continue
        _, resid = fp32_residual(bench, runs[-1].ritz_vectors[0])
        lams[prec] = res.value
        mine[prec] = PeerRow(
            comp,
            regime,
            tool,
            res.seconds,
            res.diagnostics.get("n_hvp", math.nan),
            res.value,
            resid,
            note=f"{res.status}; own residual {res.diagnostics.get('residual', math.nan):.1e}",
        )
        if prec != "fp32":
            mine[prec].note += f"; effective {base.replace(precision=prec).effective_precision}"
        if "tf32_value" in res.diagnostics:  # auto on a tensor-core GPU: the value is fp32-verified
            lams["tf32 Ritz value"] = float(res.diagnostics["tf32_value"])
    if "fp32" in lams:
        for key in (k for k in lams if k != "fp32"):
            diff = abs(lams[key] - lams["fp32"]) / abs(lams["fp32"])
            mine[precision].note += f"; |λ({key}) − λ(fp32)| / λ(fp32) = {diff:.1e}"
    for r in mine.values():
        report.add(r)
    if pyhessian_class() is None:
        report.note(f"{comp}: PyHessian is not installed (pip install pyhessian): skipped")
        return
    for regime in REGIMES:
        ref = mine.get("fp32" if regime == "strict fp32" else precision)
        with tf32_flags(*REGIMES[regime]):
            lam, v, n, dt = pyhessian_lambda(bench)
        _, resid = fp32_residual(bench, v)
        report.add(
            PeerRow(
                comp,
                regime_label(regime, dev),
                "PyHessian eigenvalues() (default)",
                dt,
                n,
                lam,
                resid,
                ratio=dt / ref.seconds if ref else math.nan,
                note=f"power iteration, stop on 1e-3 rel. change; vs {ref.tool if ref else '-'}",
            )
        )


# ---------------------------------------------------------------------------- whole processes
FLATCLI_CONFIG = """\
model: {{target: "{target}", kwargs: {kwargs}}}
data: {{train: {{source: tensors, path: data.pt}}}}
measure_data: {{split: train, num_samples: all, batch_size: {batch_size}, seed: 0}}
loss: cross_entropy
measures:
  - hessian_trace: {{min_probes: {probes}, max_probes: {probes}}}
runtime: {{device: {device}, precision: {precision}, seed: 0}}
"""

PYHESSIAN_SCRIPT = """\
import importlib.util, json, math, sys, time
import torch
from pyhessian import hessian

spec = importlib.util.spec_from_file_location("_bench_common", sys.argv[1])
common = importlib.util.module_from_spec(spec)
spec.loader.exec_module(common)
width, ck, data, bs, probes, device = int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
model = common.resnet18(width, num_classes=10)
model.load_state_dict(torch.load(ck, map_location="cpu", weights_only=True))
model = model.to(device).eval()
d = torch.load(data, weights_only=True)
x, y = d["x"].to(device), d["y"].to(device)
loader = [(x[i : i + bs], y[i : i + bs]) for i in range(0, len(x), bs)]
torch.manual_seed(0)  # the probes of the in-process PyHessian row
if device.startswith("cuda"):
    torch.cuda.synchronize()
t0 = time.perf_counter()
h = hessian(model, torch.nn.CrossEntropyLoss(), dataloader=loader, cuda=device.startswith("cuda"))
vals = h.trace(maxIter=probes, tol=-math.inf)
if device.startswith("cuda"):
    torch.cuda.synchronize()
print(json.dumps({"probes": len(vals), "trace": sum(vals) / len(vals), "seconds": time.perf_counter() - t0}))
"""


def _run(
    cmd: list[str], cwd: Path, env: dict[str, str], timeout: float
) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return out, time.perf_counter() - t0


def peer_process(bench: Bench, probes: int, precision: str, clock: Clock, report: Report) -> None:
    """A fresh ``flatcli measure`` process vs a fresh PyHessian script, both end to end
    (files in a temporary folder, removed afterwards)."""
    with tempfile.TemporaryDirectory(prefix="flatcli-catalogue-") as tmp:
        _peer_process(bench, probes, precision, clock, report, Path(tmp))


def _peer_process(
    bench: Bench, probes: int, precision: str, clock: Clock, report: Report, tmp: Path
) -> None:
    dev = bench.device
    comp = f"whole process, trace {probes} probes"
    torch.save({k: v.detach().cpu() for k, v in bench.model.state_dict().items()}, tmp / "model.pt")
    torch.save({"x": bench.x.cpu(), "y": bench.y.cpu()}, tmp / "data.pt")
    if bench.width == 64:
        target, kwargs = "torchvision:resnet18", "{num_classes: 10}"
    else:
        target, kwargs = f"{COMMON}:resnet18", f"{{width: {bench.width}, num_classes: 10}}"
    devname = "cuda" if dev.type == "cuda" else "cpu"
    (tmp / "config.yaml").write_text(
        FLATCLI_CONFIG.format(
            target=target,
            kwargs=kwargs,
            batch_size=bench.batch_size,
            probes=probes,
            device=devname,
            precision=precision,
        )
    )
    (tmp / "pyhessian_trace.py").write_text(PYHESSIAN_SCRIPT)
    env = dict(os.environ)  # the children import the installed flatcli (pip install -e .)
    left = (
        max(30.0, clock.deadline_s - clock.elapsed()) if math.isfinite(clock.deadline_s) else None
    )
    flat_cmd = [
        sys.executable,
        "-m",
        "flatcli.cli",
        "measure",
        str(tmp / "model.pt"),
        "-c",
        str(tmp / "config.yaml"),
        "-o",
        str(tmp / "out"),
        "--format",
        "csv",
    ]
    out, dt = _run(flat_cmd, tmp, env, left)
    if out.returncode != 0:
        report.add(
            PeerRow(
                comp,
                "process",
                f"flatcli measure ({precision})",
                dt,
                note=f"failed ({out.returncode}): {out.stderr.strip()[-300:]}",
            )
        )
        return
    import pandas as pd

    res = pd.read_csv(tmp / "out" / "results.csv").iloc[0]
    inner = float(res["hessian_trace_seconds"])
    mine = PeerRow(
        comp,
        f"flatcli precision {precision}",
        f"flatcli measure ({precision})",
        dt,
        float(res.get("hessian_trace_n_hvp", probes)),
        float(res["hessian_trace"]),
        note=f"measurement {inner:.2f} s, rest of the process {dt - inner:.2f} s",
    )
    report.add(mine)
    if pyhessian_class() is None:
        report.note(f"{comp}: PyHessian is not installed: skipped")
        return
    if clock.past_deadline():
        report.add(PeerRow(comp, "torch defaults", "PyHessian script", note="skipped (deadline)"))
        return
    left = (
        max(30.0, clock.deadline_s - clock.elapsed()) if math.isfinite(clock.deadline_s) else None
    )
    cmd = [
        sys.executable,
        str(tmp / "pyhessian_trace.py"),
        str(COMMON),
        str(bench.width),
        str(tmp / "model.pt"),
        str(tmp / "data.pt"),
        str(bench.batch_size),
        str(probes),
        devname,
    ]
    out, dt = _run(cmd, tmp, env, left)
    if out.returncode != 0:
        report.add(
            PeerRow(
                comp,
                "torch defaults",
                "PyHessian script",
                dt,
                note=f"failed ({out.returncode}): {out.stderr.strip()[-300:]}",
            )
        )
        return
    r = json.loads(out.stdout.strip().splitlines()[-1])
    report.add(
        PeerRow(
            comp,
            regime_label("torch defaults", dev),
            "PyHessian script",
            dt,
            r["probes"],
            r["trace"],
            ratio=dt / mine.seconds,
            note=f"measurement {r['seconds']:.2f} s, rest of the process {dt - r['seconds']:.2f} s",
        )
    )


def run_peers(
    bench: Bench, args: argparse.Namespace, base: Settings, clock: Clock, report: Report
) -> None:
    """The peer comparisons, most important first; a stage past the deadline is listed as skipped.

    At torch defaults flatcli runs at ``--precision`` and, where that is ``auto`` verifying TF32
    products in fp32 (a tensor-core GPU), also at plain ``tf32``."""
    default_precisions = [args.precision] + (["tf32"] if base.verifies() else [])
    stages: list[tuple[str, Callable[[], None]]] = [
        (
            f"trace, {args.probes} probes [torch defaults]",
            lambda: peer_trace(
                bench, "torch defaults", default_precisions, args.probes, base, report
            ),
        ),
        ("λmax", lambda: peer_lambda(bench, args.lambda_tol, args.precision, base, report)),
    ]
    if not args.skip_process:
        stages.append(
            (
                f"whole process, trace {args.probes} probes",
                lambda: peer_process(bench, args.probes, args.precision, clock, report),
            )
        )
    stages.append(
        (
            f"trace, {args.probes} probes [strict fp32]",
            lambda: peer_trace(bench, "strict fp32", ["fp32"], args.probes, base, report),
        )
    )
    for name, fn in stages:
        if clock.past_deadline():
            report.note(f"{name}: skipped (deadline {clock.deadline_s:g} s reached)")
            continue
        try:
            fn()
        except (
            RuntimeError,
            subprocess.TimeoutExpired,
        ) as e:  # OOM or a timed-out process: keep the rest
            report.note(f"{name}: failed: {type(e).__name__}: {str(e)[:300]}")
            _zero_grads(bench.model)
            if bench.device.type == "cuda":
                torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when available)")
    ap.add_argument(
        "--cpu-small",
        action="store_true",
        help="the scaled-down problem (the default on a CPU) even on a GPU",
    )
    ap.add_argument(
        "--n", type=int, default=None, help="inputs (default 5000 on GPU, 64 scaled down)"
    )
    ap.add_argument(
        "--batch-size", type=int, default=None, help="measure batch size (default 500 / 32)"
    )
    ap.add_argument(
        "--width",
        type=int,
        default=None,
        help="ResNet-18 base width (default 64 = torchvision's resnet18; 8 scaled down)",
    )
    ap.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "fp32", "tf32", "fp64"],
        help="Settings.precision of the catalogue and of flatcli's peer rows at torch defaults",
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of the stochastic measures")
    ap.add_argument("--data-seed", type=int, default=0, help="seed of the class-structured data")
    ap.add_argument(
        "--model-seed", type=int, default=0, help="seed of the initialization and of training"
    )
    ap.add_argument(
        "--checkpoint", type=Path, default=None, help="load this state dict instead of training"
    )
    ap.add_argument(
        "--save-checkpoint", type=Path, default=None, help="save the trained state dict here"
    )
    ap.add_argument(
        "--target-loss", type=float, default=0.01, help="eval-mode train CE to train to"
    )
    ap.add_argument("--train-steps", type=int, default=3000, help="most training steps")
    ap.add_argument("--train-batch", type=int, default=128, help="training mini-batch")
    ap.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    ap.add_argument("--measures", default="all", help="comma list of measures, 'all' or 'none'")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=math.inf,
        help="catalogue time budget: measures that would start after it are skipped",
    )
    ap.add_argument(
        "--deadline-s",
        type=float,
        default=math.inf,
        help="seconds from the start after which no new measure or peer row starts",
    )
    ap.add_argument(
        "--probes", type=int, default=64, help="Hutchinson probes of the trace comparisons"
    )
    ap.add_argument(
        "--lambda-tol", type=float, default=1e-4, help="flatcli λmax residual tolerance"
    )
    ap.add_argument("--skip-peers", action="store_true", help="no PyHessian comparisons")
    ap.add_argument("--skip-process", action="store_true", help="no whole-process comparison")
    ap.add_argument("--out", type=Path, default=None, help="folder for catalogue.md")
    json_arg(ap, "catalogue")
    args = ap.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    small = args.cpu_small or not args.device.startswith("cuda")
    for k, v in (CPU_DEFAULTS if small else GPU_DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.measures in ("all", ""):
        args.measure_names = [m.name for m in list_measures()]
    elif args.measures == "none":
        args.measure_names = []
    else:
        args.measure_names = [
            get_measure(m.strip()).name for m in args.measures.split(",") if m.strip()
        ]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    clock = Clock(args.deadline_s)
    dev = torch.device(args.device)
    if dev.type == "cuda" and dev.index is None:  # cuda:N, so measure_model uses the model in place
        dev = torch.device("cuda", torch.cuda.current_device())
    start_flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    base = Settings.build(
        device=dev,
        precision=args.precision,
        seed=args.seed,
        batch_size=args.batch_size,
        num_samples="all",
    )
    bench = build_bench(args, dev, print)
    meta = {
        "device": device_name(dev),
        "device_type": dev.type,
        "torch": torch.__version__,
        "flatcli": __version__,
        "python": platform.python_version(),
        "model": bench.model_name(),
        "num_params": bench.num_params,
        "n": args.n,
        "batch_size": args.batch_size,
        "data_seed": args.data_seed,
        "precision": args.precision,
        "effective_precision": base.effective_precision,
        "tf32_at_start": start_flags,
        "training": bench.training,
        "command": " ".join(
            ["python -m benchmarks.bench_catalogue", *(sys.argv[1:] if argv is None else argv)]
        ),
    }
    report = Report(meta, args.out, args.json)
    report.write()
    warm_up(bench)
    if args.measure_names:
        print(
            f"catalogue: {len(args.measure_names)} measures at precision {args.precision}",
            flush=True,
        )
        run_catalogue(bench, args.measure_names, base, args.budget_s, clock, report)
    if not args.skip_peers:
        if pyhessian_class() is None:
            report.note("PyHessian is not installed (pip install pyhessian): its rows are skipped")
        print("peers:", flush=True)
        run_peers(bench, args, base, clock, report)
    report.note(f"whole run {clock.elapsed():.1f} s (training and warm-up included)")
    print()
    print(report.markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
