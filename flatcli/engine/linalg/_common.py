"""Pieces every matrix-free routine shares: the operator adapter, progress hook, probes,
row dot products and the small tridiagonal eigenproblem."""

from __future__ import annotations

import math
from collections.abc import Callable

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


DEFAULT_BLOCK = (
    16  # vectors per product for a bare mat-vec (the estimators' former ``block`` default)
)


class Operator:
    """What an estimator needs of a symmetric P × P operator (made by `as_operator`).

    ``matmat_rows(V)``: M V for V of shape (K, P); ``shape`` (P, P) and ``dim``; ``device`` and
    ``dtype`` of the vectors (probes and bases are made there); ``block_size``: most vectors per
    product call (the engine's ``runtime.block_size`` for an engine operator, `DEFAULT_BLOCK` for a
    bare mat-vec); ``max_device_vectors``: the basis-store capacity (`flatcli.engine.linalg._store`);
    ``max_basis_vectors``: Lanczos' thick-restart cap (`flatcli.engine.linalg.lanczos.basis_limit`);
    ``report(**info)``: the progress hook (a no-op for a bare mat-vec)."""

    def __init__(
        self,
        product: MatVec,
        dim: int,
        *,
        device,
        dtype,
        block_size: int,
        max_device_vectors,
        report: Callable[..., None] | None,
        max_basis_vectors="auto",
    ):
        self.matmat_rows = product
        self.shape = (int(dim), int(dim))
        self.device, self.dtype = device, dtype
        self.block_size = int(block_size)
        self.max_device_vectors = max_device_vectors
        self.max_basis_vectors = max_basis_vectors
        self._report = report

    @property
    def dim(self) -> int:
        """P."""
        return self.shape[1]

    def report(self, **info) -> None:
        """Progress from the estimator driving this operator (forwarded to the wrapped operator's hook)."""
        if self._report is not None:
            self._report(**info)

    def __call__(self, V: torch.Tensor) -> torch.Tensor:
        """Same as ``matmat_rows``."""
        return self.matmat_rows(V)


def as_operator(
    op,
    dim: int | None = None,
    *,
    device=None,
    dtype=None,
    block_size: int | None = None,
    max_device_vectors: int | str | None = "auto",
) -> Operator:
    """The one adapter in front of every estimator: an `Operator` from a curvature operator (anything with
    ``matmat_rows`` and ``shape``: `flatcli.engine.operators.CurvatureOperator`, or an `Operator`) or
    from a bare ``V (K, P) -> M V`` callable, which needs ``dim``.

    From an operator, ``dim``, ``device``, ``dtype``, ``block_size``, ``max_device_vectors``,
    ``max_basis_vectors`` and ``report`` are its own; the keywords override them (``max_device_vectors="auto"`` and None for
    the others: keep the operator's). A bare callable gets ``device`` (None: the default device),
    ``dtype`` (default float32), ``block_size`` (default `DEFAULT_BLOCK`) and ``max_device_vectors``
    as given, and no progress hook.

    Parameters
    ----------
    op : CurvatureOperator, Operator or callable
        The operator, or a bare block product.
    dim : int, optional
        P, needed for a bare callable.
    device, dtype : optional
        Of the vectors.
    block_size : int, optional
        Vectors per product.
    max_device_vectors : int, "auto" or None
        The most basis vectors on the device at once.

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
            block_size=block_size or getattr(op, "block_size", None) or DEFAULT_BLOCK,
            max_device_vectors=(
                getattr(op, "max_device_vectors", "auto")
                if _is_auto(max_device_vectors)
                else max_device_vectors
            ),
            report=getattr(op, "report", None),
            max_basis_vectors=getattr(op, "max_basis_vectors", "auto"),
        )
    if dim is None:
        raise TypeError("a bare mat-vec needs its dimension: pass dim")
    return Operator(
        op,
        int(dim),
        device=device,
        dtype=torch.float32 if dtype is None else dtype,
        block_size=block_size or DEFAULT_BLOCK,
        max_device_vectors=max_device_vectors,
        report=None,
    )


def _is_auto(setting) -> bool:
    return isinstance(setting, str) and setting == "auto"


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
