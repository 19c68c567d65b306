"""How a curvature's products run: a `Route`, decided once per operator and never changed in place.

A `Route` is an immutable plan: the Hessian product mode (``reverse`` through the gradient graphs,
``forward``-over-reverse, ``chain``: block by block while recomputing activations, or
``finite_difference``), the mode of one-vector products, whether K vectors are pulled back in one
vmapped backward (``batched``), whether activations are recomputed, the block of vectors per
product call and the batches the products loop over. `flatcli.engine.products.ProductContext.route`
decides it from the model, the precision and the memory when the first curvature operator is built
(a one-row probe tells whether the model's operations have forward-mode rules), and every curvature
keeps the route it was built with for all its products.

Nothing changes a route. What used to flip a shared mode now makes a new route, explicitly:

* out of memory: `Route.backed_off` halves the block, then the batch (the cached gradient graphs,
  which hold memory but no part of the route, are dropped first; `MemoryPolicy`);
* an operation without a forward-mode rule or without a batched backward rule found during a
  product (`RouteFailed`): `Route.without` gives the route in reverse mode or with a loop of
  pull-backs.

The operator that met the failure takes the new route for the retried and later products, and the
engine adopts it for the operators it builds afterwards; each is counted (``oom_retries``,
``fallbacks``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch.func import grad as func_grad
from torch.func import jvp, vmap

from .batch import Batch

CPU_BATCHED_BELOW = 10_000  # parameters; measured, see docs/benchmarks/data/engine.json
_CUDA_MAX_BLOCK = 32
_CPU_MAX_BLOCK = 64
CPU_BLOCK_BYTES = 5e8
CPU_GRAPH_BYTES = 1.5e9
HESSIAN_MODES = ("reverse", "forward", "chain", "finite_difference")


def is_oom(e: BaseException) -> bool:
    """Whether ``e`` is an out-of-memory error (CUDA or CPU allocator)."""
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


class RouteFailed(RuntimeError):
    """A product found a part of its route unsupported: ``kind`` is ``"forward"`` (an operation
    without a forward-mode rule) or ``"batched"`` (one without a batched backward rule)."""

    def __init__(self, kind: str, reason: str):
        super().__init__(f"{kind} products are not supported here: {reason}")
        self.kind = kind


@dataclasses.dataclass(frozen=True)
class Route:
    """How a curvature's products run (module docstring). Frozen: a change is a new route.

    hessian : the Hessian product mode of a block of vectors, one of `HESSIAN_MODES`.
    single : the mode of a one-vector product (``reverse`` with ``runtime.hvp_mode: auto`` on CUDA:
        a backward through a cached graph is cheaper than forward-over-reverse).
    batched : K vectors pulled back with one vmapped backward, else a loop.
    recompute : activations recomputed per block inside the products (``runtime.recompute``).
    block_size : most vectors per product call.
    batch_size, batches : the rows per batch and this rank's batches the products loop over
        (the batches are not compared: they follow from the batch size).
    """

    hessian: str
    single: str
    batched: bool
    recompute: bool
    block_size: int
    batch_size: int
    batches: tuple[Batch, ...] = dataclasses.field(default=(), compare=False, repr=False)

    def mode(self, k: int) -> str:
        """The Hessian product mode of a block of ``k`` vectors."""
        return self.single if k == 1 else self.hessian

    def without(self, kind: str) -> Route:
        """The route without the part a `RouteFailed` of ``kind`` found unsupported."""
        if kind == "forward":
            return dataclasses.replace(
                self,
                hessian="reverse" if self.hessian == "forward" else self.hessian,
                single="reverse" if self.single == "forward" else self.single,
            )
        if kind == "batched":
            return dataclasses.replace(self, batched=False)
        raise ValueError(f"unknown route failure {kind!r}")

    def backed_off(self, recut: Callable[[int], tuple[Batch, ...]]) -> Route | None:
        """The route after an out-of-memory error: half the block, else half the batch (``recut``
        gives the batches of a batch size); None when both are 1."""
        if self.block_size > 1:
            return dataclasses.replace(self, block_size=self.block_size // 2)
        if self.batch_size > 1:
            bs = self.batch_size // 2
            return dataclasses.replace(self, batch_size=bs, batches=recut(bs))
        return None


def forward_supported(loss: Callable[[torch.Tensor], torch.Tensor], theta: torch.Tensor) -> bool:
    """Whether forward-over-reverse products of ``loss`` (θ ↦ one row's loss) run: one vmapped
    ``jvp`` of its gradient along two zero vectors. Out of memory is raised, not answered."""
    gfun = func_grad(loss)
    V = torch.zeros(2, theta.numel(), dtype=theta.dtype, device=theta.device)
    try:
        vmap(lambda v: jvp(gfun, (theta,), (v,))[1])(V)
    except (RuntimeError, NotImplementedError) as e:
        if is_oom(e):
            raise
        return False
    return True


class MemoryPolicy:
    """The memory a route is planned from: the default block of vectors per product call (from
    free memory), the bytes cached gradient graphs may take and the rows of a vmapped chunk.

    ``activation_bytes()``: memory one batch's forward keeps for backward (measured on CUDA).
    """

    def __init__(
        self,
        num_params: int,
        dtype: torch.dtype,
        device: torch.device,
        activation_bytes: Callable[[], int],
    ):
        self.num_params, self.dtype, self.device = num_params, dtype, device
        self._activation_bytes = activation_bytes

    def default_block(self) -> int:
        """Vectors per product call when ``runtime.block_size`` is not given: what fits in 0.5 GB
        on CPU (at most 64), half the free CUDA memory (at most 32)."""
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
