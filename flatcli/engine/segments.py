r"""Hessian products block by block (``runtime.recompute: true`` on a chain of blocks): exact
forward-over-reverse through one block at a time, keeping only the blocks' boundary tensors.

A transformer is a chain: a *prefix* (embeddings) maps θ₀ to the first block's input
:math:`h_0`; block :math:`l` maps :math:`(\theta_l, h_{l-1})` to :math:`h_l`; a *suffix* (final
norm, LM head, loss) maps :math:`(\theta_0, h_L)` to this batch's share of L. The gradient is the
backward pass :math:`g_L = \partial_{h_L} s`, :math:`(\nabla_{\theta_l} L, g_{l-1}) =
\mathrm{VJP}_l(\theta_l, h_{l-1}; g_l)`, and the Hessian product :math:`Hv` is that gradient's
derivative along :math:`\theta + \epsilon v`. So, with :math:`\dot x` the derivative of
:math:`x` along v (Pearlmutter's R-operator), one product is

1. forward, per segment, a JVP: :math:`(h_l, \dot h_l) = \mathrm{jvp}(F_l, (\theta_l, h_{l-1}),
   (v_l, \dot h_{l-1}))`, keeping only :math:`(h_l, \dot h_l)` (no graph);
2. the suffix: :math:`\mathrm{jvp}(\nabla s, (\theta_0, h_L), (v_0, \dot h_L))` gives
   :math:`(g_L, \dot g_L)` and the suffix's share of :math:`(Hv)_{\theta_0}`;
3. backward, per block from the last: :math:`\mathrm{jvp}` of the block's VJP at
   :math:`(\theta_l, h_{l-1}, g_l)` along :math:`(v_l, \dot h_{l-1}, \dot g_l)` gives
   :math:`(g_{l-1}, \dot g_{l-1})` and :math:`(Hv)_{\theta_l}`; the block's activations live only
   while it runs;
4. the prefix's VJP, differentiated the same way, adds the prefix's share of :math:`(Hv)_{\theta_0}`
   (tied weights, GPT-2's embedding and head, get the suffix's share and the prefix's: their sum).

Every step is an exact derivative (``torch.func`` forward mode over reverse mode), so the product
equals the double-backward one to rounding; tests/engine/test_segments.py checks it against a dense
Hessian built row by row and against the engine's reverse products on tiny GPT-2, BERT and ViT
models in float64, with parameter subsets, padding and two batches. What it keeps: 2(L+1) boundary
tensors (tokens × width each) and one block's activations and tangents at a time, instead of every
block's activations twice (the forward's and the ``create_graph`` backward's); what it costs: each
block's forward runs twice (step 1 and step 3) with tangents, about 2× a double-backward product
(docs/benchmarks/data/hvp_memory-blocks.json has the measurements).

When it applies (`BlockChain.find`, checked with one forward pass over the first row): the model
has an outermost ``nn.ModuleList`` of blocks (`flatcli.engine.recompute.find_blocks`), called once
each, in order, each block's first input is the previous block's output (the tensor itself, or
the first element of a tuple whose other elements carry no gradient), no other block argument
depends on θ (masks, positions), and no block shares a parameter with another segment. Otherwise
``recompute: true`` runs the checkpointed double backward of `flatcli.engine.recompute`, and the
reason is kept in ``BlockChain.find``'s second value.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.func import functional_call, grad, jvp, vjp

from .recompute import _without_cache, find_blocks


class _Reached(Exception):
    """Raised by a stub block to stop the model's forward once the wanted input is seen."""

    def __init__(self, hidden):
        super().__init__()
        self.hidden = hidden


def _split_hidden(args: tuple, kwargs: dict):
    """(hidden, rest of args, kwargs without it, where): a block's first tensor input."""
    if args:
        return args[0], args[1:], kwargs, "arg"
    return (
        kwargs["hidden_states"],
        (),
        {k: v for k, v in kwargs.items() if k != "hidden_states"},
        "kwarg",
    )


@dataclass
class _Call:
    """One block's call: its arguments other than the hidden state, and its output's shape."""

    rest: tuple
    kwargs: dict
    where: str
    tail: tuple | None  # None: the block returns a tensor; else the non-hidden tuple elements


@dataclass
class BlockChain:
    """The model as prefix → blocks → suffix (module docstring); ``None`` from `find` when it is not."""

    problem: object
    blocks: list[nn.Module]
    prefixes: list[str]
    block_names: list[list[str]]  # selected parameter names of each block
    outer_names: list[str]  # selected names outside every block (prefix and suffix)
    tails: list = field(
        default_factory=list
    )  # per block: None (returns a tensor) or its tuple's tail
    calls: tuple = ()  # (batch, list[_Call]) of the last batch seen

    # ------------------------------------------------------------ finding the chain
    @classmethod
    def find(cls, problem) -> tuple[BlockChain | None, str | None]:
        """(chain, None) when the model is a chain of blocks (module docstring), else (None, why)."""
        model = problem.model
        blocks = find_blocks(model)
        if len(blocks) < 1:
            return None, "the model has no ModuleList of blocks"
        owner = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        if len({id(b) for b in blocks}) != len(blocks):
            return None, "a block appears twice in the model (shared layers)"
        prefixes = [owner[id(b)] + "." for b in blocks]
        for alias, name in problem.aliases.items():
            if any(alias.startswith(p) or name.startswith(p) for p in prefixes):
                return None, f"the parameter {name} is shared ({alias}) with a block"
        block_names = [[n for n in problem.names if n.startswith(p)] for p in prefixes]
        inside = {n for names in block_names for n in names}
        chain = cls(
            problem, blocks, prefixes, block_names, [n for n in problem.names if n not in inside]
        )
        why = chain._check(problem.batches[0]) if problem.batches else "no batch on this rank"
        return (None, why) if why else (chain, None)

    def _check(self, batch) -> str | None:
        """Why the first batch's forward is not a chain of these blocks (None when it is)."""
        p = self.problem
        seen: list[tuple] = []
        handles = []
        for i, b in enumerate(self.blocks):
            handles.append(
                b.register_forward_hook(
                    lambda m, a, kw, out, i=i: seen.append((i, a, kw, out)), with_kwargs=True
                )
            )
        params = {
            n: x.detach().requires_grad_(True) for n, x in p.params.items()
        }  # θ's storage, no copy
        try:
            with (
                torch.enable_grad()
            ):  # one row: the structure is the batch's, the saved activations 1/rows
                p.batch_loss_sum(params, batch.select(slice(0, 1)))
        finally:
            for h in handles:
                h.remove()
        if [s[0] for s in seen] != list(range(len(self.blocks))):
            return "the blocks are not called once each, in order"
        prev = None
        for i, a, kw, out in seen:
            hidden, rest, kwargs, _ = _split_hidden(a, kw)
            if prev is not None and hidden is not prev:
                return f"block {self.prefixes[i][:-1]}'s input is not the previous block's output"
            tail = tuple(out[1:]) if isinstance(out, tuple) else ()
            self.tails.append(tail if isinstance(out, tuple) else None)
            prev = out[0] if isinstance(out, tuple) else out
            extra = [x for x in (*rest, *kwargs.values(), *tail) if isinstance(x, torch.Tensor)]
            if any(x.requires_grad for x in extra):
                return f"an input or output of block {self.prefixes[i][:-1]} other than the hidden state depends on θ"
        return None

    # ------------------------------------------------------------ one batch's block calls
    @contextlib.contextmanager
    def _stubs(self, make):
        """Every block's ``forward`` replaced by ``make(i)`` inside (restored on exit)."""
        try:
            for i, b in enumerate(self.blocks):
                b.forward = make(i)
            yield
        finally:
            for b in self.blocks:
                del b.forward

    def block_calls(self, batch) -> list[_Call]:
        """The blocks' arguments other than the hidden state on ``batch`` (θ-free: checked by
        `find`), from one pass of the prefix with pass-through blocks (no grad); the last block
        stops it. Kept for the last batch only (the vectors of a block reuse it; masks of every
        batch kept at once would grow with the measurement set)."""
        if self.calls and self.calls[0] is batch:
            return self.calls[1]
        p = self.problem
        out: list[_Call] = []
        n = len(self.blocks)

        def make(i):
            def stub(*args, **kwargs):
                args, kwargs = _without_cache(args, kwargs)
                hidden, rest, kw, where = _split_hidden(args, kwargs)
                out.append(_Call(rest, kw, where, self.tails[i]))
                if i == n - 1:
                    raise _Reached(None)
                return hidden if self.tails[i] is None else (hidden, *self.tails[i])

            return stub

        with torch.no_grad(), self._stubs(make):
            try:
                p._call(p.params, batch)
            except _Reached:
                pass
        self.calls = (batch, out)
        return out

    # ------------------------------------------------------------ the segments as functions
    def _tensors(self, i: int, P: dict) -> dict:
        """Block ``i``'s local tensors: its selected parameters from ``P`` (full names), the
        others and its buffers from the problem, cast to the compute dtype."""
        p, pre = self.problem, self.prefixes[i]
        full = {
            **{n: t for n, t in p.frozen.items() if n.startswith(pre)},
            **{n: t for n, t in p.buffers.items() if n.startswith(pre)},
            **P,
        }
        low = p.compute_dtype
        return {
            n[len(pre) :]: (t.to(low) if p.lowered and t.is_floating_point() else t)
            for n, t in full.items()
        }

    def block_fn(self, i: int, call: _Call):
        """(P_i, h) ↦ block i's hidden output."""
        block = self.blocks[i]

        def f(P, h):
            args, kwargs = (
                ((h, *call.rest), call.kwargs)
                if call.where == "arg"
                else (call.rest, {**call.kwargs, "hidden_states": h})
            )
            out = functional_call(
                block, self._tensors(i, P), args, kwargs, tie_weights=False, strict=False
            )
            return out[0] if isinstance(out, tuple) else out

        return f

    def prefix_fn(self, theta: dict, batch):
        """P_outer ↦ the first block's input (the prefix's forward, stopped there)."""
        p = self.problem

        def stop(i):
            def stub(*args, **kwargs):
                raise _Reached(_split_hidden(args, kwargs)[0])

            return stub

        def f(P):
            with self._stubs(stop):
                try:
                    p._call({**theta, **P}, batch)
                except _Reached as r:
                    return r.hidden
            raise RuntimeError("the model's forward did not reach its first block")

        return f

    def suffix_fn(self, theta: dict, batch, calls: list[_Call]):
        """(P_outer, h_L) ↦ the batch's share of L with the blocks skipped and h_L injected."""
        p = self.problem
        last = len(self.blocks) - 1

        def f(P, h):
            def make(i):
                def stub(*args, **kwargs):
                    x = h if i == last else _split_hidden(args, kwargs)[0]
                    return x if calls[i].tail is None else (x, *calls[i].tail)

                return stub

            with self._stubs(make):
                return p.batch_loss_sum({**theta, **P}, batch) / p.n

        return f

    # ------------------------------------------------------------ the product
    def hvp(
        self,
        v: torch.Tensor,
        th: torch.Tensor,
        batch,
        out: torch.Tensor | None = None,
        accumulate: bool = False,
    ) -> torch.Tensor:
        """The batch's share of H v (module docstring), flat, in θ's dtype: written into ``out``
        (``accumulate``: added to it), or a new vector.

        The parameters and their tangents are views of ``th`` and ``v``; when ``v`` is a row of a
        (K, P) block its views have another base than θ's, and forward AD then gives each tangent
        a fresh copy of a base of the primal's layout: on the 10M GPT-2 one product's own memory
        was 761 MB for a row of a 4-vector block against 325 MB for a vector of its own. So such a
        row is copied once (one P-vector) first."""
        p = self.problem
        calls = self.block_calls(batch)
        if v._base is not None and v._base.shape != th.shape:
            v = (
                v.clone()
            )  # a row of a (K, P) block: forward AD would copy its tangents' larger base
        theta = {n: x.detach() for n, x in p.unflatten(th).items()}
        vd = p.unflatten(v)
        if out is None:
            out = torch.zeros_like(v)
        elif not accumulate:
            out.zero_()
        od = p.unflatten(out)

        def sub(d, names):
            return {n: d[n] for n in names}

        P0, V0 = sub(theta, self.outer_names), sub(vd, self.outer_names)
        pre = self.prefix_fn(theta, batch)
        if P0:
            h, hd = jvp(pre, (P0,), (V0,))
        else:  # no selected parameter before the blocks: h₀ does not move
            with torch.no_grad():
                h = pre({})
            hd = torch.zeros_like(h)
        saved = [(h, hd)]
        fns = [self.block_fn(i, c) for i, c in enumerate(calls)]
        for i, f in enumerate(fns):
            h, hd = jvp(f, (sub(theta, self.block_names[i]), h), (sub(vd, self.block_names[i]), hd))
            saved.append((h, hd))
        del h, hd
        h_L, hd_L = saved.pop()
        (_, g), (hv0, gd) = jvp(
            grad(self.suffix_fn(theta, batch, calls), argnums=(0, 1)), (P0, h_L), (V0, hd_L)
        )
        _add(od, hv0)
        del h_L, hd_L, hv0
        for i in reversed(range(len(fns))):
            h_in, hd_in = saved.pop()
            (_, g), (hvi, gd) = jvp(
                _vjp_of(fns[i]),
                (sub(theta, self.block_names[i]), h_in, g),
                (sub(vd, self.block_names[i]), hd_in, gd),
            )
            _add(od, hvi)
            del h_in, hd_in, hvi
        if P0:
            _, hvp0 = jvp(lambda P, c: vjp(pre, P)[1](c)[0], (P0, g), (V0, gd))
            _add(od, hvp0)
        return out


def _vjp_of(f):
    """(P, h, g) ↦ ((∂f/∂P)ᵀ g, (∂f/∂h)ᵀ g) as one function (for a JVP over it)."""

    def G(P, h, g):
        pulled = vjp(f, P, h)[1](g)
        return pulled[0], pulled[1]

    return G


def _add(into: dict, parts: dict) -> None:
    for n, x in parts.items():
        into[n].add_(x.to(into[n].dtype))
