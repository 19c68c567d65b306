"""The exact references every test compares against, written once.

- `dense_hessian`: ∇² of a scalar function of one flat float64 vector, row by row by double
  backward (`torch.autograd.grad` of each gradient coordinate; never ``torch.func.hessian``, whose
  LayerNorm rows were wrong). `problem_hessian` and `model_hessian` build the function from a
  flatcli `Problem` or from a model, a loss of its parameters and a parameter selection.
- `hessian_products`: rows of V·H by double backward, without building H.
- `dense_ggn`: the Gauss-Newton matrix (1/n) Σ_i J_iᵀ H_z,i J_i of a `Problem`.
- `measure_on`: one measure on a `Problem` with its own context.
- `runner`, `cli`, `cli_and_output`, `cli_output`: the Typer test runner on flatcli's app.
- The tiny models shared by several test folders, re-exported from where they live
  (tests/helpers.py; tests/token_models.py, which configs also load by path).

Data, batching, BatchNorm train/eval mode and padding masks stay with the caller: the oracle
differentiates exactly the function it is given, in the model's current mode.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.func import functional_call
from typer.testing import CliRunner

from tests.helpers import ConvBN, TinyBN, cli_output, conv_bn_setup, tiny_data, tiny_mlp
from tests.token_models import TinyLM, TokenClassifier, padded_tokens

__all__ = [
    "ConvBN",
    "TinyBN",
    "TinyLM",
    "TokenClassifier",
    "cli",
    "cli_and_output",
    "cli_output",
    "conv_bn_setup",
    "dense_ggn",
    "dense_hessian",
    "hessian_products",
    "measure_on",
    "mlp_problem",
    "model_hessian",
    "padded_tokens",
    "problem_hessian",
    "runner",
    "selected_parameters",
    "tiny_data",
    "tiny_mlp",
]

DT = torch.float64


# ---------------------------------------------------------------------------- Hessians
def dense_hessian(
    loss: Callable[[torch.Tensor], torch.Tensor],
    theta: torch.Tensor,
    *,
    chunk: int = 1,
    symmetrize: bool = False,
) -> torch.Tensor:
    """∇²loss(θ) for a scalar ``loss`` of the flat float64 vector ``theta``: row i is the gradient
    of the i-th gradient coordinate (double backward). ``chunk`` > 1 takes that many rows per
    backward pass (``is_grads_batched``; the same rows, faster on larger P). ``symmetrize``
    returns (H + Hᵀ)/2 (the rows agree with the columns up to rounding)."""
    if theta.dtype != DT:
        raise TypeError(f"the dense reference is float64; theta is {theta.dtype}")
    t = theta.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(loss(t), t, create_graph=True)
    g = g.reshape(-1)
    n = g.numel()
    if chunk == 1:
        rows = [torch.autograd.grad(g[i], t, retain_graph=True)[0].reshape(-1) for i in range(n)]
        H = torch.stack(rows)
    else:
        eye = torch.eye(n, dtype=DT)
        H = torch.cat(
            [
                torch.autograd.grad(g, t, E, retain_graph=True, is_grads_batched=True)[0]
                for E in eye.split(chunk)
            ]
        ).reshape(n, n)
    H = H.detach()
    return 0.5 * (H + H.T) if symmetrize else H


def hessian_products(
    loss: Callable[[torch.Tensor], torch.Tensor], theta: torch.Tensor, V: torch.Tensor
) -> torch.Tensor:
    """Rows v_k·∇²loss(θ) for the rows v_k of ``V``, one double backward each (no dense H)."""
    t = theta.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(loss(t), t, create_graph=True)
    return torch.stack([torch.autograd.grad(g, t, v, retain_graph=True)[0] for v in V]).detach()


def parameter_products(params: Sequence[torch.Tensor], loss: torch.Tensor):
    """The product of ∇²loss over the tensors ``params`` with vectors kept one block per tensor:
    ``product(V)`` takes a list of (K, numel) blocks (each on its tensor's device and in its dtype)
    and returns the rows of ∇²loss·v the same way, one double backward per row (autograd moves
    the cotangents between devices and dtypes as the forward moved the activations)."""
    params = list(params)
    grads = torch.autograd.grad(loss, params, create_graph=True)

    def product(V):
        rows = []
        for i in range(V[0].shape[0]):
            v = [b[i].reshape(q.shape) for b, q in zip(V, params, strict=True)]
            hv = torch.autograd.grad(grads, params, grad_outputs=v, retain_graph=True)
            rows.append([h.reshape(1, -1) for h in hv])
        return [torch.cat(b) for b in zip(*rows, strict=True)]

    return product


def problem_hessian(p, theta: torch.Tensor | None = None, **options) -> torch.Tensor:
    """∇²L of a flatcli `Problem` over its selected parameters at θ (default: the model's), L
    the mean unit loss over all its batches (``Problem.loss``). ``options``: of `dense_hessian`."""
    th = p.theta if theta is None else theta
    return dense_hessian(lambda t: p.loss(p.unflatten(t)), th.to(DT), **options)


def selected_parameters(model, include: str | Sequence[str] | None = None):
    """(chosen, fixed): the model's (deduplicated) named parameters whose name contains
    ``include`` (a substring, or any of several; all when None), and the others by name."""
    subs = [include] if isinstance(include, str) else include
    named = [(n, q.detach()) for n, q in model.named_parameters()]
    chosen = [(n, q) for n, q in named if subs is None or any(s in n for s in subs)]
    names = {n for n, _ in chosen}
    return chosen, {n: q for n, q in named if n not in names}


def model_hessian(
    model,
    loss_of: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    include: str | Sequence[str] | None = None,
    **options,
) -> torch.Tensor:
    """∇² of ``loss_of(params)`` over the selected parameters of ``model`` (see
    `selected_parameters`; the others held at their values), in the order of
    ``named_parameters``. ``loss_of`` gets every parameter by name, e.g.
    ``lambda ps: F.cross_entropy(functional_call(model, ps, (x,)), y)``."""
    chosen, fixed = selected_parameters(model, include)

    def loss(flat):
        parts = torch.split(flat, [q.numel() for _, q in chosen])
        params = {n: t.view(q.shape) for (n, q), t in zip(chosen, parts, strict=True)}
        return loss_of({**fixed, **params})

    flat = torch.cat([q.reshape(-1) for _, q in chosen]).to(DT)
    return dense_hessian(loss, flat, **options)


def call(model, params, *args, **kwargs):
    """``model`` called with the parameters ``params`` (name → tensor): `functional_call`."""
    return functional_call(model, params, args, kwargs)


def dense_ggn(p, theta: torch.Tensor | None = None) -> torch.Tensor:
    """The Gauss-Newton matrix (1/n) Σ_i J_iᵀ H_z,i J_i of a `Problem` over its rows i: J_i the
    Jacobian of row i's outputs by reverse mode, one output at a time, H_z,i the dense Hessian of
    row i's loss in its outputs (double backward)."""
    t = (p.theta if theta is None else theta).detach().clone().requires_grad_(True)
    z = p.forward(t, p.batch)
    rows = z.shape[0]
    flat = z.reshape(rows, -1)
    G = torch.zeros(t.numel(), t.numel(), dtype=DT)
    for i in range(rows):
        J = torch.stack(
            [torch.autograd.grad(flat[i, c], t, retain_graph=True)[0] for c in range(flat.shape[1])]
        )
        row = p.batch.select(slice(i, i + 1))
        shape = z[i : i + 1].shape
        Hz = dense_hessian(lambda zz, r=row, s=shape: p.loss_fn.sum(zz.view(s), r), flat[i])
        G += J.T @ Hz @ J
    return G / p.n


# ---------------------------------------------------------------------------- tiny problems
def mlp_problem(act=None, n=11, batch_size=4, seed=0, loss="cross_entropy"):
    """A 4-5-3 MLP (tanh unless ``act``), float64, eval mode, on n random rows with 3 classes,
    in batches of ``batch_size`` (4, 4, 3 by default): a flatcli `Problem`."""
    from torch import nn

    from flatcli.engine import Problem

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 5), (act or nn.Tanh)(), nn.Linear(5, 3)).to(DT).eval()
    x = torch.randn(n, 4, dtype=DT)
    y = torch.randint(0, 3, (n,))
    return Problem(model, x, y, loss=loss, batch_size=batch_size, dtype=DT)


# ---------------------------------------------------------------------------- one measure
def measure_on(
    p,
    name: str,
    *,
    label: str | None = None,
    engine=None,
    seed: int = 0,
    init_params=None,
    init_state=None,
    max_hvps=None,
    max_seconds=None,
    **options,
):
    """The measure ``name`` with ``options`` on the `Problem` ``p``, with its own context (a fresh
    `CurvatureEngine` unless ``engine`` is given) and caps: what `run_measure` returns."""
    from flatcli.engine import CurvatureEngine
    from flatcli.measures import MeasureContext, MeasureSpec, run_measure

    ctx = MeasureContext(
        p,
        CurvatureEngine(p) if engine is None else engine,
        seed=seed,
        init_params=init_params,
        init_state=init_state,
    )
    spec = MeasureSpec(name, label or name, options, max_hvps=max_hvps, max_seconds=max_seconds)
    return run_measure(spec, ctx)


# ---------------------------------------------------------------------------- the CLI
runner = CliRunner()


def cli(*args):
    """``flatcli ARGS`` in-process (arguments converted with str): the click Result."""
    from flatcli.cli import app

    return runner.invoke(app, [str(a) for a in args])


def cli_and_output(*args):
    """``flatcli ARGS``: (the Result, its stdout and stderr together)."""
    res = cli(*args)
    return res, cli_output(res)
