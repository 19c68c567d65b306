"""The standard error of a mean, written once for every estimator.

Every Monte-Carlo quantity flatcli reports (Hutchinson and Hutch++ traces, diagonal estimates,
average sharpness, PAC-Bayes and ns_bound draws, Fisher-Rao and feature-robustness samples, the
precision controls) is the mean of n independent samples with the standard error
``s / √n``, ``s`` the sample standard deviation (``ddof = 1``).

One sample says nothing of the spread, so its standard error is ``inf`` (never 0 and never
NaN): an estimator that stops when its standard error is small never stops on one sample, and
a table shows ``± inf`` rather than a spurious exact value. With no sample the mean is NaN.

Works on a list of floats, a NumPy array or a torch tensor, along ``axis`` (the samples' axis;
the result keeps the input's kind: floats for a 1-D list or array, arrays or tensors otherwise).
`mean_stderr_of_sums` is the same from running sums (Σx, Σx², n), for estimators that never keep
their samples (the diagonal estimators accumulate P-vectors).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch


def mean_stderr(samples: Any, axis: int = 0) -> tuple[Any, Any]:
    """(mean, standard error of the mean) of ``samples`` along ``axis``; one sample: stderr inf,
    none: mean NaN and stderr inf."""
    if isinstance(samples, torch.Tensor):
        n = samples.shape[axis]
        mean = samples.mean(axis) if n else samples.sum(axis) * math.nan
        if n < 2:
            return mean, torch.full_like(mean, math.inf)
        return mean, samples.std(axis, unbiased=True) / math.sqrt(n)
    a = np.asarray(samples, dtype=np.float64)
    n = a.shape[axis]
    mean = a.mean(axis) if n else a.sum(axis) * math.nan
    se = a.std(axis, ddof=1) / math.sqrt(n) if n > 1 else np.full(np.shape(mean), math.inf)
    return (float(mean), float(se)) if a.ndim == 1 else (mean, se)


def mean_stderr_of_sums(total: Any, total_sq: Any, n: int) -> tuple[Any, Any]:
    """(mean, standard error) from the running sums Σx and Σx² of ``n`` samples (elementwise for
    tensors): the same numbers as `mean_stderr` of the samples, up to rounding; one sample: inf."""
    mean = total / n
    if n < 2:
        return mean, (
            torch.full_like(mean, math.inf)
            if isinstance(mean, torch.Tensor)
            else np.full(np.shape(mean), math.inf)
        )
    var = total_sq / n - mean**2
    var = var.clamp_min(0) if isinstance(var, torch.Tensor) else np.maximum(var, 0)
    return mean, (var * n / (n - 1) / n) ** 0.5
