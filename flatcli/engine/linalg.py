r"""Matrix-free linear algebra for symmetric operators given as block mat-vecs.

Every routine takes ``matvec(V) -> H V`` for a block ``V`` of shape ``(K, P)``
and returns its result together with diagnostics (steps, residuals, standard
errors, converged flags). The tridiagonal problems are solved in float64.

References
----------
Lanczos with full reorthogonalization: Golub & Van Loan, *Matrix Computations*,
4th ed., §10.1. Hutchinson (1989); Hutch++: Meyer, Musco, Musco & Woodruff (2021).
Stochastic Lanczos quadrature: Ubaru, Chen & Saad (2017); Ghorbani, Krishnan &
Xiao (2019).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import scipy.linalg
import torch

MatVec = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class LanczosResult:
    eigenvalues: np.ndarray  # Ritz values, descending
    residuals: np.ndarray  # Ritz residual norms, matching eigenvalues
    steps: int
    converged: bool
    alphas: np.ndarray = field(repr=False, default=None)
    betas: np.ndarray = field(repr=False, default=None)
    ritz_vectors: torch.Tensor | None = field(repr=False, default=None)  # (k, P), descending
    first_components: np.ndarray | None = field(repr=False, default=None)  # for SLQ weights


def _tridiag_eig(alphas, betas):
    a = np.asarray(alphas, dtype=np.float64)
    b = np.asarray(betas, dtype=np.float64)
    if len(a) == 1:
        return a.copy(), np.ones((1, 1))
    return scipy.linalg.eigh_tridiagonal(a, b)


def lanczos(
    matvec: MatVec,
    dim: int,
    *,
    max_steps: int = 100,
    min_steps: int = 20,
    tol: float = 1e-3,
    k: int = 1,
    which: str = "largest",
    v0: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    device=None,
    dtype=torch.float32,
    return_vectors: bool = False,
) -> LanczosResult:
    r"""Lanczos with full reorthogonalization for the ``k`` extreme eigenvalues.

    Stops once at least ``min(min_steps, dim)`` steps were taken and the Ritz
    residuals :math:`\|Hv - \lambda v\| = |\beta_m s_{m,i}|` of the ``k`` wanted
    Ritz pairs are at most ``tol * |\lambda_i|``, or when the Krylov space is
    exhausted (an invariant subspace: the Ritz values are then exact).
    ``which``: "largest" (algebraic) or "smallest".
    """
    max_steps = min(max_steps, dim)
    min_steps = min(min_steps, max_steps)
    if v0 is None:
        v0 = torch.randn(dim, generator=generator, dtype=torch.float64)
    q = v0.to(device=device, dtype=dtype)
    q = q / q.norm()
    Q = torch.zeros(max_steps + 1, dim, device=device, dtype=dtype)
    Q[0] = q
    alphas, betas = [], []
    converged = False
    evals = evecs = None
    res = None
    m = 0
    for j in range(max_steps):
        w = matvec(Q[j][None])[0].to(dtype)
        a = float(torch.dot(w, Q[j]))
        alphas.append(a)
        # full reorthogonalization, twice (classical Gram-Schmidt, "twice is enough")
        for _ in range(2):
            w = w - Q[: j + 1].T @ (Q[: j + 1] @ w)
        b = float(w.norm())
        m = j + 1
        evals, evecs = _tridiag_eig(alphas, betas)
        order = np.argsort(evals)[::-1] if which == "largest" else np.argsort(evals)
        evals, evecs = evals[order], evecs[:, order]
        res = np.abs(b * evecs[-1, :])
        kk = min(k, m)
        scale = np.maximum(np.abs(evals[:kk]), 1e-30)
        exhausted = b <= 1e-10 * max(1.0, float(np.max(np.abs(evals))))
        if exhausted:
            converged = True
            res = np.zeros_like(res) if b == 0 else res
            break
        if m >= min_steps and np.all(res[:kk] <= tol * scale):
            converged = True
            break
        if j + 1 < max_steps:
            betas.append(b)
            Q[j + 1] = w / b
    ritz = None
    if return_vectors:
        S = torch.as_tensor(evecs[:, : min(k, m)], dtype=dtype, device=Q.device)
        ritz = (Q[:m].T @ S).T
    return LanczosResult(
        eigenvalues=evals,
        residuals=res,
        steps=m,
        converged=converged,
        alphas=np.asarray(alphas),
        betas=np.asarray(betas[: m - 1]),
        ritz_vectors=ritz,
        first_components=evecs[0, :] if evecs is not None else None,
    )


@dataclass
class TraceResult:
    estimate: float
    stderr: float
    probes: int
    converged: bool
    samples: np.ndarray = field(repr=False, default=None)


def rademacher(k: int, dim: int, generator: torch.Generator, device=None, dtype=torch.float32):
    r = torch.randint(0, 2, (k, dim), generator=generator, dtype=torch.int8)
    return (2 * r - 1).to(device=device, dtype=dtype)


def hutchinson(
    matvec: MatVec,
    dim: int,
    *,
    tol: float = 0.01,
    min_probes: int = 16,
    max_probes: int = 1000,
    block: int = 16,
    generator: torch.Generator,
    device=None,
    dtype=torch.float32,
) -> TraceResult:
    r"""Hutchinson's trace estimator :math:`\mathrm{Tr}(H) \approx \frac1m \sum_i z_i^\top H z_i`
    with Rademacher probes drawn in blocks, stopped when the standard error of the
    mean is at most ``tol * |estimate|`` (and at least ``min_probes`` were used)."""
    samples: list[float] = []
    while len(samples) < max_probes:
        need = max(min_probes - len(samples), 1)
        k = min(max(block, 1), max_probes - len(samples)) if need <= block else min(need, max_probes - len(samples))
        Z = rademacher(k, dim, generator, device, dtype)
        HZ = matvec(Z)
        samples.extend((Z.double() * HZ.double()).sum(1).cpu().tolist())
        if len(samples) >= min_probes:
            est = float(np.mean(samples))
            se = float(np.std(samples, ddof=1) / math.sqrt(len(samples))) if len(samples) > 1 else math.inf
            if se <= tol * abs(est):
                return TraceResult(est, se, len(samples), True, np.asarray(samples))
    est = float(np.mean(samples))
    se = float(np.std(samples, ddof=1) / math.sqrt(len(samples))) if len(samples) > 1 else math.inf
    return TraceResult(est, se, len(samples), se <= tol * abs(est), np.asarray(samples))


def exact_diagonal(matvec: MatVec, dim: int, *, block: int = 16, device=None, dtype=torch.float32):
    """The diagonal of H from unit-vector products (dim products; small models only)."""
    diag = torch.empty(dim, dtype=torch.float64)
    for i in range(0, dim, block):
        k = min(block, dim - i)
        E = torch.zeros(k, dim, device=device, dtype=dtype)
        E[torch.arange(k), torch.arange(i, i + k)] = 1.0
        HE = matvec(E)
        diag[i : i + k] = HE[torch.arange(k), torch.arange(i, i + k)].double().cpu()
    return diag


def hutchinson_diagonal(
    matvec: MatVec, dim: int, *, samples: int, block: int = 16, generator, device=None, dtype=torch.float32
):
    r"""Plain diagonal estimator :math:`\mathrm{diag}(H) \approx \frac1m\sum_i z_i \circ H z_i`.
    Returns (mean, stderr) as float64 CPU tensors."""
    acc = torch.zeros(dim, dtype=torch.float64)
    acc2 = torch.zeros(dim, dtype=torch.float64)
    done = 0
    while done < samples:
        k = min(block, samples - done)
        Z = rademacher(k, dim, generator, device, dtype)
        D = (Z * matvec(Z)).double().cpu()
        acc += D.sum(0)
        acc2 += (D * D).sum(0)
        done += k
    mean = acc / samples
    var = (acc2 / samples - mean**2).clamp_min(0) * samples / max(samples - 1, 1)
    return mean, (var / samples).sqrt()


def scaled_diagonal(
    matvec: MatVec,
    theta: torch.Tensor,
    *,
    samples: int,
    eps: float = 1e-8,
    block: int = 16,
    generator,
):
    r"""The |θ|-scaled diagonal estimator (Tsuzuku et al. 2020, eq. 29 as r → 0):

    .. math:: D \approx \frac1m \sum_i s_i \circ H(|\theta| \circ s_i) \,/\, |\theta|,

    with Rademacher ``s_i`` and exact HVPs; ``|θ|`` is replaced by ``|θ| + eps``
    only where θ = 0. Unbiased for diag(H), and it transforms like the true
    diagonal under node rescaling sample by sample. Returns (mean, stderr)."""
    a = theta.detach().abs()
    a = torch.where(a == 0, torch.full_like(a, eps), a)
    dim = theta.numel()
    acc = torch.zeros(dim, dtype=torch.float64)
    acc2 = torch.zeros(dim, dtype=torch.float64)
    done = 0
    while done < samples:
        k = min(block, samples - done)
        S = rademacher(k, dim, generator, theta.device, theta.dtype)
        D = ((S * matvec(S * a)) / a).double().cpu()
        acc += D.sum(0)
        acc2 += (D * D).sum(0)
        done += k
    mean = acc / samples
    var = (acc2 / samples - mean**2).clamp_min(0) * samples / max(samples - 1, 1)
    return mean, (var / samples).sqrt()


@dataclass
class SLQResult:
    nodes: list[np.ndarray]  # Ritz values per run
    weights: list[np.ndarray]  # squared first components per run (sum to 1)
    dim: int

    def expect(self, fn: Callable[[np.ndarray], np.ndarray]) -> tuple[float, float]:
        r"""Estimate :math:`\mathrm{Tr}\, f(H)` and its standard error over runs."""
        vals = np.array([self.dim * float(np.sum(w * fn(t))) for t, w in zip(self.nodes, self.weights, strict=True)])
        se = float(vals.std(ddof=1) / math.sqrt(len(vals))) if len(vals) > 1 else float("nan")
        return float(vals.mean()), se

    def density(self, grid: np.ndarray, sigma: float) -> np.ndarray:
        """Gaussian-smoothed spectral density on ``grid`` (integrates to 1)."""
        out = np.zeros_like(grid, dtype=np.float64)
        for t, w in zip(self.nodes, self.weights, strict=True):
            out += (w[None, :] * np.exp(-((grid[:, None] - t[None, :]) ** 2) / (2 * sigma**2))).sum(1)
        return out / (len(self.nodes) * sigma * math.sqrt(2 * math.pi))


def slq(
    matvec: MatVec,
    dim: int,
    *,
    runs: int = 10,
    steps: int = 80,
    generator: torch.Generator,
    device=None,
    dtype=torch.float32,
) -> SLQResult:
    r"""Stochastic Lanczos quadrature: for ``runs`` Rademacher starts, ``steps``
    Lanczos steps give nodes (Ritz values) and weights (squared first components
    of the Ritz vectors); :math:`\mathrm{Tr} f(H) \approx \frac{P}{R}\sum_r \sum_i w_{ri} f(t_{ri})`."""
    nodes, weights = [], []
    for _ in range(runs):
        v0 = rademacher(1, dim, generator, dtype=torch.float64)[0]
        r = lanczos(
            matvec, dim, max_steps=steps, min_steps=steps, tol=0.0, k=1, v0=v0, device=device, dtype=dtype
        )
        nodes.append(r.eigenvalues)
        weights.append(r.first_components**2)
    return SLQResult(nodes, weights, dim)
