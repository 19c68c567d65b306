r"""The curvatures: each one a linear operator with one batched product method.

A curvature is a `flatcli.engine.operators.CurvatureOperator` at a point θ (``op @ v``,
``op.matmat_rows(V)``, ``op.dense()``, ``op.to_scipy()``, ...) that every estimator of
`flatcli.engine.linalg` takes as it is. A subclass of `Curvature` supplies one method,
``_matmat_batch(V, θ, j, batch, out, accumulate)``, which writes (``accumulate`` False, the first
batch) or adds batch ``j``'s share of :math:`M V` for a block ``V`` of K vectors (shape
``(K, P)``) into ``out``. Everything else is the base class's, in one place: the loop over its
route's batches in blocks of the route's size, the padding mask (M A M), the cross-rank sum, the
progress report and the counting (`Curvature.count`: one ``n_hvp`` per vector unless a subclass
says otherwise). The unit weighting (every share is the batch's sum of unit losses divided by the
whole set's U, so the sum over batches and ranks is the product of the full-set matrix) is
`Curvature.batch_loss` and `flatcli.engine.products.ProductContext.share`/``weigh``. A curvature
receives the engine's `flatcli.engine.products.ProductContext` (problem, counters, graph cache,
precision), never the engine; its own settings (the finite-difference step) are constructor
arguments.

Each curvature takes its `flatcli.engine.routes.Route` when it is built (``self.route``: the
product mode, batched or looped pull-backs, recomputation, the block and the batches) and runs
every product on it. An out-of-memory error gives a new route (`ProductContext.back_off`: smaller
block, then smaller batches) and an operation the route cannot run (`flatcli.engine.routes.RouteFailed`)
the route without that part (`ProductContext.fail_over`); the curvature retries the block on the
new route and keeps it, and the engine builds later curvatures on it.

* `Hessian`: :math:`H = \nabla^2 L(\theta)`.
  ``"reverse"``: the batch's gradient graph (``create_graph``, cached across products at
  the same θ, `flatcli.engine.graphs`) and one pull-back per vector, as one vmapped
  backward (``is_grads_batched``) on CUDA and for models under 10k parameters on CPU, else
  a loop (faster on CPU for larger models: docs/benchmarks/data/engine.json). ``"forward"``:
  forward-over-reverse ``vmap(jvp(grad(L_B)))``, the fastest for blocks on GPUs; a model
  without forward-mode rules gets a ``"reverse"`` route when it is planned (a one-row probe).
  ``"auto"``: reverse on CPU; on CUDA forward for blocks and reverse through the cached
  graphs for single vectors. With ``causal_lm`` and an LM head the batch loss is the fused,
  chunked head + cross-entropy of `flatcli.engine.lmhead`, whose double backward is analytic:
  no (tokens × vocabulary) graph through ``log_softmax`` is ever kept.
* `GGN`: :math:`G = \frac1U \sum_u J_u^\top \nabla_z^2\ell_u J_u`: a JVP, the loss's analytic
  output-Hessian product (vmapped over the vectors; a loop for sequence outputs), a backward
  through the outputs' graph.
* `FiniteDifferenceHessian`: :math:`(\nabla L(\theta + h u) - \nabla L(\theta - h u))\|v\|/2h`
  with :math:`u = v/\|v\|`, per batch, two batch gradients per vector; ``h`` relative
  (``relative_eps``·max(1, ‖θ‖), ``runtime.hvp_mode: finite_difference``) or absolute (``eps``).

Adding a curvature is one subclass with a `_matmat_batch` method (and a `count` when its cost is
not one product per vector), plus a test against a dense float64 reference; the engine hands it
out with ``engine.curvature(MyCurvature, θ)`` (docs/architecture.md, "How to add a curvature").
"""

from __future__ import annotations

import abc
import math

import torch
from torch.func import grad as func_grad
from torch.func import jvp, vmap

from .operators import CurvatureOperator
from .products import ProductContext
from .routes import RouteFailed, is_oom


class Curvature(CurvatureOperator, abc.ABC):
    """Base class: a curvature at θ as an operator; the loop, the weighting and the counting.

    Parameters
    ----------
    state : the engine's `flatcli.engine.products.ProductContext`.
    theta : the point (default: the model's parameters, read at each product); copied.
    precision : None, or ``"fp32"`` for the verification view of a low-precision engine (TF32
        off and a bf16 forward in float32 during the products: `ProductContext.full_precision`).
    name : the operator's name (default: the class's ``name``).

    A subclass supplies ``_matmat_batch(V, θ, j, batch, out, accumulate)``, which writes
    (``accumulate`` False) or adds batch ``j``'s share of M V into ``out``, on ``self.route``
    (the `flatcli.engine.routes.Route` taken when the curvature was built).
    """

    name = "curvature"

    def __init__(
        self,
        state: ProductContext,
        theta: torch.Tensor | None = None,
        *,
        precision: str | None = None,
        name: str | None = None,
    ):
        p = state.problem
        self.route = state.route()  # decided now; only a failure or back-off replaces it
        super().__init__(
            None,
            p.num_params,
            device=p.device,
            dtype=p.dtype,
            name=name or type(self).name,
            precision_context=(
                state.full_precision if precision == "fp32" and state.precision.low else None
            ),
        )
        self.state = state
        self.theta = None if theta is None else theta.detach().clone()

    @property
    def problem(self):
        """The problem the products are taken over."""
        return self.state.problem

    def _matmat(self, V: torch.Tensor) -> torch.Tensor:
        """M V for V (K, P): `_matmat_batch` over this rank's batches, in blocks with the
        out-of-memory back-off, summed over ranks, reported and counted. With padding rows
        (`flatcli.engine.problem.Problem.mask`), M is applied to V before and to the output
        after: every curvature A is taken as M A M, symmetric in every product mode. A block
        that fails on its route is retried on the new route (module docstring)."""
        st = self.state
        st.not_local("curvature products")
        p = st.problem
        V2 = p.mask(V.to(p.device, p.dtype))  # a copy when masked: the caller's V is left alone
        th = st.theta_of(self.theta)
        out = torch.empty_like(V2)  # the first batch writes its rows, later ones add
        i = 0
        while i < V2.shape[0]:
            route = self.route
            k = min(route.block_size, V2.shape[0] - i)
            try:
                for j, b in enumerate(route.batches):
                    self._matmat_batch(V2[i : i + k], th, j, b, out[i : i + k], j > 0)
                if not route.batches:
                    out[i : i + k].zero_()
                i += k
            except RouteFailed as e:
                self.route = st.fail_over(route, e)
            except RuntimeError as e:  # torch.cuda.OutOfMemoryError is a RuntimeError
                if not is_oom(e):
                    raise
                self.route = st.back_off(route, e)
        p.dist.sum_(out)
        p.mask(out, inplace=True)
        st.report()
        self.count(V, th)
        return out

    def count(self, V: torch.Tensor, th: torch.Tensor) -> None:
        """Add the cost of a product of the rows V at θ to the counters: one product per vector."""
        self.state.tally.n_hvp += V.shape[0]

    @abc.abstractmethod
    def _matmat_batch(self, V, th, j, batch, out, accumulate) -> None:
        """Batch ``j``'s share of M V into ``out`` (see the class docstring): the hook a subclass
        must write (abstract: a curvature without it cannot be made)."""

    def batch_loss(self, batch):
        """θ ↦ this batch's share of L (sum of its unit losses / U)."""
        return lambda t: self.state.share(t, batch)

    def forward_fn(self, batch):
        """θ ↦ the model output on ``batch``."""
        p = self.problem
        return lambda t: p.forward(p.unflatten(t), batch)

    @staticmethod
    def put(out: torch.Tensor, value: torch.Tensor, accumulate: bool) -> None:
        """Write ``value`` into ``out``, or add it (``accumulate``)."""
        _put(out, value, accumulate)


def _put(out: torch.Tensor, value: torch.Tensor, accumulate: bool) -> None:
    if accumulate:
        out.add_(value)
    else:
        out.copy_(value)


class Hessian(Curvature):
    """Exact Hessian products (module docstring)."""

    name = "hessian"

    def _matmat_batch(self, V, th, j, batch, out, accumulate) -> None:
        """See `Curvature`."""
        st, route = self.state, self.route
        mode = route.mode(V.shape[0])
        if mode == "chain":  # block by block (flatcli.engine.segments)
            for k in range(V.shape[0]):
                st.chain.hvp(V[k], th, batch, out=out[k], accumulate=accumulate)
            return None
        if mode == "forward":
            try:
                return _put(out, self._forward(V, th, batch), accumulate)
            except (RuntimeError, NotImplementedError) as e:
                if is_oom(e):
                    raise
                raise RouteFailed("forward", str(e).splitlines()[0] if str(e) else "") from e
        t, g, _ = st.graphs.get(th, j, batch, len(route.batches))
        st.pullback(g, t, V, st.graphs.keeping, out, accumulate, batched=route.batched)

    def _forward(self, V, th, batch) -> torch.Tensor:
        gfun = func_grad(self.batch_loss(batch))

        def hv(v):
            return jvp(gfun, (th,), (v,))[1]

        return vmap(hv)(V) if V.shape[0] > 1 else hv(V[0])[None]


class GGN(Curvature):
    """Generalized Gauss-Newton products (module docstring)."""

    name = "ggn"

    def count(self, V: torch.Tensor, th: torch.Tensor) -> None:
        """One product per vector, in ``n_hvp`` and ``n_ggnvp``."""
        super().count(V, th)
        self.state.tally.n_ggnvp += V.shape[0]

    def _matmat_batch(self, V, th, j, batch, out, accumulate) -> None:
        """See `Curvature`. The VJP is a plain backward through the outputs' graph
        (`flatcli.engine.products.ProductContext.pullback`: batched or a loop), not ``torch.func.vjp``, whose first call
        in a process imports ``torch._dynamo`` (and pandas): 1.3 s of every process that runs
        normalized sharpness, ns_bound or the Fisher-Rao term on an MLP (`flatcli measure` on
        tests/engine/test_distributed.py's config: 6.3 → 4.6 s). Per product it is as fast (medians of 9
        interleaved rounds, 1 and 8 vectors, 64-16-16-10 and 784-256-256-10 MLPs and a small CNN,
        one CPU thread: 0.80-1.04× of the torch.func time) and gives the same values."""
        p, st = self.problem, self.state
        fwd = self.forward_fn(batch)
        t = th.detach().requires_grad_(True)
        with torch.enable_grad():
            z = fwd(t)  # the graph of the outputs, not the outputs

        def hjv(v):
            zv, jv = jvp(fwd, (th,), (v,))
            return st.weigh(
                p.loss_fn.output_hvp(zv.detach(), batch, jv)
            )  # zv, jv freed before the VJP

        if V.shape[0] > 1 and p.loss_fn.units_are_rows:
            try:
                H = vmap(hjv)(V)
            except (RuntimeError, NotImplementedError) as e:
                if is_oom(e):
                    raise
                st.tally.fallbacks += 1
            else:
                st.pullback(z, t, H, False, out, accumulate, batched=self.route.batched)
                return
        for k in range(V.shape[0]):
            st.pullback(
                z,
                t,
                hjv(V[k])[None],
                retain=k < V.shape[0] - 1,
                out=out[k : k + 1],
                accumulate=accumulate,
                batched=self.route.batched,
            )


class FiniteDifferenceHessian(Curvature):
    """Central differences of batch gradients (module docstring).

    eps : None for the relative step ``relative_eps``·max(1, ‖θ‖) along unit directions (scaled
        back by ‖v‖), or an absolute step ε along v itself.
    relative_eps : the relative step (``CurvatureEngine``'s ``fd_eps``).
    """

    name = "fd_hessian"

    def __init__(
        self,
        state: ProductContext,
        theta: torch.Tensor | None = None,
        *,
        eps: float | None = None,
        relative_eps: float = 1e-3,
        precision: str | None = None,
        name: str | None = None,
    ):
        for what, h in (("eps", eps), ("relative_eps", relative_eps)):
            if h is not None and not (h > 0 and math.isfinite(h)):
                raise ValueError(f"{what} must be a positive float. Got {h!r} instead.")
        super().__init__(state, theta, precision=precision, name=name)
        self.eps = None if eps is None else float(eps)
        self.relative_eps = float(relative_eps)

    def steps(self, V: torch.Tensor, th: torch.Tensor) -> torch.Tensor:
        """The step ε_k of each row (0 for zero rows, which give 0)."""
        if self.eps is not None:
            return torch.full((V.shape[0],), self.eps, dtype=V.dtype, device=V.device)
        h = self.relative_eps * max(1.0, float(th.norm()))
        norms = V.norm(dim=1)
        return torch.where(norms > 0, h / norms, torch.zeros_like(norms))

    def count(self, V: torch.Tensor, th: torch.Tensor) -> None:
        """One product per vector, and two full-set gradients per vector that moved θ."""
        st = self.state
        moved = int((self.steps(V.to(st.problem.dtype), th) > 0).sum())
        st.tally.n_hvp += V.shape[0]
        st.tally.grad_units += 2 * moved * st.problem.n

    def _matmat_batch(self, V, th, j, batch, out, accumulate) -> None:
        """See `Curvature`."""
        st = self.state
        steps = self.steps(V, th)
        f = self.batch_loss(batch)
        for k in range(V.shape[0]):
            e = float(steps[k])
            if e == 0.0:
                if not accumulate:
                    out[k].zero_()
                continue
            gp = st.batch_grad(f, th + e * V[k])
            gm = st.batch_grad(f, th - e * V[k])
            _put(out[k], (gp - gm) / (2 * e), accumulate)
