r"""Where the estimators' vectors live: one small backend for dot products, norms, scaling, random
probes, orthonormalization and bases, so each block of a vector stays on its parameter's device
and in its dtype.

A block of K vectors is, in a `FlatSpace` (the default: every operator of the engine), one
``(K, P)`` tensor on one device; in a `ParamSpace`, a list with one ``(K, n_i)`` tensor per
parameter (or group of parameters), each on that parameter's device and in its dtype. The
estimators (`flatcli.engine.linalg.lanczos`, `~flatcli.engine.linalg.slq`,
`~flatcli.engine.linalg.hutchinson`, `~flatcli.engine.linalg.hutchinson_diagonal`) never touch a
block's tensors: they call its space, which the operator brings (``op.space``; a flat space of
its P, device and dtype when it has none). A product of a per-parameter operator takes and returns
such lists.

Reductions across parts run in float64 on the CPU (a dot product is the sum of the parts' dot
products, a norm the root of the summed squares), so two parts in different dtypes or on
different devices never meet in one tensor: only K numbers per reduction cross devices. Random
probes are the flat probes' coordinates (`rademacher` drawn range by range from the same seeds),
so a per-parameter estimate uses exactly the probes of the flat one. The flat space does what the
estimators always did, operation for operation, so its values are unchanged to the bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch

from ._common import _M31, _SIGNS, _hash31, rademacher, rowdot
from ._store import BasisStore


class FlatSpace:
    """Vectors as one ``(K, P)`` tensor on ``device`` in ``dtype`` (module docstring)."""

    parts = None

    def __init__(self, dim: int, device, dtype):
        self.dim, self.device, self.dtype = int(dim), device, dtype

    # ------------------------------------------------------------ making
    def probes(self, k: int, generator: torch.Generator, dtype=None) -> torch.Tensor:
        """K Rademacher vectors (`rademacher`), in ``dtype`` (default: the space's)."""
        return rademacher(k, self.dim, generator, self.device, dtype or self.dtype)

    def from_flat(self, V: torch.Tensor) -> torch.Tensor:
        """A (K, P) tensor as a block of this space (its dtype kept)."""
        return V.to(self.device)

    def to_flat(self, X: torch.Tensor) -> torch.Tensor:
        """The block as one (K, P) tensor (on the space's device)."""
        return X

    def store(self, capacity=None, max_rows=None, preallocate=False, wide=False) -> BasisStore:
        """A basis of rows (`BasisStore`), in the space's dtype or float64 (``wide``)."""
        dtype = torch.float64 if wide else self.dtype
        return BasisStore(
            self.dim,
            self.device,
            dtype,
            capacity=capacity,
            max_rows=max_rows,
            preallocate=preallocate,
        )

    # ------------------------------------------------------------ casting and picking
    def native(self, X: torch.Tensor) -> torch.Tensor:
        """The block in the space's dtype."""
        return X.to(self.dtype)

    def wide(self, X: torch.Tensor) -> torch.Tensor:
        """The block in float64."""
        return X.double()

    def take(self, X: torch.Tensor, rows) -> torch.Tensor:
        """The rows ``rows`` (indices) of the block."""
        return X[torch.as_tensor(rows, device=X.device)]

    def count(self, X: torch.Tensor) -> int:
        """K, the block's vectors."""
        return X.shape[0]

    def cat(self, blocks: list) -> torch.Tensor:
        """The blocks' rows one after the other."""
        return torch.cat(blocks)

    def apply(self, fn: Callable, *blocks):
        """``fn`` of the blocks' tensors (part by part in a `ParamSpace`)."""
        return fn(*blocks)

    # ------------------------------------------------------------ arithmetic
    def dot(self, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        """Row-wise dot products (K,) in float64 (`rowdot`)."""
        return rowdot(A, B)

    def sumprod(self, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        """Row-wise sums of the elementwise product, (K,), in the blocks' dtype."""
        return (A * B).sum(1)

    def total(self, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        """The sum of the elementwise product over all rows (a trace of AᵀB)."""
        return (A * B).sum()

    def norm(self, X: torch.Tensor) -> torch.Tensor:
        """Row norms (K,)."""
        return X.norm(dim=1)

    def frobenius(self, X: torch.Tensor) -> torch.Tensor:
        """The norm of all the block's entries."""
        return X.norm()

    def div(self, X: torch.Tensor, c) -> torch.Tensor:
        """The block divided by a number c."""
        return X / c

    def div_rows(self, X: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """Row i divided by d[i]."""
        return X / d[:, None]

    def qr(self, X: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
        """(Q, R) of the rows: Q's rows orthonormal and spanning X's, ``X = Rᵀ Q`` (R as NumPy)."""
        f = torch.linalg.qr(X.T)
        return f.Q.T, f.R.cpu().numpy()


class ParamSpace:
    """Vectors as one block per parameter (or group): ``parts`` lists (numel, device, dtype) in
    the parameters' order (module docstring). ``device`` and ``dtype``: the first part's device and
    the widest dtype (what a reduction or a size estimate uses)."""

    def __init__(self, parts: Iterable[tuple[int, object, torch.dtype]]):
        self.parts = [(int(n), torch.device(d), t) for n, d, t in parts]
        if not self.parts:
            raise ValueError("a parameter space needs at least one part")
        self.dim = sum(n for n, _, _ in self.parts)
        self.device = self.parts[0][1]
        self.dtype = max((t for _, _, t in self.parts), key=lambda t: torch.finfo(t).bits)
        self.offsets = np.cumsum([0] + [n for n, _, _ in self.parts]).tolist()

    @classmethod
    def of(cls, tensors: Iterable[torch.Tensor]) -> ParamSpace:
        """The space of these tensors (e.g. ``model.parameters()``): one part each."""
        return cls((t.numel(), t.device, t.dtype) for t in tensors)

    # ------------------------------------------------------------ making
    def probes(self, k: int, generator: torch.Generator, dtype=None) -> list[torch.Tensor]:
        """The flat space's K Rademacher vectors, each part computed on its own device."""
        seeds = torch.randint(0, _M31 + 1, (k, 1), generator=generator, dtype=torch.int64)
        return [
            _signs(seeds, a, a + n, dev, dtype or t)
            for a, (n, dev, t) in zip(self.offsets, self.parts, strict=False)
        ]

    def from_flat(self, V: torch.Tensor) -> list[torch.Tensor]:
        """A (K, P) tensor cut into parts, each moved to its device (its dtype kept)."""
        return [
            V[:, a : a + n].to(dev)
            for a, (n, dev, _) in zip(self.offsets, self.parts, strict=False)
        ]

    def to_flat(self, X: list[torch.Tensor]) -> torch.Tensor:
        """The parts as one (K, P) float64 tensor on the CPU."""
        return torch.cat([x.detach().double().cpu() for x in X], 1)

    def store(self, capacity=None, max_rows=None, preallocate=False, wide=False) -> _PartStore:
        """A basis of rows kept part by part (each part's rows on its device)."""
        return _PartStore(
            [
                BasisStore(
                    n,
                    dev,
                    torch.float64 if wide else t,
                    capacity=capacity,
                    max_rows=max_rows,
                    preallocate=preallocate,
                )
                for n, dev, t in self.parts
            ]
        )

    # ------------------------------------------------------------ casting and picking
    def native(self, X):
        """Each part in its parameter's dtype."""
        return [x.to(t) for x, (_, _, t) in zip(X, self.parts, strict=True)]

    def wide(self, X):
        """Each part in float64 (on its device)."""
        return [x.double() for x in X]

    def take(self, X, rows):
        """The rows ``rows`` of every part."""
        return [x[torch.as_tensor(rows, device=x.device)] for x in X]

    def count(self, X) -> int:
        """K, the block's vectors."""
        return X[0].shape[0]

    def cat(self, blocks: list):
        """The blocks' rows one after the other, part by part."""
        return [torch.cat(p) for p in zip(*blocks, strict=True)]

    def apply(self, fn: Callable, *blocks):
        """``fn`` of each part's tensors."""
        return [fn(*xs) for xs in zip(*blocks, strict=True)]

    # ------------------------------------------------------------ arithmetic
    def dot(self, A, B) -> torch.Tensor:
        """Row-wise dot products (K,), float64 on the CPU: the sum of the parts'."""
        return sum(rowdot(a, b.to(a.dtype)).cpu() for a, b in zip(A, B, strict=True))

    def sumprod(self, A, B) -> torch.Tensor:
        """Row-wise dot products (K,), float64 on the CPU (as `dot`)."""
        return self.dot(A, B)

    def total(self, A, B) -> torch.Tensor:
        """The sum of the elementwise product over all rows, float64 on the CPU."""
        return self.dot(A, B).sum()

    def norm(self, X) -> torch.Tensor:
        """Row norms (K,), float64 on the CPU."""
        return self.dot(X, X).sqrt()

    def frobenius(self, X) -> torch.Tensor:
        """The norm of all the block's entries (float64, CPU)."""
        return self.dot(X, X).sum().sqrt()

    def div(self, X, c):
        """Every part divided by a number c."""
        return [x / c for x in X]

    def div_rows(self, X, d: torch.Tensor):
        """Row i of every part divided by d[i]."""
        return [x / d.to(x.device, x.dtype)[:, None] for x in X]

    def qr(self, X) -> tuple[list[torch.Tensor], np.ndarray]:
        """(Q, R) of the rows by Gram-Schmidt over the rows, each against the earlier ones twice
        (dot products summed over the parts in float64; the parts never meet): Q's rows
        orthonormal (a dependent row leaves a zero row and a zero on R's diagonal), ``X = Rᵀ Q``."""
        k = self.count(X)
        R = np.zeros((k, k))
        rows = []
        for i in range(k):
            x = self.take(X, [i])
            for _ in range(2):
                for j, q in enumerate(rows):
                    c = float(self.dot(q, x)[0])
                    R[j, i] += c
                    x = [xp - c * qp.to(xp.dtype) for xp, qp in zip(x, q, strict=True)]
            R[i, i] = float(self.norm(x)[0])
            rows.append(self.div(x, R[i, i]) if R[i, i] > 0 else x)
        return self.cat(rows), R


class _PartStore:
    """A basis kept as one `BasisStore` per part: coefficients are summed over the parts before
    any part is updated, so the Gram-Schmidt pass is the flat one's."""

    def __init__(self, stores: list[BasisStore]):
        self.stores = stores
        self.device = stores[0].device

    def __len__(self) -> int:
        return len(self.stores[0])

    @property
    def peak_resident(self) -> int:
        """Most rows of a part on its device at once."""
        return max(s.peak_resident for s in self.stores)

    def append(self, rows) -> None:
        """Add rows (each part to its store)."""
        for s, r in zip(self.stores, rows, strict=True):
            s.append(r)

    def rows(self, start: int, stop: int):
        """Rows [start, stop) of every part."""
        return [s.rows(start, stop) for s in self.stores]

    def coefficients(self, W) -> torch.Tensor:
        """``Q Wᵀ`` (n, k), float64 on the CPU: the sum of the parts'."""
        return sum(
            s.coefficients(w.to(s.dtype)).double().cpu()
            for s, w in zip(self.stores, W, strict=True)
        )

    def project_out(self, W):
        """One classical Gram-Schmidt pass over all parts, and the coefficients."""
        C = self.coefficients(W)
        out = [
            s.subtract(w.to(s.dtype), C.to(s.device, s.dtype))
            for s, w in zip(self.stores, W, strict=True)
        ]
        return out, C

    def combine(self, S: torch.Tensor):
        """``Sᵀ Q`` part by part."""
        return [s.combine(S.to(s.device, s.dtype)) for s in self.stores]

    def restart(self, S: torch.Tensor, rows) -> None:
        """A thick restart of every part with the same coefficients."""
        for s, r in zip(self.stores, rows, strict=True):
            s.restart(S.to(s.dtype), r)


def _signs(seeds: torch.Tensor, start: int, stop: int, device, dtype) -> torch.Tensor:
    """Coordinates [start, stop) of the Rademacher rows of ``seeds`` (`rademacher`'s construction,
    chunk by chunk of 24 coordinates), computed on ``device``."""
    k = seeds.shape[0]
    seeds = seeds.to(device)
    c0, c1 = start // 24, (stop + 23) // 24
    base = _hash31(torch.arange(c0, c1, device=seeds.device, dtype=torch.int64))
    h = _hash31(base[None, :] ^ seeds).to(torch.int32)
    by = h.view(torch.uint8).reshape(k, c1 - c0, 4)[:, :, :3].reshape(k, (c1 - c0) * 3)
    signs = _SIGNS.to(seeds.device, dtype)[by.long()].reshape(k, (c1 - c0) * 24)
    return signs[:, start - 24 * c0 : stop - 24 * c0]


def space_of(op) -> FlatSpace | ParamSpace:
    """The operator's space (``op.space``), or the flat space of its P, device and dtype."""
    space = getattr(op, "space", None)
    return space if space is not None else FlatSpace(op.shape[1], op.device, op.dtype)
