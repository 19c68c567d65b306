r"""`Tracker`: curvature measures of a model during training, from any PyTorch loop.

A tracker is built once from the model, the loss, a fixed tracking set (the same rows at every
step, so that the numbers are comparable) and the measures; ``tracker.step(step, optimizer=opt)``
after each optimizer step evaluates the measures when the schedule says so
(`flatcli.tracking.schedule`) and records a row (`flatcli.tracking.track_files`).

What an evaluation leaves alone. The measures run on a `flatcli.engine.Problem`, which holds
detached copies of the parameters and differentiates those (never ``.grad``), in eval mode
(every module's mode is restored after, `flatcli.engine.problem.eval_mode`); the optimizer is
read, never stepped or written; every random stream is saved and restored around the evaluation
(torch's CPU and CUDA generators, NumPy's and Python's), and the estimators draw from their own
seeded generators. A training run with and without a tracker gives bit-identical weights.

Warm starts. Each Krylov measure (``hessian_lambda_max``, ``hessian_top_eigenvalues``,
``preconditioned_lambda_max``) keeps its Ritz vectors from one evaluation to the next
(`flatcli.measures.MeasureContext.warm`) and starts there; the residual test is unchanged, so a
warm start changes the cost, never the tolerance. Every ``cold_every``-th evaluation (and the
first) starts cold from the seeded random start with the certified step floor.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._version import __version__
from ..engine import CurvatureEngine, Problem
from ..engine.batch import Batch
from ..engine.problem import eval_mode, nonfinite_tensors, not_finite
from ..errors import ConfigError
from ..measures import MeasureContext, MeasureSpec, run_measure
from ..measures.during_training import TRACKED_BY_DEFAULT
from ..run.measuring import as_specs, check_targets, describe_error
from ..run.results import Row
from ..validation import Bool, Integral, Optional, Real, check_fields, opt
from .schedule import Schedule
from .track_files import TrackStore


@dataclass(frozen=True)
class TrackOptions:
    """How a `Tracker` computes: the problem's settings and the warm starts.

    Parameters
    ----------
    batch_size : int
        Rows per forward pass over the tracking set (results do not depend on it).
    precision : str
        ``runtime.precision`` of the products (``auto``: fp32 on CPU, TF32 verified in fp32 on a
        tensor-core GPU; ``fp64`` for exact tests).
    hvp_mode : str
        How Hessian products are computed (`flatcli.engine.CurvatureEngine`).
    seed : int
        Seed of the estimators' random starts (the same at every evaluation).
    warm : bool
        Start the Krylov measures from the previous evaluation's Ritz vectors.
    cold_every : int
        Every ``cold_every``-th evaluation starts cold (certified random start); 1: always cold.
    max_seconds : float, optional
        A cap per measure and evaluation: a capped estimator returns its estimate so far with
        status ``budget``.
    device, dtype, params : optional
        Where and in which type the products run (default: the model's), and the parameter
        selection (``{include: [...], exclude: [...]}``; default every trainable parameter).
    """

    batch_size: int = opt(256, Integral(1, None), "rows per forward pass")
    precision: str = "auto"
    hvp_mode: str = "auto"
    seed: int = opt(0, Integral(0, None), "seed of the estimators' random starts")
    warm: bool = opt(True, Bool(), "warm-start the Krylov measures")
    cold_every: int = opt(10, Integral(1, None), "every N-th evaluation starts cold")
    max_seconds: float | None = opt(
        None, Optional(Real(0, None, "neither")), "cap per measure and evaluation"
    )
    device: Any = None
    dtype: Any = None
    params: Any = field(default=None)

    def __post_init__(self):
        check_fields(self)


@contextlib.contextmanager
def untouched(model: torch.nn.Module):
    """Eval mode (restored), gradients enabled, and every random stream (torch CPU and CUDA,
    NumPy, Python) saved and restored: what the training sees after is what it saw before."""
    np_state, py_state = np.random.get_state(), random.getstate()
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=cuda), torch.enable_grad(), eval_mode(model):
            yield
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)


class Tracker:
    """Curvature measures of ``model`` on a fixed tracking set during training.

    Parameters
    ----------
    model : torch.nn.Module
        The model being trained (read, never changed).
    data : Batch, mapping or tuple
        The tracking set: ``(x, y)``, named tensors, or a `flatcli.engine.batch.Batch`; fixed.
    loss : str
        ``cross_entropy``, ``mse`` or ``causal_lm`` (`flatcli.engine.losses`).
    measures : str or sequence, optional
        Measure names, ``{name: options}`` entries or specs (default ``hessian_lambda_max`` and
        ``gradient_norm``); any registered measure runs, the cheap ones are meant.
    every : int, optional
        Evaluate at steps divisible by ``every``.
    budget : float, optional
        Keep the tracker's time near this fraction of the training time (`Schedule`).
    out : str or Path, optional
        The output folder (``track.json``, ``track.csv``); resumed when it holds a run.
    options : TrackOptions, optional
        Batch size, precision, seed, warm starts, caps, device and parameter selection.

    Examples
    --------
    >>> tracker = Tracker(model, (x, y), "mse", every=10, out="runs/track")  # doctest: +SKIP
    >>> for step in range(100):                                              # doctest: +SKIP
    ...     train_step(); tracker.step(step, optimizer=opt)
    """

    def __init__(
        self,
        model: torch.nn.Module,
        data,
        loss: str = "cross_entropy",
        measures=None,
        *,
        every: int | None = None,
        budget: float | None = None,
        out: str | Path | None = None,
        options: TrackOptions | None = None,
    ):
        self.model = model
        self.loss = loss
        self.options = options if options is not None else TrackOptions()
        self.specs: list[MeasureSpec] = as_specs(
            list(TRACKED_BY_DEFAULT) if measures is None else measures
        )
        for spec in self.specs:
            spec.parsed()  # a bad name or option fails here, not at the first evaluation
        self.schedule = Schedule(every=every, budget=budget)
        self.batch = Batch.of(data, where="the tracking set")
        self._warm: dict[str, dict] = {}
        self._last: int | None = None  # the last step evaluated
        with untouched(model):  # the tracking set, the loss and the engine's settings checked now
            problem = self._problem()
            check_targets(
                model, self.batch, loss, "the tracking set", problem.device, problem.dtype
            )
            CurvatureEngine(
                problem, hvp_mode=self.options.hvp_mode, precision=self.options.precision
            )
            self.rows_in_set = problem.rows
        self.store = TrackStore(out, self._meta())

    @property
    def rows(self) -> list[dict]:
        """The rows so far (with those of a resumed run before its first step)."""
        return self.store.rows

    def _meta(self) -> dict[str, Any]:
        o = self.options
        return {
            "flatcli_version": __version__,
            "loss": self.loss,
            "tracking_rows": self.rows_in_set,
            "measures": [
                {"label": s.label, "name": s.name, "options": dict(s.options)} for s in self.specs
            ],
            "every": self.schedule.every,
            "budget": self.schedule.budget,
            "warm": o.warm,
            "cold_every": o.cold_every,
            "seed": o.seed,
            "precision": o.precision,
        }

    def _problem(self) -> Problem:
        o = self.options
        return Problem(
            self.model,
            self.batch,
            loss=self.loss,
            batch_size=o.batch_size,
            device=o.device,
            dtype=o.dtype,
            params=o.params,
        )

    def step(self, step: int, optimizer=None, *, epoch: int | None = None) -> dict | None:
        """Record a row at training step ``step`` when the schedule says so.

        Parameters
        ----------
        step : int
            The training step (the row's ``step``; ``every`` counts it).
        optimizer : torch.optim.Optimizer, optional
            The training optimizer: the row's ``lr``, and the state of
            ``preconditioned_lambda_max``. Read only.
        epoch : int, optional
            Recorded in the row.

        Returns
        -------
        dict or None
            The row (column → value) when this step was evaluated, else None.
        """
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise ConfigError(f"`step` must be an int. Got {step!r} instead.")
        t0 = time.perf_counter()
        self.schedule.tick(t0)
        self.store.resume_at(int(step))
        row = None
        if int(step) != self._last and self.schedule.due(int(step)):
            self._last = int(step)  # a step is evaluated once (gradient accumulation repeats it)
            row, details = self._evaluate(int(step), optimizer, epoch)
            spent = self.schedule.spent + time.perf_counter() - t0
            row["overhead"] = spent / self.schedule.trained if self.schedule.trained else None
            self.store.append(row, details)
        t1 = time.perf_counter()
        self.schedule.charge(t1 - t0, row is not None, t1)
        return row

    def _warm_state(self, label: str) -> dict | None:
        """The warm-start state of ``label`` for this evaluation (a fresh one when cold)."""
        o = self.options
        if not o.warm:
            return None
        if self.schedule.evaluations % o.cold_every == 0:
            self._warm[label] = {}
        return self._warm.setdefault(label, {})

    def _evaluate(self, step: int, optimizer, epoch) -> tuple[dict, dict]:
        o = self.options
        row = Row(checkpoint="", labels=[s.label for s in self.specs])
        with untouched(self.model):
            problem = self._problem()
            engine = CurvatureEngine(problem, hvp_mode=o.hvp_mode, precision=o.precision)
            with engine.precision.context():
                loss = engine.loss()
                cache: dict[str, Any] = {}
                specs = self.specs
                if not math.isfinite(loss):  # every measure of this step fails, training goes on
                    err = not_finite(f"step {step}", loss, nonfinite_tensors(problem.params))
                    for spec in specs:
                        row.fail(str(err), type(err).__name__, spec.label)
                    specs = []
                for spec in specs:
                    ctx = MeasureContext(
                        problem,
                        engine,
                        seed=o.seed if spec.seed is None else spec.seed,
                        max_seconds=spec.max_seconds if spec.max_seconds else o.max_seconds,
                        cache=cache,
                        warm=self._warm_state(spec.label),
                        optimizer=optimizer,
                    )
                    try:
                        row.results[spec.label] = run_measure(spec, ctx)
                    except Exception as e:  # a failed measure is a row's error; training goes on
                        row.fail(describe_error(e), type(e).__name__, spec.label)
        flat = row.flat()
        del flat["checkpoint"]
        head = {"step": step, "lr": _lr(optimizer), "epoch": epoch, "tracking_loss": loss}
        details = {lab: r.diagnostics for lab, r in row.results.items()}
        details.update({lab: {"error": msg} for lab, msg in row.errors.items()})
        return {**head, **flat}, details


def _lr(optimizer) -> float | None:
    """The first parameter group's learning rate (None without an optimizer)."""
    groups = getattr(optimizer, "param_groups", None)
    return float(groups[0]["lr"]) if groups else None
