r"""Losses, gradients and curvature-vector products over a `Problem`.

All products are exact sums over the whole measurement set, weighted by
``batch size / n`` (each batch's loss is ``sum / n``), so they equal the
products of :math:`\nabla^2 L(\theta)` for the full-set mean loss.

Hessian-vector products for a block ``V`` of K vectors (shape ``(K, P)``):

* ``"reverse"``: per batch, build the gradient graph once (double backward) and
  pull back all K vectors through it with one vmapped backward
  (``is_grads_batched``), falling back to a loop that reuses the graph.
* ``"forward"``: forward-over-reverse, ``vmap(jvp(grad(L_B)))`` over the K
  vectors, usually fastest on GPUs. Falls back to ``"reverse"`` when an op has
  no forward-mode rule.
* ``"auto"`` (default): ``"forward"`` on CUDA, ``"reverse"`` on CPU.

K is capped by ``block_size`` (default: chosen from free device memory on CUDA,
16 on CPU); on CUDA out-of-memory the block is halved and the retry counted in
``oom_retries``.
"""

from __future__ import annotations

import math

import torch
from torch.func import grad as func_grad
from torch.func import jvp, vmap

from ..errors import MeasurementError
from .problem import Problem

HVP_MODES = ("auto", "reverse", "forward")


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


class CurvatureEngine:
    """Losses, gradients, HVPs, GGN-vector products and finite differences.

    Counters ``n_hvp`` (Hessian-vector products, one per vector), ``n_grad``
    (full-set gradients) and ``n_forward`` (full-set forward passes) are kept so
    measures can report their cost.
    """

    def __init__(self, problem: Problem, hvp_mode: str = "auto", block_size: int | None = None):
        if hvp_mode not in HVP_MODES:
            raise ValueError(f"hvp_mode must be one of {HVP_MODES}, got {hvp_mode!r}")
        self.problem = problem
        self.device = problem.device
        if hvp_mode == "auto":
            hvp_mode = "forward" if self.device.type == "cuda" else "reverse"
        self.hvp_mode = hvp_mode
        self.block_size = int(block_size) if block_size else self._default_block()
        self.n_hvp = 0
        self.n_grad = 0
        self.n_forward = 0
        self.oom_retries = 0
        self.fallbacks = 0

    # ------------------------------------------------------------ bookkeeping
    def counters(self) -> dict[str, int]:
        return {
            "n_hvp": self.n_hvp,
            "n_grad": self.n_grad,
            "n_forward": self.n_forward,
            "oom_retries": self.oom_retries,
        }

    def _default_block(self) -> int:
        if self.device.type != "cuda":
            return 16
        try:
            free, _ = torch.cuda.mem_get_info(self.device)
        except Exception:
            return 16
        # One probe costs roughly a few copies of parameters plus activations of one batch.
        p = self.problem
        elt = torch.finfo(p.dtype).bits // 8
        x0 = p.batches[0][0]
        act = elt * x0.numel() * 64  # generous activation estimate per probe
        per_probe = 6 * p.num_params * elt + act
        return int(max(1, min(64, (0.4 * free) // max(per_probe, 1))))

    @property
    def num_params(self) -> int:
        return self.problem.num_params

    @property
    def theta(self) -> torch.Tensor:
        return self.problem.theta

    # ------------------------------------------------------------ zeroth / first order
    @torch.no_grad()
    def loss(self, theta: torch.Tensor | None = None) -> float:
        """L(θ) over the measurement set (θ defaults to the model's parameters)."""
        p = self.problem
        params = p.params if theta is None else p.unflatten(theta)
        total = 0.0
        for x, y in p.batches:
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
        for x, y in p.batches:
            s = p.batch_loss_sum(params, x, y) / p.n
            (gb,) = torch.autograd.grad(s, th)
            g += gb
            total += float(s.detach())
        self.n_grad += 1
        return total, g.detach()

    def grad(self, theta: torch.Tensor | None = None) -> torch.Tensor:
        return self.loss_grad(theta)[1]

    # ------------------------------------------------------------ second order
    def hvp(self, V: torch.Tensor, theta: torch.Tensor | None = None) -> torch.Tensor:
        """H V for V of shape (P,) or (K, P); H the Hessian of L at θ."""
        single = V.ndim == 1
        V2 = V.reshape(1, -1) if single else V
        if V2.shape[1] != self.num_params:
            raise ValueError(f"vectors have {V2.shape[1]} entries, the model {self.num_params} parameters")
        V2 = V2.to(self.device, self.problem.dtype)
        th = (self.problem.theta if theta is None else theta).detach()
        outs = []
        i = 0
        while i < V2.shape[0]:
            k = min(self.block_size, V2.shape[0] - i)
            try:
                outs.append(self._hvp_block(V2[i : i + k], th))
                i += k
            except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
                if not _is_oom(e) or self.block_size == 1:
                    raise
                self.oom_retries += 1
                self.block_size = max(1, self.block_size // 2)
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
        self.n_hvp += V2.shape[0]
        out = torch.cat(outs, 0)
        return out[0] if single else out

    def _hvp_block(self, V: torch.Tensor, th: torch.Tensor) -> torch.Tensor:
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
        p = self.problem
        out = torch.zeros_like(V)
        for x, y in p.batches:
            t = th.clone().requires_grad_(True)
            s = p.batch_loss_sum(p.unflatten(t), x, y) / p.n
            (g,) = torch.autograd.grad(s, t, create_graph=True)
            if V.shape[0] == 1:
                (hv,) = torch.autograd.grad(g, t, V[0], retain_graph=False)
                out[0] += hv
                continue
            try:
                (hv,) = torch.autograd.grad(g, t, V, is_grads_batched=True, retain_graph=True)
                out += hv
            except RuntimeError as e:
                if _is_oom(e):
                    raise
                self.fallbacks += 1
                for k in range(V.shape[0]):
                    (hv,) = torch.autograd.grad(g, t, V[k], retain_graph=k < V.shape[0] - 1)
                    out[k] += hv
        return out

    def _hvp_forward(self, V: torch.Tensor, th: torch.Tensor) -> torch.Tensor:
        p = self.problem
        out = torch.zeros_like(V)
        for x, y in p.batches:

            def f(t, x=x, y=y):
                return p.batch_loss_sum(p.unflatten(t), x, y) / p.n

            gfun = func_grad(f)

            def hv(v, gfun=gfun):
                return jvp(gfun, (th,), (v,))[1]

            out += vmap(hv)(V) if V.shape[0] > 1 else hv(V[0])[None]
        return out

    def ggnvp(self, V: torch.Tensor, theta: torch.Tensor | None = None) -> torch.Tensor:
        """Generalized Gauss-Newton products G V = Jᵀ H_z J V (V of shape (P,) or (K, P))."""
        p = self.problem
        single = V.ndim == 1
        V2 = (V.reshape(1, -1) if single else V).to(self.device, p.dtype)
        th = (p.theta if theta is None else theta).detach()
        out = torch.zeros_like(V2)
        for x, y in p.batches:

            def fwd(t, x=x):
                return p.forward(p.unflatten(t), x)

            for k in range(V2.shape[0]):
                z, jv = jvp(fwd, (th,), (V2[k],))
                zz = z.detach().requires_grad_(True)
                s = p.per_sample_loss(zz, y).sum() / p.n
                (gz,) = torch.autograd.grad(s, zz, create_graph=True)
                (hz_jv,) = torch.autograd.grad(gz, zz, jv)
                _, vjp_fn = torch.func.vjp(fwd, th)
                out[k] += vjp_fn(hz_jv)[0]
        self.n_hvp += V2.shape[0]
        return out[0] if single else out

    def fd_hvp(self, V: torch.Tensor, eps: float = 1e-3, theta: torch.Tensor | None = None) -> torch.Tensor:
        """Central finite differences (∇L(θ + εv) − ∇L(θ − εv)) / 2ε, for non-smooth models."""
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
