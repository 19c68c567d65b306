"""The two models of the fidelity checks and their dense float64 Hessians.

A: a 12-48-24-5 tanh MLP, cross-entropy on 128 random rows (an indefinite Hessian, 1,873 parameters);
B: a 10-40-40-3 ReLU MLP, MSE on 64 rows with targets 5·randn (strongly indefinite, 2,203
parameters, much of the spectrum at the kink of ½log(1 + λ₊)). Dense references are built row by
row with double backward (`dense_hessian`) and cached per process."""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import nn

from flatcli.engine import Problem
from tests.oracles import problem_hessian

DT = torch.float64


def model_a() -> Problem:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(12, 48), nn.Tanh(), nn.Linear(48, 24), nn.Tanh(), nn.Linear(24, 5))
    m = m.to(DT)
    x = torch.randn(128, 12, dtype=DT)
    y = torch.randint(0, 5, (128,))
    return Problem(m, x, y, loss="cross_entropy", batch_size=128)


def model_b() -> Problem:
    torch.manual_seed(3)
    m = nn.Sequential(nn.Linear(10, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 3))
    m = m.to(DT)
    x = torch.randn(64, 10, dtype=DT)
    y = 5 * torch.randn(64, 3, dtype=DT)
    return Problem(m, x, y, loss="mse", batch_size=64)


@functools.cache
def reference(name: str) -> tuple[Problem, np.ndarray]:
    """The problem and its dense Hessian's eigenvalues (float64)."""
    p = {"A": model_a, "B": model_b}[name]()
    return p, torch.linalg.eigvalsh(dense_hessian(p)).numpy()


def dense_hessian(p: Problem) -> torch.Tensor:
    """H of L at θ (symmetrized; rows 256 at a time)."""
    return problem_hessian(p, chunk=256, symmetrize=True)


class _Quadratic(nn.Module):
    """f(θ) = ½ θᵀAθ at θ = 0, the same for every row: under MSE against the target −1 the loss is
    a positive multiple of (1 + f)², whose Hessian at θ = 0 is that multiple of A (∇f = 0 there)."""

    def __init__(self, A: torch.Tensor):
        super().__init__()
        self.register_buffer("A", A)
        self.theta = nn.Parameter(torch.zeros(A.shape[0], dtype=A.dtype))

    def forward(self, x):
        f = 0.5 * self.theta @ (self.A @ self.theta)
        return f.expand(x.shape[0], 1) + 0 * x[:, :1]


def rotated(eigs, seed: int = 0) -> torch.Tensor:
    """Q diag(eigs) Qᵀ for a seeded random orthogonal Q (float64)."""
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(len(eigs), len(eigs), generator=g, dtype=DT))
    return (Q * torch.as_tensor(eigs, dtype=DT)) @ Q.T


def quadratic(eigs, seed: int = 0, rows: int = 4) -> Problem:
    """A `Problem` whose loss Hessian is a positive multiple of ``rotated(eigs, seed)``: any
    chosen spectrum, so any ratio Tr H / Tr|H| (the multiple cancels in ratios and relative errors)."""
    m = _Quadratic(rotated(eigs, seed))
    x = torch.zeros(rows, 1, dtype=DT)
    y = -torch.ones(rows, 1, dtype=DT)
    return Problem(m, x, y, loss="mse", batch_size=rows, dtype=DT)
