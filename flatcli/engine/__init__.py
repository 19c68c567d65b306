"""Curvature engine: knows nothing about measures.

A `Problem` is (model, batches of named tensors, loss, parameter selection, ranks);
`CurvatureEngine` supplies losses, gradients, curvature operators (one class per
curvature, `flatcli.engine.curvatures`) and per-unit quantities over it;
`flatcli.engine.linalg` holds the matrix-free algorithms built on them.
"""

from .batch import Batch
from .capture import LayerCapture
from .facade import CurvatureEngine
from .losses import LOSSES, Loss, NotApplicable, get_loss
from .params import ParamSelection
from .problem import Problem, eval_mode

__all__ = [
    "Batch",
    "Problem",
    "CurvatureEngine",
    "LayerCapture",
    "Loss",
    "LOSSES",
    "NotApplicable",
    "ParamSelection",
    "eval_mode",
    "get_loss",
]
