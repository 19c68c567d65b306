"""What every product shares, in one place: counters, the memory policy and the products' state
(the loop over this rank's batches with the cross-rank sum is the curvatures' base class,
`flatcli.engine.curvatures.Curvature`; precision: `flatcli.engine.precision`).

* `Counters`: products and passes, in full-set equivalents (a gradient over a batch of u
  of the U units counts u/U), so measures report their cost whatever the batching.
* `MemoryPolicy`: how many vectors go through one product call (``block_size``; chosen from
  free memory unless given) and the out-of-memory back-off: cached graphs are dropped first,
  then the block is halved, then the batch size (`ProductState.back_off`); every retry is
  counted in ``oom_retries``.
* `ProductState`: everything a curvature product reads or changes (the problem, this rank's
  batches, the memory policy, the counters, the gradient-graph cache, the Hessian product mode
  and its once-and-for-all fallback, activation recomputation, the precision and its fp32 view,
  the estimators' basis caps, the progress hook) and the helpers they share
  (`ProductState.pullback`, `ProductState.batch_grad`, the unit weighting `ProductState.share`).
  `flatcli.engine.facade.CurvatureEngine` builds one and hands it to every curvature; no
  curvature sees the engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from ..errors import MeasurementError
from ..validation import validate
from .batch import Batch
from .graphs import GraphCache
from .linalg.lanczos import host_fit
from .precision import Precision, tf32_flags
from .problem import Problem
from .recompute import (
    AUTO_RECOMPUTE,
    checkpointed_blocks,
    find_blocks,
    parse_recompute,
    predicted_product_bytes,
)
from .segments import BlockChain

_CPU_BATCHED_BELOW = 10_000  # parameters; measured, see docs/benchmarks/data/engine.json
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

    _FIELDS = (
        "n_hvp",
        "n_ggnvp",
        "grad_units",
        "forward_units",
        "n_vjp",
        "oom_retries",
        "fallbacks",
    )

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
        return {
            "n_hvp": self.n_hvp,
            "n_ggnvp": self.n_ggnvp,
            "n_grad": self.n_grad,
            "n_forward": self.n_forward,
            "n_vjp": self.n_vjp,
            "oom_retries": self.oom_retries,
            "fallbacks": self.fallbacks,
        }


class MemoryPolicy:
    """Block size and out-of-memory back-off (module docstring).

    ``activation_bytes()``: memory one batch's forward keeps for backward (measured on CUDA).
    """

    def __init__(
        self,
        num_params: int,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int | None,
        activation_bytes: Callable[[], int],
    ):
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


class ProductState:
    """What the curvature products read and change, built once per engine (module docstring).

    Parameters
    ----------
    problem : the model as functional parameters over the measurement set.
    hvp_mode : "auto", "reverse", "forward" or "finite_difference" (checked by the engine); ``auto``
        is resolved here (forward on CUDA, reverse elsewhere) and remembered in ``hvp_auto``.
    block_size, reverse_batched, cache_graphs, recompute : as `CurvatureEngine`'s.
    precision : the resolved `flatcli.engine.precision.Precision` (`full_precision` is its fp32 view).
    max_device_vectors, max_basis_vectors : the checked settings the curvatures carry to the
        estimators (``max_basis_vectors`` resolved at its first use).

    Attributes a product may change: ``batches`` and ``batch_size`` (re-cut by the out-of-memory
    back-off, `set_batch_size`), ``hvp_mode`` (``reverse`` for good after a forward-mode failure,
    `forward_failed`), ``reverse_batched`` (off for good after a batched pull-back failure),
    ``tally`` and ``memory.block_size``.
    """

    def __init__(
        self,
        problem: Problem,
        *,
        hvp_mode: str,
        block_size: int | None,
        reverse_batched: bool | None,
        cache_graphs: bool | None,
        recompute: str | bool,
        precision: Precision | None = None,
        max_device_vectors: int | str | None = "auto",
        max_basis_vectors: int | str | None = "auto",
    ):
        self.problem = problem
        self.device = problem.device
        self.precision = precision or Precision.of("fp32", problem.device)
        self.max_device_vectors = max_device_vectors
        self._basis_setting, self._basis_resolved = max_basis_vectors, False
        self.on_progress: Callable[[dict], None] | None = None  # called after every product
        self.local = False  # inside map_batches: batch products on this rank alone
        self.shared = False  # inside map_batches with fewer batches than ranks: rows split
        self.hvp_auto = hvp_mode == "auto"
        self.hvp_mode = (
            ("forward" if self.device.type == "cuda" else "reverse")
            if hvp_mode == "auto"
            else hvp_mode
        )
        if reverse_batched is None:
            reverse_batched = self.device.type == "cuda" or problem.num_params < _CPU_BATCHED_BELOW
        self.reverse_batched = bool(reverse_batched)
        self.recompute = parse_recompute(recompute)
        self._recompute_on: bool | None = None  # decided at the first product (auto)
        self.chain: BlockChain | None = (
            None  # the block-by-block product, when recomputing on a chain
        )
        self.chain_reason: str | None = None  # why not, when recomputing without it
        self.batch_size = problem.batch_size
        self.batches: list[Batch] = list(problem.batches)
        self.tally = Counters(problem.n)
        self.memory = MemoryPolicy(
            problem.num_params, problem.dtype, self.device, block_size, self.activation_bytes
        )
        self.graphs = GraphCache(
            self.gradient_graph,
            self.memory.graph_budget,
            False if self.recompute == "true" else cache_graphs,
        )

    def theta_of(self, theta: torch.Tensor | None) -> torch.Tensor:
        """θ (default: the model's parameters), detached, on the problem's device and dtype."""
        p = self.problem
        return (p.theta_flat if theta is None else theta).detach().to(self.device, p.dtype)

    def not_local(self, what: str) -> None:
        """Raise inside `flatcli.engine.CurvatureEngine.map_batches`, where ``what`` (full-set
        products) would see only this rank's shard."""
        if self.local or self.shared:
            raise RuntimeError(
                f"{what} are not available inside CurvatureEngine.map_batches (only batch_loss_grad)"
            )

    def report(self, **info) -> None:
        """Tell `on_progress` (when set) the counters so far and ``info`` (e.g. an estimate and its
        standard error from the algorithm driving the products)."""
        if self.on_progress is not None:
            self.on_progress({**self.tally.as_dict(), **info})

    @property
    def max_basis_vectors(self) -> int | None:
        """``runtime.max_basis_vectors`` resolved at its first use (the first curvature: every rank
        gets there together, as the products are collectives) and kept: ``auto`` becomes the
        P-vectors that fit in half the free host memory (`flatcli.engine.linalg.lanczos.host_fit`),
        the least over the ranks, since every rank must run the same Lanczos; an int or None stays."""
        if not self._basis_resolved:
            if self._basis_setting == "auto":
                fit = host_fit(self.problem.num_params, self.problem.dtype)
                fit = self.problem.dist.min_int(2**62 if fit is None else fit)
                self._basis_setting = None if fit >= 2**62 else fit
            self._basis_resolved = True
        return self._basis_setting

    @contextlib.contextmanager
    def full_precision(self):
        """fp32 products inside (the verification view): TF32 off, and a bf16 problem's forward in
        float32 (the model's weights upcast; the cached bf16 gradient graphs are dropped on the way
        in and out, since they hold the other precision's arithmetic). Everything is restored after."""
        lowered = self.problem.lowered
        if lowered:
            self.drop_graphs()
        try:
            with tf32_flags(False, False), self.problem.full_precision():
                yield
        finally:
            if lowered:
                self.drop_graphs()

    # ------------------------------------------------------------ unit weighting
    def share(self, t: torch.Tensor, batch: Batch) -> torch.Tensor:
        """A batch's share of L at the flat parameters ``t``: the sum of its unit losses over the
        whole set's U (so the shares of every batch and rank add up to the full-set mean loss)."""
        p = self.problem
        return p.batch_loss_sum(p.unflatten(t), batch) / p.n

    def weigh(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (a sum over a batch's units) divided by U in place: its share of the full set."""
        return x.div_(self.problem.n)

    # ------------------------------------------------------------ Hessian product mode
    def hessian_mode(self, k: int) -> str:
        """How a Hessian product of ``k`` vectors runs: ``reverse`` while recomputing activations;
        with ``auto``, single vectors go through the gradient graphs (a backward is cheaper than
        forward-over-reverse when the graph is kept), whether they are kept or not, so that
        ``runtime.cache_graphs`` and the free memory never change a product's arithmetic."""
        mode = (
            "reverse" if self.recompute_active else self.hvp_mode
        )  # checkpointing runs in reverse mode
        if mode == "forward" and self.hvp_auto and k == 1:
            mode = "reverse"  # one vector at a time (Lanczos): a backward through a cached graph is cheaper
        return mode

    def forward_failed(self) -> None:
        """An operation without a forward-mode rule: count the fallback, reverse mode from now on."""
        self.tally.fallbacks += 1
        self.hvp_mode = "reverse"

    @property
    def recompute_active(self) -> bool:
        """Whether Hessian products recompute activations (``recompute``; ``auto``: the model has
        blocks and `flatcli.engine.recompute.predicted_product_bytes` exceeds 80% of the free memory,
        decided once, at the first product)."""
        if self._recompute_on is None:
            blocks = find_blocks(self.problem.model)
            on = self.recompute == "true"
            if self.recompute == "auto" and blocks and self.batches:
                need, free = predicted_product_bytes(
                    self.problem, self.batches[0], len(self.batches), self.device
                )
                on = free is not None and need > AUTO_RECOMPUTE * free
            self._recompute_on = bool(on and blocks)
            self._blocks = blocks
            if self._recompute_on:
                self.chain, self.chain_reason = BlockChain.find(self.problem)
            if on:
                self.graphs.drop(stop=True)
                self.graphs.state = "off"
        return self._recompute_on

    # ------------------------------------------------------------ derivatives the curvatures share
    def gradient_graph(self, th: torch.Tensor, batch: Batch):
        """(t, ∇ of the batch's share of L with its graph kept, the share's value): the entries of
        ``graphs``; with `recompute_active`, the forward runs its blocks checkpointed."""
        t = th.clone().requires_grad_(True)
        with (
            checkpointed_blocks(self._blocks) if self.recompute_active else contextlib.nullcontext()
        ):
            lb = self.share(t, batch)
        (g,) = torch.autograd.grad(lb, t, create_graph=True)
        return t, g, float(lb.detach())

    def pullback(
        self,
        g: torch.Tensor,
        t: torch.Tensor,
        V: torch.Tensor,
        retain: bool,
        out: torch.Tensor | None = None,
        accumulate: bool = False,
    ) -> torch.Tensor:
        """The one batched-VJP helper: rows ``V[k]`` pulled back through ``g``'s graph to ``t``, as
        one vmapped backward (``is_grads_batched``), or a loop when an op has no batched rule.
        ``out``: write the rows there (``accumulate``: add them), making no stacked copy (on CPU a
        fresh (K, P) block costs page faults as long as the products' arithmetic for ResNet-18)."""
        K = V.shape[0]
        if K > 1 and self.reverse_batched:
            try:
                (hv,) = torch.autograd.grad(g, t, V, is_grads_batched=True, retain_graph=True)
                return hv if out is None else (out.add_(hv) if accumulate else out.copy_(hv))
            except RuntimeError as e:
                if is_oom(e):
                    raise
                self.tally.fallbacks += 1
                self.reverse_batched = False
        if out is None:
            return torch.stack(
                [
                    torch.autograd.grad(g, t, V[k], retain_graph=retain or k < K - 1)[0]
                    for k in range(K)
                ]
            )
        for k in range(K):
            (h,) = torch.autograd.grad(g, t, V[k], retain_graph=retain or k < K - 1)
            if accumulate:
                out[k].add_(h)
            else:
                out[k].copy_(h)
        return out

    @staticmethod
    def batch_grad(f: Callable[[torch.Tensor], torch.Tensor], th: torch.Tensor) -> torch.Tensor:
        """∇f(θ) of a scalar function of the flat parameters (one batch's share of L)."""
        t = th.detach().clone().requires_grad_(True)
        (g,) = torch.autograd.grad(f(t), t)
        return g.detach()

    # ------------------------------------------------------------ memory
    def set_batch_size(self, bs: int) -> None:
        """Re-cut this rank's shard into batches of ``bs`` rows (out-of-memory back-off)."""
        p = self.problem
        self.batch_size = bs
        self.batches = p.batch.select(p.shard).split(bs) if p.shard.stop > p.shard.start else []
        self.drop_graphs()

    def drop_graphs(self, stop_caching: bool = False) -> bool:
        """Free the cached graphs (``stop_caching``: and keep no more). True when something changed."""
        return self.graphs.drop(stop_caching)

    def back_off(self, e: BaseException) -> None:
        """One step of the out-of-memory policy (drop graphs, halve the block, halve the batch)."""
        freed = self.drop_graphs(
            stop_caching=True
        )  # the cached graphs go first; then the block, then the batch
        if not freed and self.memory.block_size > 1:
            self.memory.block_size = self.memory.block_size // 2
        elif not freed and self.batch_size > 1:
            self.set_batch_size(self.batch_size // 2)
        elif not freed:
            raise MeasurementError(
                "out of memory for a single vector on a single sample; use a smaller model or another device"
            ) from e
        self.tally.oom_retries += 1
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def activation_bytes(self) -> int:
        """Memory kept for backward by one forward pass over the first batch (CUDA)."""
        p = self.problem
        if not self.batches:
            return 1
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        t = p.theta.requires_grad_(True)
        s = p.batch_loss_sum(p.unflatten(t), self.batches[0])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del s, t
        return int(max(peak - base, 1))
