r"""Curvature matrices as linear operators (the face curvlinops gives them).

A `CurvatureOperator` is a symmetric :math:`P \times P` matrix over the
measurement set that is never formed: ``op @ v`` multiplies a vector
(shape ``(P,)``) and ``op @ V`` a block of columns (shape ``(P, K)``), exactly
as a dense matrix would; ``op.matmat_rows(V)`` takes the engine's native layout,
K vectors as rows ``(K, P)``, without transposes. Every operator counts its own
products (``op.n_products``) on top of the engine's counters, and
``op.to_scipy()`` gives a `scipy.sparse.linalg.LinearOperator` in float64 for
scipy's solvers (``eigsh``, ``cg``, ...).

The curvatures themselves are operators: `flatcli.engine.curvatures.Curvature` subclasses this
class and supplies the product of a block (`_matmat`) over the data; the engine hands them out at
a point θ (`flatcli.engine.CurvatureEngine.hessian`, ``.ggn``, ``.fd_hessian``, or any curvature
class through ``.curvature``). A bare ``V (K, P) -> M V`` callable becomes an operator through
``CurvatureOperator(product, dim, ...)``.

Operators compose like matrices: ``H + G``, ``H - G``, ``2.0 * H`` and ``H + lam * identity(H)``
(each product of a sum calls each operand once, and each operand counts its own products).

``precision="fp32"`` gives the same operator with TF32 matrix products switched
off during its products: the verification view of a TF32 engine (see
``runtime.precision: auto``). `restrict` gives the block of one parameter set,
:math:`P_b H P_b` (vectors zeroed outside the block before and after the product).

References: Dangel, Tatzel & Hennig (curvlinops), ``_torch_base.py``;
Martens 2020 (GGN), Pearlmutter 1994 (HVPs).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

Product = Callable[[torch.Tensor], torch.Tensor]


class CurvatureOperator:
    """A symmetric P × P curvature matrix given by block products.

    A subclass overrides `_matmat` (the product of a block of rows) and passes ``product=None``;
    otherwise ``product`` is called.

    Parameters
    ----------
    product : ``V (K, P) -> M V`` for K row vectors, or None in a subclass that overrides `_matmat`.
    dim : P.
    device, dtype : where the vectors live and their type.
    name : "hessian", "ggn", "fd_hessian" (for messages and diagnostics).
    precision_context : a context-manager factory entered around every product
        (e.g. TF32 off), or None.

    How an estimator drives the operator (vectors per product, basis caps, progress) is the
    estimator's own `flatcli.engine.linalg.EstimatorSettings`, not the operator's.
    """

    def __init__(
        self,
        product: Product | None,
        dim: int,
        *,
        device=None,
        dtype=torch.float32,
        name: str = "operator",
        precision_context: Callable | None = None,
    ):
        if product is None and type(self)._matmat is CurvatureOperator._matmat:
            raise TypeError(f"{type(self).__name__}: give a product or override _matmat(V)")
        self._product = product
        self.shape = (int(dim), int(dim))
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.dtype = dtype
        self.name = name
        self._context = precision_context
        self.n_products = 0

    # ------------------------------------------------------------ products
    def matmat_rows(self, V: torch.Tensor) -> torch.Tensor:
        """M V for V of shape (K, P) or (P,), vectors as rows (the engine's layout)."""
        single = V.ndim == 1
        V2 = V.reshape(1, -1) if single else V
        if V2.ndim != 2 or V2.shape[1] != self.shape[1]:
            raise ValueError(
                f"{self.name}: vectors must have shape (P,) or (K, P) with P = {self.shape[1]}; "
                f"got {tuple(V.shape)}"
            )
        if self._context is None:
            out = self._matmat(V2)
        else:
            with self._context():
                out = self._matmat(V2)
        self.n_products += V2.shape[0]
        return out[0] if single else out

    def _matmat(self, V: torch.Tensor) -> torch.Tensor:
        """M V for a block V (K, P) of checked rows: the ``product`` given, or a subclass's
        override (checked when the operator is made)."""
        return self._product(V)

    def __call__(self, V: torch.Tensor) -> torch.Tensor:
        """Same as `matmat_rows` (so an operator can stand where a block mat-vec is expected)."""
        return self.matmat_rows(V)

    def __matmul__(self, X: torch.Tensor) -> torch.Tensor:
        """M x for x of shape (P,), or M X for X of shape (P, K) (columns), like a dense matrix."""
        if not isinstance(X, torch.Tensor):
            X = torch.as_tensor(np.asarray(X))
        if X.ndim == 1:
            return self.matmat_rows(X.to(self.device, self.dtype))
        if X.ndim != 2 or X.shape[0] != self.shape[1]:
            raise ValueError(
                f"{self.name}: expected shape (P,) or (P, K) with P = {self.shape[1]}. Got {tuple(X.shape)} instead."
            )
        return self.matmat_rows(X.T.to(self.device, self.dtype)).T

    # ------------------------------------------------------------ algebra
    def _derived(self, product: Product, name: str) -> CurvatureOperator:
        """An operator of this one's shape, device and type with ``product``."""
        return CurvatureOperator(
            product, self.shape[1], device=self.device, dtype=self.dtype, name=name
        )

    def _other(self, other, op: str) -> CurvatureOperator:
        if not isinstance(other, CurvatureOperator):
            raise TypeError(
                f"{self.name} {op} {type(other).__name__}: both sides must be operators "
                "(for M + λI write M + λ * identity(M))"
            )
        if other.shape != self.shape:
            raise ValueError(
                f"{self.name} {op} {other.name}: shapes differ, {self.shape} and {other.shape}"
            )
        return other

    def __add__(self, other: CurvatureOperator) -> CurvatureOperator:
        """M + N: one product of each per call (each operand counts its own products)."""
        other = self._other(other, "+")
        return self._derived(
            lambda V: self.matmat_rows(V) + other.matmat_rows(V).to(V.dtype),
            f"({self.name} + {other.name})",
        )

    def __sub__(self, other: CurvatureOperator) -> CurvatureOperator:
        """M − N (e.g. H − G, the Hessian's part the Gauss-Newton matrix leaves out)."""
        other = self._other(other, "-")
        return self._derived(
            lambda V: self.matmat_rows(V) - other.matmat_rows(V).to(V.dtype),
            f"({self.name} - {other.name})",
        )

    def __mul__(self, scale: float) -> CurvatureOperator:
        """The operator scaled by a real number c (c · M)."""
        if isinstance(scale, bool) or not isinstance(scale, int | float):
            return NotImplemented
        c = float(scale)
        if not np.isfinite(c):
            raise ValueError(
                f"{self.name}: a scale must be a finite number. Got {scale!r} instead."
            )
        return self._derived(lambda V: c * self.matmat_rows(V), f"{c:g}*{self.name}")

    __rmul__ = __mul__

    def __neg__(self) -> CurvatureOperator:
        return self * -1.0

    # ------------------------------------------------------------ views
    def restrict(self, index: slice | torch.Tensor) -> CurvatureOperator:
        """The block :math:`P_b M P_b` of the coordinates ``index`` (a slice or a boolean mask),
        still of shape P × P (zero outside the block): its trace is the block's trace and its
        largest eigenvalue the block's."""
        mask = torch.zeros(self.shape[1], dtype=torch.bool, device=self.device)
        mask[index] = True
        maskf = mask.to(self.dtype)

        def product(V: torch.Tensor) -> torch.Tensor:
            return self.matmat_rows(V * maskf) * maskf

        return self._derived(product, f"{self.name}[block]")

    def to_scipy(self):
        """A `scipy.sparse.linalg.LinearOperator` view (float64 NumPy in and out)."""
        from scipy.sparse.linalg import LinearOperator

        def mv(x):
            x = np.asarray(x, dtype=np.float64)
            X = torch.as_tensor(
                x.reshape(self.shape[1], -1).T.copy(), device=self.device, dtype=self.dtype
            )
            out = self.matmat_rows(X).double().cpu().numpy().T
            return out.reshape(x.shape)

        return LinearOperator(
            self.shape, matvec=mv, matmat=mv, rmatvec=mv, rmatmat=mv, dtype=np.float64
        )

    def dense(self, block: int = 64) -> torch.Tensor:
        """The whole matrix from unit-vector products (P products: tiny models and tests only)."""
        P = self.shape[1]
        cols = []
        for i in range(0, P, block):
            k = min(block, P - i)
            E = torch.zeros(k, P, device=self.device, dtype=self.dtype)
            E[torch.arange(k), torch.arange(i, i + k)] = 1.0
            cols.append(self.matmat_rows(E))
        return torch.cat(cols, 0).T

    def __repr__(self) -> str:
        return f"CurvatureOperator({self.name}, shape={self.shape}, dtype={self.dtype}, device={self.device})"


def identity(like: CurvatureOperator) -> CurvatureOperator:
    """Return the identity matrix of ``like``'s shape, device and type.

    ``H + lam * identity(H)`` is the damped Hessian H + λI (e.g. with weight decay λ); the
    identity takes no curvature products.
    """
    return like._derived(lambda V: V.clone(), "I")
