"""Auto-PGD ascent inside an L2 or L∞ ball and its helpers (the adaptive scale vector, random
starts, projection), shared by the sharpness family (`flatcli.measures.sharpness`, where the
method and its references are described)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


def scale_vector(problem, adaptive: bool, eta: float) -> torch.Tensor:
    """The coordinate scale c: |θ| + η on parameters named ``*weight*``, 1 elsewhere (ASAM)."""
    theta = problem.theta
    c = torch.ones_like(theta)
    if not adaptive:
        return c
    for name, sl in problem.param_slices().items():
        if "weight" in name.rsplit(".", 1)[-1]:
            c[sl] = theta[sl].abs() + eta
    return c


def _project(z: torch.Tensor, rho: float, norm: str) -> torch.Tensor:
    if norm == "linf":
        return z.clamp(-rho, rho)
    nz = float(z.norm())
    return z * (rho / nz) if nz > rho else z


def _direction(g: torch.Tensor, norm: str) -> torch.Tensor:
    if norm == "linf":
        return g.sign()
    ng = float(g.norm())
    return g / ng if ng > 0 else torch.zeros_like(g)


def random_start(
    dim: int, rho: float, norm: str, gen: torch.Generator, device, dtype
) -> torch.Tensor:
    """A uniform random point of the ℓ2 ball (direction × ρ·U^{1/dim}) or the ℓ∞ box of radius ρ."""
    if norm == "linf":
        u = torch.rand(dim, generator=gen, dtype=torch.float64) * 2 - 1
        return (rho * u).to(device, dtype)
    g = torch.randn(dim, generator=gen, dtype=torch.float64)
    r = float(torch.rand(1, generator=gen, dtype=torch.float64)) ** (1.0 / dim)
    return (rho * r * g / g.norm()).to(device, dtype)


def apgd_checkpoints(steps: int) -> list[int]:
    """Croce & Hein 2020 checkpoints w_j = ⌈p_j N⌉ (j ≥ 1) inside 1..N−1."""
    ps = [0.0, 0.22]
    while ps[-1] <= 1.0:
        ps.append(ps[-1] + max(ps[-1] - ps[-2] - 0.03, 0.06))
    ws = sorted({math.ceil(p * steps - 1e-9) for p in ps[1:] if p <= 1.0})
    return [w for w in ws if 1 <= w <= steps - 1]


@dataclass
class AscentResult:
    """The outcome of one Auto-PGD ascent (`apgd`)."""

    value: float  # best objective found (the random start included)
    z: torch.Tensor  # where
    evals: int  # objective + gradient evaluations
    reductions: int  # step halvings
    final_step: float
    finite: bool
    stopped: bool = False  # ``stop()`` ended the ascent early: ``value`` is the best so far


FG = Callable[[torch.Tensor], tuple[float, torch.Tensor | None]]


def apgd(
    fg: FG,
    z0: torch.Tensor,
    rho: float,
    norm: str,
    steps: int,
    stop: Callable[[], bool] | None = None,
) -> AscentResult:
    r"""Maximize f over :math:`\|z\|_p \le \rho` by Auto-PGD (Croce & Hein 2020, Alg. 1).

    ``fg(z)`` returns ``(f(z), ∇f(z))``. Initial step η = 2ρ, momentum α = 0.75,
    ``steps`` iterations after the start point (``steps + 1`` evaluations).
    Stops at once when f is not finite; and after an iteration where ``stop()`` (a budget) is
    true, with the best point so far (``stopped``; every evaluated point lies in the ball, so
    the value is still a lower bound of the maximum).
    """
    alpha = 0.75
    eta = 2.0 * rho
    checkpoints = set(apgd_checkpoints(steps))

    x0 = _project(z0, rho, norm)
    f0, g0 = fg(x0)
    evals = 1
    if not math.isfinite(f0):
        return AscentResult(f0, x0, evals, 0, eta, False)
    fmax, xmax, gmax = f0, x0, g0
    fhist = [f0]
    if steps == 0:
        return AscentResult(fmax, xmax, evals, 0, eta, True)
    x1 = _project(x0 + eta * _direction(g0, norm), rho, norm)
    f1, g1 = fg(x1)
    evals += 1
    if not math.isfinite(f1):
        return AscentResult(f1, x1, evals, 0, eta, False)
    fhist.append(f1)
    if f1 > fmax:
        fmax, xmax, gmax = f1, x1, g1
    x_prev, x, g = x0, x1, g1
    reductions = 0
    reduced_last = False
    fmax_last = f0  # f_max at w_0 = 0
    w_last = 0
    for k in range(1, steps):
        if stop is not None and stop():
            return AscentResult(fmax, xmax, evals, reductions, eta, True, stopped=True)
        z = _project(x + eta * _direction(g, norm), rho, norm)
        xn = _project(x + alpha * (z - x) + (1 - alpha) * (x - x_prev), rho, norm)
        fn, gn = fg(xn)
        evals += 1
        if not math.isfinite(fn):
            return AscentResult(fn, xn, evals, reductions, eta, False)
        fhist.append(fn)  # f(x^(k+1))
        if fn > fmax:
            fmax, xmax, gmax = fn, xn, gn
        x_prev, x, g = x, xn, gn
        if k in checkpoints:
            ups = sum(1 for i in range(w_last, k) if fhist[i + 1] > fhist[i])
            cond1 = ups < 0.75 * (k - w_last)
            cond2 = (not reduced_last) and fmax <= fmax_last
            reduced_last = cond1 or cond2
            fmax_last = fmax
            w_last = k
            if reduced_last:
                eta /= 2.0
                reductions += 1
                x, g = xmax, gmax
                fhist[-1] = fmax
    return AscentResult(fmax, xmax, evals, reductions, eta, True)


def _nonfinite_value(vals: list[float]) -> float:
    return math.inf if any(v == math.inf for v in vals) else math.nan
