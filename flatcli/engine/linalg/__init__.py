r"""Matrix-free linear algebra for symmetric operators given as block mat-vecs.

Every estimator takes an operator: a `flatcli.engine.operators.CurvatureOperator`, or
`as_operator` of a bare ``matvec(V) -> H V`` for a block ``V`` of shape ``(K, P)`` and its
dimension; the operator supplies P and the device and dtype of the vectors. How the estimator
drives it is its own `EstimatorSettings` (``settings=``: the vectors per product, the basis caps
and the progress hook; `flatcli.engine.CurvatureEngine.estimator_settings` fills one from the
engine's runtime settings), so no estimator takes more than 8 parameters. The estimators touch
their vectors only through the operator's vector space (`flatcli.engine.linalg.vectors`: one flat
``(K, P)`` tensor, or one block per parameter on its own device and in its own dtype). Stopping rules travel in one frozen object per family
(`KrylovStop`, `ProbeStop`, `DiagonalCheck`; the `Budget` inside the first two). Every routine
returns its result together with diagnostics (steps, residuals, standard
errors, converged flags, number of products). Small projected problems are
solved in float64. Random probes come from a seeded CPU ``torch.Generator``;
drawing K probes at once gives the same probes as K single draws, so results do
not depend on how products are blocked.

References
----------
Block Lanczos with full reorthogonalization: Golub & Van Loan, *Matrix
Computations*, 4th ed., §10.1 and §10.3.6 (block Lanczos); the Ritz residual
identity :math:`\|Hx - \theta x\| = \|R\,y_{\text{last}}\|` (§10.1.4).
Hutchinson (1989); Hutch++: Meyer, Musco, Musco & Woodruff, SOSA 2021, Alg. 1.
Stochastic Lanczos quadrature: Ubaru, Chen & Saad, SIMAX 2017, §3 (eq. 3.5);
Ghorbani, Krishnan & Xiao, ICML 2019, §2. Diagonal estimators: Bekas, Kokiopoulou
& Saad 2007; Tsuzuku, Sato & Sugiyama, ICML 2020, eq. 29.
"""

from ._common import (
    MIN_NODES,
    MIN_SAMPLES,
    EstimatorSettings,
    MatVec,
    Operator,
    as_operator,
    rademacher,
    rowdot,
    t_factor,
)
from .budget import Budget
from .declarations import Cost
from .diagonal import (
    CheckedDiagonal,
    _check_coordinates,
    checked_diagonal_cost,
    checked_gauss_newton_diagonal,
    diagonal_check_cost,
    exact_diagonal,
    exact_diagonal_cost,
    hutchinson_diagonal,
    remainder_block_gaps,
    residual_groups,
    sampled_diagonal_cost,
    scaled_diagonal,
)
from .lanczos import (
    LANCZOS_WORK_VECTORS,
    LanczosResult,
    PrecisionControl,
    basis_floor,
    certified_min_steps,
    krylov_steps,
    lanczos,
    lanczos_cost,
    precision_control,
    precision_control_cost,
    verify_eigenpair,
    verify_eigenpair_cost,
)
from .slq import SLQResult, gauss_rule, slq, slq_cost, slq_group_size
from .stop import DiagonalCheck, KrylovStop, ProbeStop
from .trace import (
    NearZeroFloor,
    TraceResult,
    hutchinson,
    hutchinson_cost,
    hutchpp,
    hutchpp_cost,
    near_zero_cost,
    probes_to_tolerance,
)

__all__ = [
    "LANCZOS_WORK_VECTORS",
    "Budget",
    "Cost",
    "checked_diagonal_cost",
    "diagonal_check_cost",
    "exact_diagonal_cost",
    "sampled_diagonal_cost",
    "krylov_steps",
    "lanczos_cost",
    "precision_control_cost",
    "verify_eigenpair_cost",
    "slq_cost",
    "hutchinson_cost",
    "hutchpp_cost",
    "near_zero_cost",
    "MIN_NODES",
    "MIN_SAMPLES",
    "NearZeroFloor",
    "MatVec",
    "EstimatorSettings",
    "Operator",
    "as_operator",
    "KrylovStop",
    "ProbeStop",
    "DiagonalCheck",
    "rademacher",
    "rowdot",
    "CheckedDiagonal",
    "checked_gauss_newton_diagonal",
    "exact_diagonal",
    "hutchinson_diagonal",
    "residual_groups",
    "remainder_block_gaps",
    "scaled_diagonal",
    "LanczosResult",
    "PrecisionControl",
    "basis_floor",
    "certified_min_steps",
    "lanczos",
    "precision_control",
    "verify_eigenpair",
    "SLQResult",
    "gauss_rule",
    "slq",
    "slq_group_size",
    "t_factor",
    "TraceResult",
    "hutchinson",
    "hutchpp",
    "probes_to_tolerance",
    "_check_coordinates",
]
