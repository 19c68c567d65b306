r"""The engine measures talk to: losses, gradients, curvature operators and per-unit quantities.

`CurvatureEngine` is what measures talk to over a `flatcli.engine.problem.Problem`. It builds
one `flatcli.engine.products.ProductContext` (counters, memory policy, graph cache, precision, the
current product route) and hands out curvatures over it (`flatcli.engine.curvatures`: each one a linear
operator that owns its loop, weighting and counting; `curvature(kind, θ)`, `hessian`, `ggn`,
`fd_hessian`), which estimators then drive directly: the engine is not on a product's path. It
adds the loss and gradient loops, per-unit quantities, the fp32 view, `map_batches` and the exact
Gauss-Newton diagonal (`flatcli.engine.ggn_diag`). It knows nothing about measures; measures get
every derivative from it.

All quantities are exact sums over the whole measurement set (every rank's shard, summed),
each batch weighted by its scored units over the set's U, so they equal those of the
full-set mean loss whatever the batch size or the number of ranks. An embedding's padding rows
are frozen coordinates (`flatcli.engine.problem`): gradients, curvature products (M A M), the
exact Gauss-Newton diagonal and the directions of `per_unit_directional` have them masked.

Two things measures may need to reduce themselves, when they loop over `module_io`:
`sum_` (a tensor summed over ranks) and `gather` (per-row tensors in the global order).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.func import jvp

from .. import validation
from ..errors import ConfigError
from . import ggn_diag
from .batch import Batch
from .capture import LayerCapture
from .curvatures import GGN, Curvature, FiniteDifferenceHessian, Hessian
from .dist import Dist
from .linalg import EstimatorSettings
from .losses import NotApplicable
from .precision import BF16_FD_REFUSED, Precision
from .problem import Problem
from .products import ProductContext
from .recompute import parse_recompute
from .routes import RouteFailed, is_oom

HVP_MODES = validation.HVP_MODES  # the vocabulary is declared once, in flatcli.validation


class CurvatureEngine:
    """Losses, gradients, curvature operators and per-unit products over a `Problem`.

    Parameters
    ----------
    problem : the model as functional parameters over the measurement set.
    hvp_mode : {"auto", "reverse", "forward", "finite_difference"}: how Hessian products are
        computed (`flatcli.engine.curvatures`); ``finite_difference`` makes every HVP of every
        measure a central difference of two gradients (relative step ``fd_eps``).
    block_size : most vectors multiplied at once (default: from free memory).
    reverse_batched : pull K vectors back with one vmapped backward (default: on CUDA and for
        models under 10k parameters; a loop otherwise, which is faster on CPU for large models).
    cache_graphs : keep per-batch gradient graphs across products at one θ (None: when they fit).
    precision : "auto", "fp32", "tf32", "bf16" or "fp64", as ``runtime.precision``
        (`flatcli.engine.precision`): ``auto`` runs TF32 products on a tensor-core GPU and asks
        measures to verify converged quantities in fp32 (``precision.verify``); ``bf16`` sets the
        problem's forward to bfloat16 (``Problem.compute_dtype``; vectors stay in the problem's
        dtype) and verifies likewise; the engine computes in the problem's dtype otherwise.
    max_device_vectors : most basis vectors the Krylov estimators keep on the device
        (``runtime.max_device_vectors``): an int, None (unbounded) or "auto" (from free CUDA memory,
        unbounded on CPU); the rest lives in host memory (`flatcli.engine.linalg._store`).
    max_basis_vectors : most Lanczos basis vectors kept at all, device and host
        (``runtime.max_basis_vectors``): an int, None (unbounded) or "auto" (what fits in half the
        free host memory at its first use, the least over the ranks:
        `flatcli.engine.products.ProductContext.max_basis_vectors`); beyond
        it Lanczos thick-restarts (`flatcli.engine.linalg.lanczos`).
    recompute : "false", "true" or "auto" (``runtime.recompute``; booleans accepted): Hessian products
        that keep one block's activations at a time: block by block on a chain of blocks
        (`flatcli.engine.segments`), else with per-block activation checkpointing
        (`flatcli.engine.recompute`); no gradient graphs cached across products. ``auto`` turns it on when the model has blocks and
        the predicted peak of a product does not fit in free memory (``state.route().recompute``).

    Arguments are checked at this boundary with the rules of `flatcli.validation` (``hvp_mode``,
    ``precision``, ``recompute``, ``block_size``, ``max_device_vectors``, ``max_basis_vectors``: the same rule and wording
    as the config and `flatcli.run.settings.Settings`, raised as ValueError as they always were): the
    engine is a public entry point (``flatcli.engine.CurvatureEngine``, built directly by tests and
    library users), so it does not rely on `Settings` having checked them.

    Counters (`flatcli.engine.counters.Counters`): ``n_hvp``, ``n_ggnvp``, ``n_grad``, ``n_forward``,
    ``n_vjp``, ``oom_retries``, ``fallbacks``.
    """

    def __init__(
        self,
        problem: Problem,
        hvp_mode: str = "auto",
        block_size: int | None = None,
        reverse_batched: bool | None = None,
        cache_graphs: bool | None = None,
        fd_eps: float = 1e-3,
        precision: str = "auto",
        max_device_vectors: int | str | None = "auto",
        recompute: str | bool = "false",
        max_basis_vectors: int | str | None = "auto",
    ):
        validation.validate("hvp_mode", hvp_mode, error=ValueError)
        if not (fd_eps > 0 and math.isfinite(fd_eps)):
            raise ValueError(f"fd_eps must be a positive float. Got {fd_eps!r} instead.")
        parse_recompute(
            recompute
        )  # a bad value raises before the precision is read (the state keeps the parsed one)
        self.problem = problem
        # what the caller asked for, as given: `derive` builds an engine for another model with them
        self._options = dict(
            hvp_mode=hvp_mode,
            block_size=block_size,
            reverse_batched=reverse_batched,
            cache_graphs=cache_graphs,
            fd_eps=fd_eps,
            precision=precision,
            max_device_vectors=max_device_vectors,
            recompute=recompute,
            max_basis_vectors=max_basis_vectors,
        )
        max_device_vectors = validation.validate(
            "max_device_vectors", max_device_vectors, error=ValueError
        )
        max_basis_vectors = validation.validate(
            "max_basis_vectors", max_basis_vectors, error=ValueError
        )
        self.precision = Precision.of(precision, problem.device)
        if self.precision.name == "bf16" and hvp_mode == "finite_difference":
            raise ConfigError(BF16_FD_REFUSED)
        # the engine owns the products' precision: bf16 lowers the problem's forward, the others keep θ's type
        problem.compute_dtype = (
            self.precision.compute_dtype if self.precision.name == "bf16" else problem.dtype
        )
        self.state = ProductContext(
            problem,
            hvp_mode=hvp_mode,
            block_size=block_size,
            reverse_batched=reverse_batched,
            cache_graphs=cache_graphs,
            recompute=recompute,
            precision=self.precision,
            max_device_vectors=max_device_vectors,
            max_basis_vectors=max_basis_vectors,
        )

    def derive(self, model: torch.nn.Module) -> CurvatureEngine:
        """An engine with this one's settings (HVP mode, block size, graph caching, finite-difference
        step, precision) over `Problem.derive` of ``model``: the problem a measure needs for a
        transformed copy of the model (a BatchNorm-folded one) without touching engine internals."""
        return CurvatureEngine(self.problem.derive(model), **self._options)

    def merge_counts(self, other: CurvatureEngine) -> None:
        """Add ``other``'s cost counters to this engine's (a derived engine's products count
        towards the measure that ran them)."""
        self.state.tally.merge(other.state.tally)

    # ------------------------------------------------------------ bookkeeping
    def counters(self) -> dict[str, float]:
        """Every counter the engine keeps (see `flatcli.engine.counters.Counters`): ``n_hvp``,
        ``n_ggnvp``, ``n_grad``, ``n_forward``, ``n_vjp``, ``oom_retries``, ``fallbacks``."""
        return self.state.tally.as_dict()

    def count(self, *, n_forward: float = 0, n_grad: float = 0) -> None:
        """Add full-set passes a measure ran itself (forward passes through hooks on a layer)."""
        self.state.tally.forward_units += n_forward * self.problem.n
        self.state.tally.grad_units += n_grad * self.problem.n

    @property
    def on_progress(self) -> Callable[[dict], None] | None:
        """Called after every product with the counters so far and what the estimator driving the
        products reports (an estimate and its standard error)."""
        return self.state.on_progress

    @on_progress.setter
    def on_progress(self, hook: Callable[[dict], None] | None) -> None:
        self.state.on_progress = hook

    def _theta(self, theta: torch.Tensor | None) -> torch.Tensor:
        return self.state.theta_of(theta)

    @property
    def _batches(self) -> list[Batch]:
        return self.state.batches

    @property
    def _tally(self):
        return self.state.tally

    @property
    def _dist(self) -> Dist:
        return self.problem.dist

    def full_precision(self):
        """A context with fp32 products inside (the verification view): TF32 off, and a bf16
        problem's forward in float32 (`flatcli.engine.products.ProductContext.full_precision`)."""
        return self.state.full_precision()

    @property
    def estimator_settings(self) -> EstimatorSettings:
        """How the estimators drive this engine's curvatures, from its runtime settings: the
        vectors per product call (the block of the current route, read at each estimator call,
        so an out-of-memory back-off is followed), the basis caps (``runtime.max_device_vectors``,
        ``runtime.max_basis_vectors``) and the progress hook (`on_progress`). Pass it to the
        estimators of `flatcli.engine.linalg` (``settings=``)."""
        st = self.state
        return EstimatorSettings(
            block_size=lambda: st.route().block_size,
            max_device_vectors=st.max_device_vectors,
            max_basis_vectors=st.max_basis_vectors,
            report=st.report,
        )

    # ------------------------------------------------------------ curvatures
    def curvature(
        self, kind: type[Curvature], theta: torch.Tensor | None = None, **settings
    ) -> Curvature:
        """The curvature ``kind`` (a `flatcli.engine.curvatures.Curvature` subclass) at θ (default:
        the model's parameters) as a linear operator over this engine's problem, batches, counters
        and memory policy; ``settings`` are its constructor's (``precision="fp32"``: the
        verification view, TF32 off during its products)."""
        return kind(self.state, theta, **settings)

    def hessian(
        self, theta: torch.Tensor | None = None, *, precision: str | None = None
    ) -> Curvature:
        """The Hessian of L at θ (default: the model's parameters) as a linear operator
        (``precision="fp32"``: TF32 off during its products, the verification view); with
        ``hvp_mode="finite_difference"``, central differences of gradients (relative step ``fd_eps``)."""
        if self.state.hvp_mode == "finite_difference":
            return self.curvature(
                FiniteDifferenceHessian,
                theta,
                relative_eps=self._options["fd_eps"],
                precision=precision,
                name="hessian",
            )
        return self.curvature(Hessian, theta, precision=precision)

    def ggn(self, theta: torch.Tensor | None = None, *, precision: str | None = None) -> Curvature:
        r"""The generalized Gauss-Newton matrix :math:`\frac1U \sum_u J_u^\top \nabla_z^2 \ell_u J_u`
        at θ as a linear operator (positive semi-definite for convex losses); its products are
        counted in ``n_hvp`` and ``n_ggnvp``."""
        return self.curvature(GGN, theta, precision=precision)

    def fd_hessian(
        self,
        theta: torch.Tensor | None = None,
        *,
        eps: float | None = None,
        precision: str | None = None,
    ) -> Curvature:
        r"""The Hessian by central differences of gradients, :math:`(\nabla L(\theta+\epsilon v) -
        \nabla L(\theta-\epsilon v))/2\epsilon`: two gradients per vector, exact up to
        :math:`O(\epsilon^2)` for smooth losses and usable for non-smooth ones (relative step as
        ``runtime.hvp_mode: finite_difference`` when ``eps`` is None, else the absolute ``eps``)."""
        return self.curvature(
            FiniteDifferenceHessian,
            theta,
            eps=eps,
            relative_eps=self._options["fd_eps"],
            precision=precision,
        )

    def ggn_diagonal(self, theta: torch.Tensor | None = None) -> torch.Tensor:
        r"""The exact diagonal of the generalized Gauss-Newton matrix at θ, shape (P,):
        :math:`\frac1U \sum_u \sum_k (a_{uk}^\top J_u)^2` with :math:`\sum_k a a^\top` the loss's
        per-unit output Hessian (closed forms; `flatcli.engine.ggn_diag`). For networks that are
        piecewise linear in every single parameter (Linear/Conv, ReLU/leaky ReLU, max/avg pooling,
        BatchNorm in eval mode, each parameter used once) it is also the exact Hessian diagonal.
        Cost: C backward passes over the set (C outputs per unit), counted as C in ``n_vjp``.
        A loss whose units are not rows (``causal_lm``) raises `flatcli.engine.losses.NotApplicable`."""
        self.state.not_local("full-set products")
        p = self.problem
        th = self._theta(theta)
        out, C = ggn_diag.ggn_diagonal(p, self._batches, th, self.state.memory.chunk_rows)
        self._dist.sum_(out)
        p.mask(out, inplace=True)  # diag(M G M): a tied head's share of the padding rows too
        self._tally.n_vjp += int(
            self._dist.gather_cat(torch.tensor([int(C)])).max()
        )  # C of a rank with rows
        return out

    # ------------------------------------------------------------ zeroth and first order
    @torch.no_grad()
    def loss(self, theta: torch.Tensor | None = None) -> float:
        """L(θ) over the measurement set (θ defaults to the model's parameters)."""
        self.state.not_local("full-set products")
        p = self.problem
        params = p.unflatten(self._theta(theta))
        total = sum(float(p.batch_loss_sum(params, b)) for b in self._batches)
        self._tally.forward_units += p.n
        return self._dist.sum_float(total)[0] / p.n

    def loss_grad(
        self, theta: torch.Tensor | None = None, *, keep_graph: bool = False
    ) -> tuple[float, torch.Tensor]:
        """(L(θ), ∇L(θ)) as a float and a flat vector. ``keep_graph``: build the per-batch gradient
        graphs (``create_graph``) and keep them when they fit, so that HVPs at the same θ that
        follow (an ascent step that needs ∇L and H∇L) reuse this forward and backward."""
        self.state.not_local("full-set products")
        p = self.problem
        th = self._theta(theta)
        if keep_graph and self.state.graphs.keeping:
            total, g = 0.0, torch.zeros_like(th)
            for j, b in enumerate(self._batches):
                _, gb, lb = self.state.graphs.get(th, j, b, len(self._batches))
                g += gb.detach()
                total += lb
        else:
            total, g = self._loss_grad_over(self._batches, th, p.n)
        self._tally.grad_units += p.n
        self._dist.sum_(g)
        p.mask(
            g, inplace=True
        )  # padding rows frozen (`flatcli.engine.problem`): a tied head's share too
        return self._dist.sum_float(total)[0], g

    def batch_loss_grad(
        self, batch: Batch, theta: torch.Tensor | None = None, *, need_grad: bool = True
    ) -> tuple[float, torch.Tensor | None]:
        """(L_B(θ), ∇L_B(θ)) for the mean loss over the rows ``batch`` (e.g. an m-sharpness batch
        of the measurement set): its rows are split over the ranks and cut into the engine's
        batch size; counted as the batch's share of a full-set pass."""
        p = self.problem
        th = self._theta(theta)
        units = p.units(batch)
        dist = (
            Dist() if self.state.local else self._dist
        )  # inside map_batches: the whole batch, here
        mine = batch.select(dist.shard(batch.rows))
        chunks = mine.split(self.state.batch_size) if mine.rows else []
        if need_grad:
            total, g = self._loss_grad_over(chunks, th, units)
            self._tally.grad_units += units
            dist.sum_(g)
            p.mask(g, inplace=True)
            return dist.sum_float(total)[0], g
        with torch.no_grad():
            params = p.unflatten(th)
            total = sum(float(p.batch_loss_sum(params, c)) for c in chunks)
        self._tally.forward_units += units
        return dist.sum_float(total)[0] / units, None

    def map_batches(self, batches: list[Any], fn: Callable[[Any], Any]) -> list[Any]:
        """``[fn(b) for b in batches]`` for independent per-batch problems (m-sharpness; an item
        may carry more than its `Batch`, e.g. a random state), with the items dealt round-robin
        to the ranks: each batch is computed whole on one rank, inside
        ``fn`` `batch_loss_grad` stays local (no communication per step), and the results (any
        picklable values) are gathered in batch order on every rank, as are the counters. A batch
        is computed exactly as one process computes it, so the results equal one process's.
        Inside ``fn`` only `batch_loss_grad` may be called (a full-set product would see only
        this rank's shard: it raises, on one process too, so that a measure that works on one
        process works on many).

        Fewer batches than ranks (one m-batch on 2 ranks): dealing whole batches would leave ranks
        idle, so every rank runs ``fn`` on every batch instead and `batch_loss_grad` splits each
        batch's rows over the ranks (losses and gradients summed across them), as outside
        ``map_batches``: each rank forwards about 1/R of the rows, and the values equal one
        process's up to the order of the sums. ``fn`` must then take the same steps on every rank
        (it does when it depends only on the item and on what `batch_loss_grad` returns, which is
        the same on every rank)."""
        if self._dist.active and len(batches) < self._dist.world:
            self.state.rows_split = True
            try:
                return [fn(b) for b in batches]
            finally:
                self.state.rows_split = False
        before = self._tally.as_raw()
        self.state.local = True
        try:
            mine = {
                i: fn(batches[i]) for i in range(self._dist.rank, len(batches), self._dist.world)
            }
        finally:
            self.state.local = False
        if not self._dist.active:
            return [mine[i] for i in range(len(batches))]
        grown = [a - b for a, b in zip(self._tally.as_raw(), before, strict=True)]
        self._tally.add_raw(
            [d - g for d, g in zip(self._dist.sum_float(*grown), grown, strict=True)]
        )
        done: dict[int, Any] = {}
        for part in self._dist.gather_objects(mine):
            done.update(part)
        return [done[i] for i in range(len(batches))]

    def _loss_grad_over(
        self, batches: list[Batch], th: torch.Tensor, n: int
    ) -> tuple[float, torch.Tensor]:
        """The one gradient loop: this rank's part of the mean loss over ``batches`` (n units in all,
        every rank) and its gradient."""
        p = self.problem
        t = th.detach().clone().requires_grad_(True)
        params = p.unflatten(t)
        total = 0.0
        g = torch.zeros_like(t)
        for b in batches:
            s = p.batch_loss_sum(params, b) / n
            (gb,) = torch.autograd.grad(s, t)
            g += gb
            total += float(s.detach())
        return total, g.detach()

    # ------------------------------------------------------------ per-unit quantities
    @torch.no_grad()
    def per_unit(self, fn: Callable, theta: torch.Tensor | None = None, *, classes: bool = False):
        """``fn(Z, t)`` of the scored units, batch by batch, concatenated over the whole set in unit
        order (every rank gets all of it): Z (U_b, C) their outputs and t their targets as the loss
        scores them, or, with ``classes``, their class scores and integer labels (a
        `flatcli.engine.losses.NotApplicable` when the outputs are not class scores). ``fn`` returns
        a tensor with one row per unit, or a tuple of them. One forward pass."""
        self.state.not_local("full-set products")
        p = self.problem
        params = p.unflatten(self._theta(theta))
        batches = self._batches or [
            p.batch.select(slice(0, 1))
        ]  # a rank without rows joins with nothing
        parts: list = []
        for b in batches:
            Z, t = self._units(p.forward(params, b), b, classes)
            if not self._batches:
                Z, t = Z[:0], t[:0]
            r = fn(Z, t)
            parts.append(r if isinstance(r, tuple) else (r,))
        self._tally.forward_units += p.n
        outs = [self._dist.gather_cat(torch.cat(cols)) for cols in zip(*parts, strict=True)]
        return tuple(outs) if len(outs) > 1 else outs[0]

    def _units(self, out: torch.Tensor, b: Batch, classes: bool):
        loss = self.problem.loss_fn
        if classes:
            c = loss.classes(out, b)
            if c is None:
                raise NotApplicable(
                    f"needs class scores and integer labels; loss {loss.name!r} on outputs of "
                    f"shape {tuple(out.shape)} gives none"
                )
            return c
        Z, t, mask = loss.scores(out, b)
        return (Z, t) if mask is None else (Z[mask], t[mask])

    @torch.no_grad()
    def loss_and_error(self, theta: torch.Tensor | None = None) -> tuple[float, float]:
        """(L(θ), the 0-1 error of the argmax over the scored units) in one forward pass (the
        outputs must be class scores)."""
        p = self.problem
        params = p.unflatten(self._theta(theta))
        total, wrong = 0.0, 0.0
        for b in self._batches:
            out = p.forward(params, b)
            total += float(p.loss_fn.sum(out, b))
            Z, t = self._units(out, b, classes=True)
            wrong += float((Z.argmax(-1) != t).sum())
        self._tally.forward_units += p.n
        total, wrong = self._dist.sum_float(total, wrong)
        return total / p.n, wrong / p.n

    def per_unit_directional(
        self, v: torch.Tensor, theta: torch.Tensor | None = None, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        r"""The directional derivatives :math:`\langle v, \nabla_\theta \ell_u(\theta)\rangle` of every
        scored unit's loss, shape (U,), in unit order (every rank gets all): one forward-mode product
        per batch (the JVP of the vector of unit losses), or, when an operation has no forward-mode
        rule, the double-backward trick (also one pass per batch). ``labels`` (U,) replace the
        units' targets (e.g. labels drawn from the model)."""
        p = self.problem
        th = self._theta(theta)
        v = p.mask(
            v.detach().to(th)
        )  # padding rows frozen: the same in forward mode and in the fallback
        out, i = [], p.unit_offset
        for b in self._batches:
            ub = p.units(b)
            lb = None if labels is None else labels[i : i + ub]
            i += ub

            def losses(t, b=b, lb=lb):
                Z, tt, mask = p.loss_fn.scores(p.forward(p.unflatten(t), b), b)
                if mask is not None:
                    Z, tt = Z[mask], tt[mask]
                return p.loss_fn.unit_losses(Z, tt if lb is None else lb.to(tt))

            out.append(self._jvp_rows(losses, th, v))
        self._tally.grad_units += p.n
        local = torch.cat(out) if out else torch.zeros(0, dtype=th.dtype, device=th.device)
        return self._dist.gather_cat(local)

    def _jvp_rows(self, fn, th: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        try:
            return jvp(fn, (th,), (v,))[1].detach()
        except (RuntimeError, NotImplementedError) as e:
            if is_oom(e):
                raise
            self._tally.fallbacks += 1
            t = th.clone().requires_grad_(True)
            ell = fn(t)
            u = torch.zeros_like(ell, requires_grad=True)
            (jt_u,) = torch.autograd.grad(ell, t, u, create_graph=True)
            (jv,) = torch.autograd.grad(jt_u, u, v)
            return jv.detach()

    # ------------------------------------------------------------ layers
    @torch.no_grad()
    def module_io(self, module: torch.nn.Module, theta: torch.Tensor | None = None):
        """Yield (batch, module input, module output, model output) for this rank's batches: one
        forward pass with a hook on ``module``, which must run exactly once per forward pass.
        Sums over these batches must go through `sum_` to cover every rank."""
        p = self.problem
        params = p.unflatten(self._theta(theta))
        for b in self._batches:
            with LayerCapture(module) as cap:
                out = p.forward(params, b)
            yield b, *cap.single(), out
        self._tally.forward_units += p.n

    def module_output_hvp(
        self, module: torch.nn.Module, batch: Batch, z0: torch.Tensor, V: torch.Tensor
    ) -> torch.Tensor:
        r"""Per-row Hessian-vector products of the loss in a module's output.

        ``z0`` (B, d) is the module's output on ``batch``; returns (k, B, d) whose row n of block r
        is :math:`\nabla_z^2 \ell(x_n) V_r`, the Hessian of row n's loss with respect to its own
        module output through the rest of the network (in eval mode a row's loss depends on its own
        output only). The output is replaced by a leaf tensor (a forward hook), and one batched
        double backward of the summed losses with V_r repeated over the batch gives every row's
        product at once (a loop over r when an op has no batched rule)."""
        p = self.problem
        zz = z0.detach().clone().requires_grad_(True)
        with LayerCapture(module, replace=zz):
            out = p.forward(p.params, batch)
        s = p.loss_fn.sum(out, batch)
        (g,) = torch.autograd.grad(s, zz, create_graph=True)
        k, (B, d) = V.shape[0], zz.shape
        self._tally.grad_units += p.units(batch) * self._dist.world
        if not g.requires_grad:  # the loss is linear in z
            return torch.zeros(k, B, d, dtype=zz.dtype, device=zz.device)
        Vb = V[:, None, :].expand(k, B, d).to(zz)
        route = self.state.route()
        try:
            return self.state.pullback(g, zz, Vb, retain=False, batched=route.batched)
        except RouteFailed as e:  # no batched rule: a loop, here and in the curvatures built later
            route = self.state.fail_over(route, e)
            return self.state.pullback(g, zz, Vb, retain=False, batched=route.batched)

    # ------------------------------------------------------------ reductions for measures
    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks, in place (a measure's sum over `module_io` batches)."""
        return self._dist.sum_(t)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Per-row tensors of this rank's batches concatenated over the ranks in row order."""
        return self._dist.gather_cat(t)
