r"""Block Lanczos with full reorthogonalization, its certified step count, and the precision
controls of converged eigenpairs (Golub & Van Loan §10.1, §10.3.6).

`lanczos`: unlike power iteration, the Ritz values converge to the *algebraic*
extremes: the largest eigenvalue is found even when a negative eigenvalue has larger
magnitude (the smallest: ``lanczos(-H)``).

Near zero: a relative test cannot be met by a Ritz value at 0, so the tolerance has an
absolute floor: the residual test is :math:`\|Hx_i - \theta_i x_i\| \le \mathrm{tol}\cdot
\max(|\theta_i|, \mathrm{tol}\cdot s)` with :math:`s = \max_j |\theta_j|` (all Ritz values:
the estimate of :math:`\|H\|_2` on the way). A wanted value with :math:`|\theta_i| <
\mathrm{tol}\cdot s` is 0 at the tolerance's resolution of the spectrum; it is then known to
:math:`\mathrm{tol}^2 s` absolutely (``near_zero`` set when such a value stopped the run).
Values above :math:`\mathrm{tol}\cdot s`, the usual case, keep the relative test unchanged.

Thick restarts (``max_basis``, ``runtime.max_basis_vectors``; Wu & Simon, SIMAX 22, 2000): full
reorthogonalization keeps one P-vector a step (40 steps of a 1B-parameter model: 160 GB in float32),
and host offload (`flatcli.engine.linalg._store`) only moves them. With a cap m, when the basis is
full before the run stops, it becomes the `restart_keep` (about m/2) best Ritz vectors and the
residual direction of the last block, T becomes diag(θ₁..θⱼ), and Lanczos goes on with full
reorthogonalization in that subspace of the Krylov space; the next orthogonalization projects the
new block's product on every basis row, which fills T's border (the coupling
:math:`R\,y[s{:}e]` of the residual identity) from the data.
The wanted Ritz values never get worse at a restart (the new space holds the old Ritz vectors; Cauchy
interlacing), and the cap is raised to ``min_steps`` (and to k + 2 blocks), so the first cycle is a
plain Krylov space of the certified dimension and the certificate of ``min_steps`` carries over. The
price is more products for the same residual where the top of the spectrum is not separated
(the benchmark pages of the docs). ``steps`` counts products; once restarted, T is no longer tridiagonal, so
``alphas``, ``betas`` and ``first_components`` (SLQ's) are None. Restarting was chosen over
selective reorthogonalization (Parlett & Scott 1979), which bounds the work, not the basis.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import recompute
from ._common import EstimatorSettings, as_operator, rademacher, rowdot, settings_or_default
from ._store import device_capacity
from .declarations import Cost
from .sem import mean_stderr
from .stop import KrylovStop
from .vectors import space_of

# P-vectors Lanczos holds beside its basis (in θ's element size): its float64 start (two), the
# product of the current block and the next block
LANCZOS_WORK_VECTORS = 4


@dataclass
class LanczosResult:
    """Ritz values of the Krylov space, descending.

    eigenvalues: all Ritz values, descending.
    residuals: Ritz residual norms ‖Hx − θx‖ matching ``eigenvalues``.
    steps: products (= the Krylov-space dimension reached, without restarts).
    converged: the ``k`` wanted pairs met the residual test (or the space is exact).
    """

    eigenvalues: np.ndarray
    residuals: np.ndarray
    steps: int
    converged: bool
    alphas: np.ndarray = field(repr=False, default=None)  # diagonal of T (block size 1)
    betas: np.ndarray = field(repr=False, default=None)  # off-diagonal of T (block size 1)
    ritz_vectors: torch.Tensor | None = field(
        repr=False, default=None
    )  # (k, P), in eigenvalue order
    first_components: np.ndarray | None = field(repr=False, default=None)  # e_1ᵀ S, for SLQ weights
    block: int = 1
    block_steps: int = 0
    n_hvp: int = 0
    device_vectors: int = 0  # most basis vectors on the device at once (`BasisStore.peak_resident`)
    near_zero: bool = False  # a wanted Ritz value below tol·max|θ|: stopped at the absolute floor
    stopped_by_budget: bool = False  # the `Budget` ran out before the residual test was met
    basis_vectors: int = 0  # most basis vectors kept (the thick-restart cap, or the step cap)
    restarts: int = 0  # thick restarts (``max_basis``)


def certified_min_steps(dim: int, eps: float = 0.25, delta: float = 0.01) -> int:
    r"""Fewest Lanczos steps after which a random start certifies the top Ritz value.

    Kuczyński & Woźniakowski (SIMAX 1992, Thm. 4.2): for a symmetric matrix and a Gaussian
    start, after k steps :math:`P[\lambda_1 - \theta_1 > \epsilon (\lambda_1 - \lambda_n)]
    \le 1.648 \sqrt{n}\, e^{-\sqrt{\epsilon}(2k - 1)}` (stated for PSD matrices; Krylov spaces
    are shift invariant, so it holds for :math:`H - \lambda_n I`). This returns the smallest k
    making that probability at most ``delta``: with it, "the residual is small" (θ₁ is close to
    *an* eigenvalue) becomes "θ₁ is close to the *largest* one" with probability ≥ 1 − δ over
    the start, whatever the spectrum.

    Parameters
    ----------
    dim : int
        The matrix dimension n.
    eps : float
        Relative gap ε of the certificate.
    delta : float
        Failure probability δ over the start.

    Returns
    -------
    int
        The fewest steps k (8 at n = 80, 12 at n = 84k and 14 at n = 11M with the defaults).
    """
    if dim <= 1:
        return 1
    need = math.log(1.648 * math.sqrt(dim) / delta) / math.sqrt(eps)
    return int(min(dim, max(1, math.ceil((need + 1) / 2))))


class _BlockKrylov:
    """The state of (block) Lanczos: basis (a `BasisStore`), projected matrix T, and Ritz pairs.

    ``max_rows``: the most basis rows (the step cap, or with ``capped`` the thick-restart cap
    ``max_basis``)."""

    def __init__(
        self,
        space,
        X,
        max_rows: int,
        capacity: int | None = None,
        capped: bool = False,
    ):
        b = space.count(X)
        self.capped = (
            capped  # max_rows is a thick-restart cap (else the step cap: a last partial block)
        )
        self.space, self.dtype = space, space.dtype
        self.Q = space.store(capacity=capacity, max_rows=max_rows, preallocate=capped)
        self.Q.append(space.native(space.qr(X)[0]))
        self.T = np.zeros((max_rows, max_rows), dtype=np.float64)
        self.s, self.e = 0, b
        self.block_width = b
        self.max_rows = max_rows
        self.restarts = 0

    def block(self) -> torch.Tensor:
        """The newest block of the basis (the input of the next product), on the device."""
        return self.Q.rows(self.s, self.e)

    def orthogonalize(self, W: torch.Tensor) -> torch.Tensor:
        """W − Q(QᵀW) against the whole basis; a second pass only where the first cancelled much
        (Daniel, Gragg, Kaufman & Stewart 1976: "twice is enough"). Fills T's new columns."""
        before = self.space.norm(W)
        W, C = self.Q.project_out(W)
        if bool((self.space.norm(W) < 0.7071 * before).any()):
            W, C2 = self.Q.project_out(W)
            C = C + C2
        C = C.double().cpu().numpy()
        s, e = self.s, self.e
        self.T[:e, s:e] = C
        self.T[s:e, :s] = C[:s].T
        self.T[s:e, s:e] = 0.5 * (C[s:e] + C[s:e].T)
        return W

    def ritz(self, W):
        """Ritz values (descending), vectors in T's basis, residual norms, and the next block.

        Residual identity: with W = Q_next R, ‖H x_i − θ_i x_i‖ = ‖R y_i[s:e]‖."""
        e, s = self.e, self.s
        evals, evecs = np.linalg.eigh(self.T[:e, :e])
        order = np.argsort(evals)[::-1]
        evals, evecs = evals[order], evecs[:, order]
        sp = self.space
        if e - s == 1:
            nrm = float(sp.frobenius(sp.wide(W)))
            R = np.array([[nrm]])
            Qnext = sp.div(W, nrm) if nrm > 0 else W
        else:
            Qd, R = sp.qr(sp.wide(W))
            Qnext = sp.native(Qd)
        res = np.linalg.norm(R @ evecs[s:e, :], axis=0)
        return evals, evecs, res, R, Qnext

    def room(self) -> int:
        """Rows the basis can still take."""
        return self.max_rows - self.e

    def extend(self, Qnext, keep: np.ndarray, most: int) -> None:
        """Append the kept directions of the next block (at most ``most``)."""
        width = min(len(keep), self.room(), most)
        Qn = self.space.take(Qnext, keep[:width])
        self.s, self.e = self.e, self.e + width
        self.Q.append(Qn)

    def grow(self, evals, evecs, Qnext, keep: np.ndarray, k: int, most: int) -> None:
        """The next block of the basis: appended, or after a thick restart when the basis is full."""
        b = self.block_width
        if self.capped and self.room() < min(len(keep), b):
            self.restart(evals, evecs, Qnext, keep, restart_keep(self.max_rows, k, b), most)
        else:
            self.extend(Qnext, keep, most)

    def restart(self, evals, evecs, Qnext, keep: np.ndarray, j: int, most: int) -> None:
        """Thick restart (Wu & Simon 2000): the basis becomes the ``j`` first Ritz vectors (in
        descending order) and the kept directions of the next block; T becomes diag(θ₁..θⱼ). Its
        border (the coupling ``R y[s:e]`` of the residual identity) is filled by the next
        orthogonalization, which projects the new block's product on every basis row."""
        keep = keep[: min(len(keep), most)]
        S = torch.as_tensor(evecs[:, :j].copy(), dtype=self.dtype)
        self.Q.restart(S, self.space.take(Qnext, keep))
        self.T[:] = 0.0
        self.T[np.arange(j), np.arange(j)] = evals[:j]
        self.s, self.e = j, j + len(keep)
        self.restarts += 1


def restart_keep(max_basis: int, k: int, block: int) -> int:
    """Ritz vectors a thick restart keeps: about half the basis, at least ``k``, leaving room for
    two more blocks (the next block and one product of it)."""
    return int(max(k, min((max_basis - block) // 2, max_basis - 2 * block)))


def host_fit(dim: int, dtype) -> int | None:
    """Vectors of ``dim`` coordinates of ``dtype`` that fit in half the free host memory
    (`flatcli.engine.recompute.free_bytes` of the CPU: ``MemAvailable``; None where unknown): what
    ``runtime.max_basis_vectors: auto`` allows."""
    free = recompute.free_bytes(torch.device("cpu"))
    return None if free is None else int(0.5 * free // max(1, dim * (torch.finfo(dtype).bits // 8)))


def basis_floor(dim: int, k: int, block: int, min_steps: int | None) -> int:
    """The least cap a Lanczos basis takes: the fewest steps (``min_steps``, default
    `certified_min_steps`), so that the first cycle certifies, and ``k`` + 2 blocks of room.

    Parameters
    ----------
    dim : int
        P, the vector length.
    k : int
        Wanted eigenpairs.
    block : int
        The Krylov block size.
    min_steps : int, optional
        The fewest steps (default `certified_min_steps`).

    Returns
    -------
    int
        The least number of basis vectors.
    """
    return max(certified_min_steps(dim) if min_steps is None else int(min_steps), k + 2 * block)


def basis_limit(setting, dim: int, dtype, rows: int, floor: int) -> int:
    r"""The most Lanczos basis rows, at most ``rows`` (the basis the run would build without a cap),
    from ``setting`` (``runtime.max_basis_vectors``): an int (raised to ``floor``, `basis_floor`),
    None (unbounded), or ``"auto"``: what fits in half the free host memory (`host_fit`), at least
    ``floor`` (the engine resolves its own ``auto`` once, the same on every rank)."""
    if isinstance(setting, str) and setting == "auto":
        setting = host_fit(dim, dtype)
    return rows if setting is None else min(rows, max(int(setting), floor))


def lanczos(
    op,
    *,
    k: int = 1,
    block: int | None = None,
    v0: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    return_vectors: bool = False,
    stop: KrylovStop = KrylovStop(),
    settings: EstimatorSettings | None = None,
) -> LanczosResult:
    r"""(Block) Lanczos with full reorthogonalization for the ``k`` largest eigenvalues (the
    smallest: ``lanczos(-H)``, negated).

    Builds an orthonormal basis :math:`Q` of the block Krylov space
    :math:`\mathrm{span}\{X, HX, H^2X, \dots\}` (``X``: ``block`` start vectors,
    default ``k``), reorthogonalizing every new block against all of :math:`Q`
    ("twice is enough"), and takes the Rayleigh-Ritz values of
    :math:`T = Q^\top H Q` (float64, assembled from the projection coefficients).
    A block start finds eigenvalues of multiplicity up to ``block``; with
    ``block=1`` this is classical Lanczos.

    Stops (``stop``, a `KrylovStop`) after at least ``min_steps`` products (default:
    `certified_min_steps`, which makes a small residual certify the *extreme* eigenvalue) once the
    residuals :math:`\|Hx_i - \theta_i x_i\|` of the ``k`` wanted Ritz pairs are at most
    ``tol * |\theta_i|`` (near zero: an absolute floor, module docstring); when the space is
    exhausted (an invariant subspace: exact Ritz values); or at ``max_steps`` products, or when
    ``stop.budget`` is spent (checked between blocks; ``stopped_by_budget``).

    Parameters
    ----------
    op : CurvatureOperator or Operator
        The symmetric operator: a `flatcli.engine.operators.CurvatureOperator`, or anything
        `as_operator` takes (a bare ``V (K, P) -> H V`` as ``as_operator(mv, dim)``); it gives P
        and the device and dtype of the vectors.
    k : int
        How many of the algebraically largest pairs must converge.
    block : int, optional
        Block size of the Krylov space (default ``k``); not the settings' ``block_size``.
    v0 : torch.Tensor, optional
        Start vector(s), shape (P,) or (block, P); default seeded Gaussian.
    generator : torch.Generator, optional
        Seeds the default start.
    return_vectors : bool
        Also return the Ritz vectors.
    stop : KrylovStop
        Tolerance, fewest and most steps, budget, the most basis vectors kept (``max_basis``;
        "auto": the settings' ``max_basis_vectors``).
    settings : EstimatorSettings, optional
        ``max_device_vectors`` bounds the basis vectors on the device at once (the rest live in
        host memory, pinned on CUDA, and reorthogonalization streams them in chunks; the values
        equal the all-on-device run's to rounding); ``max_basis_vectors`` and the progress hook.

    Returns
    -------
    LanczosResult
        Ritz values (and vectors), residuals, steps, products, convergence and restarts.
    """
    op, opts = as_operator(op), settings_or_default(settings)
    matvec, dim, device, dtype, space = op.matmat_rows, op.dim, op.device, op.dtype, space_of(op)
    budget, tol = stop.the_budget(), stop.tol
    max_steps = int(min(stop.max_steps, dim))
    wanted = max_steps
    left = budget.left()
    if left is not None:
        max_steps = int(
            min(max_steps, max(left, int(block or k or 1), 1))
        )  # the first block always runs
    min_steps = certified_min_steps(dim) if stop.min_steps is None else int(stop.min_steps)
    min_steps = int(min(min_steps, max_steps))
    X = _start_block(v0, block, k, dim, max_steps, generator)
    b = X.shape[0]
    setting = opts.max_basis_vectors if stop.max_basis == "auto" else stop.max_basis
    rows = basis_limit(setting, dim, dtype, max_steps, basis_floor(dim, k, b, min_steps))
    cap = device_capacity(opts.max_device_vectors, dim, device, dtype)
    kry = _BlockKrylov(
        space,
        space.from_flat(X.to(dtype=torch.float64)),
        rows,
        cap and max(int(cap), b),
        rows < max_steps,
    )
    converged = stopped = near_zero = False
    nblock = nprod = 0
    while True:
        nprod += kry.e - kry.s
        W = kry.orthogonalize(space.native(matvec(kry.block())))
        nblock += 1
        evals, evecs, res, R, Qnext = kry.ritz(W)
        kk = min(k, kry.e)
        scale = max(1.0, float(np.max(np.abs(evals))))
        keep = np.nonzero(np.abs(np.diag(R)) > 1e-10 * scale)[0]
        if len(keep) == 0 or kry.e >= dim:
            converged = True  # invariant subspace: the Ritz values are exact
            break
        opts.progress(
            steps=nprod, value=float(evals[0]), residual=float(res[0] / max(abs(evals[0]), 1e-30))
        )
        spread = float(np.max(np.abs(evals)))  # max |θ|: the estimate of ‖H‖₂ so far
        small = (
            np.abs(evals[:kk]) < tol * spread
        )  # 0 at the tolerance's resolution: the absolute floor
        floor = np.maximum(np.abs(evals[:kk]), max(tol * spread, 1e-30))
        if nprod >= min_steps and np.all(res[:kk] <= tol * floor):
            converged, near_zero = True, bool(small.any())
            break
        if nprod >= max_steps or budget.exhausted(nprod):
            stopped = nprod < wanted
            break
        kry.grow(evals, evecs, Qnext, keep, k, max_steps - nprod)
    e = kry.e
    ritz = None
    if return_vectors:
        S = torch.as_tensor(evecs[:, : min(k, e)], dtype=dtype, device=kry.Q.device)
        ritz = kry.Q.combine(S)
    T = kry.T[:e, :e]
    budget.spend(nprod)
    plain = kry.restarts == 0
    return LanczosResult(
        eigenvalues=evals,
        residuals=res,
        steps=nprod,
        converged=converged,
        alphas=np.diag(T).copy() if b == 1 and plain else None,
        betas=np.diag(T, -1).copy() if b == 1 and plain else None,
        ritz_vectors=ritz,
        first_components=evecs[0, :].copy() if plain else None,
        block=b,
        block_steps=nblock,
        n_hvp=nprod,
        device_vectors=kry.Q.peak_resident,
        near_zero=near_zero,
        stopped_by_budget=stopped,
        basis_vectors=rows,
        restarts=kry.restarts,
    )


def _start_block(v0, block, k, dim, max_steps, generator) -> torch.Tensor:
    """The (block, P) float64 start: ``v0`` completed with seeded Gaussian vectors."""
    if v0 is not None and v0.ndim == 1:
        v0 = v0[None]
    b = int(block) if block else (v0.shape[0] if v0 is not None else max(1, int(k)))
    b = max(1, min(b, max_steps))
    if v0 is None:
        return torch.randn(b, dim, generator=generator, dtype=torch.float64)
    v0 = v0.detach().cpu().double()
    if v0.shape[0] < b:
        extra = torch.randn(b - v0.shape[0], dim, generator=generator, dtype=torch.float64)
        v0 = torch.cat([v0, extra])
    return v0[:b]


@dataclass
class PrecisionControl:
    """A paired fp32 control sample of a trace estimate computed with fast (TF32) products.

    ``diff`` is the mean over the control probes of :math:`z^\top (H_{fast} - H_{fp32}) z`
    (the fast estimator's bias per probe), ``diff_stderr`` its standard error, ``rel_diff`` =
    ``|diff| / |mean of z^T H_fp32 z|``; ``probes`` products with each operator."""

    diff: float
    diff_stderr: float
    rel_diff: float
    probes: int


def precision_control(
    fast, exact, *, probes: int = 8, generator: torch.Generator
) -> PrecisionControl:
    """Compare a fast operator (TF32 products) with its fp32 view on the same Rademacher probes.

    Each probe costs one product with each operator; the difference of the quadratic forms is
    paired, so its mean estimates the bias the fast products put into a trace estimate
    (independently of the Monte-Carlo noise of the estimate itself).

    Parameters
    ----------
    fast, exact : CurvatureOperator or Operator
        The fast (TF32 or bf16) operator and its fp32 view.
    probes : int
        Paired Rademacher probes.
    generator : torch.Generator
        Seeded CPU generator of the probes.

    Returns
    -------
    PrecisionControl
        The mean paired difference of the quadratic forms, its standard error, and the relative
        difference.
    """
    Z = rademacher(probes, exact.shape[1], generator, exact.device, exact.dtype)
    qf = rowdot(Z, fast.matmat_rows(Z).to(Z.dtype)).cpu().numpy()
    qe = rowdot(Z, exact.matmat_rows(Z).to(Z.dtype)).cpu().numpy()
    d = qf - qe
    bias, se = mean_stderr(d)
    mean_e = float(np.mean(qe))
    return PrecisionControl(bias, se, abs(bias) / max(abs(mean_e), 1e-30), probes)


def verify_eigenpair(op, x: torch.Tensor) -> tuple[float, float]:
    r"""(Rayleigh quotient, relative residual) of ``x`` under ``op``, from one product.

    :math:`\lambda = x^\top H x / x^\top x` and :math:`\|Hx - \lambda x\| / |\lambda|`: how a
    Ritz pair found with fast (TF32) products is checked with full-precision ones.

    Parameters
    ----------
    op : CurvatureOperator or Operator
        The full-precision operator.
    x : torch.Tensor
        The Ritz vector, length P.

    Returns
    -------
    rayleigh, residual : float
        The Rayleigh quotient and the relative residual.
    """
    x = x.to(op.device, op.dtype)
    hx = op.matmat_rows(x).double()
    xd = x.double()
    lam = float(xd @ hx / (xd @ xd))
    res = float((hx - lam * xd).norm() / xd.norm())
    return lam, res / max(abs(lam), 1e-30)


# ---------------------------------------------------------------------------- declared costs


def krylov_steps(dim: int, stop: KrylovStop, block: int = 1) -> tuple[int, int]:
    """(least, most) products of `lanczos` from a random start under ``stop``: at least its
    ``min_steps`` (default `certified_min_steps`) and its first block (cut to ``max_steps``), at
    most ``max_steps``, never more than ``dim``."""
    least = certified_min_steps(dim) if stop.min_steps is None else int(stop.min_steps)
    first = max(1, min(block, int(stop.max_steps)))
    return min(dim, max(first, least)), min(dim, int(stop.max_steps))


def lanczos_cost(
    dim: int,
    stop: KrylovStop,
    *,
    k: int = 1,
    block: int = 1,
    warm: bool = False,
    work: bool = True,
) -> Cost:
    """What `lanczos` declares for ``k`` pairs in blocks of ``block`` under ``stop``.

    Products: `krylov_steps` (``warm``: a start from earlier Ritz vectors may stop after its first
    block). Vectors: the basis, one per step up to ``stop.max_basis`` raised to `basis_floor`
    (an int; otherwise unbounded), and `LANCZOS_WORK_VECTORS` per block vector. Vector operations:
    full reorthogonalization, twice, 2·j dot products and axpys at step j.

    Parameters
    ----------
    dim : int
        P, the vector length.
    stop : KrylovStop
        Its ``min_steps``, ``max_steps`` and ``max_basis`` (the tolerance and budget do not enter).
    k, block : int
        Wanted pairs and Krylov block size (as `lanczos` takes them).
    warm : bool
        Whether the run may start warm.
    work : bool
        Whether to count the working vectors (False where a part beside it, the bases of SLQ
        runs, already bounds them).

    Returns
    -------
    Cost
        Products in blocks of ``block``, basis and working vectors, reorthogonalization.
    """
    block = max(1, min(block, int(stop.max_steps)))  # as `lanczos` cuts its start block
    least, most = krylov_steps(dim, stop, block)
    if warm:
        least = min(dim, block)
    basis = most
    if isinstance(stop.max_basis, int):
        basis = min(most, max(stop.max_basis, basis_floor(dim, k, block, stop.min_steps)))
    return Cost(
        hvp=(least, most),
        block=block,
        vectors=basis + LANCZOS_WORK_VECTORS * block * work,
        vector_ops=(2 * min(least, most) ** 2, 2 * most**2),
    )


def verify_eigenpair_cost(pairs: int = 1) -> Cost:
    """`verify_eigenpair` of ``pairs`` Ritz pairs: one product each."""
    return Cost(hvp=pairs)


def precision_control_cost(probes: int) -> Cost:
    """`precision_control` with ``probes`` probes: one product with each operator per probe."""
    return Cost(hvp=2 * probes)
