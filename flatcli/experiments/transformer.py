"""A small transformer for modular arithmetic (the ``modular_addition`` experiment).

`ModularTransformer` reads the token ids ``(a, b, =)`` given positionally as ``x`` (an int64
tensor of shape (N, 3): operands in 0..p−1, ``=`` is token p) and returns class logits of shape
(N, p) read at the last position, so flatcli's ``cross_entropy`` loss and most of the catalogue
apply as to any classifier: the last module, ``unembed``, is a Linear on (N, d_model) features
(relative flatness's default layer).

The architecture follows the grokking models of Power et al. (2022) and Nanda et al. (2023),
smaller: token and learned position embeddings, ``layers`` pre-residual blocks of multi-head
self-attention (bidirectional over the three positions) and a ReLU MLP, no LayerNorm, then the
unembedding. Attention is written out (``softmax(q kᵀ / √d_head) v``) instead of calling
``scaled_dot_product_attention``: PyTorch's fused SDPA kernels have no double backward on the
CPU, and every Hessian measure differentiates the loss twice.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class Attention(nn.Module):
    """Multi-head self-attention in plain tensor operations (twice differentiable)."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be a multiple of heads ({heads})")
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, h: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """(N, T, d) → (N, T, d), or (N, 1, d) for the last position's query alone."""
        n, t, d = h.shape
        q, k, v = self.qkv(h).view(n, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if last_only:
            q = q[:, :, -1:]
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // self.heads), dim=-1)
        return self.out((weights @ v).transpose(1, 2).reshape(n, q.shape[2], d))


class Block(nn.Module):
    """Attention then a ReLU MLP, each added to the residual stream."""

    def __init__(self, d_model: int, heads: int, d_mlp: int):
        super().__init__()
        self.attn = Attention(d_model, heads)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_mlp), nn.ReLU(), nn.Linear(d_mlp, d_model))

    def forward(self, h: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """(N, T, d) → (N, T, d); with ``last_only`` the last position's stream alone, (N, 1, d)."""
        h = (h[:, -1:] if last_only else h) + self.attn(h, last_only)
        return h + self.mlp(h)


class ModularTransformer(nn.Module):
    """``layers``-block transformer on (a, b, =) token ids → logits over the p residues.

    ``p`` residues (vocabulary p + 1 with ``=``), width ``d_model``, ``heads`` attention heads,
    MLP width ``d_mlp`` (default 4·d_model), sequences of ``seq_len`` tokens. Embeddings start
    at N(0, 1/d_model) (unit-norm rows on average); the Linears at PyTorch's default.
    """

    def __init__(
        self,
        p: int = 59,
        d_model: int = 32,
        heads: int = 4,
        d_mlp: int | None = None,
        layers: int = 1,
        seq_len: int = 3,
    ):
        super().__init__()
        self.p = p
        self.embed = nn.Embedding(p + 1, d_model)
        self.pos = nn.Parameter(torch.randn(seq_len, d_model) / math.sqrt(d_model))
        nn.init.normal_(self.embed.weight, std=1 / math.sqrt(d_model))
        self.blocks = nn.ModuleList(
            Block(d_model, heads, d_mlp or 4 * d_model) for _ in range(layers)
        )
        self.unembed = nn.Linear(d_model, p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (N, T) (integers; float ids are refused) → logits (N, p) at the last position."""
        if x.is_floating_point():
            raise TypeError(
                "ModularTransformer takes integer token ids. Got a floating tensor instead."
            )
        h = self.embed(x) + self.pos[: x.shape[1]]
        for i, block in enumerate(self.blocks):  # the last block only where the logits are read
            h = block(h, last_only=i == len(self.blocks) - 1)
        return self.unembed(h[:, -1])
