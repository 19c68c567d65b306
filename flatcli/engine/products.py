r"""Losses, gradients and curvature-vector products over a `Problem`.

All products are exact sums over the whole measurement set, weighted by
``batch size / n`` (each batch contributes ``sum of its per-sample losses / n``),
so they equal the products of :math:`\nabla^2 L(\theta)` for the full-set mean
loss whatever the batch size, and an uneven last batch carries exactly its share.
The measurement set stays on the device (`Problem` moves it there once) and is
visited in a fixed order.

Hessian-vector products for a block ``V`` of K vectors (shape ``(K, P)``):

* ``"reverse"``: per batch, the gradient graph (``create_graph``) is built once
  and every one of the K vectors is pulled back through it (double backward
  with the graph reused). The graphs are also kept across calls at the same θ
  when they fit (``cache_graphs``; auto: the tensors they save, measured on the
  first batch, within 1.5 GB on CPU or 30% of free CUDA memory), so Lanczos'
  one-vector products cost one backward each, as PyHessian's single-batch mode,
  but for any number of batches. The K pull-backs run as one vmapped backward
  (``is_grads_batched``) on CUDA and for models under 10k parameters on CPU,
  else as a loop, which is faster on CPU for larger models.
* ``"forward"``: forward-over-reverse, ``vmap(jvp(grad(L_B)))`` over the K
  vectors: the fastest for blocks on GPUs. When an operation has no
  forward-mode rule the engine falls back to ``"reverse"`` once and for all
  (counted in ``fallbacks``).
* ``"auto"`` (default): ``"reverse"`` on CPU; on CUDA ``"forward"`` for blocks
  and ``"reverse"`` through the cached graphs for single vectors.

The CPU measurements behind these choices are in docs/performance.md (MLP
64-256-256-10 on digits, 2 cores: per-probe cost 1.6-2.0 gradients for the
cached-graph loop, 1.9-2.6 for a fresh double backward per vector, 2.8-3.4
for forward-over-reverse).

K is capped by ``block_size``: the constructor's value when given, otherwise,
on CUDA, the number of probes whose estimated memory (three times the
activations of one batch, measured with one forward pass, plus four parameter
vectors) fits in half of the free device memory (at most 32); on CPU as many as
keep a block within ~500 MB (at most 64). On out-of-memory the cached graphs
are dropped first, then the block is halved, and at block size 1 the batch
size is halved; the product is retried each time and every retry is counted
in ``oom_retries`` (reported with every measure's diagnostics).

Generalized Gauss-Newton products :math:`G v = \frac1n\sum_i J_i^\top H_{z,i} J_i v`
(:math:`J_i` the Jacobian of the outputs, :math:`H_{z,i}` the Hessian of the
per-sample loss in the outputs) are batched the same way: one vmapped JVP, one
vmapped output-space HVP and one vmapped VJP per batch.

``ggn_diagonal`` is the exact diagonal of that matrix (`flatcli.engine.ggn_diag`):
C per-sample vector-Jacobian products per sample, by an outer-product rule for
Linear layers and vmapped per-sample products for every other parameter.

``fd_hvp`` is the central difference
:math:`(\nabla L(\theta + \epsilon v) - \nabla L(\theta - \epsilon v)) / 2\epsilon`,
for models that are not twice differentiable. ``hvp_mode="finite_difference"``
(``runtime.hvp_mode`` in YAML) makes every HVP of every measure one: with
:math:`u = v/\|v\|` and the step :math:`h = \texttt{fd\_eps}\cdot\max(1, \|\theta\|)`
(``fd_eps`` = 1e-3 by default, a relative step),
:math:`Hv \approx \|v\|\,(\nabla L(\theta + hu) - \nabla L(\theta - hu)) / 2h`:
two full gradients per vector, exact up to :math:`O(h^2)` for smooth losses; for
ReLU networks it averages the curvature over kinks within :math:`h`.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch.func import grad as func_grad
from torch.func import jvp, vjp, vmap

from ..errors import MeasurementError
from . import ggn_diag
from .problem import Problem

HVP_MODES = ("auto", "reverse", "forward", "finite_difference")

_CUDA_MAX_BLOCK = 32
_CPU_MAX_BLOCK = 64
_CPU_BLOCK_BYTES = 5e8
_CPU_GRAPH_BYTES = 1.5e9
_CPU_BATCHED_BELOW = 10_000  # parameters; measured, see docs/performance.md


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


class CurvatureEngine:
    """Losses, gradients, HVPs, GGN-vector products and finite differences.

    Parameters
    ----------
    problem : Problem
        The model as functional parameters over the measurement set.
    hvp_mode : {"auto", "reverse", "forward", "finite_difference"}
        How Hessian-vector products are computed (see the module docstring).
    fd_eps : float
        Relative step of ``"finite_difference"`` products (h = fd_eps·max(1, ‖θ‖)).
    block_size : int, optional
        Most vectors multiplied at once. Default: chosen from free memory.
    reverse_batched : bool, optional
        In ``"reverse"`` mode, pull the K vectors back with one vmapped backward
        (``is_grads_batched``) instead of a loop over the retained graph.
        Default: True on CUDA and for models under 10k parameters, else False
        (the faster one, measured).
    cache_graphs : bool, optional
        Keep the per-batch gradient graphs between calls at the same θ. Default
        (None): when they fit the memory budget; False never; True always.

    Counters ``n_hvp`` (Hessian- and GGN-vector products, one per vector),
    ``n_grad`` (full-set gradients), ``n_forward`` (full-set forward passes),
    ``n_vjp`` (full-set passes of per-sample vector-Jacobian products, C per
    `ggn_diagonal`) and ``oom_retries`` are kept so measures can report their cost.
    """

    def __init__(
        self,
        problem: Problem,
        hvp_mode: str = "auto",
        block_size: int | None = None,
        reverse_batched: bool | None = None,
        cache_graphs: bool | None = None,
        fd_eps: float = 1e-3,
    ):
        if hvp_mode not in HVP_MODES:
            raise ValueError(f"hvp_mode must be one of {HVP_MODES}, got {hvp_mode!r}")
        if not (fd_eps > 0 and math.isfinite(fd_eps)):
            raise ValueError(f"fd_eps must be a positive float, got {fd_eps!r}")
        self.fd_eps = float(fd_eps)
        if block_size is not None and int(block_size) < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.problem = problem
        self.device = problem.device
        self._auto = hvp_mode == "auto"
        if hvp_mode == "auto":
            hvp_mode = "forward" if self.device.type == "cuda" else "reverse"
        self.hvp_mode = hvp_mode
        if reverse_batched is None:
            reverse_batched = self.device.type == "cuda" or problem.num_params < _CPU_BATCHED_BELOW
        self.reverse_batched = bool(reverse_batched)
        self.cache_graphs = cache_graphs
        self._graphs: list | None = None
        self._graphs_theta: torch.Tensor | None = None
        self._cache_state = "off" if cache_graphs is False else "unknown"
        self._block_size = int(block_size) if block_size else None
        self.batch_size = problem.batch_size
        self.batches = list(problem.batches)
        self.n_hvp = 0
        self.n_grad = 0
        self.n_forward = 0
        self.n_ggnvp = 0
        self.n_vjp = 0
        self._linear_fast = None
        self.oom_retries = 0
        self.fallbacks = 0

    # ------------------------------------------------------------ bookkeeping
    def counters(self) -> dict[str, int]:
        return {
            "n_hvp": self.n_hvp,
            "n_grad": self.n_grad,
            "n_forward": self.n_forward,
            "n_vjp": self.n_vjp,
            "oom_retries": self.oom_retries,
        }

    @property
    def block_size(self) -> int:
        """Most vectors per product call (chosen from free memory unless given)."""
        if self._block_size is None:
            self._block_size = self._default_block()
        return self._block_size

    @block_size.setter
    def block_size(self, value: int) -> None:
        self._block_size = max(1, int(value))

    def _default_block(self) -> int:
        p = self.problem
        elt = torch.finfo(p.dtype).bits // 8
        if self.device.type != "cuda":
            return int(max(1, min(_CPU_MAX_BLOCK, _CPU_BLOCK_BYTES // (4 * p.num_params * elt))))
        try:
            free, _ = torch.cuda.mem_get_info(self.device)
            act = self._activation_bytes()
        except RuntimeError:
            return 8
        per_probe = 3 * act + 4 * p.num_params * elt
        return int(max(1, min(_CUDA_MAX_BLOCK, (0.5 * free) // max(per_probe, 1))))

    def _activation_bytes(self) -> int:
        """Memory kept for backward by one forward pass over the first batch (CUDA)."""
        p = self.problem
        x, y = self.batches[0]
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        t = p.theta.requires_grad_(True)
        s = p.batch_loss_sum(p.unflatten(t), x, y)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del s, t
        return int(max(peak - base, 1))

    def _set_batch_size(self, bs: int) -> None:
        p = self.problem
        self.batch_size = bs
        self.batches = [(p.x[i : i + bs], p.y[i : i + bs]) for i in range(0, p.n, bs)]

    def _graph_budget(self) -> float:
        if self.device.type == "cuda":
            try:
                return 0.3 * torch.cuda.mem_get_info(self.device)[0]
            except RuntimeError:
                return 0.0
        return _CPU_GRAPH_BYTES

    def drop_graphs(self) -> None:
        """Free the cached gradient graphs (they are rebuilt when needed and allowed)."""
        self._graphs = None
        self._graphs_theta = None

    def _graph(self, th: torch.Tensor, x: torch.Tensor, y: torch.Tensor, count: bool = False):
        """The gradient of one batch's share of L with its graph kept (create_graph)."""
        saved = [0]
        seen: set[int] = set()

        def pack(t):  # count each storage once (parameter views share θ's)
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                saved[0] += st.nbytes()
            return t

        hooks = (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            if count
            else contextlib.nullcontext()
        )
        with hooks:
            t = th.clone().requires_grad_(True)
            (g,) = torch.autograd.grad(self._loss_fn(x, y)(t), t, create_graph=True)
        return t, g, saved[0]

    def _graphs_at(self, th: torch.Tensor):
        """Yield (t, ∇L_B(t)) per batch, reusing graphs cached at the same θ.

        With ``cache_graphs=None`` (auto) the graphs are kept when the tensors
        saved for the first batch, scaled to the whole set, fit the budget
        (1.5 GB on CPU, 30% of free CUDA memory); ``True`` always keeps them.
        """
        if self._graphs is not None and torch.equal(self._graphs_theta, th):
            yield from self._graphs
            return
        self._graphs = None
        keep = self._cache_state in ("unknown", "fits")
        built = []
        for i, (x, y) in enumerate(self.batches):
            decide = i == 0 and self._cache_state == "unknown"
            t, g, nbytes = self._graph(th, x, y, count=decide and self.cache_graphs is None)
            if decide:
                fits = (
                    self.cache_graphs is True
                    or nbytes * self.problem.n / len(x) <= self._graph_budget()
                )
                self._cache_state = "fits" if fits else "too_big"
                keep = fits
            if keep:
                built.append((t, g))
            yield t, g
        if keep:
            self._graphs = built
            self._graphs_theta = th.clone()

    @property
    def num_params(self) -> int:
        return self.problem.num_params

    @property
    def theta(self) -> torch.Tensor:
        return self.problem.theta

    def _loss_fn(self, x: torch.Tensor, y: torch.Tensor):
        p = self.problem

        def f(t):
            return p.batch_loss_sum(p.unflatten(t), x, y) / p.n

        return f

    # ------------------------------------------------------------ zeroth / first order
    @torch.no_grad()
    def loss(self, theta: torch.Tensor | None = None) -> float:
        """L(θ) over the measurement set (θ defaults to the model's parameters)."""
        p = self.problem
        params = p.params if theta is None else p.unflatten(theta)
        total = 0.0
        for x, y in self.batches:
            total += float(p.batch_loss_sum(params, x, y))
        self.n_forward += 1
        return total / p.n

    def loss_grad(self, theta: torch.Tensor | None = None) -> tuple[float, torch.Tensor]:
        """(L(θ), ∇L(θ)) as a float and a flat vector."""
        p = self.problem
        th = (p.theta if theta is None else theta).detach().requires_grad_(True)
        params = p.unflatten(th)
        total = 0.0
        g = torch.zeros_like(th)
        for x, y in self.batches:
            s = p.batch_loss_sum(params, x, y) / p.n
            (gb,) = torch.autograd.grad(s, th)
            g += gb
            total += float(s.detach())
        self.n_grad += 1
        return total, g.detach()

    def grad(self, theta: torch.Tensor | None = None) -> torch.Tensor:
        return self.loss_grad(theta)[1]

    # ------------------------------------------------------------ second order
    def _blocks(self, V: torch.Tensor, theta: torch.Tensor | None, fn) -> torch.Tensor:
        """Apply ``fn(block, θ)`` to blocks of V's rows with out-of-memory back-off."""
        single = V.ndim == 1
        V2 = V.reshape(1, -1) if single else V
        if V2.ndim != 2 or V2.shape[1] != self.num_params:
            raise ValueError(
                f"vectors must have shape (P,) or (K, P) with P = {self.num_params}; got {tuple(V.shape)}"
            )
        V2 = V2.to(self.device, self.problem.dtype)
        th = (
            (self.problem.theta if theta is None else theta)
            .detach()
            .to(self.device, self.problem.dtype)
        )
        outs = []
        i = 0
        while i < V2.shape[0]:
            k = min(self.block_size, V2.shape[0] - i)
            try:
                outs.append(fn(V2[i : i + k], th))
                i += k
            except RuntimeError as e:  # torch.cuda.OutOfMemoryError is a RuntimeError
                if not _is_oom(e):
                    raise
                if self._graphs is not None or self._cache_state == "fits":
                    self.drop_graphs()  # free the cached graphs first, and stop caching
                    self._cache_state = "too_big"
                elif self.block_size > 1:
                    self.block_size = self.block_size // 2
                elif self.batch_size > 1:
                    self._set_batch_size(self.batch_size // 2)
                else:
                    raise MeasurementError(
                        "out of memory for a single vector on a single sample; use a smaller model or another device"
                    ) from e
                self.oom_retries += 1
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
        out = torch.cat(outs, 0) if len(outs) > 1 else outs[0]
        return out[0] if single else out

    def hvp(self, V: torch.Tensor, theta: torch.Tensor | None = None) -> torch.Tensor:
        """H V for V of shape (P,) or (K, P); H the Hessian of L at θ (default: the model's)."""
        out = self._blocks(V, theta, self._hvp_block)
        self.n_hvp += 1 if V.ndim == 1 else V.shape[0]
        return out

    def _hvp_block(self, V: torch.Tensor, th: torch.Tensor) -> torch.Tensor:
        if self.hvp_mode == "finite_difference":
            return self._hvp_fd(V, th)
        if (
            self.hvp_mode == "forward"
            and self._auto
            and V.shape[0] == 1
            and self._cache_state in ("unknown", "fits")
        ):
            # one vector at a time (Lanczos): a backward through a cached graph beats forward-over-reverse
            return self._hvp_reverse(V, th)
        if self.hvp_mode == "forward":
            try:
                return self._hvp_forward(V, th)
            except (RuntimeError, NotImplementedError) as e:
                if _is_oom(e):
                    raise
                self.fallbacks += 1
                self.hvp_mode = "reverse"
        return self._hvp_reverse(V, th)

    def _hvp_reverse(self, V: torch.Tensor, th: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(V)
        K = V.shape[0]
        for t, g in self._graphs_at(th):
            keep = self._graphs is not None or self._cache_state == "fits"
            if K > 1 and self.reverse_batched:
                try:
                    (hv,) = torch.autograd.grad(g, t, V, is_grads_batched=True, retain_graph=True)
                    out += hv
                    continue
                except RuntimeError as e:
                    if _is_oom(e):
                        raise
                    self.fallbacks += 1
                    self.reverse_batched = False
            for k in range(K):
                (hv,) = torch.autograd.grad(g, t, V[k], retain_graph=keep or k < K - 1)
                out[k] += hv
        return out

    def _hvp_fd(self, V: torch.Tensor, th: torch.Tensor) -> torch.Tensor:
        """Central differences of full gradients along each unit direction (see the module docstring)."""
        h = self.fd_eps * max(1.0, float(th.norm()))
        out = torch.zeros_like(V)
        for k in range(V.shape[0]):
            n = float(V[k].norm())
            if n == 0.0:
                continue
            u = V[k] / n
            gp = self.grad(th + h * u)
            gm = self.grad(th - h * u)
            out[k] = (gp - gm) * (n / (2 * h))
        return out

    def _hvp_forward(self, V: torch.Tensor, th: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(V)
        for x, y in self.batches:
            gfun = func_grad(self._loss_fn(x, y))

            def hv(v, gfun=gfun):
                return jvp(gfun, (th,), (v,))[1]

            out += vmap(hv)(V) if V.shape[0] > 1 else hv(V[0])[None]
        return out

    def ggnvp(self, V: torch.Tensor, theta: torch.Tensor | None = None) -> torch.Tensor:
        r"""Generalized Gauss-Newton products :math:`GV` for V of shape (P,) or (K, P).

        :math:`G = \frac1n \sum_i J_i^\top \nabla_z^2 \ell(z_i, y_i) J_i`, positive
        semi-definite for convex losses (cross-entropy, MSE). Counted in ``n_hvp``.
        """
        out = self._blocks(V, theta, self._ggn_block)
        k = 1 if V.ndim == 1 else V.shape[0]
        self.n_hvp += k
        self.n_ggnvp += k
        return out

    def _ggn_block(self, V: torch.Tensor, th: torch.Tensor) -> torch.Tensor:
        p = self.problem
        out = torch.zeros_like(V)
        for x, y in self.batches:

            def fwd(t, x=x):
                return p.forward(p.unflatten(t), x)

            def lz(z, y=y):
                return p.per_sample_loss(z, y).sum() / p.n

            z, vjp_fn = vjp(fwd, th)
            z = z.detach()
            gz = func_grad(lz)

            def one(v, fwd=fwd, gz=gz, z=z, vjp_fn=vjp_fn):
                jv = jvp(fwd, (th,), (v,))[1]
                hjv = jvp(gz, (z,), (jv,))[1]
                return vjp_fn(hjv)[0]

            try:
                out += vmap(one)(V) if V.shape[0] > 1 else one(V[0])[None]
            except (RuntimeError, NotImplementedError) as e:
                if _is_oom(e) or V.shape[0] == 1:
                    raise
                self.fallbacks += 1
                for k in range(V.shape[0]):
                    out[k] += one(V[k])
        return out

    def ggn_diagonal(self, theta: torch.Tensor | None = None) -> torch.Tensor:
        r"""The exact diagonal of the generalized Gauss-Newton matrix at θ, shape (P,).

        :math:`\mathrm{diag}(G)_j = \frac1n \sum_i \sum_k (a_{ik}^\top J_i)_j^2` with
        :math:`\sum_k a_{ik}a_{ik}^\top` the per-sample output Hessian of the loss
        (closed forms for cross-entropy and MSE): see `flatcli.engine.ggn_diag`.
        Nonnegative. For networks that are piecewise linear in every single
        parameter (Linear/Conv layers, ReLU/leaky ReLU, max/avg pooling, BatchNorm
        in eval mode, each parameter used once),
        :math:`\partial^2 z/\partial\theta_j^2 = 0`, so this is also the exact
        diagonal of the Hessian of L. Cost: C backward passes over the set (C
        outputs per sample), counted as C in ``n_vjp``.
        """
        p = self.problem
        th = (p.theta if theta is None else theta).detach().to(self.device, p.dtype)
        if self._linear_fast is None:
            self._linear_fast = ggn_diag.linear_fast_path(p, self.batches[0][0])
        out, C = ggn_diag.ggn_diagonal(p, self.batches, th, self._jacobian_chunk, self._linear_fast)
        self.n_vjp += int(C)
        return out

    def _jacobian_chunk(self, C: int, P: int) -> int:
        """Samples per vmapped chunk of per-sample gradients: chunk × C × P numbers within the memory budget."""
        elt = torch.finfo(self.problem.dtype).bits // 8
        budget = _CPU_BLOCK_BYTES
        if self.device.type == "cuda":
            try:
                budget = 0.1 * torch.cuda.mem_get_info(self.device)[0]
            except RuntimeError:
                budget = _CPU_BLOCK_BYTES
        return int(max(1, budget // (2 * C * max(P, 1) * elt)))

    def fd_hvp(
        self, V: torch.Tensor, eps: float = 1e-3, theta: torch.Tensor | None = None
    ) -> torch.Tensor:
        r"""Central finite differences :math:`(\nabla L(\theta+\epsilon v) - \nabla L(\theta-\epsilon v))/2\epsilon`.

        Two full gradients per vector (counted in ``n_grad``); exact up to
        :math:`O(\epsilon^2)` for smooth losses and usable for non-smooth ones.
        """
        if not (eps > 0 and math.isfinite(eps)):
            raise ValueError(f"eps must be a positive float, got {eps!r}")
        single = V.ndim == 1
        V2 = V.reshape(1, -1) if single else V
        th = (self.problem.theta if theta is None else theta).detach()
        outs = []
        for v in V2:
            v = v.to(th)
            gp = self.grad(th + eps * v)
            gm = self.grad(th - eps * v)
            outs.append((gp - gm) / (2 * eps))
        self.n_hvp += V2.shape[0]
        out = torch.stack(outs)
        return out[0] if single else out

    # ------------------------------------------------------------ checks
    def check_finite(self) -> float:
        val = self.loss()
        if not math.isfinite(val):
            raise MeasurementError(f"the loss at the checkpoint is not finite ({val})")
        return val
