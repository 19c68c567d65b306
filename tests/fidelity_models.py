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
