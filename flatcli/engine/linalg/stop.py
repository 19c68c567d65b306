"""When the iterative estimators stop: one small frozen object per family, so an estimator's
signature holds what it computes and the stopping rules travel together.

* `KrylovStop` (`flatcli.engine.linalg.lanczos`): relative residual tolerance, fewest and most
  Krylov steps, and a `Budget`;
* `ProbeStop` (`flatcli.engine.linalg.hutchinson`, `~flatcli.engine.linalg.hutchpp`): relative
  standard-error tolerance, fewest and most probes, a `Budget`, and optionally where to read an
  estimate of Tr|H| a measure already has (the near-zero floor's scale, `NearZeroFloor`);
* `DiagonalCheck` (`flatcli.engine.linalg.checked_gauss_newton_diagonal`): the tolerance of its
  Gauss-Newton checks and the work each may spend.

The defaults are the estimators' former keyword defaults. `SLQ <flatcli.engine.linalg.slq>` has a
fixed size (runs × steps) and takes its `Budget` directly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .budget import Budget, no_budget


@dataclass(frozen=True)
class KrylovStop:
    """Lanczos stops at ``tol`` (relative residuals of the wanted Ritz pairs) once at least ``min_steps``
    Krylov steps are done (None: `flatcli.engine.linalg.certified_min_steps` of the dimension), at
    ``max_steps``, or when ``budget`` is spent. ``max_basis``: the most basis vectors kept, beyond
    which Lanczos thick-restarts (``"auto"``: the estimator settings' ``max_basis_vectors``, else what
    fits in half the free host memory; None: unbounded; `flatcli.engine.linalg.lanczos.basis_limit`)."""

    tol: float = 1e-3
    min_steps: int | None = None
    max_steps: int = 100
    budget: Budget | None = None
    max_basis: int | str | None = "auto"

    def the_budget(self) -> Budget:
        """``budget``, or a budget without caps."""
        return self.budget if self.budget is not None else no_budget()


@dataclass(frozen=True)
class ProbeStop:
    """A trace estimator stops when its standard error is at most ``tol`` relative (or at the near-zero
    floor) once at least ``min_probes`` probes are done, at ``max_probes``, or when ``budget`` is spent."""

    tol: float = 0.01
    min_probes: int = 16
    max_probes: int = 1000
    budget: Budget | None = None
    abs_trace: Callable[[], float | tuple[float, float] | None] | None = (
        None  # Tr|H| known already, or (Tr|H|, its stderr) (None: the near-zero floor computes it)
    )

    def the_budget(self) -> Budget:
        """``budget``, or a budget without caps."""
        return self.budget if self.budget is not None else no_budget()


@dataclass(frozen=True)
class DiagonalCheck:
    """The checks of `flatcli.engine.linalg.checked_gauss_newton_diagonal`: relative tolerance ``tol``,
    ``check`` coordinates and ``probes`` Gaussian probes per tensor, at most ``max_exact`` unit-vector
    products for curved tensors, ``samples`` residual probes in ``groups`` groups for the rest."""

    tol: float
    check: int = 3
    probes: int = 2
    max_exact: int = 4096
    samples: int = 64
    groups: int = 8
