"""Curvature engine: knows nothing about measures.

`Problem` holds the model as functional parameters over a fixed measurement set;
`CurvatureEngine` supplies losses, gradients and batched curvature products;
`flatcli.engine.linalg` holds the matrix-free algorithms built on them.
"""

from .problem import Problem, eval_mode
from .products import CurvatureEngine

__all__ = ["Problem", "CurvatureEngine", "eval_mode"]
