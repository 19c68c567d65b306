"""Opt-in: one demo-zoo model retrained with its parameters saved along the way (for ``landscape --pca``).

`train_zoo` saves only each model's final and initial parameters. `train_trajectory`
retrains one zoo model with the zoo's exact recipe (same initialization seed,
labels, full-batch Adam, weight decay and training-loss target, see
`flatcli.demo.zoo.train_to_target`) and saves θ every ``every`` steps, plus the
initialization (step 0) and the final step. The default ``flatcli demo`` never
calls it.

    python -m flatcli.demo.trajectory OUTDIR [NAME] [EVERY]

writes ``OUTDIR/trajectory/NAME/step_<k>.pt`` (``{"state_dict", "model_kwargs",
"hparams", "step"}``, loadable with the zoo's ``config.yaml``).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

from ..loading.data import digits_split
from .models import MLP
from .zoo import ZOO_GRID, _noisy_labels, model_name, train_to_target

DEFAULT_MODEL = "mlp_w256_wd0_noise0"


def zoo_models() -> dict[str, tuple[int, dict]]:
    """Name → (index in the zoo's grid, hyperparameters), in `train_zoo`'s order."""
    keys = list(ZOO_GRID)
    out = {}
    for i, values in enumerate(itertools.product(*ZOO_GRID.values())):
        hp = dict(zip(keys, values, strict=True))
        out[model_name(hp)] = (i, hp)
    return out


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
    seed : the zoo's seed (initialization ``seed * 1000 + index``, label noise).

    Returns
    -------
    The saved checkpoint paths in training order.
    """
    models = zoo_models()
    if name not in models:
        from ..errors import ConfigError

        raise ConfigError(f"no zoo model named {name!r}; one of {', '.join(models)}")
    if int(every) < 1:
        from ..errors import ConfigError

        raise ConfigError(f"every must be ≥ 1; got {every}")
    i, hp = models[name]
    folder = Path(outdir) / "trajectory" / name
    folder.mkdir(parents=True, exist_ok=True)
    x, y = digits_split("train")
    yn = _noisy_labels(y, hp["label_noise"], seed)
    torch.manual_seed(seed * 1000 + i)
    model = MLP(64, hp["width"], 2, 10)
    mk = {"in_features": 64, "width": hp["width"], "depth": 2, "num_classes": 10}
    paths: list[Path] = []

    def save(step: int, m: torch.nn.Module) -> None:
        p = folder / f"step_{step}.pt"
        sd = {k: v.detach().clone() for k, v in m.state_dict().items()}
        torch.save({"state_dict": sd, "model_kwargs": mk, "hparams": hp, "step": step}, p)
        paths.append(p)

    save(0, model)

    def on_step(step: int, m: torch.nn.Module) -> None:
        if step % int(every) == 0:
            save(step, m)

    steps, loss = train_to_target(model, x, yn, hp["weight_decay"], on_step=on_step)
    if steps % int(every) != 0:
        save(steps, model)
    log(
        f"trained {name}: {steps} steps, train CE {loss:.4f}; saved {len(paths)} checkpoints in {folder}"
    )
    return paths


if __name__ == "__main__":  # pragma: no cover - documented command
    args = sys.argv[1:]
    if not args:
        print(__doc__)
        sys.exit(2)
    train_trajectory(
        args[0], args[1] if len(args) > 1 else DEFAULT_MODEL, int(args[2]) if len(args) > 2 else 20
    )
