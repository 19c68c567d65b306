"""Opt-in: one demo-zoo model retrained with its parameters saved along the way (for ``landscape pca``).

`train_zoo` saves only each model's final and initial parameters. `train_trajectory`
retrains one zoo model from its own `flatcli.training.TrainTask` (same initialization, labels,
recipe and training-loss target, so the same weights) and saves θ every ``every`` steps, plus
the initialization (step 0) and the final step. The default ``flatcli demo`` never calls it.

    python -m flatcli.demo.trajectory OUTDIR [NAME] [EVERY]

writes ``OUTDIR/trajectory/NAME/step_<k>.pt`` (``{"state_dict", "model_kwargs",
"hparams", "step"}``, loadable with the zoo's ``config.yaml``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from ..errors import ConfigError, ExitCode
from ..training import TrainTask, float_state, init_model, task_data, train_to_target
from .zoo import zoo_tasks

DEFAULT_MODEL = "mlp_w256_wd0_noise0"


def zoo_models(seed: int = 0) -> dict[str, TrainTask]:
    """Name → the zoo's training task, in `train_zoo`'s order."""
    return {t.name: t for t in zoo_tasks(".", seed)}


def train_trajectory(
    outdir: str | Path,
    name: str = DEFAULT_MODEL,
    every: int = 20,
    seed: int = 0,
    log=print,
) -> list[Path]:
    """Retrain the zoo model ``name`` and save its parameters every ``every`` steps.

    Parameters
    ----------
    outdir : the zoo's directory (checkpoints go to ``outdir/trajectory/<name>/``).
    name : a zoo model, e.g. "mlp_w256_wd0_noise0" (see `zoo_models`).
    every : save every this many optimizer steps (step 0 and the last step are
        always saved).
    seed : the zoo's seed.

    Returns
    -------
    The saved checkpoint paths in training order.
    """
    models = zoo_models(seed)
    if name not in models:
        raise ConfigError(f"no zoo model named {name!r}; one of {', '.join(models)}")
    if int(every) < 1:
        raise ConfigError(f"every must be ≥ 1. Got {every} instead.")
    task = models[name]
    folder = Path(outdir) / "trajectory" / name
    folder.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []

    def save(step: int, m: torch.nn.Module) -> None:
        p = folder / f"step_{step}.pt"
        torch.save(
            {
                "state_dict": float_state(m),
                "model_kwargs": task.model_kwargs,
                "hparams": task.hparams,
                "step": step,
            },
            p,
        )
        paths.append(p)

    def on_step(step: int, m: torch.nn.Module) -> None:
        if step % int(every) == 0:
            save(step, m)

    x, y, _ = task_data(task)
    model = init_model(task)
    save(0, model)
    res = train_to_target(
        model, x, y, task.recipe, seed=task.seed, criterion=task.criterion, on_step=on_step
    )
    if res.steps % int(every) != 0:
        save(res.steps, model)
    log(
        f"trained {name}: {res.steps} steps, train CE {res.train_loss:.4f}; saved {len(paths)} checkpoints in {folder}"
    )
    return paths


if __name__ == "__main__":  # pragma: no cover - documented command
    args = sys.argv[1:]
    if not args:
        print(__doc__)
        sys.exit(ExitCode.USAGE)
    train_trajectory(
        args[0], args[1] if len(args) > 1 else DEFAULT_MODEL, int(args[2]) if len(args) > 2 else 20
    )
