"""Pieces every matrix-free routine shares: the operator adapter, progress hook, probes,
row dot products and the small tridiagonal eigenproblem."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

MatVec = Callable[[torch.Tensor], torch.Tensor]

MIN_SAMPLES = 4  # fewest independent samples (probes, SLQ runs) behind a passed tolerance test
MIN_NODES = 3  # fewest Gauss nodes of an SLQ run that counts (a time cap may cut one shorter)


def t_factor(samples: int) -> float:
    """t_{samples−1}(0.975) / 1.96 (Student's t quantile, ``scipy.special.stdtrit``, the function
    behind ``scipy.stats.t.ppf``): a standard error of the mean of ``samples`` values times this is
    the half-width of Student's 95% interval over 1.96, so ±2·stderr keeps about its normal
    coverage with few samples (12.7/1.96 = 6.5 at 2, 1.62 at 4, 1.21 at 8, 1.09 at 16); inf below
    2 samples."""
    if samples < 2:
        return math.inf
    from scipy.special import stdtrit  # imported here: ~0.1 s at start-up (scipy.stats: ~0.6 s)

    return float(stdtrit(samples - 1, 0.975)) / 1.959963984540054


def _tridiag_eig(alphas, betas):
    a = np.asarray(alphas, dtype=np.float64)
    b = np.asarray(betas, dtype=np.float64)
    if len(a) == 1:
        return a.copy(), np.ones((1, 1))
    import scipy.linalg  # imported here: it costs ~0.2 s at start-up

    return scipy.linalg.eigh_tridiagonal(a, b)


DEFAULT_BLOCK = 16  # vectors per product call when no block size is given


@dataclass(frozen=True)
class EstimatorSettings:
    """How an estimator drives its operator: its own options, not the operator's.

    The engine fills one from its runtime settings (`flatcli.engine.CurvatureEngine.estimator_settings`);
    the default suits a bare operator.

    Parameters
    ----------
    block_size : most vectors per product call: an int, or a callable read at each block (the
        engine's ``runtime.block_size``, which its out-of-memory back-off may lower); None:
        `DEFAULT_BLOCK`.
    max_device_vectors : most basis vectors on the device at once (``runtime.max_device_vectors``;
        "auto": from free memory, unbounded on CPU; `flatcli.engine.linalg._store`).
    max_basis_vectors : most Lanczos basis vectors kept at all (``runtime.max_basis_vectors``;
        "auto": what fits in half the free host memory; `flatcli.engine.linalg.lanczos.basis_limit`).
    report : ``report(**info)``, told the running estimate (e.g. probes so far and the stderr);
        None ignores it.
    """

    block_size: int | Callable[[], int] | None = None
    max_device_vectors: int | str | None = "auto"
    max_basis_vectors: int | str | None = "auto"
    report: Callable[..., None] | None = None

    def block(self) -> int:
        """Vectors per product call now."""
        b = self.block_size
        b = b() if callable(b) else b
        return int(b) if b else DEFAULT_BLOCK

    def progress(self, **info) -> None:
        """Tell ``report`` (when set) the estimator's progress."""
        if self.report is not None:
            self.report(**info)

    def basis_rows(self, dim: int, full: int) -> int | str | None:
        """The Lanczos basis cap for vectors of ``dim`` of the ``full`` coordinates (a parameter
        block's Lanczos): ``max_basis_vectors`` in full vectors scaled to ``dim`` (None: unbounded;
        "auto" stays)."""
        cap = self.max_basis_vectors
        if cap is None or isinstance(cap, str):
            return cap
        return max(1, cap * full // max(dim, 1))


def settings_or_default(settings: EstimatorSettings | None) -> EstimatorSettings:
    """``settings``, or the defaults of a bare operator."""
    return settings if settings is not None else EstimatorSettings()


class Operator:
    """What an estimator needs of a symmetric P × P operator (made by `as_operator`): its
    product ``matmat_rows(V)`` (M V for V of shape (K, P)), ``shape`` (P, P) and ``dim``, the
    ``device`` and ``dtype`` of its vectors (probes and bases are made there), and their
    ``space`` (`flatcli.engine.linalg.vectors`: flat, or one block per parameter, whose
    products take and return lists of blocks)."""

    def __init__(self, product: MatVec, dim: int, *, device, dtype, space=None):
        self.matmat_rows = product
        self.shape = (int(dim), int(dim))
        self.device, self.dtype = device, dtype
        self.space = space  # None: flat (`flatcli.engine.linalg.vectors.space_of`)

    @property
    def dim(self) -> int:
        """P."""
        return self.shape[1]

    def __call__(self, V: torch.Tensor) -> torch.Tensor:
        """Same as ``matmat_rows``."""
        return self.matmat_rows(V)


def as_operator(op, dim: int | None = None, *, device=None, dtype=None, space=None) -> Operator:
    """The one adapter in front of every estimator: an `Operator` from a curvature operator
    (anything with ``matmat_rows`` and ``shape``: `flatcli.engine.operators.CurvatureOperator`, or
    an `Operator`) or from a bare ``V (K, P) -> M V`` callable, which needs ``dim``.

    From an operator, ``dim``, ``device`` and ``dtype`` are its own (``device`` and ``dtype`` given
    override them); a bare callable gets ``device`` (None: the default device) and ``dtype``
    (default float32), or ``space`` (a `flatcli.engine.linalg.vectors.ParamSpace`: vectors one
    block per parameter, and P, device and dtype from it). How the estimator drives it (block size, basis caps, progress) is the
    estimator's `EstimatorSettings`.

    Parameters
    ----------
    op : CurvatureOperator, Operator or callable
        The operator, or a bare block product.
    dim : int, optional
        P, needed for a bare callable.
    device, dtype : optional
        Of the vectors.
    space : ParamSpace, optional
        The vectors' space of a bare per-parameter product (its own for an operator that has one).

    Returns
    -------
    Operator
        The adapter every estimator takes.
    """
    if hasattr(op, "matmat_rows") and hasattr(op, "shape"):
        return Operator(
            op.matmat_rows,
            op.shape[1],
            device=device if device is not None else op.device,
            dtype=op.dtype if dtype is None else dtype,
            space=space
            or (getattr(op, "space", None) if device is None and dtype is None else None),
        )
    if space is not None:
        return Operator(op, space.dim, device=space.device, dtype=space.dtype, space=space)
    if dim is None:
        raise TypeError("a bare mat-vec needs its dimension: pass dim")
    return Operator(op, int(dim), device=device, dtype=torch.float32 if dtype is None else dtype)


_M31 = 0x7FFFFFFF


_MULT = 0x45D9F3B  # < 2**27: products of 31-bit values stay below 2**58, exact in int64


_SIGNS = ((torch.arange(256)[:, None] >> torch.arange(8)[None, :]) & 1).to(torch.float64) * 2 - 1


def _hash31(x: torch.Tensor) -> torch.Tensor:
    """A 31-bit integer mixing hash (Mueller's hash32 structure) on int64 tensors;
    identical on every device since it only uses exact integer operations."""
    x = ((x ^ (x >> 16)) * _MULT) & _M31
    x = ((x ^ (x >> 16)) * _MULT) & _M31
    return x ^ (x >> 16)


def rademacher(k: int, dim: int, generator: torch.Generator, device=None, dtype=torch.float32):
    """K Rademacher (±1) vectors of length ``dim``, generated on ``device``.

    Row r takes one 31-bit seed s_r from the CPU ``generator``; its signs are
    the low 24 bits of ``hash(hash(j) ^ s_r)`` for chunk j, computed with exact
    integer operations (little-endian bytes), so the probes are the same on CPU
    and CUDA, cost one generator call per row rather than one per sign, and K
    rows drawn at once equal K single draws.

    Parameters
    ----------
    k, dim : int
        Number and length of the vectors.
    generator : torch.Generator
        Seeded CPU generator (one draw per row).
    device, dtype : optional
        Of the result.

    Returns
    -------
    torch.Tensor
        (k, dim) of ±1.
    """
    seeds = torch.randint(0, _M31 + 1, (k, 1), generator=generator, dtype=torch.int64).to(device)
    dev = seeds.device
    nchunk = (dim + 23) // 24
    base = _hash31(torch.arange(nchunk, device=dev, dtype=torch.int64))
    h = _hash31(base[None, :] ^ seeds).to(torch.int32)  # (k, nchunk), values < 2**31
    by = h.view(torch.uint8).reshape(k, nchunk, 4)[:, :, :3].reshape(k, nchunk * 3)
    return _SIGNS.to(dev, dtype)[by.long()].reshape(k, nchunk * 24)[:, :dim]


def rowdot(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """Row-wise dot products of two (K, P) blocks, as float64.

    On CPU one batched BLAS dot; on CUDA an
    elementwise product summed in float64 (a batched matmul there could run in TF32).

    Parameters
    ----------
    A, B : torch.Tensor
        Blocks of shape (K, P).

    Returns
    -------
    torch.Tensor
        (K,) float64 dot products.
    """
    if A.device.type == "cuda":
        return (A * B).sum(1, dtype=torch.float64)
    return torch.bmm(A[:, None, :], B[:, :, None]).reshape(A.shape[0]).to(torch.float64)
