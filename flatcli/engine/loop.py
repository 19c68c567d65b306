"""What every product shares, in one place: counters, the memory policy and the loop over
this rank's batches with the cross-rank sum (precision: `flatcli.engine.precision`).

* `Counters`: products and passes, in full-set equivalents (a gradient over a batch of u
  of the U units counts u/U), so measures report their cost whatever the batching.
* `MemoryPolicy`: how many vectors go through one product call (``block_size``; chosen from
  free memory unless given) and the out-of-memory back-off: cached graphs are dropped first,
  then the block is halved, then the batch size; every retry is counted in ``oom_retries``.
* `ProductLoop.apply`: a curvature's product of a block of vectors ``V`` (K, P) summed over
  this rank's batches into one preallocated output, then over ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import MeasurementError
from ..validation import validate

_CUDA_MAX_BLOCK = 32
_CPU_MAX_BLOCK = 64
CPU_BLOCK_BYTES = 5e8
CPU_GRAPH_BYTES = 1.5e9


def count(x: float) -> float:
    """A counter value: an int when whole, else the fraction (rounded to 6 digits)."""
    return int(x) if float(x).is_integer() else round(float(x), 6)


def is_oom(e: BaseException) -> bool:
    """Whether ``e`` is an out-of-memory error (CUDA or CPU allocator)."""
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


class Counters:
    """``n_hvp`` (Hessian-, GGN- and finite-difference products, one per vector), ``n_ggnvp``,
    ``n_grad`` and ``n_forward`` (full-set equivalents), ``n_vjp`` (passes of per-sample
    vector-Jacobian products, C per exact Gauss-Newton diagonal), ``oom_retries``, ``fallbacks``.

    They count the logical work of the whole set, the same on every rank: a full-set gradient
    is 1 whatever the number of ranks; a per-batch product driven by a measure (``module_output_hvp``)
    counts its batch times the number of ranks (exact when the shards are equal)."""

    def __init__(self, units: int):
        self.units = units
        self.n_hvp = 0
        self.n_ggnvp = 0
        self.grad_units = 0.0
        self.forward_units = 0.0
        self.n_vjp = 0
        self.oom_retries = 0
        self.fallbacks = 0

    _FIELDS = ("n_hvp", "n_ggnvp", "grad_units", "forward_units", "n_vjp", "oom_retries", "fallbacks")

    def as_raw(self) -> list[float]:
        """The raw counts (units, not full-set equivalents), in `_FIELDS` order."""
        return [float(getattr(self, k)) for k in self._FIELDS]

    def add_raw(self, values: list[float]) -> None:
        """Add raw counts in `_FIELDS` order (e.g. the other ranks' share of `map_batches` work)."""
        for k, v in zip(self._FIELDS, values, strict=True):
            cur = getattr(self, k)
            setattr(self, k, cur + (v if isinstance(cur, float) else int(round(v))))

    def merge(self, other: Counters) -> None:
        """Add another engine's counts (over the same units: a BatchNorm-folded copy of the problem)."""
        for k in self._FIELDS:
            setattr(self, k, getattr(self, k) + getattr(other, k))

    @property
    def n_grad(self) -> float:
        """Gradients, in full-set equivalents."""
        return count(self.grad_units / self.units)

    @property
    def n_forward(self) -> float:
        """Forward passes without a gradient, in full-set equivalents."""
        return count(self.forward_units / self.units)

    def as_dict(self) -> dict[str, float]:
        """Every counter by name."""
        return {"n_hvp": self.n_hvp, "n_ggnvp": self.n_ggnvp, "n_grad": self.n_grad, "n_forward": self.n_forward,
                "n_vjp": self.n_vjp, "oom_retries": self.oom_retries, "fallbacks": self.fallbacks}


class MemoryPolicy:
    """Block size and out-of-memory back-off (module docstring).

    ``activation_bytes()``: memory one batch's forward keeps for backward (measured on CUDA).
    """

    def __init__(self, num_params: int, dtype: torch.dtype, device: torch.device, block_size: int | None,
                 activation_bytes: Callable[[], int]):
        block_size = validate("block_size", block_size, error=ValueError)
        self.num_params, self.dtype, self.device = num_params, dtype, device
        self._block = int(block_size) if block_size else None
        self._activation_bytes = activation_bytes

    @property
    def block_size(self) -> int:
        """Most vectors per product call."""
        if self._block is None:
            self._block = self._default_block()
        return self._block

    @block_size.setter
    def block_size(self, value: int) -> None:
        self._block = max(1, int(value))

    def _default_block(self) -> int:
        elt = torch.finfo(self.dtype).bits // 8
        if self.device.type != "cuda":
            return int(max(1, min(_CPU_MAX_BLOCK, CPU_BLOCK_BYTES // (4 * self.num_params * elt))))
        try:
            free, _ = torch.cuda.mem_get_info(self.device)
            act = self._activation_bytes()
        except RuntimeError:
            return 8
        per_probe = 3 * act + 4 * self.num_params * elt
        return int(max(1, min(_CUDA_MAX_BLOCK, (0.5 * free) // max(per_probe, 1))))

    def graph_budget(self) -> float:
        """Bytes the cached gradient graphs may take: 1.5 GB on CPU, 30% of free CUDA memory."""
        if self.device.type == "cuda":
            try:
                return 0.3 * torch.cuda.mem_get_info(self.device)[0]
            except RuntimeError:
                return 0.0
        return CPU_GRAPH_BYTES

    def chunk_rows(self, C: int, P: int) -> int:
        """Samples per vmapped chunk of per-sample gradients: chunk × C × P numbers within the budget."""
        elt = torch.finfo(self.dtype).bits // 8
        budget = CPU_BLOCK_BYTES
        if self.device.type == "cuda":
            try:
                budget = 0.1 * torch.cuda.mem_get_info(self.device)[0]
            except RuntimeError:
                budget = CPU_BLOCK_BYTES
        return int(max(1, budget // (2 * C * max(P, 1) * elt)))


class ProductLoop:
    """Products of blocks of vectors over this rank's batches, summed over ranks.

    ``engine`` supplies ``problem``, ``batches`` (this rank's, possibly re-cut after an OOM),
    ``memory`` (`MemoryPolicy`), ``tally`` (`Counters`), ``drop_graphs`` (caches to drop on OOM) and
    ``set_batch_size``.
    """

    def __init__(self, engine):
        self.engine = engine

    def apply(self, product, V: torch.Tensor, theta: torch.Tensor | None) -> torch.Tensor:
        """``product(V_block, θ, batch_index, batch, out, accumulate)`` summed over the batches, for
        V of shape (P,) or (K, P), in blocks with out-of-memory back-off; then summed over ranks."""
        eng = self.engine
        p = eng.problem
        single = V.ndim == 1
        V2 = V.reshape(1, -1) if single else V
        if V2.ndim != 2 or V2.shape[1] != p.num_params:
            raise ValueError(f"vectors must have shape (P,) or (K, P) with P = {p.num_params}; got {tuple(V.shape)}")
        V2 = V2.to(p.device, p.dtype)
        th = (p.theta if theta is None else theta).detach().to(p.device, p.dtype)
        out = torch.empty_like(V2)  # the first batch writes its rows, later ones add
        i = 0
        while i < V2.shape[0]:
            k = min(eng.memory.block_size, V2.shape[0] - i)
            try:
                self._block(product, V2[i : i + k], th, out[i : i + k])
                i += k
            except RuntimeError as e:  # torch.cuda.OutOfMemoryError is a RuntimeError
                if not is_oom(e):
                    raise
                self.back_off(e)
        p.dist.sum_(out)
        return out[0] if single else out

    def _block(self, product, V: torch.Tensor, th: torch.Tensor, out: torch.Tensor) -> None:
        for j, b in enumerate(self.engine.batches):
            product(V, th, j, b, out, j > 0)
        if not self.engine.batches:
            out.zero_()

    def back_off(self, e: BaseException) -> None:
        """One step of the out-of-memory policy (drop graphs, halve the block, halve the batch)."""
        eng = self.engine
        freed = eng.drop_graphs(stop_caching=True)  # the cached graphs go first; then the block, then the batch
        if not freed and eng.memory.block_size > 1:
            eng.memory.block_size = eng.memory.block_size // 2
        elif not freed and eng.batch_size > 1:
            eng.set_batch_size(eng.batch_size // 2)
        elif not freed:
            raise MeasurementError(
                "out of memory for a single vector on a single sample; use a smaller model or another device"
            ) from e
        eng.tally.oom_retries += 1
        if eng.device.type == "cuda":
            torch.cuda.empty_cache()
