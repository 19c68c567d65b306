r"""1D and 2D slices of the loss along filter-normalized random directions.

Li, Xu, Taylor, Studer, Goldstein, "Visualizing the Loss Landscape of Neural
Nets", NeurIPS 2018, Sec. 4: with θ* the checkpoint and δ, η two seeded random
directions normalized filter by filter (`flatcli.landscape.directions`),

.. math::

    f(\alpha) = L(\theta^* + \alpha\delta), \qquad
    f(\alpha, \beta) = L(\theta^* + \alpha\delta + \beta\eta),

evaluated on a grid of ``steps`` points per axis over ``span`` (default
[−1, 1], Li et al.'s range). The grid always contains α = 0 (and β = 0), the
checkpoint itself, so the centre value is exact. The two directions are drawn
independently from one generator (δ first), as in Li et al.; in high dimension
they are nearly orthogonal (their cosine is recorded in ``meta``).

Train and (when given) test loss and accuracy are computed at every point on
the given data, in eval mode, with functional parameters: the model is left
exactly as it was.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..engine import eval_mode
from ..errors import ConfigError
from ..run.settings import Settings
from ..validation import BIAS_BN, Integral, OneOf, check_fields, opt
from .directions import cosine, random_direction
from .evaluate import ViewOptions, evaluate_splits, problem_kwargs, split_problems
from .loss_grid import LandscapeResult, summarize

DEFAULT_SPAN = (-1.0, 1.0)


def parse_span(
    span: str | Sequence[float] | None, default: tuple[float, float]
) -> tuple[float, float]:
    """``"a,b"`` or ``(a, b)`` with a < b, or the default."""
    if span is None:
        return default
    if isinstance(span, str):
        parts = [p.strip() for p in span.split(",")]
        try:
            vals = [float(p) for p in parts]
        except ValueError:
            vals = []
        if len(vals) != 2:
            raise ConfigError(
                f"`span` must be two numbers 'a,b' (e.g. -1,1). Got {span!r} instead."
            )
    else:
        vals = [float(v) for v in span]
        if len(vals) != 2:
            raise ConfigError(f"span must be two numbers (a, b). Got {span!r} instead.")
    a, b = vals
    if not (np.isfinite(a) and np.isfinite(b) and a < b):
        raise ConfigError(f"span must satisfy a < b (finite). Got {a:g},{b:g} instead.")
    return a, b


def axis_grid(
    span: tuple[float, float], steps: int, include: Sequence[float] = (0.0,)
) -> np.ndarray:
    """``steps`` evenly spaced values over ``span`` (float64) plus the values in ``include``.

    A grid value within 1e-9·(b − a) of an included value is snapped onto it,
    so e.g. linspace(−0.5, 1.5, 25) holds exactly 0 and 1. When only 0 (the checkpoint) is to be
    included, the span holds it inside and there are ≥ 3 steps, the interior value nearest to 0
    becomes 0: exactly ``steps`` points with the span's ends (a slice or a PCA plane of
    ``--steps 11`` is 11 × 11, never 12 × 12; the spacing next to 0 may then be uneven).
    """
    if int(steps) < 2:
        raise ConfigError(f"`steps` must be ≥ 2. Got {steps} instead.")
    a, b = span
    g = np.linspace(a, b, int(steps))
    if tuple(include) == (0.0,) and a < 0 < b and len(g) >= 3:
        g[1 + int(np.argmin(np.abs(g[1:-1])))] = 0.0
        return g
    tol = 1e-9 * (b - a)
    for v in include:
        near = np.abs(g - v) <= tol
        if near.any():
            g[near] = v
        else:
            g = np.append(g, v)
    return np.unique(g)


def grid_coefficients(alpha: np.ndarray, beta: np.ndarray | None = None) -> np.ndarray:
    """The grid's points as rows of coefficients: (len(alpha), 1) for one axis; for two, the
    (len(alpha)·len(beta), 2) pairs (α_i, β_j) with β fastest (the CSV order)."""
    if beta is None:
        return alpha[:, None]
    aa, bb = np.meshgrid(alpha, beta, indexing="ij")
    return np.stack([aa.ravel(), bb.ravel()], axis=1)


def direction_chunks(
    base: dict[str, torch.Tensor], directions: list[dict[str, torch.Tensor]], coeffs: np.ndarray
) -> Callable[[int, int], dict[str, torch.Tensor]]:
    """Points θ_k = base + Σ_j coeffs[k, j]·d_j, stacked for points first..stop-1."""

    def chunk(first: int, stop: int) -> dict[str, torch.Tensor]:
        out = {}
        for n, p in base.items():
            c = torch.as_tensor(coeffs[first:stop], dtype=p.dtype, device=p.device)
            shape = (-1,) + (1,) * p.ndim
            v = p.unsqueeze(0).expand(stop - first, *p.shape).clone()
            for j, d in enumerate(directions):
                v += c[:, j].view(shape) * d[n].unsqueeze(0)
            out[n] = v
        return out

    return chunk


@dataclass(frozen=True)
class SliceView(ViewOptions):
    """``view="slice"``: a 1D/2D filter-normalized slice around one checkpoint (`slice_landscape`),
    validated at construction.

    ``dims`` 1 or 2 random directions; ``steps`` grid points per axis over ``span`` (α = 0 is
    added when missing); ``span`` the grid range (a, b) or "a,b" (default -1,1); ``bias_bn``
    "zero" (Li et al.) or "keep": the direction on 1-D parameters (biases, normalization layers),
    see `flatcli.landscape.directions`; ``points_per_pass`` and ``on_progress``: `ViewOptions`."""

    dims: int = opt(1, OneOf(1, 2), "random directions")
    steps: int = opt(25, Integral(2), "grid points per axis")
    span: str | Sequence[float] | None = None
    bias_bn: str = opt("zero", OneOf(*BIAS_BN), "the direction on biases and norm layers")

    def __post_init__(self):
        check_fields(self)
        parse_span(self.span, DEFAULT_SPAN)


def slice_landscape(
    model: torch.nn.Module,
    train,
    test=None,
    *,
    options: SliceView | None = None,
    settings: Settings | None = None,
    **fields,
) -> LandscapeResult:
    """Evaluate a ``dims``-dimensional slice around the model's parameters.

    Parameters
    ----------
    model : the network at θ* (not modified).
    train, test : the data (batches of named tensors or (x, y) pairs); every point gets train
        (and test) loss and accuracy.
    options : the slice's `SliceView` (``dims``, ``steps``, ``span``, ``bias_bn``,
        ``points_per_pass``, ``on_progress``; default ``SliceView()``: 1 direction, 25 steps over
        (−1, 1), ``bias_bn="zero"``).
    settings : the `flatcli.run.settings.Settings` (loss, batch size, device, precision, ``seed``: the
        seed of the directions, CPU generator, float64 draws); its fields may be given as keywords.

    Returns
    -------
    `LandscapeResult` of kind "1d" or "2d".
    """
    opts = options if options is not None else SliceView()
    dims, steps, span, bias_bn = opts.dims, opts.steps, opts.span, opts.bias_bn
    st = Settings.build(settings, **fields)
    seed = st.seed
    a, b = parse_span(span, DEFAULT_SPAN)
    t0 = time.perf_counter()
    alpha = axis_grid((a, b), steps)
    beta = alpha.copy() if dims == 2 else None
    with eval_mode(model):
        problems = split_problems(model, train, test, **problem_kwargs(st))
        base = problems["train"].params
        gen = torch.Generator().manual_seed(int(seed))
        dirs = [random_direction(base, gen, bias_bn) for _ in range(dims)]
        coeffs = grid_coefficients(alpha, beta)
        progress = opts.progress(len(coeffs) * len(problems))
        metrics, diags = evaluate_splits(
            problems,
            direction_chunks(base, dirs, coeffs),
            len(coeffs),
            opts.points_per_pass,
            progress.advance,
        )
        shape = (len(alpha),) if dims == 1 else (len(alpha), len(beta))
        metrics = {k: v.reshape(shape) for k, v in metrics.items()}
    res = LandscapeResult(kind=f"{dims}d", alpha=alpha, beta=beta, **metrics)
    res.meta = {
        "seed": int(seed),
        "bias_bn": bias_bn,
        "span": [a, b],
        "steps": int(steps),
        "normalization": "filter",
        "num_params": problems["train"].num_params,
        "n_train": problems["train"].n,
        "n_test": problems["test"].n if "test" in problems else None,
        "direction_cosine": cosine(dirs[0], dirs[1]) if dims == 2 else None,
        "evaluator": diags,
    }
    res.summary = summarize(res)
    res.seconds = time.perf_counter() - t0
    return res
