"""What every curvature product shares: the `ProductContext` an engine builds once.

It holds the problem, the counters (`flatcli.engine.counters`), the memory policy and the
gradient-graph cache, the precision and its fp32 view, the estimators' basis caps, the progress
hook, and the current `flatcli.engine.routes.Route`: planned at the first `ProductContext.route`
(when the first curvature operator is built) and replaced, never changed, by `replan` (an
out-of-memory back-off, `back_off`, or a route failure, `fail_over`). Each curvature keeps the
route it was built with (`flatcli.engine.curvatures.Curvature.route`); the engine's own loops
(losses, gradients) follow the current one's batches. The helpers the curvatures share are here
too: `ProductContext.pullback`, `ProductContext.batch_grad` and the unit weighting
`ProductContext.share`. `flatcli.engine.facade.CurvatureEngine` builds the context and hands it
to every curvature; no curvature sees the engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from ..errors import MeasurementError
from ..validation import validate
from .batch import Batch
from .counters import Counters
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
from .routes import (
    CPU_BATCHED_BELOW,
    MemoryPolicy,
    Route,
    RouteFailed,
    forward_supported,
    is_oom,
)
from .segments import BlockChain


class ProductContext:
    """What the curvature products share, built once per engine (module docstring).

    Parameters
    ----------
    problem : the model as functional parameters over the measurement set.
    hvp_mode : "auto", "reverse", "forward" or "finite_difference" (checked by the engine); the
        route resolves ``auto`` (forward on CUDA, with one-vector products in reverse; reverse
        elsewhere).
    block_size, reverse_batched, cache_graphs, recompute : as `CurvatureEngine`'s (None: the
        route's choice).
    precision : the resolved `flatcli.engine.precision.Precision` (`full_precision` is its fp32 view).
    max_device_vectors, max_basis_vectors : the checked settings the curvatures carry to the
        estimators (``max_basis_vectors`` resolved at its first use).
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
        block_size = validate("block_size", block_size, error=ValueError)
        self.problem = problem
        self.device = problem.device
        self.precision = precision or Precision.of("fp32", problem.device)
        self.max_device_vectors = max_device_vectors
        self._basis_setting, self._basis_resolved = max_basis_vectors, False
        self.on_progress: Callable[[dict], None] | None = None  # called after every product
        self.local = False  # inside map_batches: batch products on this rank alone
        self.rows_split = False  # inside map_batches with fewer batches than ranks: rows split
        self.hvp_mode = hvp_mode  # the setting, as asked; the route holds what runs
        self.recompute = parse_recompute(recompute)
        self._asked = (int(block_size) if block_size else None, reverse_batched)
        self._route: Route | None = None
        self._blocks: list = []
        self.chain: BlockChain | None = None  # the block-by-block product of a `chain` route
        self.chain_reason: str | None = None  # why not, when recomputing without it
        self.tally = Counters(problem.n)
        self.memory = MemoryPolicy(
            problem.num_params, problem.dtype, self.device, self.activation_bytes
        )
        self.graphs = GraphCache(
            self.gradient_graph,
            self.memory.graph_budget,
            False if self.recompute == "true" else cache_graphs,
        )

    # ------------------------------------------------------------ the route
    def route(self) -> Route:
        """The current route: planned at the first call (`plan`), then only replaced (`replan`)."""
        if self._route is None:
            self._route = self.plan()
        return self._route

    @property
    def batches(self) -> tuple[Batch, ...] | list[Batch]:
        """The batches of this rank: the current route's (the problem's before any is planned)."""
        return self.problem.batches if self._route is None else self._route.batches

    @property
    def batch_size(self) -> int:
        """Rows per batch of the current route."""
        return self.problem.batch_size if self._route is None else self._route.batch_size

    def plan(self) -> Route:
        """Decide the route from the model, the precision and the memory: recomputation (``auto``:
        the model has blocks and `flatcli.engine.recompute.predicted_product_bytes` exceeds 80% of
        the free memory) and then a chain of blocks; the Hessian mode (a forward mode is probed on
        one row first: without forward-mode rules the route is reverse, counted in ``fallbacks``);
        batched pull-backs (default: on CUDA and under 10k parameters); the block size (default:
        `MemoryPolicy.default_block`)."""
        p = self.problem
        block, batched = self._asked
        recompute = self._plan_recompute()
        hessian = self.hvp_mode
        if hessian == "auto":
            hessian = "forward" if self.device.type == "cuda" else "reverse"
        single = "reverse" if self.hvp_mode == "auto" and hessian == "forward" else hessian
        if recompute:
            hessian = single = "chain" if self.chain is not None else "reverse"
        elif "forward" in (hessian, single) and not self._forward_runs():
            self.tally.fallbacks += 1
            hessian, single = "reverse", "reverse"
        if batched is None:
            batched = self.device.type == "cuda" or p.num_params < CPU_BATCHED_BELOW
        return Route(
            hessian=hessian,
            single=single,
            batched=bool(batched),
            recompute=recompute,
            block_size=block or self.memory.default_block(),
            batch_size=p.batch_size,
            batches=tuple(p.batches),
        )

    def _plan_recompute(self) -> bool:
        """Whether products recompute activations (`plan`); finds the chain of blocks when they do."""
        p = self.problem
        blocks = find_blocks(p.model)
        on = self.recompute == "true"
        if self.recompute == "auto" and blocks and p.batches:
            need, free = predicted_product_bytes(p, p.batches[0], len(p.batches), self.device)
            on = free is not None and need > AUTO_RECOMPUTE * free
        self._blocks = blocks
        if on and blocks:
            self.chain, self.chain_reason = BlockChain.find(p)
        if on:
            self.graphs.drop(stop=True)
            self.graphs.state = "off"
        return bool(on and blocks)

    def _forward_runs(self) -> bool:
        """The forward-mode probe of `plan`: one row of the first batch (True without rows)."""
        p = self.problem
        if not p.batches:
            return True
        row = p.batches[0].select(slice(0, 1))
        return forward_supported(lambda t: self.share(t, row), self.theta_of(None))

    def replan(self, route: Route) -> Route:
        """Make ``route`` the current one (for operators built from now on and the engine's loops);
        the cached graphs go when its batches differ. Returns it."""
        if self._route is not None and route.batch_size != self._route.batch_size:
            self.drop_graphs()
        self._route = route
        return route

    def back_off(self, route: Route, e: BaseException) -> Route:
        """The route to retry with after an out-of-memory error ``e`` in a product on ``route``: the
        same one when cached graphs could be freed (they go first), else the current one when
        another operator already backed off, else `Route.backed_off`; counted in ``oom_retries``."""
        freed = self.drop_graphs(stop_caching=True)
        current = self.route()
        if freed:
            new = route
        elif current != route:
            new = current
        else:
            new = route.backed_off(self._recut)
        if new is None:
            raise MeasurementError(
                "out of memory for a single vector on a single sample; use a smaller model or another device"
            ) from e
        self.tally.oom_retries += 1
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return self.replan(new) if new is not route else route

    def fail_over(self, route: Route, failure: RouteFailed) -> Route:
        """The route to retry with after ``failure`` on ``route`` (`Route.without`), made current;
        counted in ``fallbacks``."""
        self.tally.fallbacks += 1
        return self.replan(route.without(failure.kind))

    def _recut(self, bs: int) -> tuple[Batch, ...]:
        p = self.problem
        return tuple(p.batch.select(p.shard).split(bs)) if p.shard.stop > p.shard.start else ()

    # ------------------------------------------------------------ settings and hooks
    def theta_of(self, theta: torch.Tensor | None) -> torch.Tensor:
        """θ (default: the model's parameters), detached, on the problem's device and dtype."""
        p = self.problem
        return (p.theta_flat if theta is None else theta).detach().to(self.device, p.dtype)

    def not_local(self, what: str) -> None:
        """Raise inside `flatcli.engine.CurvatureEngine.map_batches`, where ``what`` (full-set
        products) would see only this rank's shard."""
        if self.local or self.rows_split:
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

    # ------------------------------------------------------------ derivatives the curvatures share
    def gradient_graph(self, th: torch.Tensor, batch: Batch):
        """(t, ∇ of the batch's share of L with its graph kept, the share's value): the entries of
        ``graphs``; on a route that recomputes, the forward runs its blocks checkpointed."""
        t = th.clone().requires_grad_(True)
        recompute = self.route().recompute
        with checkpointed_blocks(self._blocks) if recompute else contextlib.nullcontext():
            lb = self.share(t, batch)
        (g,) = torch.autograd.grad(lb, t, create_graph=True)
        return t, g, float(lb.detach())

    @staticmethod
    def pullback(
        g: torch.Tensor,
        t: torch.Tensor,
        V: torch.Tensor,
        retain: bool,
        out: torch.Tensor | None = None,
        accumulate: bool = False,
        *,
        batched: bool,
    ) -> torch.Tensor:
        """The one batched-VJP helper: rows ``V[k]`` pulled back through ``g``'s graph to ``t``, as
        one vmapped backward (``is_grads_batched``; `RouteFailed` when an op has no batched rule)
        or, not ``batched``, a loop. ``out``: write the rows there (``accumulate``: add them),
        making no stacked copy (on CPU a fresh (K, P) block costs page faults as long as the
        products' arithmetic for ResNet-18)."""
        K = V.shape[0]
        if K > 1 and batched:
            try:
                (hv,) = torch.autograd.grad(g, t, V, is_grads_batched=True, retain_graph=True)
            except RuntimeError as e:
                if is_oom(e):
                    raise
                raise RouteFailed("batched", str(e).splitlines()[0] if str(e) else "") from e
            return hv if out is None else (out.add_(hv) if accumulate else out.copy_(hv))
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
    def drop_graphs(self, stop_caching: bool = False) -> bool:
        """Free the cached graphs (``stop_caching``: and keep no more). True when something changed."""
        return self.graphs.drop(stop_caching)

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
