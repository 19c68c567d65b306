r"""Random directions with filter-wise normalization (Li et al., NeurIPS 2018, Sec. 4).

A direction :math:`d` has the shape of the parameters :math:`\theta`. It is drawn
from a standard Gaussian (seeded) and then normalized filter by filter so that
every filter of :math:`d` has the norm of the matching filter of :math:`\theta`:

.. math:: d_{i,j} \leftarrow \frac{d_{i,j}}{\lVert d_{i,j} \rVert} \, \lVert \theta_{i,j} \rVert

(Li et al. 2018, eq. in Sec. 4, "filter-wise normalization"), where
:math:`d_{i,j}` is the j-th filter of layer i. A filter is a slice along the
first dimension of a parameter with two or more dimensions: an output channel
of a convolution kernel (``out × in × kh × kw``), a row of a Linear weight
(``out × in``), a row of an embedding. The scale is exactly
``‖θ_ij‖ / ‖d_ij‖`` (Li et al.'s code adds 1e-10 to the denominator; flatcli
only maps an all-zero filter of d to zero), so the norms match to rounding.

Parameters with at most one dimension (biases, BatchNorm / LayerNorm scales
and shifts) follow ``bias_bn``:

* ``"zero"`` (default, Li et al.'s choice ``ignore='biasbn'``): the direction is
  zero there, so slices move only the weights;
* ``"keep"``: each entry is its own filter, so the direction entry is
  ``±|θ_k|`` with a random sign (Li et al.'s code copies ``θ`` itself, i.e. the
  + sign everywhere; a random sign keeps the direction random).

With this normalization the slice is invariant to rescaling a ReLU network's
filters (the scale invariance that makes plain random directions misleading,
Li et al. Sec. 3–4).
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..validation import BIAS_BN as BIAS_BN_CHOICES


def filter_norms(t: torch.Tensor) -> torch.Tensor:
    """Norm of each filter (slice along the first dimension); a 0-/1-D tensor is one filter per entry."""
    if t.ndim <= 1:
        return t.detach().abs().reshape(-1)
    return t.detach().reshape(t.shape[0], -1).norm(dim=1)


def normalize_direction(d: torch.Tensor, w: torch.Tensor, bias_bn: str = "zero") -> torch.Tensor:
    """Filter-normalize one direction tensor ``d`` against the weight ``w`` (returns a new tensor)."""
    if d.shape != w.shape:
        raise ValueError(
            f"direction shape {tuple(d.shape)} differs from the parameter's {tuple(w.shape)}"
        )
    if w.ndim <= 1:
        if bias_bn == "zero":
            return torch.zeros_like(w)
        if bias_bn == "keep":
            sign = torch.where(d >= 0, 1.0, -1.0).to(w.dtype)
            return sign * w.abs()
        raise ConfigError(
            f"bias_bn must be one of {', '.join(BIAS_BN_CHOICES)}. Got {bias_bn!r} instead."
        )
    dn = d.reshape(d.shape[0], -1)
    dnorm = dn.norm(dim=1)
    scale = torch.where(dnorm > 0, filter_norms(w) / torch.where(dnorm > 0, dnorm, 1), 0)
    return (dn * scale[:, None]).reshape(w.shape)


def random_direction(
    params: dict[str, torch.Tensor],
    generator: torch.Generator,
    bias_bn: str = "zero",
) -> dict[str, torch.Tensor]:
    """A seeded Gaussian direction, filter-normalized against ``params``.

    Parameters
    ----------
    params : name -> tensor, in a fixed order (the order the draws are made in).
    generator : a seeded CPU ``torch.Generator``; draws are made in float64 on
        the CPU, so a seed gives the same direction on every device and dtype.
    bias_bn : "zero" (default) or "keep", for parameters with at most one
        dimension (see the module docstring).

    Returns
    -------
    dict name -> tensor, same shapes, devices and dtypes as ``params``.
    """
    if bias_bn not in BIAS_BN_CHOICES:
        raise ConfigError(
            f"bias_bn must be one of {', '.join(BIAS_BN_CHOICES)}. Got {bias_bn!r} instead."
        )
    out = {}
    for name, w in params.items():
        g = torch.randn(w.shape, generator=generator, dtype=torch.float64)
        d = normalize_direction(g, w.detach().to("cpu", torch.float64), bias_bn)
        out[name] = d.to(w.device, w.dtype)
    return out


def cosine(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Cosine of the angle between two directions (nearly 0 for independent draws in high dimension)."""
    dot = sum(float((a[k].double() * b[k].double()).sum()) for k in a)
    na = sum(float(a[k].double().pow(2).sum()) for k in a) ** 0.5
    nb = sum(float(b[k].double().pow(2).sum()) for k in b) ** 0.5
    return dot / (na * nb) if na > 0 and nb > 0 else float("nan")
