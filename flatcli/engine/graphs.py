"""Per-batch autograd graphs kept across products at one θ.

Reverse-mode Hessian products pull vectors back through the graph of a batch's
gradient (``create_graph``). Building it costs a forward and a backward pass;
keeping it lets Lanczos' one-vector products cost one backward each, as PyHessian's
single-batch mode, but for any number of batches. A `GraphCache` keeps one entry per
batch at one θ when they fit: with ``policy=None`` (auto) the tensors saved for the
first batch, scaled to the whole shard, must fit the budget (1.5 GB on CPU, 30% of
free CUDA memory); ``True`` always keeps them, ``False`` never.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def saved_bytes_counter():
    """``(hooks, total)``: saved-tensor hooks that add the bytes of each distinct storage the
    graph saves to ``total[0]`` (parameter views share θ's storage and count once)."""
    total = [0]
    seen: set[int] = set()

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total[0] += st.nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), total


class GraphCache:
    """Entries ``build(θ, batch) -> entry`` per batch, kept at one θ when they fit.

    Parameters
    ----------
    build : makes one batch's entry (tensors holding a graph).
    budget : ``() -> bytes`` the entries may take.
    policy : None (auto: when they fit), True (always), False (never).
    """

    def __init__(
        self,
        build: Callable[[torch.Tensor, Any], Any],
        budget: Callable[[], float],
        policy: bool | None = None,
    ):
        self.build = build
        self.budget = budget
        self.policy = policy
        self.state = "off" if policy is False else "unknown"  # unknown | fits | too_big | off
        self.entries: list | None = None
        self.theta: torch.Tensor | None = None

    @property
    def keeping(self) -> bool:
        """Whether entries are (or may be) kept."""
        return self.state in ("unknown", "fits")

    def drop(self, stop: bool = False) -> bool:
        """Free the kept entries (``stop``: and stop keeping them). True when something was freed or
        the policy changed."""
        had = self.entries is not None or (stop and self.state == "fits")
        self.entries = None
        self.theta = None
        if stop and self.state != "off":
            self.state = "too_big"
        return had

    def get(self, th: torch.Tensor, j: int, batch, batches: int) -> Any:
        """Batch ``j``'s entry at ``th`` (one of ``batches``), reused when kept at the same θ.
        θ is compared at the first batch; later batches of the same pass trust it."""
        if j == 0 and (self.theta is None or not torch.equal(self.theta, th)):
            self.entries, self.theta = None, None
        if self.entries is not None and j in self.entries:
            return self.entries[j]
        decide = j == 0 and self.state == "unknown"
        if decide and self.policy is None:
            hooks, total = saved_bytes_counter()
            with hooks:
                entry = self.build(th, batch)
            self.state = "fits" if total[0] * batches <= self.budget() else "too_big"
        else:
            entry = self.build(th, batch)
            if decide:
                self.state = "fits"
        if self.keeping:
            if self.entries is None:
                self.entries, self.theta = {}, th.clone()
            self.entries[j] = entry
        return entry
