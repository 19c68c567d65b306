r"""The diagonal preconditioner of an adaptive optimizer, read from its state (Adam, AdamW, RMSprop).

The update of Adam and AdamW (PyTorch's, Kingma & Ba 2015, Alg. 1) is
:math:`\theta \leftarrow \theta - \eta\,\hat m / (\sqrt{\hat v} + \epsilon)` with the bias-corrected
second moment :math:`\hat v = v / (1 - \beta_2^t)` (``exp_avg_sq``; ``max_exp_avg_sq`` under
``amsgrad``), ``t`` the state's ``step``. RMSprop's is :math:`\theta \leftarrow \theta - \eta\, g /
(\sqrt{v} + \epsilon)` (``square_avg``, no bias correction; centered: :math:`\sqrt{v - \bar g^2}`,
``grad_avg``). The preconditioner is the learning-rate-free diagonal

.. math:: P = \mathrm{diag}(\sqrt{\hat v} + \epsilon),

with ε added after the square root, as the optimizers apply it, so that the step is
:math:`\eta P^{-1} \hat m`. The preconditioned sharpness is :math:`\lambda_{\max}(P^{-1} H) =
\lambda_{\max}(P^{-1/2} H P^{-1/2})` (Cohen et al. 2022, "Adaptive gradient methods at the edge of
stability", §2); its stability threshold under the frozen preconditioner is
:math:`(2 + 2\beta_1)/((1 - \beta_1)\eta)` for Adam's exponential-average momentum
(38/η at β₁ = 0.9) and :math:`(2 + 2\mu)/\eta` for RMSprop's heavy-ball momentum μ (2/η without).

State and parameters are matched by the optimizer's own numbering: a live optimizer's parameters
are matched by identity with the model's; a saved state dict's parameter ``i`` (in the order of its
``param_groups``) is the model's ``i``-th parameter in ``model.named_parameters()`` order, which is
what ``torch.optim.Adam(model.parameters())`` numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..engine import NotApplicable
from ..errors import ConfigError

NESTED = ("optimizer", "optimizer_state_dict", "optimizer_states")  # where checkpoints keep it


@dataclass(frozen=True)
class Preconditioner:
    """The diagonal of P over θ (the problem's flat layout), the optimizer's family, its momentum
    β₁ (μ for RMSprop), the learning rate (None when the groups differ) and the stability
    threshold of the preconditioned sharpness (None without one learning rate)."""

    diagonal: torch.Tensor
    kind: str
    beta1: float
    lr: float | None
    threshold: float | None


def load_state(path: str) -> dict:
    """A saved optimizer state dict (``torch.save(optimizer.state_dict())``, or a checkpoint holding
    one under ``optimizer``, ``optimizer_state_dict`` or Lightning's ``optimizer_states``)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"optimizer_state: no file {p}")
    try:
        doc = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # unreadable or not a tensor file
        raise ConfigError(f"optimizer_state: {p} cannot be read as a torch file ({e})") from None
    return as_state_dict(doc, str(p))


def as_state_dict(doc: Any, where: str) -> dict:
    """The optimizer state dict in ``doc`` (itself, or nested under a checkpoint's key)."""
    for key in NESTED:
        if isinstance(doc, dict) and key in doc:
            doc = doc[key]
            doc = doc[0] if isinstance(doc, list) and doc else doc
            break
    if not (isinstance(doc, dict) and "state" in doc and "param_groups" in doc):
        raise ConfigError(
            f"{where} holds no optimizer state dict (keys 'state' and 'param_groups')"
        )
    return doc


def _numbered(optimizer, model: torch.nn.Module) -> tuple[dict, dict[int, str]]:
    """(state dict, optimizer index → model parameter name)."""
    names = [n for n, _ in model.named_parameters()]
    if isinstance(optimizer, torch.optim.Optimizer):
        sd = optimizer.state_dict()
        by_id = {id(q): n for n, q in model.named_parameters()}
        flat = [q for g in optimizer.param_groups for q in g["params"]]
        ids = [i for g in sd["param_groups"] for i in g["params"]]
        return sd, {i: by_id.get(id(q), "") for i, q in zip(ids, flat, strict=True)}
    sd = as_state_dict(optimizer, "the optimizer state")
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    return sd, {i: (names[j] if j < len(names) else "") for j, i in enumerate(ids)}


def _second_moment(state: dict, group: dict, name: str) -> tuple[torch.Tensor, str]:
    """(√v̂ + ε as the optimizer applies it, family) of one parameter's state."""
    eps = float(group.get("eps", 1e-8))
    if "exp_avg_sq" in state:
        v = state["max_exp_avg_sq"] if group.get("amsgrad") else state["exp_avg_sq"]
        t = float(state["step"])
        beta2 = float(group["betas"][1])
        return (v.double() / (1.0 - beta2**t)).sqrt() + eps, "adam"
    if "square_avg" in state:
        v = state["square_avg"].double()
        if group.get("centered"):
            v = v - state["grad_avg"].double() ** 2
        return v.sqrt() + eps, "rmsprop"
    raise NotApplicable(
        f"the optimizer state of {name} has no second moment (exp_avg_sq of Adam/AdamW or "
        "square_avg of RMSprop)"
    )


def preconditioner(optimizer, problem) -> Preconditioner:
    """P over the problem's θ from ``optimizer`` (a live optimizer or a state dict); `NotApplicable`
    naming the parameter when a selected one has no state (no step taken yet) or the optimizer
    keeps no second moment."""
    sd, numbering = _numbered(optimizer, problem.model)
    state = {numbering[i]: s for i, s in sd["state"].items() if i in numbering}
    group_of = {numbering[i]: g for g in sd["param_groups"] for i in g["params"] if i in numbering}
    parts, kinds = [], set()
    for name in problem.names:
        if name not in state or not state[name]:
            raise NotApplicable(f"the optimizer has no state for parameter {name} (no step yet?)")
        d, kind = _second_moment(state[name], group_of[name], name)
        if d.numel() != problem.params[name].numel():
            raise ConfigError(
                f"the optimizer state of {name} has {d.numel()} entries, the parameter "
                f"{problem.params[name].numel()}: the state belongs to another model"
            )
        parts.append(d.reshape(-1))
        kinds.add(kind)
    groups = [group_of[n] for n in problem.names]
    kind = kinds.pop() if len(kinds) == 1 else "mixed"
    beta1 = _momentum(groups[0], kind)
    lrs = {float(g["lr"]) for g in groups}
    lr = lrs.pop() if len(lrs) == 1 else None
    threshold = None
    if lr is not None and lr > 0 and kind in ("adam", "rmsprop"):
        threshold = (2 + 2 * beta1) / ((1 - beta1) * lr) if kind == "adam" else (2 + 2 * beta1) / lr
    diag = torch.cat(parts).to(problem.device, problem.dtype)
    return Preconditioner(diag, kind, beta1, lr, threshold)


def _momentum(group: dict, kind: str) -> float:
    """β₁ of Adam, μ of RMSprop (0 without momentum)."""
    if kind == "adam":
        return float(group["betas"][0])
    return float(group.get("momentum", 0.0) or 0.0)


def finite_positive(diagonal: torch.Tensor) -> bool:
    """Whether every entry of P is finite and positive (P^{-1/2} exists)."""
    return bool(torch.isfinite(diagonal).all()) and bool((diagonal > 0).all())
