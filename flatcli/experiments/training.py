"""Training every model of a study to the same training-loss target.

Each model is trained by mini-batch SGD (momentum) or Adam with the grid point's batch size,
learning rate and weight decay until its cross-entropy on the whole training set, evaluated in
eval mode without the regularizer, is at most the target (Jiang et al. 2020 stop at 0.01), or
until ``max_steps``. Measures taken away from a minimum are dominated by the residual gradient,
so models that miss the target are recorded (``reached_target = 0``) and left out of the
correlations downstream, not hidden.

Determinism: every model trains in one thread, from ``torch.manual_seed(seed)`` (initialization)
and a batch-order generator seeded by ``seed``; the result is the same whether the models train
one after the other or in parallel worker processes.

Weight decay is the coupled L2 penalty (``weight_decay/2 · Σ‖W‖²`` added to the objective
through the optimizer's ``weight_decay``) on weight matrices and conv kernels only, not on
biases or normalization parameters. Label noise replaces the labels of a seeded random
``label_noise`` fraction of the training set by uniformly drawn classes (Zhang et al. 2017);
for one seed the corrupted sets are nested (a prefix of one permutation).
"""

from __future__ import annotations

import json
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

EVAL_CHUNK = 4096


@dataclass(frozen=True)
class TrainResult:
    """How one model's training ended."""

    steps: int
    epochs: int
    train_loss: float  # eval-mode cross-entropy on the training labels, no regularizer
    reached_target: bool
    diverged: bool
    seconds: float
    lr: float  # effective learning rate (lr × lr_factor)


def effective_lr(training: dict[str, Any]) -> float:
    """The learning rate used: ``lr`` (or ``lr[optimizer]``) × ``lr_factor``."""
    lr = training["lr"]
    base = lr[training["optimizer"]] if isinstance(lr, dict) else lr
    return float(base) * float(training.get("lr_factor", 1.0))


def _optimizer(model: torch.nn.Module, training: dict[str, Any]) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": float(training["weight_decay"])}, {"params": rest, "weight_decay": 0.0}]
    lr = effective_lr(training)
    if training["optimizer"] == "adam":
        return torch.optim.Adam(groups, lr=lr)
    return torch.optim.SGD(groups, lr=lr, momentum=float(training["momentum"]))


@torch.no_grad()
def eval_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean cross-entropy over (x, y) in eval mode (the model's mode is restored)."""
    was = model.training
    model.eval()
    try:
        total = 0.0
        for i in range(0, len(x), EVAL_CHUNK):
            total += float(torch.nn.functional.cross_entropy(model(x[i : i + EVAL_CHUNK]), y[i : i + EVAL_CHUNK], reduction="sum"))
        return total / len(x)
    finally:
        model.train(was)


def train_to_target(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    training: dict[str, Any],
    *,
    seed: int,
    target: float,
) -> TrainResult:
    """Train ``model`` in place on (x, y) until the eval-mode train cross-entropy ≤ ``target``.

    ``training``: ``optimizer`` (sgd | adam), ``lr`` (a number or {optimizer: lr}), ``lr_factor``,
    ``batch_size`` (≥ len(x): full batch), ``weight_decay``, ``momentum`` (SGD), ``max_steps``,
    ``eval_every`` (steps between checks; None: once per epoch). The loss is checked before the
    first step too. A non-finite loss stops training (``diverged``).
    """
    t0 = time.perf_counter()
    device = x.device
    n = len(x)
    bs = min(int(training["batch_size"]), n)
    per_epoch = math.ceil(n / bs)
    every = int(training["eval_every"] or per_epoch)
    opt = _optimizer(model, training)
    gen = torch.Generator().manual_seed(int(seed))
    lossf = torch.nn.functional.cross_entropy
    steps = epochs = 0
    loss = eval_loss(model, x, y)
    while loss > target and math.isfinite(loss) and steps < training["max_steps"]:
        perm = torch.randperm(n, generator=gen).to(device)
        for i in range(0, n, bs):
            idx = perm[i : i + bs]
            model.train()
            opt.zero_grad(set_to_none=True)
            lossf(model(x[idx]), y[idx]).backward()
            opt.step()
            steps += 1
            if steps % every == 0 or steps >= training["max_steps"]:
                loss = eval_loss(model, x, y)
                if loss <= target or not math.isfinite(loss) or steps >= training["max_steps"]:
                    break
        epochs += 1
    model.eval()
    return TrainResult(
        steps=steps, epochs=epochs, train_loss=loss, reached_target=bool(loss <= target),
        diverged=not math.isfinite(loss), seconds=time.perf_counter() - t0, lr=effective_lr(training),
    )  # fmt: skip


def noisy_labels(y: torch.Tensor, frac: float, seed: int, num_classes: int) -> torch.Tensor:
    """``y`` with a seeded ``frac`` of its entries replaced by uniform random classes."""
    if frac <= 0:
        return y.clone()
    g = torch.Generator().manual_seed(10_000 + int(seed))
    perm = torch.randperm(len(y), generator=g)
    new = torch.randint(0, num_classes, (len(y),), generator=g)
    out = y.clone()
    idx = perm[: int(round(frac * len(y)))]
    out[idx] = new[idx]
    return out


# ------------------------------------------------------------------ one task per model
_DATA: dict[str, Any] = {}


def _study_data(flat: dict[str, Any], base_dir: str) -> dict[str, Any]:
    """Train split (normalized, and raw for noisy-label files) and the class count, once per process."""
    key = json.dumps([flat["data"], base_dir], sort_keys=True, default=str)
    if key not in _DATA:
        from ..api import DataCache
        from ..config import from_dict
        from ..loading.data import load_split

        cfg = from_dict({**flat, "checkpoints": []}, base_dir=base_dir, env={})
        train = DataCache(cfg).get("train")
        x, y = train["x"], train["y"]
        raw_x = load_split(cfg.data.train, "train", cfg.base_dir, None)["x"]
        test = DataCache(cfg).get("test")
        classes = int(max(int(y.max()), int(test["y"].max()) if test is not None else 0)) + 1
        _DATA[key] = {"x": x, "y": y, "raw_x": raw_x, "classes": classes}
    return _DATA[key]


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def train_task(task: dict[str, Any]) -> dict[str, Any]:
    """Train one grid point and write its checkpoints (and noisy-label file); returns its record.

    ``task``: ``flatcli`` (the study's flatcli config), ``base_dir``, ``outdir`` (the study folder),
    ``name``, ``hp`` (the grid point), ``training`` (defaults merged with the grid point),
    ``model_axes``, ``target``.
    """
    from ..loading.models import build_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    flush = torch.set_flush_denormal(True)  # denormals slow CPU training tenfold near the target
    try:
        out = Path(task["outdir"])
        flat, hp, training = task["flatcli"], task["hp"], task["training"]
        data = _study_data(flat, task["base_dir"])
        x, y = data["x"], data["y"]
        row: dict[str, Any] = {"path": f"checkpoints/{task['name']}.pt", "init_checkpoint": f"checkpoints/{task['name']}.init.pt"}
        if "label_noise" in hp:
            y = noisy_labels(y, float(hp["label_noise"]), int(hp["seed"]), data["classes"])
            rel = f"data/train_noise{hp['label_noise']:g}_seed{hp['seed']}.pt"
            (out / "data").mkdir(parents=True, exist_ok=True)
            tmp = out / f"{rel}.{os.getpid()}.tmp"
            torch.save({"x": data["raw_x"], "y": y}, tmp)
            os.replace(tmp, out / rel)
            row["train_data"] = rel
        kwargs = {**flat["model"].get("kwargs", {}), **{k: hp[k] for k in task["model_axes"]}}
        torch.manual_seed(int(hp["seed"]))
        model = build_model(flat["model"]["target"], kwargs, Path(task["base_dir"]))
        (out / "checkpoints").mkdir(parents=True, exist_ok=True)
        torch.save({"state_dict": model.state_dict(), "model_kwargs": kwargs}, out / row["init_checkpoint"])
        dev = _resolve_device(training["device"])
        model.to(dev)
        res = train_to_target(model, x.to(dev), y.to(dev), training, seed=int(hp["seed"]), target=float(task["target"]))
        model.cpu()
        torch.save({"state_dict": model.state_dict(), "model_kwargs": kwargs, "hparams": hp}, out / row["path"])
        return {"row": row, "hp": hp, "result": asdict(res)}
    finally:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(flush)


def run_tasks(tasks: list[dict[str, Any]], jobs: int, log=None) -> list[dict[str, Any]]:
    """Run ``train_task`` over ``tasks``: in this process (jobs = 1) or a pool of ``jobs``
    spawned processes. Records come back in the order of ``tasks``."""
    done: list[dict[str, Any]] = []

    def report(i: int, rec: dict[str, Any]) -> None:
        if log is not None:
            r = rec["result"]
            hp = ", ".join(f"{k}={v}" for k, v in rec["hp"].items())
            state = "reached" if r["reached_target"] else ("DIVERGED" if r["diverged"] else "MISSED")
            log(f"[{i + 1}/{len(tasks)}] {hp}: {r['steps']} steps, train CE {r['train_loss']:.4f} {state} ({r['seconds']:.1f}s)")

    if jobs <= 1 or len(tasks) <= 1:
        for i, t in enumerate(tasks):
            done.append(train_task(t))
            report(i, done[-1])
        return done
    import multiprocessing as mp

    with ProcessPoolExecutor(max_workers=min(jobs, len(tasks)), mp_context=mp.get_context("spawn")) as pool:
        for i, rec in enumerate(pool.map(train_task, tasks)):
            done.append(rec)
            report(i, rec)
    return done
