r"""The exact diagonal of the generalized Gauss-Newton matrix.

.. math::

    \mathrm{diag}(G)_j = \frac1n \sum_i \sum_k \big(a_{ik}^\top J_i\big)_j^2,
    \qquad \sum_k a_{ik} a_{ik}^\top = \nabla_z^2 \ell(z_i, y_i),

with :math:`J_i` (C × P) the Jacobian of sample i's C outputs and
:math:`a_{ik}` the columns of a factor of the output-space loss Hessian, in
closed form from the loss (`flatcli.engine.losses.Loss.ggn_factors`): cross-entropy,
:math:`\nabla_z^2\ell = \mathrm{diag}(p) - pp^\top` with
:math:`a_k = \sqrt{p_k}\,(e_k - p)`; MSE (per-sample :math:`\sum_c (f_c - y_c)^2`),
:math:`a_k = \sqrt2\, e_k`. Only for losses whose units are rows (a ``causal_lm``
sequence has T·V outputs: `flatcli.engine.losses.NotApplicable`). Nonnegative by
construction. Each term is a per-sample vector-Jacobian product, so the
diagonal costs C backward passes over the set (counted as C in the engine's
``n_vjp``), computed two ways:

* ``nn.Linear`` layers called once per forward on (batch × features) inputs,
  with parameters of their own: the per-sample gradient of the weight for
  cotangent :math:`a_{ik}` is the outer product :math:`\delta_{ik} x_i^\top`
  (:math:`\delta_{ik}` the back-propagated output gradient, :math:`x_i` the
  layer input), so :math:`\sum_i (\delta_{ik} x_i^\top)^{\circ 2} =
  (\delta_k^{\circ 2})^\top x^{\circ 2}`: one matrix product per layer and
  cotangent, no per-sample gradient is formed (Dangel, Kunstner & Hennig 2020,
  BackPACK's ``DiagGGNExact``). A forward hook records the layer's input and
  output (returning a copy, so in-place activations do not overwrite it).
* every other parameter (convolutions, BatchNorm, anything else): per-sample
  vector-Jacobian products with ``vmap``, in chunks of samples whose
  gradients (chunk × C × P' numbers, twice for the work space) stay within ~500 MB
  on CPU or a tenth of free CUDA memory. A model whose forward branches on its inputs'
  values (Hugging Face mask helpers ask ``attention_mask.all()``), which ``vmap`` over
  rows cannot trace, gets the same products one row at a time.

A parameter that is also used outside its Linear layer's call (e.g. a weight
read directly in ``forward``) is invisible to the hook; `checked_gauss_newton_diagonal`
(``hessian_diag: auto``) would flag the mismatch against exact Hessian entries.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.func import vjp, vmap

from .batch import Batch
from .losses import NotApplicable
from .routes import is_oom

__all__ = ["linear_fast_path", "ggn_diagonal"]


def _factors(problem, z: torch.Tensor, batch) -> torch.Tensor:
    """The loss's Gauss-Newton factors (C, b, C) of the per-row outputs ``z`` (b, C) of ``batch``."""
    Z, t, _ = problem.loss_fn.scores(z, batch)
    return problem.loss_fn.ggn_factors(Z.reshape(z.shape), t)


def linear_fast_path(problem, batch) -> list[tuple[nn.Linear, str | None, str | None]]:
    """Linear layers the outer-product rule applies to: (module, weight name, bias name) in ``problem.names``.

    Kept: called exactly once by a forward pass on ``batch``, on a 2-D input whose
    first dimension is the batch, and holding parameters no other module holds.
    """
    model = problem.model
    holders: dict[int, int] = {}
    for mod in model.modules():
        for prm in mod._parameters.values():
            if prm is not None:
                holders[id(prm)] = holders.get(id(prm), 0) + 1
    names = {id(prm): n for n, prm in model.named_parameters()}
    trainable = set(problem.names)
    calls: dict[nn.Module, list[bool]] = {}
    handles = []
    rows = batch.rows
    for mod in model.modules():
        if isinstance(mod, nn.Linear):

            def hook(m, inp, out, calls=calls):
                calls.setdefault(m, []).append(inp[0].ndim == 2 and inp[0].shape[0] == rows)

            handles.append(mod.register_forward_hook(hook))
    try:
        with torch.no_grad():
            problem.forward(problem.params, batch)
    finally:
        for h in handles:
            h.remove()
    out = []
    for mod, seen in calls.items():
        if seen != [True]:
            continue
        w = names.get(id(mod.weight)) if holders.get(id(mod.weight)) == 1 else None
        b = (
            names.get(id(mod.bias))
            if mod.bias is not None and holders.get(id(mod.bias)) == 1
            else None
        )
        w = w if w in trainable else None
        b = b if b in trainable else None
        if w or b:
            out.append((mod, w, b))
    return out


def _linear_part(problem, th, batch, fast, slices, out):
    """Accumulate Σ_i Σ_k (δ_ik x_iᵀ)² and Σ_i Σ_k δ_ik² into ``out`` for the fast Linear layers."""
    records: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(m, inp, o):
        records[m] = (inp[0].detach(), o)
        return o.clone()  # later in-place ops change the copy, not the recorded output

    handles = [m.register_forward_hook(hook) for m, _, _ in fast]
    t = th.detach().requires_grad_(True)
    try:
        z = problem.forward(problem.unflatten(t), batch)
    finally:
        for h in handles:
            h.remove()
    z = z.reshape(
        batch.rows, -1
    )  # a loss whose units are rows scores this (`flatcli.engine.losses`)
    cots = _factors(problem, z.detach(), batch)
    outs = [records[m][1] for m, _, _ in fast]
    for k in range(cots.shape[0]):
        deltas = torch.autograd.grad(
            z, outs, cots[k], retain_graph=k < cots.shape[0] - 1, allow_unused=True
        )
        for (m, wn, bn), d in zip(fast, deltas, strict=True):
            if d is None:
                continue
            d2 = d.detach() * d.detach()
            if wn is not None:
                xin = records[m][0]
                out[slices[wn]] += (d2.T @ (xin * xin)).reshape(-1)
            if bn is not None:
                out[slices[bn]] += d2.sum(0)
    return z.shape[1]


def _per_sample_part(
    problem, th, batch, rest: list[str], slices, out, chunk_of: Callable[[int, int], int]
):
    """Accumulate Σ_i Σ_k (a_ikᵀ J_i)² for the parameters ``rest`` by vmapped per-sample VJPs."""
    base = problem.unflatten(th)
    idx = torch.cat([torch.arange(slices[n].start, slices[n].stop, device=th.device) for n in rest])
    sizes = [slices[n].stop - slices[n].start for n in rest]

    def single(t_rest, row):
        params = dict(base)
        for n, piece in zip(rest, torch.split(t_rest, sizes), strict=True):
            params[n] = piece.view(base[n].shape)
        one = Batch({k: v[None] for k, v in row.items()})
        return problem.forward(params, one).reshape(-1)

    def per_sample(t_rest, row, A):
        _, pull = vjp(lambda tt: single(tt, row), t_rest)
        return vmap(lambda a: pull(a)[0])(A)

    batched = vmap(per_sample, in_dims=(None, 0, 0))
    t_rest = th[idx]
    with torch.no_grad():
        z = problem.forward(base, batch).reshape(batch.rows, -1)
    cots = _factors(problem, z, batch).transpose(
        0, 1
    )  # (b, C, C): sample i's cotangents a_ik as rows
    C = z.shape[1]
    step = chunk_of(C, len(idx))
    acc = torch.zeros(len(idx), dtype=th.dtype, device=th.device)
    rows = dict(batch.items())
    looped = False
    for i in range(0, batch.rows, step):
        chunk = {k: v[i : i + step] for k, v in rows.items()}
        if not looped:
            try:
                U = batched(t_rest, chunk, cots[i : i + step]).detach()  # (b, C, P')
                acc += U.square_().sum((0, 1))
                continue
            except (
                RuntimeError
            ) as e:  # data-dependent control flow on a row (a Hugging Face mask check)
                if is_oom(e):
                    raise
                looped = True
        for r in range(
            len(cots[i : i + step])
        ):  # one row at a time, the C cotangents still vmapped
            U = per_sample(t_rest, {k: v[r] for k, v in chunk.items()}, cots[i + r]).detach()
            acc += U.square_().sum(0)
    out[idx] += acc
    return C


def ggn_diagonal(
    problem, batches, theta: torch.Tensor, chunk_of: Callable[[int, int], int]
) -> tuple[torch.Tensor, int]:
    """diag(G) at ``theta`` over ``batches`` (the module docstring), divided by the whole set's
    units; returns (this rank's part, C). ``chunk_of(C, P')``: samples per vmapped chunk."""
    p = problem
    if not p.loss_fn.units_are_rows:
        raise NotApplicable(
            f"the exact Gauss-Newton diagonal needs per-row outputs; loss '{p.loss_name}' "
            "scores many units per row (use a stochastic diagonal: hessian_diag: hutchinson)"
        )
    th = theta.detach()
    out = torch.zeros_like(th)
    if not batches:
        return out, 0
    fast = linear_fast_path(p, batches[0])
    slices = p.param_slices()
    done = {n for _, w, b in fast for n in (w, b) if n is not None}
    rest = [n for n in p.names if n not in done]
    C = 0
    for b in batches:
        if fast:
            C = _linear_part(p, th, b, fast, slices, out)
        if rest:
            C = _per_sample_part(p, th, b, rest, slices, out, chunk_of)
    return out / p.n, C
