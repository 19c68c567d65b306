"""Tiny token models for the engine's named-tensor tests (loaded by path from configs too)."""

import torch
from torch import nn


class TinyLM(nn.Module):
    """Next-token model: embedding → tanh MLP mixing each position with the previous one → logits
    (batch, T, vocab). Takes ``input_ids`` and ``attention_mask`` by keyword, like a Hugging Face
    model, and returns an object with ``.logits``; ``tie`` ties the output layer to the embedding."""

    def __init__(self, vocab: int = 7, dim: int = 4, tie: bool = False):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(2 * dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, input_ids, attention_mask=None):
        h = self.emb(input_ids)
        prev = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)
        h = torch.tanh(self.mix(torch.cat([h, prev], dim=-1)))
        if attention_mask is not None:
            h = h * attention_mask[..., None].to(h.dtype)
        return _Output(self.head(h))


class _Output(dict):
    """A stand-in for a Hugging Face ``ModelOutput``: a dict whose ``logits`` is also an attribute."""

    def __init__(self, logits):
        super().__init__(logits=logits)
        self.logits = logits


class TokenClassifier(nn.Module):
    """Sequence classifier on token ids: embedding, masked mean pooling, tanh layer, head."""

    def __init__(self, vocab: int = 9, dim: int = 4, classes: int = 3):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, input_ids, attention_mask):
        m = attention_mask[..., None].to(self.emb.weight.dtype)
        h = (self.emb(input_ids) * m).sum(1) / m.sum(1).clamp_min(1.0)
        return self.head(torch.tanh(self.body(h)))


def padded_tokens(rows: int, length: int, vocab: int, seed: int = 0):
    """Token ids with right padding of random lengths (2..length) and the attention mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (rows, length), generator=g)
    lengths = torch.randint(2, length + 1, (rows,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    return ids * mask, mask
