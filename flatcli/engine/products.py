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
from collections.abc import Callable

import torch
from torch.func import grad as func_grad
from torch.func import jvp, vjp, vmap

from ..errors import MeasurementError
from . import ggn_diag
from .operators import CurvatureOperator
from .problem import Problem, nonfinite_tensors, not_finite

HVP_MODES = ("auto", "reverse", "forward", "finite_difference")

_CUDA_MAX_BLOCK = 32
_CPU_MAX_BLOCK = 64
_CPU_BLOCK_BYTES = 5e8
_CPU_GRAPH_BYTES = 1.5e9
_CPU_BATCHED_BELOW = 10_000  # parameters; measured, see docs/performance.md


def _count(x: float) -> float:
    """A counter value: an int when whole, else the fraction (rounded to 6 digits)."""
    return int(x) if float(x).is_integer() else round(float(x), 6)


@contextlib.contextmanager
def tf32_flags(matmul: bool, cudnn: bool):
    """Set torch's two TF32 switches (CUDA matmul, cuDNN) inside; the previous values are restored."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


class LayerCapture:
    """A forward hook that records a module's input and output, or replaces its output
    (``with LayerCapture(module) as cap: model(x)``; then ``cap.single()``)."""

    def __init__(self, module: torch.nn.Module, replace: torch.Tensor | None = None):
        self.module, self.replace = module, replace
        self.inputs: list[torch.Tensor] = []
        self.outputs: list[torch.Tensor] = []

    def __enter__(self):
        self.handle = self.module.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc):
        self.handle.remove()

    def _hook(self, mod, inp, out):
        self.inputs.append(inp[0])
        self.outputs.append(out)
        return self.replace

    def single(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(input, output) of the one call; a module that ran 0 or several times is an error."""
        if len(self.inputs) != 1:
            raise MeasurementError(
                f"the layer ran {len(self.inputs)} times in one forward pass; it must run exactly once "
                "(no weight sharing)"
            )
        return self.inputs[0], self.outputs[0]


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

    precision : "fp32", "tf32" (TF32 matrix products on CUDA) or "fp64": what the products run at.
    verify : with TF32 products, ask measures to verify converged quantities in fp32
        (`needs_verification`; ``runtime.precision: auto``).

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
        precision: str = "fp32",
        verify: bool = False,
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
        self.precision = precision
        self.verify = bool(verify)
        self.n_hvp = 0
        self.n_ggnvp = 0
        self._grad_samples = 0  # samples whose gradient was taken (n per full gradient)
        self._forward_samples = 0  # samples passed forward without a gradient
        self.n_vjp = 0
        self._linear_fast = None
        self.oom_retries = 0
        self.fallbacks = 0
        self.on_progress: Callable[[dict], None] | None = None  # called after every product

    # ------------------------------------------------------------ bookkeeping
    @property
    def n_grad(self) -> float:
        """Gradients taken, in full-set equivalents (a gradient over a batch of m samples counts m/n)."""
        return _count(self._grad_samples / self.problem.n)

    @n_grad.setter
    def n_grad(self, value: float) -> None:
        self._grad_samples = round(value * self.problem.n)

    @property
    def n_forward(self) -> float:
        """Forward passes without a gradient, in full-set equivalents."""
        return _count(self._forward_samples / self.problem.n)

    @n_forward.setter
    def n_forward(self, value: float) -> None:
        self._forward_samples = round(value * self.problem.n)

    def counters(self) -> dict[str, float]:
        """Every counter the engine keeps: products, gradients, forwards, OOM retries, fallbacks."""
        return {
            "n_hvp": self.n_hvp,
            "n_ggnvp": self.n_ggnvp,
            "n_grad": self.n_grad,
            "n_forward": self.n_forward,
            "n_vjp": self.n_vjp,
            "oom_retries": self.oom_retries,
            "fallbacks": self.fallbacks,
        }

    # ------------------------------------------------------------ precision
    @property
    def low_precision(self) -> bool:
        """Whether products run with TF32 matrix multiplies (``precision="tf32"`` on CUDA), so that
        converged quantities should be verified with `full_precision` products."""
        return self.precision == "tf32" and self.device.type == "cuda"

    @property
    def needs_verification(self) -> bool:
        """Whether measures should re-check converged quantities with fp32 products
        (``runtime.precision: auto`` running TF32 products; an explicit ``tf32`` does not verify)."""
        return self.verify and self.low_precision

    def full_precision(self):
        """TF32 off for the products inside (fp32 verification); the previous flags are restored."""
        return tf32_flags(False, False)

    # ------------------------------------------------------------ operators
    def _operator(self, product, name: str, precision: str | None) -> CurvatureOperator:
        ctx = self.full_precision if precision == "fp32" and self.low_precision else None
        return CurvatureOperator(product, self.num_params, device=self.device, dtype=self.problem.dtype,
                                 name=name, precision_context=ctx, report=self.report)

    def hessian(self, theta: torch.Tensor | None = None, *, precision: str | None = None) -> CurvatureOperator:
        """The Hessian of L at θ (default: the model's parameters) as a linear operator.

        ``precision="fp32"`` turns TF32 off during its products (the verification view of a
        TF32 engine); None uses the engine's precision."""
        th = None if theta is None else theta.detach().clone()
        return self._operator(lambda V: self.hvp(V, theta=th), "hessian", precision)

    def ggn(self, theta: torch.Tensor | None = None, *, precision: str | None = None) -> CurvatureOperator:
        """The generalized Gauss-Newton matrix at θ as a linear operator (see `ggnvp`)."""
        th = None if theta is None else theta.detach().clone()
        return self._operator(lambda V: self.ggnvp(V, theta=th), "ggn", precision)

    def fd_hessian(self, theta: torch.Tensor | None = None, *, eps: float | None = None,
                   precision: str | None = None) -> CurvatureOperator:
        """The Hessian by central differences of full gradients (see `fd_hvp`; step relative to
        ‖θ‖ as ``runtime.hvp_mode: finite_difference`` when ``eps`` is None)."""
        th = None if theta is None else theta.detach().clone()

        def product(V):
            if eps is None:
                out = self._blocks(V, th, self._hvp_fd)
                self.n_hvp += V.shape[0]
                return out
            return self.fd_hvp(V, eps=eps, theta=th)

        return self._operator(product, "fd_hessian", precision)

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
            lb = self._loss_fn(x, y)(t)
            (g,) = torch.autograd.grad(lb, t, create_graph=True)
        return t, g, float(lb.detach()), saved[0]

    def _graphs_at(self, th: torch.Tensor):
        """Yield (t, ∇L_B(t), L_B(t)) per batch, reusing graphs cached at the same θ.

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
            t, g, lb, nbytes = self._graph(th, x, y, count=decide and self.cache_graphs is None)
            if decide:
                fits = (
                    self.cache_graphs is True
                    or nbytes * self.problem.n / len(x) <= self._graph_budget()
                )
                self._cache_state = "fits" if fits else "too_big"
                keep = fits
            if keep:
                built.append((t, g, lb))
            yield t, g, lb
        if keep:
            self._graphs = built
            self._graphs_theta = th.clone()

    @property
    def num_params(self) -> int:
        """P, the number of trainable parameters."""
        return self.problem.num_params

    @property
    def theta(self) -> torch.Tensor:
        """The model's parameters as one flat vector (a copy)."""
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
        self._forward_samples += p.n
        return total / p.n

    def loss_grad(self, theta: torch.Tensor | None = None, *, keep_graph: bool = False) -> tuple[float, torch.Tensor]:
        """(L(θ), ∇L(θ)) as a float and a flat vector.

        ``keep_graph``: build the per-batch gradient graphs (``create_graph``) and keep them
        when they fit the cache budget, so that HVPs at the same θ that follow (an ascent step
        that needs ∇L and H∇L) reuse this one forward and backward instead of rebuilding it."""
        p = self.problem
        th = (p.theta if theta is None else theta).detach().to(self.device, p.dtype)
        if keep_graph and self._cache_state != "too_big" and self.cache_graphs is not False:
            total, g = 0.0, torch.zeros_like(th)
            for _, gb, lb in self._graphs_at(th):
                g += gb.detach()
                total += lb
            self._grad_samples += p.n
            return total, g
        return self._loss_grad_over(self.batches, th, p.n)

    def grad(self, theta: torch.Tensor | None = None) -> torch.Tensor:
        """∇L(θ) as a flat vector."""
        return self.loss_grad(theta)[1]

    def batch_loss_grad(self, x: torch.Tensor, y: torch.Tensor, theta: torch.Tensor | None = None, *,
                        need_grad: bool = True) -> tuple[float, torch.Tensor | None]:
        """(L_B(θ), ∇L_B(θ)) for the mean loss over the given samples B (e.g. an m-sharpness batch),
        computed in chunks of the engine's batch size; counted in samples (m/n of a gradient)."""
        p = self.problem
        th = (p.theta if theta is None else theta).detach().to(self.device, p.dtype)
        chunks = [(x[i : i + self.batch_size], y[i : i + self.batch_size]) for i in range(0, len(x), self.batch_size)]
        if need_grad:
            return self._loss_grad_over(chunks, th, len(x))
        with torch.no_grad():
            params = p.unflatten(th)
            total = sum(float(p.batch_loss_sum(params, xc, yc)) for xc, yc in chunks)
        self._forward_samples += len(x)
        return total / len(x), None

    def _loss_grad_over(self, batches, th: torch.Tensor, n: int) -> tuple[float, torch.Tensor]:
        """The one gradient loop: the mean loss over ``batches`` (n samples) and its gradient."""
        p = self.problem
        t = th.detach().clone().requires_grad_(True)
        params = p.unflatten(t)
        total = 0.0
        g = torch.zeros_like(t)
        for x, y in batches:
            s = p.batch_loss_sum(params, x, y) / n
            (gb,) = torch.autograd.grad(s, t)
            g += gb
            total += float(s.detach())
            self._grad_samples += len(x)
        return total, g.detach()

    # ------------------------------------------------------------ forward passes and per-sample products
    @torch.no_grad()
    def outputs(self, theta: torch.Tensor | None = None):
        """Yield (model outputs, labels) batch by batch (one forward pass over the set, no gradient)."""
        p = self.problem
        params = p.params if theta is None else p.unflatten(theta)
        for x, y in self.batches:
            yield p.forward(params, x), y
            self._forward_samples += len(x)

    def loss_and_error(self, theta: torch.Tensor | None = None) -> tuple[float, float]:
        """(L(θ), 0-1 error of the argmax over the set) in one forward pass; the outputs must be
        class scores (batch, classes) with integer labels."""
        total, wrong = 0.0, 0
        for out, y in self.outputs(theta):
            total += float(self.problem.per_sample_loss(out, y).sum())
            wrong += int((out.argmax(1) != y).sum())
        return total / self.problem.n, wrong / self.problem.n

    def per_sample_directional(self, v: torch.Tensor, theta: torch.Tensor | None = None,
                               labels: torch.Tensor | None = None) -> torch.Tensor:
        r"""The directional derivatives :math:`\langle v, \nabla_\theta \ell_i(\theta)\rangle` of every
        sample's loss, shape (n,), in the set's order: one forward-mode product per batch (the
        JVP of the vector of per-sample losses), or, when an operation has no forward-mode rule,
        the double-backward trick (the gradient in u of ⟨v, J^T u⟩), also one pass per batch.
        ``labels`` (n,) replace the set's labels (e.g. labels drawn from the model)."""
        p = self.problem
        th = (p.theta if theta is None else theta).detach().to(self.device, p.dtype)
        v = v.detach().to(th)
        out, i = [], 0
        for x, y in self.batches:
            yb = y if labels is None else labels[i : i + len(x)].to(y.device)
            i += len(x)

            def losses(t, x=x, yb=yb):
                return p.per_sample_loss(p.forward(p.unflatten(t), x), yb)

            out.append(self._jvp_rows(losses, th, v))
            self._grad_samples += len(x)
        return torch.cat(out)

    def _jvp_rows(self, fn, th: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        try:
            return jvp(fn, (th,), (v,))[1].detach()
        except (RuntimeError, NotImplementedError) as e:
            if _is_oom(e):
                raise
            self.fallbacks += 1
            t = th.clone().requires_grad_(True)
            ell = fn(t)
            u = torch.zeros_like(ell, requires_grad=True)
            (jt_u,) = torch.autograd.grad(ell, t, u, create_graph=True)
            (jv,) = torch.autograd.grad(jt_u, u, v)
            return jv.detach()

    @torch.no_grad()
    def module_io(self, module: torch.nn.Module, theta: torch.Tensor | None = None):
        """Yield (x, y, module input, module output, model output) per batch: one forward pass
        with a hook on ``module``, which must run exactly once per forward pass."""
        p = self.problem
        params = p.params if theta is None else p.unflatten(theta)
        for x, y in self.batches:
            with LayerCapture(module) as cap:
                out = p.forward(params, x)
            self._forward_samples += len(x)
            yield x, y, *cap.single(), out

    def module_output_hvp(self, module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, z0: torch.Tensor,
                          V: torch.Tensor) -> torch.Tensor:
        r"""Per-sample Hessian-vector products of the loss in a module's output.

        ``z0`` (B, d) is the module's output on the batch ``x``; returns (k, B, d) whose row n of
        block r is :math:`\nabla_z^2 \ell(x_n) V_r`, the Hessian of sample n's loss with respect to
        its own module output through the rest of the network (in eval mode a sample's loss
        depends on its own output only). The output is replaced by a leaf tensor (a forward hook),
        and one batched double backward of the summed losses with V_r repeated over the batch
        gives every sample's product at once (a loop over r when an op has no batched rule)."""
        p = self.problem
        zz = z0.detach().clone().requires_grad_(True)
        with LayerCapture(module, replace=zz):
            out = p.forward(p.params, x)
        s = p.per_sample_loss(out, y).sum()
        (g,) = torch.autograd.grad(s, zz, create_graph=True)
        k, (B, d) = V.shape[0], zz.shape
        self._grad_samples += len(x)
        if not g.requires_grad:  # the loss is linear in z
            return torch.zeros(k, B, d, dtype=zz.dtype, device=zz.device)
        Vb = V[:, None, :].expand(k, B, d).to(zz)
        return self._pullback(g, zz, Vb, retain=False)

    def _pullback(self, g: torch.Tensor, t: torch.Tensor, V: torch.Tensor, retain: bool,
                  out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
        """The one batched-VJP helper: rows ``V[k]`` pulled back through ``g``'s graph to ``t``,
        as one vmapped backward (``is_grads_batched``), or a loop when an op has no batched rule.

        ``out`` (K rows): write the rows there (``accumulate``: add them), so that a loop over
        K vectors makes no stacked copy; on CPU a fresh (K, P) block costs page faults that take
        as long as the products' arithmetic for an 11M-parameter ResNet-18."""
        K = V.shape[0]
        if K > 1 and self.reverse_batched:
            try:
                (hv,) = torch.autograd.grad(g, t, V, is_grads_batched=True, retain_graph=True)
                return hv if out is None else (out.add_(hv) if accumulate else out.copy_(hv))
            except RuntimeError as e:
                if _is_oom(e):
                    raise
                self.fallbacks += 1
                self.reverse_batched = False
        if out is None:
            return torch.stack([torch.autograd.grad(g, t, V[k], retain_graph=retain or k < K - 1)[0]
                                for k in range(K)])
        for k in range(K):
            (h,) = torch.autograd.grad(g, t, V[k], retain_graph=retain or k < K - 1)
            if accumulate:
                out[k].add_(h)
            else:
                out[k].copy_(h)
        return out

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
        out = None  # (K, P), allocated once when the rows take several blocks; each block fills its rows
        i = 0
        while i < V2.shape[0]:
            k = min(self.block_size, V2.shape[0] - i)
            if out is None and k < V2.shape[0]:
                out = torch.empty_like(V2)
            try:
                if out is None:
                    out = fn(V2, th, None)
                else:
                    blk = fn(V2[i : i + k], th, out[i : i + k])
                    if blk.data_ptr() != out[i : i + k].data_ptr():
                        out[i : i + k].copy_(blk)
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
        return out[0] if single else out

    def hvp(self, V: torch.Tensor, theta: torch.Tensor | None = None) -> torch.Tensor:
        """H V for V of shape (P,) or (K, P); H the Hessian of L at θ (default: the model's)."""
        out = self._blocks(V, theta, self._hvp_block)
        self.n_hvp += 1 if V.ndim == 1 else V.shape[0]
        self.report()
        return out

    def report(self, **info) -> None:
        """Tell `on_progress` (when set) the counters so far and ``info`` (e.g. an estimate and
        its standard error from the algorithm driving the products)."""
        if self.on_progress is not None:
            self.on_progress({**self.counters(), **info})

    def _hvp_block(self, V: torch.Tensor, th: torch.Tensor, dest: torch.Tensor | None = None) -> torch.Tensor:
        if self.hvp_mode == "finite_difference":
            return self._hvp_fd(V, th)
        if (
            self.hvp_mode == "forward"
            and self._auto
            and V.shape[0] == 1
            and self._cache_state in ("unknown", "fits")
        ):
            # one vector at a time (Lanczos): a backward through a cached graph beats forward-over-reverse
            return self._hvp_reverse(V, th, dest)
        if self.hvp_mode == "forward":
            try:
                return self._hvp_forward(V, th)
            except (RuntimeError, NotImplementedError) as e:
                if _is_oom(e):
                    raise
                self.fallbacks += 1
                self.hvp_mode = "reverse"
        return self._hvp_reverse(V, th, dest)

    def _hvp_reverse(self, V: torch.Tensor, th: torch.Tensor, dest: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty_like(V) if dest is None else dest  # the first batch writes, later ones add
        first = True
        for t, g, _ in self._graphs_at(th):
            keep = self._graphs is not None or self._cache_state == "fits"
            self._pullback(g, t, V, retain=keep, out=out, accumulate=not first)
            first = False
        return out.zero_() if first else out

    def _hvp_fd(self, V: torch.Tensor, th: torch.Tensor, dest: torch.Tensor | None = None) -> torch.Tensor:
        """Central differences along each unit direction with the relative step (module docstring)."""
        h = self.fd_eps * max(1.0, float(th.norm()))
        norms = V.norm(dim=1)
        return self._central_differences(V, th, torch.where(norms > 0, h / norms, torch.zeros_like(norms)))

    def _central_differences(self, V: torch.Tensor, th: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """The one central-difference helper: row k is (∇L(θ + ε_k v_k) − ∇L(θ − ε_k v_k)) / 2ε_k,
        two full gradients per row; rows with ε_k = 0 (zero vectors) cost nothing and give 0."""
        out = torch.zeros_like(V)
        for k in range(V.shape[0]):
            e = float(steps[k])
            if e == 0.0:
                continue
            gp = self.grad(th + e * V[k])
            gm = self.grad(th - e * V[k])
            out[k] = (gp - gm) / (2 * e)
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
        self.report()
        return out

    def _ggn_block(self, V: torch.Tensor, th: torch.Tensor, dest: torch.Tensor | None = None) -> torch.Tensor:
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
        out = self._central_differences(V2.to(th), th, torch.full((V2.shape[0],), float(eps)))
        self.n_hvp += V2.shape[0]
        return out[0] if single else out

    # ------------------------------------------------------------ checks
    def check_finite(self, where: str = "the checkpoint") -> float:
        """L(θ); a non-finite value raises `flatcli.engine.problem.not_finite`, naming the
        parameters and buffers that hold NaN/inf."""
        val = self.loss()
        if not math.isfinite(val):
            p = self.problem
            raise not_finite(where, val, nonfinite_tensors({**p.params, **p.frozen, **p.buffers}))
        return val
