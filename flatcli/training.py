"""Training models to a loss target: the one training loop of the demo and the experiments.

Measures taken away from a minimum are dominated by the residual gradient, so every model is
trained until a convergence criterion holds (`LossTarget`: the cross-entropy over the whole
training set, evaluated in eval mode without any regularizer, ≤ 0.01, as Jiang et al. 2020
do; or `Plateau`: that target, or train accuracy 100% with the loss on a plateau, for
regularization too strong to reach it) or until ``max_steps``; a model that misses it is
recorded (``reached_target = 0``), not hidden.

A `Recipe` says how: the optimizer (``sgd`` with momentum, ``adam``, or ``adamw`` with
decoupled weight decay, Loshchilov & Hutter 2019), learning rate, batch size, the optimizer's
``weight_decay`` (for sgd and adam the coupled penalty: its gradient ``weight_decay · W`` is
added by the optimizer; for adamw the decoupled decay), an explicit ``l2`` penalty
``l2/2 · Σ‖W‖²`` added to the objective, ``dtype`` and ``device``. Both penalties act on
weight matrices and kernels only (parameters with ≥ 2 dimensions), never on biases or
normalization parameters. Dropout belongs to the model (e.g. ``MLP(dropout=0.1)``): it is
active in training and off in the eval-mode checks and in every measurement.

Determinism: training runs under `single_threaded` (one torch and one BLAS thread, denormals
flushed), so the weights are bit-identical for any thread setting of the calling process and
any number of worker processes; they come from ``torch.manual_seed`` (initialization, dropout)
and a batch-order generator, both seeded by the task. What remains machine-dependent is float
rounding of the CPU's kernels (AVX2 vs AVX-512, another BLAS); ``dtype: float64`` shrinks its
effect on the trajectory by nine orders of magnitude (checkpoints are saved in float32).

`TrainTask` (one model: where to write it, its model and data, hyperparameters, recipe,
criterion, seeds, label noise) → `train_model` → `TrainRecord` (the manifest row and how
training ended); `run_tasks` runs many, in this process or in a pool of spawned processes, and
`write_manifest` writes ``manifest.csv`` (the checkpoints and their hyperparameters, for
``checkpoints: {manifest: manifest.csv}``) and ``training.csv``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from .config import from_dict
from .errors import ConfigError
from .loading.data import load_split
from .loading.factory import build_model
from .loading.jobs import coerce_cell
from .loading.load import DataCache
from .run.results import read_table, write_table
from .run.settings import resolve_device
from .validation import OPTIMIZERS as OPTIMIZERS  # re-exported: the vocabulary is declared there
from .validation import TRAINING, TRAINING_DTYPES, validate

EVAL_CHUNK = 4096
DTYPES = {name: getattr(torch, name) for name in TRAINING_DTYPES}  # float32, float64
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


@contextlib.contextmanager
def single_threaded():
    """One torch thread and one BLAS thread, here and in the worker processes started inside
    (they read the environment), and denormals flushed to zero; everything is restored after.

    One thread makes every reduction run in the same order whatever the machine's core count
    or ``OMP_NUM_THREADS``, so training is bit-reproducible across thread settings, and avoids
    oversubscription (a multi-threaded BLAS on tiny problems runs 10–20× slower on a loaded
    machine). Denormals slow CPU training near a loss target tenfold.
    """
    from threadpoolctl import threadpool_limits

    threads = torch.get_num_threads()
    old = {k: os.environ.get(k) for k in THREAD_VARS}
    flush = torch.set_flush_denormal(True)
    torch.set_num_threads(1)
    os.environ.update({k: "1" for k in THREAD_VARS})
    try:
        with threadpool_limits(limits=1):
            yield
    finally:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(flush)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass(frozen=True)
class Recipe:
    """How to train: optimizer, learning rate, batches, penalties, budget, precision, device.

    ``batch_size`` None (or ≥ the training set) trains full-batch; ``eval_every`` None checks
    the criterion once per epoch. ``momentum`` applies to sgd; ``weight_decay`` is the
    optimizer's (coupled for sgd and adam, decoupled for adamw); ``l2`` adds ``l2/2 · Σ‖W‖²``
    to the objective. Both penalties skip parameters with fewer than 2 dimensions.

    Every field is checked with its rule in `flatcli.validation.TRAINING` (the experiment spec's
    ``training`` keys use the same rules); errors name the field.
    """

    optimizer: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.9
    batch_size: int | None = None
    weight_decay: float = 0.0
    l2: float = 0.0
    max_steps: int = 20000
    eval_every: int | None = None
    dtype: str = "float32"
    device: str = "cpu"

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "batch_size" and value is None:  # full-batch
                continue
            object.__setattr__(self, f.name, validate(f.name, value, rules=TRAINING))


@dataclass(frozen=True)
class Evaluation:
    """One check of the training set: eval-mode cross-entropy (no regularizer) and accuracy."""

    step: int
    loss: float
    accuracy: float


class Criterion(Protocol):
    """When training stops: ``met`` over the evaluations so far (the latest last)."""

    def met(self, history: Sequence[Evaluation]) -> bool:
        """Whether the model counts as trained."""
        ...

    def describe(self) -> str:
        """The criterion in words."""
        ...


@dataclass(frozen=True)
class LossTarget:
    """Converged when the latest eval-mode train cross-entropy is ≤ ``target`` (Jiang et al. 2020).

    A criterion is any object with ``met(history) -> bool`` over the evaluations so far (the
    latest last) and ``describe() -> str``; one that also looks at accuracy or at a plateau of
    the loss (for regularization too strong to reach the target) plugs in the same way.
    """

    target: float = 0.01

    def met(self, history: Sequence[Evaluation]) -> bool:
        """Whether the latest evaluation reached the target."""
        return history[-1].loss <= self.target

    def describe(self) -> str:
        """The criterion in words."""
        return f"train cross-entropy ≤ {self.target:g} (eval mode)"


@dataclass(frozen=True)
class Plateau:
    r"""Converged at the loss target, or at a plateau of a model that fits its training set: for
    regularization too strong for the target (an l2 penalty or weight decay holds the weights,
    hence the margins, small; the eval-mode cross-entropy levels off above it).

    ``met`` holds when the latest eval-mode train cross-entropy is ≤ ``target`` (as `LossTarget`),
    or when all of

    * the latest train accuracy is ≥ ``min_accuracy`` (default 1.0: every training point fitted),
    * there are at least ``2·window`` evaluations after the initial one, and
    * the loss has stopped falling: with :math:`\bar L_1` the mean loss of the last ``window``
      evaluations and :math:`\bar L_0` that of the ``window`` before them,
      :math:`\bar L_1 \ge (1 - \text{rtol})\,\bar L_0`.

    Evaluations come once per epoch by default (``Recipe.eval_every``), so ``window`` is in
    epochs then. Comparing window means, not single values, keeps mini-batch noise from hiding
    (or faking) a plateau.
    """

    target: float = 0.01
    min_accuracy: float = 1.0
    window: int = 10
    rtol: float = 0.01

    def __post_init__(self):

        validate(
            "target_loss", self.target, "plateau target", rules=TRAINING
        )  # the spec's target_loss rule
        if not 0 < self.min_accuracy <= 1:
            raise ConfigError(
                f"plateau min_accuracy must be in (0, 1]. Got {self.min_accuracy!r} instead."
            )
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ConfigError(
                f"plateau window must be an int ≥ 1 (evaluations). Got {self.window!r} instead."
            )
        if not 0 <= self.rtol < 1:
            raise ConfigError(f"plateau rtol must be in [0, 1). Got {self.rtol!r} instead.")

    def plateaued(self, history: Sequence[Evaluation]) -> bool:
        """Whether the mean loss of the last ``window`` evaluations is ≥ (1 − rtol) × that of the
        ``window`` before (the initial evaluation, before any step, never counts)."""
        w = self.window
        if len(history) - 1 < 2 * w:
            return False
        recent = sum(e.loss for e in history[-w:]) / w
        before = sum(e.loss for e in history[-2 * w : -w]) / w
        return recent >= (1.0 - self.rtol) * before

    def met(self, history: Sequence[Evaluation]) -> bool:
        """At the loss target, or fitting the training set on a plateau (class docstring)."""
        last = history[-1]
        if last.loss <= self.target:
            return True
        return last.accuracy >= self.min_accuracy and self.plateaued(history)

    def describe(self) -> str:
        """The criterion in words."""
        return (
            f"train cross-entropy ≤ {self.target:g} (eval mode), or train accuracy ≥ {self.min_accuracy:.0%} "
            f"with the loss on a plateau (mean of the last {self.window} evaluations ≥ {1 - self.rtol:g} × "
            f"the mean of the {self.window} before)"
        )


@dataclass(frozen=True)
class TrainResult:
    """How one model's training ended."""

    steps: int
    epochs: int
    train_loss: float  # eval-mode cross-entropy on the training labels, no regularizer
    train_acc: float
    reached_target: bool
    diverged: bool
    seconds: float


def _optimizer(model: torch.nn.Module, recipe: Recipe) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": float(recipe.weight_decay)},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]  # fmt: skip
    if recipe.optimizer == "adam":
        return torch.optim.Adam(groups, lr=recipe.lr)
    if recipe.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=recipe.lr)
    return torch.optim.SGD(groups, lr=recipe.lr, momentum=float(recipe.momentum))


def l2_penalty(model: torch.nn.Module, l2: float) -> torch.Tensor:
    """``l2/2 · Σ‖W‖²`` over the parameters with ≥ 2 dimensions (weight matrices, kernels)."""
    return (
        0.5 * l2 * sum((p * p).sum() for p in model.parameters() if p.requires_grad and p.ndim >= 2)
    )


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, step: int = 0) -> Evaluation:
    """Mean cross-entropy and accuracy over (x, y) in eval mode (the model's mode is restored)."""
    was = model.training
    model.eval()
    try:
        total, correct = 0.0, 0
        for i in range(0, len(x), EVAL_CHUNK):
            out, yb = model(x[i : i + EVAL_CHUNK]), y[i : i + EVAL_CHUNK]
            total += float(torch.nn.functional.cross_entropy(out, yb, reduction="sum"))
            correct += int((out.argmax(1) == yb).sum())
        return Evaluation(step, total / len(x), correct / len(x))
    finally:
        model.train(was)


def train_to_target(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    recipe: Recipe,
    *,
    seed: int = 0,
    criterion: Criterion | None = None,
    on_step: Callable[[int, torch.nn.Module], None] | None = None,
) -> TrainResult:
    """Train ``model`` in place on (x, y) until ``criterion`` holds (default `LossTarget` 0.01).

    Training runs on the recipe's device and in its dtype; the model comes back on its own
    device and dtype (float32 weights trained in float64 are rounded once, at the end). The
    criterion is checked before the first step, every ``eval_every`` steps (default once per
    epoch) and at ``max_steps``; a non-finite loss stops training (``diverged``). Mini-batches
    come from a permutation per epoch drawn by a generator seeded with ``seed``.
    ``on_step(step, model)``, when given, runs after every optimizer step (e.g. to save a
    trajectory); it must not change the model. Runs under `single_threaded`.
    """
    with single_threaded():
        return _train(model, x, y, recipe, seed, criterion or LossTarget(), on_step)


def _train(model, x, y, recipe: Recipe, seed: int, criterion: Criterion, on_step) -> TrainResult:

    t0 = time.perf_counter()
    dev, dt = resolve_device(recipe.device), DTYPES[recipe.dtype]
    first = next(model.parameters(), None)
    home = (
        (first.device, first.dtype) if first is not None else (torch.device("cpu"), torch.float32)
    )
    model.to(device=dev, dtype=dt)
    x, y = (
        (x.to(device=dev, dtype=dt) if x.is_floating_point() else x.to(dev)),
        y.to(dev),
    )  # token ids stay integers
    n = len(x)
    bs = min(int(recipe.batch_size or n), n)
    every = int(recipe.eval_every or math.ceil(n / bs))
    opt = _optimizer(model, recipe)
    gen = torch.Generator().manual_seed(int(seed))
    history = [evaluate(model, x, y)]

    def done() -> bool:
        return (
            criterion.met(history)
            or not math.isfinite(history[-1].loss)
            or history[-1].step >= recipe.max_steps
        )

    steps = epochs = 0
    while not done():
        perm = torch.randperm(n, generator=gen).to(dev)
        for i in range(0, n, bs):
            idx = perm[i : i + bs]
            model.train()
            opt.zero_grad(set_to_none=True)
            objective = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            if recipe.l2:
                objective = objective + l2_penalty(model, recipe.l2)
            objective.backward()
            opt.step()
            steps += 1
            if on_step is not None:
                on_step(steps, model)
            if steps % every == 0 or steps >= recipe.max_steps:
                history.append(evaluate(model, x, y, steps))
                if done():
                    break
        epochs += 1
    model.eval().to(device=home[0], dtype=home[1])
    last = history[-1]
    return TrainResult(steps=steps, epochs=epochs, train_loss=last.loss, train_acc=last.accuracy,
                       reached_target=bool(criterion.met(history)), diverged=not math.isfinite(last.loss),
                       seconds=time.perf_counter() - t0)  # fmt: skip


def noisy_labels(y: torch.Tensor, frac: float, seed: int, num_classes: int) -> torch.Tensor:
    """``y`` with a seeded ``frac`` of its entries replaced by uniformly drawn classes (Zhang et
    al. 2017; a drawn class may equal the true one). For one seed the corrupted sets are
    nested: a larger fraction corrupts a prefix of the same permutation."""
    if frac <= 0:
        return y.clone()
    g = torch.Generator().manual_seed(10_000 + int(seed))
    perm = torch.randperm(len(y), generator=g)
    new = torch.randint(0, num_classes, (len(y),), generator=g)
    out = y.clone()
    idx = perm[: int(round(frac * len(y)))]
    out[idx] = new[idx]
    return out


def model_name(
    hp: dict[str, Any],
    index: int | None = None,
    prefix: str = "",
    short: dict[str, str] | None = None,
) -> str:
    """A checkpoint stem from hyperparameters: ``[index_][prefix_]key<value>_...``, e.g.
    ``003_weight_decay0.0005_seed1`` or, with ``short={"width": "w"}`` and prefix ``mlp``, ``mlp_w64``."""
    short = short or {}
    parts = ([f"{index:03d}"] if index is not None else []) + ([prefix] if prefix else [])
    return "_".join(
        parts
        + [
            f"{short.get(k, k)}{v:g}" if isinstance(v, float) else f"{short.get(k, k)}{v}"
            for k, v in hp.items()
        ]
    )


# ------------------------------------------------------------------ one model, many models
@dataclass(frozen=True)
class TrainTask:
    """One model to train and save under ``outdir``: ``checkpoints/<name>.pt`` (and ``.init.pt``),
    plus its training set, ``train_data`` (a path relative to ``outdir``) or, when ``label_noise``
    is set, ``data/train_noise<f>_seed<s>.pt``.

    ``data`` is a flatcli ``data`` mapping (paths relative to ``base_dir``); the model is
    ``model_target(**model_kwargs)`` built after ``torch.manual_seed(seed)``; ``seed`` also
    seeds the batch order, ``noise_seed`` (default ``seed``) the label noise; ``hparams`` are
    recorded in the checkpoint and the manifest. ``train_data`` is for a training set that is
    the task's own (its ``data.train`` differs from the study's, e.g. a training fraction): the
    sweep then measures the model on that file (the manifest's ``train_data`` column).
    """

    name: str
    outdir: str
    model_target: str
    model_kwargs: dict[str, Any]
    data: dict[str, Any]
    recipe: Recipe
    hparams: dict[str, Any] = field(default_factory=dict)
    criterion: Criterion = field(default_factory=LossTarget)
    seed: int = 0
    noise_seed: int | None = None
    label_noise: float | None = None
    base_dir: str = "."
    train_data: str = ""


@dataclass(frozen=True)
class TrainRecord:
    """A trained model: its files (relative to the task's ``outdir``), hyperparameters, result."""

    path: str
    init_checkpoint: str
    hparams: dict[str, Any]
    result: TrainResult
    train_data: str = ""
    lr: float = math.nan  # the learning rate used


_DATA: dict[str, tuple[torch.Tensor, torch.Tensor, Any, int]] = {}


def _training_data(
    data: dict[str, Any], base_dir: str
) -> tuple[torch.Tensor, torch.Tensor, Any, int]:
    """(x normalized, the target (``y`` or ``labels``), the training split as the source gives it (a
    `flatcli.engine.batch.Batch`, not normalized), number of classes) of a ``data`` mapping, once per process."""
    key = json.dumps([data, base_dir], sort_keys=True, default=str)
    if key not in _DATA:
        cfg = from_dict({"data": data, "checkpoints": []}, base_dir=base_dir, env={})
        cache = DataCache(cfg)
        train = cache.get("train")
        x, y = train["x"], train.target
        raw = (
            train
            if not cfg.data.normalize
            else load_split(cfg.data.train, "train", cfg.base_dir, None)
        )
        test = cache.get("test")
        classes = max(int(y.max()), int(test.target.max()) if test is not None else 0) + 1
        _DATA[key] = (x, y, raw, classes)
    return _DATA[key]


def _save(obj: dict[str, Any], path: Path) -> None:
    """``torch.save`` through a temporary file and a rename (no torn files in parallel runs)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def float_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the model's state on the CPU with floating tensors in float32 (as checkpoints hold them)."""
    return {
        k: (v.float() if v.is_floating_point() else v).cpu() for k, v in model.state_dict().items()
    }


def task_data(task: TrainTask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The task's training set: inputs (normalized as configured), labels (with the task's label
    noise) and the inputs as the data source stores them (for a noisy-label file)."""
    x, y, raw, classes = _training_data(task.data, task.base_dir)
    if task.label_noise is not None:
        y = noisy_labels(y, float(task.label_noise), _noise_seed(task), classes)
    return x, y, raw["x"]


def save_train_data(task: TrainTask, y: torch.Tensor) -> str:
    """Save the task's own training set (``task.train_data``, or the noisy-label file) with the
    labels ``y`` and the other tensors as its data source stores them; returns its path
    relative to ``task.outdir`` ('' when the task trains on the study's training set)."""
    if task.train_data:
        rel = task.train_data
    elif task.label_noise is not None:
        rel = f"data/train_noise{task.label_noise:g}_seed{_noise_seed(task)}.pt"
    else:
        return ""
    raw = _training_data(task.data, task.base_dir)[2]
    _save({**dict(raw), raw.target_key: y}, Path(task.outdir) / rel)
    return rel


def _noise_seed(task: TrainTask) -> int:
    return task.seed if task.noise_seed is None else task.noise_seed


def init_model(task: TrainTask) -> torch.nn.Module:
    """The task's model at initialization: built after ``torch.manual_seed(task.seed)``."""
    torch.manual_seed(int(task.seed))
    return build_model(task.model_target, dict(task.model_kwargs), Path(task.base_dir))


def train_model(task: TrainTask) -> TrainRecord:
    """Build, train (`train_to_target`) and save one model; returns its record. Checkpoints hold
    ``state_dict`` (float32), ``model_kwargs`` and ``hparams``; the task's own training set
    (noisy labels, or ``train_data``) is saved beside them (`save_train_data`)."""
    with single_threaded():
        out = Path(task.outdir)
        x, y, _ = task_data(task)
        train_data = save_train_data(task, y)
        model = init_model(task)
        rel, init = f"checkpoints/{task.name}.pt", f"checkpoints/{task.name}.init.pt"
        _save({"state_dict": float_state(model), "model_kwargs": task.model_kwargs}, out / init)
        res = train_to_target(model, x, y, task.recipe, seed=task.seed, criterion=task.criterion)
        _save(
            {
                "state_dict": float_state(model),
                "model_kwargs": task.model_kwargs,
                "hparams": task.hparams,
            },
            out / rel,
        )
        return TrainRecord(rel, init, dict(task.hparams), res, train_data, task.recipe.lr)


def describe(record: TrainRecord) -> str:
    """One log line: hyperparameters, steps, final loss and whether the criterion held."""
    r = record.result
    hp = ", ".join(f"{k}={v}" for k, v in record.hparams.items())
    state = "reached" if r.reached_target else ("DIVERGED" if r.diverged else "MISSED")
    return f"{hp}: {r.steps} steps, train CE {r.train_loss:.4f} {state} ({r.seconds:.1f}s)"


def default_jobs() -> int:
    """Models trained in parallel by default: one single-threaded process per core, up to 2."""
    return min(2, os.cpu_count() or 1)


def run_tasks(
    tasks: Sequence[TrainTask], jobs: int = 1, log: Callable[[str], None] | None = None
) -> list[TrainRecord]:
    """`train_model` over ``tasks``, in this process (jobs = 1) or a pool of ``jobs`` spawned
    processes; the records come back in the order of ``tasks`` and are the same either way."""
    done: list[TrainRecord] = []

    def report(rec: TrainRecord) -> None:
        done.append(rec)
        if log is not None:
            log(f"[{len(done)}/{len(tasks)}] {describe(rec)}")

    if jobs <= 1 or len(tasks) <= 1:
        for t in tasks:
            report(train_model(t))
        return done
    import multiprocessing as mp

    with ProcessPoolExecutor(
        max_workers=min(jobs, len(tasks)), mp_context=mp.get_context("spawn")
    ) as pool:
        for rec in pool.map(train_model, tasks):
            report(rec)
    return done


# ------------------------------------------------------------------ manifest.csv and training.csv
RESULT_COLUMNS = [
    "lr_effective",
    "steps",
    "epochs",
    "train_loss",
    "train_acc",
    "reached_target",
    "diverged",
    "seconds",
]


def write_manifest(
    folder: str | Path,
    records: Sequence[TrainRecord],
    hp_keys: Sequence[str],
    converged_column: bool = False,
) -> tuple[Path, Path]:
    """Write ``folder/manifest.csv`` (the checkpoints, their initializations, noisy-label
    training sets and hyperparameters: what ``checkpoints: {manifest: manifest.csv}`` reads)
    and ``folder/training.csv`` (the same and how training ended). Returns both paths.

    ``converged_column`` adds a manifest column ``converged`` (1 when training met its criterion,
    i.e. ``reached_target``): flatcli's results.csv then carries it as ``hp_converged``, the
    filter ``flatcli correlate --where "hp_converged == 1"`` for a criterion that is not a train
    loss bound (`Plateau`)."""
    folder = Path(folder)
    files = ["path", "init_checkpoint"] + (
        ["train_data"] if any(r.train_data for r in records) else []
    )
    rows = []
    for r in records:
        res = r.result
        rows.append({"path": r.path, "init_checkpoint": r.init_checkpoint, "train_data": r.train_data, **r.hparams,
                     "converged": int(res.reached_target),
                     "lr_effective": r.lr, "steps": res.steps, "epochs": res.epochs, "train_loss": res.train_loss,
                     "train_acc": res.train_acc, "reached_target": int(res.reached_target),
                     "diverged": int(res.diverged), "seconds": round(res.seconds, 2)})  # fmt: skip
    manifest = write_table(
        folder / "manifest.csv",
        rows,
        files + list(hp_keys) + (["converged"] if converged_column else []),
    )
    training = write_table(folder / "training.csv", rows, files + list(hp_keys) + RESULT_COLUMNS)
    return manifest, training


def read_training(path: str | Path, hp_keys: Sequence[str]) -> list[TrainRecord]:
    """The records of an earlier training from its ``training.csv`` (cells typed back)."""

    def num(cell: str | None) -> float:
        return float(cell) if cell else math.nan

    out = []
    for t in read_table(path)[1]:
        res = TrainResult(steps=int(t["steps"]), epochs=int(t["epochs"]), train_loss=num(t["train_loss"]),
                          train_acc=num(t.get("train_acc")), reached_target=t["reached_target"] == "1",
                          diverged=t["diverged"] == "1", seconds=num(t["seconds"]))  # fmt: skip
        hp = {k: coerce_cell(t[k]) for k in hp_keys}
        out.append(
            TrainRecord(
                t["path"],
                t["init_checkpoint"],
                hp,
                res,
                t.get("train_data", ""),
                num(t.get("lr_effective")),
            )
        )
    return out
