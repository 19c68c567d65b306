r"""Next-token cross-entropy fused with the output layer, chunked over tokens, with an analytic
double backward: what keeps a large vocabulary out of memory in ``causal_lm`` Hessian products.

For a model whose logits are the output of one ``nn.Linear`` (the LM head: Hugging Face's
``lm_head``, tied or not), the loss of a batch is

.. math:: f(h, W, b) = \sum_{t\ \text{scored}} \ell\big(W h_t + b,\ y_t\big),
   \qquad \ell(z, y) = \operatorname{logsumexp}(z) - z_y,

with :math:`h` (tokens × width) the head's input. `fused_loss_sum` computes f through two
autograd functions that visit the tokens in chunks, so no (tokens × vocabulary) tensor outlives a
chunk:

* ``_LinearCE``: f; its backward is ``_LinearCEGrad`` (so the gradient is itself differentiable);
* ``_LinearCEGrad``: :math:`g_h = R W`, :math:`g_W = R^\top h`, :math:`g_b = \mathbf 1^\top R` with
  :math:`R = \mathrm{softmax}(Z) - Y` on scored tokens (0 elsewhere); its backward takes cotangents
  :math:`(c_h, c_W, c_b)` and returns :math:`\nabla^2 f\,(c_h, c_W, c_b)` (the Hessian is symmetric):
  with :math:`\dot Z = c_h W^\top + h c_W^\top + c_b` and
  :math:`\dot R = P \circ \dot Z - P\,\mathrm{diag}(P \dot Z^\top)` (row-wise :math:`p \circ \dot z - p (p\cdot\dot z)`),

  .. math:: \dot g_h = \dot R W + R c_W, \quad \dot g_W = \dot R^\top h + R^\top c_h, \quad
     \dot g_b = \mathbf 1^\top \dot R.

A reverse-over-reverse Hessian-vector product through the model then runs these closed forms for
the head and ordinary autograd for the body. A third derivative is not supported.

Forward-over-reverse products (``torch.func.jvp`` of ``torch.func.grad``, vmapped over a block of
vectors, and `torch.autograd.forward_ad` dual tensors through an ordinary backward) run the same
closed forms: ``_LinearCEGrad``'s forward-mode rule is the Hessian product above, ``_LinearCE``'s
is :math:`\sum_t R_t\cdot\dot z_t`. Both functions use the ``setup_context`` form and
``generate_vmap_rule`` (which ``torch.func`` requires), and the chunk loops write nothing in place
into fresh buffers where a vmapped tangent would land.

`find_head` decides whether the fused form applies: the model's output must be the very tensor an
``nn.Linear`` returned (checked with a forward hook on one batch); a model that post-processes its
logits (scaling, soft-capping) keeps the plain ``log_softmax`` path.
"""

from __future__ import annotations

import torch
from torch import nn

CHUNK_ELEMENTS = 2**22  # logits per chunk (16 MiB in fp32): chunk tokens = this / vocabulary


def _chunks(n: int, vocab: int):
    size = max(1, CHUNK_ELEMENTS // max(1, vocab))
    for i in range(0, n, size):
        yield slice(i, min(n, i + size))


def _probs_and_residual(h, W, b, labels, keep, sl):
    """(P, R) of one chunk: softmax of its logits and R = P − one-hot on scored tokens (0 elsewhere).
    Out of place (a scatter and a mask), so that it runs under ``vmap`` as well."""
    z = h[sl] @ W.T
    if b is not None:
        z = z + b
    P = torch.softmax(z, dim=-1)
    k = keep[sl][:, None]
    R = P.scatter_add(-1, labels[sl][:, None], -k.to(P.dtype).expand(-1, 1))
    return P, torch.where(k, R, torch.zeros((), dtype=R.dtype))


def _gradient(h, W, b, labels, keep):
    """(g_h, g_W, g_b) of f (module docstring), chunk by chunk."""
    gh = torch.zeros_like(h)
    gW = torch.zeros_like(W)
    gb = torch.zeros_like(b) if b is not None else None
    for sl in _chunks(h.shape[0], W.shape[0]):
        _, R = _probs_and_residual(h, W, b, labels, keep, sl)
        gh[sl] = R @ W
        gW += R.T @ h[sl]
        if gb is not None:
            gb += R.sum(0)
    return gh, gW, gb


def _hessian_product(h, W, b, labels, keep, ch, cW, cb):
    r""":math:`\nabla^2 f\,(c_h, c_W, c_b)` (module docstring; any of the c may be None: zero), chunk
    by chunk. Written without in-place writes into fresh buffers (chunks concatenated, sums out of
    place), so that it runs under ``vmap`` with batched c and unbatched h, W, b: the same code is the
    double backward (`_LinearCEGrad.backward`) and the forward-mode rule (`_LinearCEGrad.jvp`)."""
    parts, oW, ob = [], None, None
    for sl in _chunks(h.shape[0], W.shape[0]):
        P, R = _probs_and_residual(h, W, b, labels, keep, sl)
        zd = None
        for term in (
            None if ch is None else ch[sl] @ W.T,
            None if cW is None else h[sl] @ cW.T,
            cb,
        ):
            if term is not None:
                zd = term if zd is None else zd + term
        if zd is None:  # every cotangent zero
            zd = torch.zeros_like(P)
        Rd = torch.where(
            keep[sl][:, None],
            P * (zd - (P * zd).sum(-1, keepdim=True)),
            torch.zeros((), dtype=P.dtype),
        )
        oh = Rd @ W
        dW = Rd.T @ h[sl]
        if cW is not None:
            oh = oh + R @ cW
        if ch is not None:
            dW = dW + R.T @ ch[sl]
        parts.append(oh)
        oW = dW if oW is None else oW + dW
        if b is not None:
            ob = Rd.sum(0) if ob is None else ob + Rd.sum(0)
    return torch.cat(parts), oW, ob


def _scaled(t, s):
    return None if t is None else t * s


class _LinearCEGrad(torch.autograd.Function):
    """(g_h, g_W, g_b) of f, times the incoming scalar ``scale`` (module docstring). Its backward and
    its forward-mode rule (``jvp``) are the same Hessian product (the Hessian is symmetric);
    ``generate_vmap_rule`` lets ``torch.func.vmap`` run it over a block of vectors."""

    generate_vmap_rule = True

    @staticmethod
    def forward(h, W, b, labels, keep, scale):
        gh, gW, gb = _gradient(h, W, b, labels, keep)
        return gh * scale, gW * scale, _scaled(gb, scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        h, W, b, labels, keep, scale = inputs
        saved = (h, W, b if b is not None else h.new_empty(0), labels, keep, scale)
        ctx.save_for_backward(*saved)
        ctx.save_for_forward(*saved)
        ctx.has_bias = b is not None

    @staticmethod
    def _saved(ctx):
        h, W, b, labels, keep, scale = ctx.saved_tensors
        return h, W, (b if ctx.has_bias else None), labels, keep, scale

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, ch, cW, cb):
        h, W, b, labels, keep, scale = _LinearCEGrad._saved(ctx)
        oh, oW, ob = _hessian_product(h, W, b, labels, keep, ch, cW, cb)
        return oh * scale, oW * scale, _scaled(ob, scale), None, None, None

    @staticmethod
    def jvp(ctx, dh, dW, db, _labels, _keep, dscale):
        h, W, b, labels, keep, scale = _LinearCEGrad._saved(ctx)
        oh, oW, ob = _hessian_product(h, W, b, labels, keep, dh, dW, db if b is not None else None)
        out = [oh * scale, oW * scale, _scaled(ob, scale)]
        if dscale is not None:  # the incoming scalar's own tangent: the gradient times it
            out = [
                None if o is None else o + g * dscale
                for o, g in zip(out, _gradient(h, W, b, labels, keep), strict=True)
            ]
        return tuple(out)


class _LinearCE(torch.autograd.Function):
    r"""f(h, W, b): the summed next-token cross-entropy of the scored tokens (module docstring).
    Its forward-mode rule is :math:`\sum_t R_t \cdot \dot z_t` (the gradient's pairing with the
    tangents), computed chunk by chunk."""

    generate_vmap_rule = True

    @staticmethod
    def forward(h, W, b, labels, keep):
        total = h.new_zeros(())
        for sl in _chunks(h.shape[0], W.shape[0]):
            z = h[sl] @ W.T
            if b is not None:
                z = z + b
            k = keep[sl]
            ell = torch.logsumexp(z, dim=-1) - z.gather(1, labels[sl][:, None])[:, 0]
            total = total + torch.where(k, ell, torch.zeros((), dtype=ell.dtype)).sum()
        return total

    @staticmethod
    def setup_context(ctx, inputs, output):
        h, W, b, labels, keep = inputs
        saved = (h, W, b if b is not None else h.new_empty(0), labels, keep)
        ctx.save_for_backward(*saved)
        ctx.save_for_forward(*saved)
        ctx.has_bias = b is not None

    @staticmethod
    def backward(ctx, g):
        h, W, b, labels, keep = ctx.saved_tensors
        gh, gW, gb = _LinearCEGrad.apply(h, W, b if ctx.has_bias else None, labels, keep, g)
        return gh, gW, gb, None, None

    @staticmethod
    def jvp(ctx, dh, dW, db, _labels, _keep):
        h, W, b, labels, keep = ctx.saved_tensors
        b = b if ctx.has_bias else None
        total = None
        for sl in _chunks(h.shape[0], W.shape[0]):
            _, R = _probs_and_residual(h, W, b, labels, keep, sl)
            terms = []
            if dh is not None:
                terms.append((R @ W * dh[sl]).sum())
            if dW is not None:
                terms.append((R.T @ h[sl] * dW).sum())
            if db is not None and b is not None:
                terms.append((R.sum(0) * db).sum())
            for t in terms:
                total = t if total is None else total + t
        return total if total is not None else h.new_zeros(())


def fused_loss_sum(
    h: torch.Tensor,
    W: torch.Tensor,
    b: torch.Tensor | None,
    labels: torch.Tensor,
    keep: torch.Tensor,
) -> torch.Tensor:
    """Σ over scored tokens of the cross-entropy of ``W h_t + b`` against ``labels`` (h: tokens ×
    width, flattened; ``keep`` marks the scored tokens). Twice differentiable, chunked."""
    return _LinearCE.apply(h, W, b, labels.clamp_min(0), keep)


class HeadCapture:
    """Inside, the LM head records its input, weight and bias (the functional tensors in use) and
    returns a zero-memory stand-in for the logits instead of computing them."""

    def __init__(self, head: nn.Linear):
        self.head = head
        self.seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []

    def __enter__(self):
        self.head.forward = self._stub  # an instance attribute shadows the class's forward
        return self

    def __exit__(self, *exc):
        del self.head.forward

    def _stub(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((x, self.head.weight, self.head.bias))
        return x.new_zeros(()).expand(*x.shape[:-1], self.head.out_features)


def find_head(model: nn.Module, forward, batch) -> str | None:
    """The name of the ``nn.Linear`` whose output is the model's output on ``batch`` (the LM head),
    or None when the model transforms its logits after that layer (then no fused form applies).
    ``forward(batch)`` runs the model (the problem's functional forward) and returns its output."""
    outs: dict[str, torch.Tensor] = {}
    handles = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            handles.append(
                mod.register_forward_hook(lambda m, i, o, name=name: outs.__setitem__(name, o))
            )
    try:
        with torch.no_grad():
            out = forward(batch)
    finally:
        for hd in handles:
            hd.remove()
    hits = [n for n, o in outs.items() if o is out]
    return hits[0] if len(hits) == 1 else None
