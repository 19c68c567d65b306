"""Stochastic Lanczos quadrature (Ubaru, Chen & Saad, SIMAX 2017, §3, eq. 3.5; Ghorbani,
Krishnan & Xiao, ICML 2019, §2)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ._common import (
    MIN_NODES,
    MIN_SAMPLES,
    EstimatorSettings,
    MatVec,
    _tridiag_eig,
    as_operator,
    rademacher,
    settings_or_default,
    t_factor,
)
from ._store import device_capacity
from .budget import Budget, no_budget
from .declarations import Cost
from .sem import mean_stderr
from .vectors import space_of


@dataclass
class SLQResult:
    """Stochastic Lanczos quadrature nodes and weights per run, and the dimension P."""

    nodes: list[np.ndarray]  # Ritz values per run
    weights: list[np.ndarray]  # squared first components per run (sum to 1)
    dim: int
    n_hvp: int = 0
    steps: int = 0  # Lanczos steps requested per run (0: unknown; a shorter run ended on an invariant subspace)
    stopped_by_budget: bool = False  # fewer runs than asked: the `Budget` ran out

    def expect(self, fn: Callable[[np.ndarray], np.ndarray]) -> tuple[float, float]:
        r"""Estimate :math:`\mathrm{Tr}\, f(H) \approx \frac{P}{R}\sum_r \sum_i w_{ri} f(t_{ri})`
        and its standard error over the R runs ((nan, nan) without a run)."""
        if not self.nodes:
            return math.nan, math.nan
        vals = np.array(
            [
                self.dim * float(np.sum(w * fn(t)))
                for t, w in zip(self.nodes, self.weights, strict=True)
            ]
        )
        return mean_stderr(vals)

    def quadrature_error(self, fn: Callable[[np.ndarray], np.ndarray]) -> float:
        r"""An estimate (meant as a bound) of the Lanczos-quadrature error of `expect`'s value,
        which the standard error over runs does not contain where it has the same sign in every
        run (a bias).

        Per run, the m-point Gauss rule :math:`Q_m` (the run's nodes and weights) is compared
        with the rules of the same start vector after m − 1, m − 2 and ⌊m/2⌋ steps (`gauss_rule`,
        no products); the estimate is :math:`P\max_k |\mathrm{mean}_r (Q_{m,r} - Q_{k,r})|`,
        averaged over runs with its sign (errors that change sign from run to run are already in
        the spread over runs). The consecutive rules are the classical a-posteriori estimate for a
        smooth f; they collapse on an f with a kink inside the spectrum (log1p(max(t, 0)) on an
        indefinite Hessian), whose Gauss error decays slowly in m and alternates in sign from step
        to step: there the half-length rule carries it. Measured against dense float64 references
        (tests/fidelity_models.py, 40 runs of 25 steps): ½log(1 + λ₊) on the ReLU MLP B, true
        error +6.8, this estimate 24; on the tanh MLP A, true 0.53, estimate 1.5. A run is exact
        (no difference) when it stopped early on an invariant subspace or has as many nodes as
        the dimension."""
        diffs = np.zeros((len(self.nodes), 3))
        for r, (t, w) in enumerate(zip(self.nodes, self.weights, strict=True)):
            m = len(t)
            if (
                m >= self.dim
                or m < MIN_NODES
                or (self.steps and m < self.steps and not self.stopped_by_budget)
            ):
                continue
            q = float(np.sum(w * fn(t)))
            diffs[r] = [
                q - float(np.sum(wk * fn(tk)))
                for tk, wk in (gauss_rule(t, w, k) for k in (m - 1, m - 2, max(1, m // 2)))
            ]
        return float(self.dim * np.abs(diffs.mean(0)).max()) if len(diffs) else 0.0

    def stderr(self, fn: Callable[[np.ndarray], np.ndarray]) -> tuple[float, float, float, float]:
        """`expect`'s value and a standard error that covers its truth: the between-run standard
        error times `t_factor` combined with `quadrature_error` (root sum of squares). Returns
        (value, stderr, between-run stderr, quadrature error); stderr is nan for one run."""
        value, se = self.expect(fn)
        quad = self.quadrature_error(fn)
        total = (
            math.hypot(se * t_factor(len(self.nodes)), quad) if len(self.nodes) > 1 else math.nan
        )
        return value, total, se, quad

    def density(self, grid: np.ndarray, sigma: float) -> np.ndarray:
        """Gaussian-smoothed spectral density on ``grid`` (integrates to 1)."""
        out = np.zeros_like(grid, dtype=np.float64)
        for t, w in zip(self.nodes, self.weights, strict=True):
            out += (w[None, :] * np.exp(-((grid[:, None] - t[None, :]) ** 2) / (2 * sigma**2))).sum(
                1
            )
        return out / (len(self.nodes) * sigma * math.sqrt(2 * math.pi))


def gauss_rule(nodes: np.ndarray, weights: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    r"""The k-point Gauss rule of the discrete measure :math:`\sum_i w_i \delta_{t_i}` (k ≤ len(t)).

    For an SLQ run's m-point rule this is the rule k < m Lanczos steps of the same start vector
    would have given: the measure's first 2m − 1 moments are the run's, so its first k
    Lanczos coefficients (the leading k × k block of the run's tridiagonal) are too. Computed by
    Lanczos on diag(t) from the start vector √w, fully reorthogonalized, in float64.

    Parameters
    ----------
    nodes, weights : numpy.ndarray
        The measure's points t and weights w.
    k : int
        Points of the rule.

    Returns
    -------
    nodes, weights : numpy.ndarray
        The k-point rule.
    """
    t = np.asarray(nodes, dtype=np.float64)
    Q = np.zeros((k, len(t)))
    q = np.sqrt(np.asarray(weights, dtype=np.float64))
    q = q / np.linalg.norm(q)
    a, b = np.zeros(k), np.zeros(k)
    for j in range(k):
        Q[j] = q
        v = t * q
        a[j] = q @ v
        for _ in range(2):
            v = v - Q[: j + 1].T @ (Q[: j + 1] @ v)
        b[j] = np.linalg.norm(v)
        if j + 1 < k:
            if b[j] <= 1e-14 * max(1.0, float(np.abs(t).max())):
                a, b = a[: j + 1], b[: j + 1]
                break
            q = v / b[j]
    ev, S = _tridiag_eig(a, b[: len(a) - 1])
    return ev, S[0, :] ** 2


class _RunBases:
    """The Lanczos bases of R runs in lockstep: one (R, m, P) device tensor, or with a ``capacity``
    one offloaded `BasisStore` per run (reorthogonalized run by run, so at most ``capacity`` basis
    vectors are on the device at once)."""

    def __init__(self, space, R: int, m: int, capacity: int | None):
        self.R, self.space = R, space
        self.stores = None
        if (capacity is not None and capacity < m) or space.parts is not None:
            self.stores = [space.store(capacity=capacity, max_rows=m) for _ in range(R)]
        else:
            self.Q = torch.zeros(R, m, space.dim, device=space.device, dtype=space.dtype)

    @property
    def peak_resident(self) -> int:
        """Most basis vectors on the device at once."""
        if self.stores is None:
            return int(self.Q.shape[0] * self.Q.shape[1])
        return max(s.peak_resident for s in self.stores)

    def put(self, live: list[int], j: int, q) -> None:
        """Step j's vectors ``q`` of the live runs."""
        if self.stores is None:
            self.Q[torch.as_tensor(live, device=q.device), j] = q
            return
        for pos, r in enumerate(live):
            self.stores[r].append(self.space.take(q, [pos]))

    def reorthogonalize(self, W, live: list[int], j: int):
        """Each live run's row of W against its own basis (steps 0..j), twice."""
        if self.stores is not None:
            rows = []
            for pos, r in enumerate(live):
                w = self.space.take(W, [pos])
                for _ in range(2):
                    w, _c = self.stores[r].project_out(w)
                rows.append(w)
            return self.space.cat(rows)
        idx = torch.as_tensor(live, device=W.device)
        Qa = self.Q[:, : j + 1] if len(live) == self.R else self.Q[idx, : j + 1]
        for _ in range(2):
            W = W - torch.einsum("rj,rjp->rp", torch.einsum("rjp,rp->rj", Qa, W), Qa)
        return W


def _lanczos_runs(
    space,
    matvec: MatVec,
    V0,
    steps: int,
    capacity: int | None = None,
    stop: Callable[[], bool] | None = None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Independent single-vector Lanczos recurrences run in lockstep.

    Each step multiplies the current vectors of all live runs as one block; each
    run is fully reorthogonalized against its own basis (twice), kept on the device or,
    with a ``capacity``, in host memory (`_RunBases`). Returns the tridiagonal (alphas, betas)
    of every run. ``stop()`` true after a step ends every run there (a shorter run is a Gauss
    quadrature with fewer nodes: still an estimate).
    """
    R, m = space.count(V0), min(steps, space.dim)
    bases = _RunBases(space, R, m, capacity)
    q = space.native(V0)
    q = space.div_rows(q, space.norm(q))
    alphas = np.zeros((R, m))
    betas = np.zeros((R, m))
    length = np.full(R, m)
    live = list(range(R))
    for j in range(m):
        bases.put(live, j, q)
        W = space.native(matvec(q))
        a = space.sumprod(W, q)
        W = bases.reorthogonalize(W, live, j)
        bnorm = space.norm(W)
        halt = stop is not None and stop()
        a_np, b_np = a.double().cpu().numpy(), bnorm.double().cpu().numpy()
        keep = []
        for pos, r in enumerate(live):
            alphas[r, j] = a_np[pos]
            betas[r, j] = b_np[pos]
            scale = max(1.0, float(np.max(np.abs(alphas[r, : j + 1]))))
            if j + 1 >= m or b_np[pos] <= 1e-10 * scale or halt:
                length[r] = j + 1
            else:
                keep.append(pos)
        if not keep:
            break
        q = space.div_rows(space.take(W, keep), bnorm[torch.as_tensor(keep, device=bnorm.device)])
        live = [live[pos] for pos in keep]
    _lanczos_runs.last_device_vectors = bases.peak_resident  # instrumentation (tests)
    return [(alphas[r, : length[r]], betas[r, : length[r] - 1]) for r in range(R)]


HOST_ROOM = 2e9  # bytes the Lanczos bases of SLQ runs in lockstep may take in host memory


def slq_group_size(dim: int, steps: int, runs: int, *, device=None, dtype=torch.float32) -> int:
    """How many SLQ runs can share the device at once: their Lanczos bases
    (runs × steps × P numbers) must fit in a quarter of free CUDA memory, or 2 GB on CPU.

    Parameters
    ----------
    dim : int
        P, the vector length.
    steps, runs : int
        Lanczos steps per run and runs wanted.
    device, dtype : optional
        Where the bases live.

    Returns
    -------
    int
        Runs per group, between 1 and ``runs``.
    """
    elt = torch.finfo(dtype).bits // 8
    per_run = max(1, steps * dim * elt)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    budget = HOST_ROOM
    if dev.type == "cuda":
        try:
            budget = 0.25 * torch.cuda.mem_get_info(dev)[0]
        except RuntimeError:
            budget = HOST_ROOM
    return int(max(1, min(runs, budget // per_run)))


def slq(
    op,
    *,
    runs: int = 10,
    steps: int = 80,
    generator: torch.Generator | None = None,
    block: int | None = None,
    budget: Budget | None = None,
    starts: torch.Tensor | None = None,
    settings: EstimatorSettings | None = None,
) -> SLQResult:
    r"""Stochastic Lanczos quadrature (Ubaru, Chen & Saad 2017, eq. 3.5).

    For ``runs`` Rademacher starts :math:`v_r` (normalized), ``steps`` Lanczos
    steps with full reorthogonalization give the tridiagonal :math:`T_r` with
    eigenpairs :math:`(t_{ri}, s_{ri})`: nodes :math:`t_{ri}`, weights
    :math:`w_{ri} = (e_1^\top s_{ri})^2`, and
    :math:`\mathrm{Tr} f(H) \approx \frac{P}{R}\sum_r \sum_i w_{ri} f(t_{ri})`.

    Runs proceed in lockstep, ``block`` at a time (default: as many as
    `slq_group_size` allows), each step one block product. Probe r is the same
    whatever the grouping, so results do not depend on ``block``.

    Parameters
    ----------
    op : CurvatureOperator or Operator
        An operator or anything `as_operator` takes (P, device, dtype from it).
    runs : int
        Rademacher starts (ignored when ``starts`` is given).
    steps : int
        Lanczos steps per run.
    generator : torch.Generator, optional
        Seeded CPU generator of the starts.
    block : int, optional
        Runs in lockstep (default `slq_group_size`).
    budget : Budget, optional
        Checked before each group of runs; a group is cut to the runs whose ``steps`` products it
        still allows, and when it is spent the runs done so far are the result
        (``stopped_by_budget``). The first group always runs: one run under a product cap, up to
        `MIN_SAMPLES` in lockstep (no more than ``block``) under a time cap only, whose runs end at
        the step where the time is up; a run cut before `MIN_NODES` nodes is dropped, so the
        result may hold no run at all (`expect` is then NaN).
    starts : torch.Tensor, optional
        (R, P) start vectors instead of ``runs`` draws (a caller continuing one stream of probes).
    settings : EstimatorSettings, optional
        With ``max_device_vectors`` below ``steps`` each run's basis lives in host memory and is
        streamed in chunks; the nodes and weights equal the all-on-device run's to rounding.

    Returns
    -------
    SLQResult
        Nodes and weights per run, from which ``Tr f(H)`` estimates follow, with the products and
        ``stopped_by_budget``.
    """
    op = as_operator(op)
    matvec, dim, device, dtype = op.matmat_rows, op.dim, op.device, op.dtype
    if starts is not None:
        runs = int(starts.shape[0])
    elif generator is None:
        raise ValueError("slq needs a generator or the start vectors (starts)")
    steps = int(min(steps, dim))
    g = int(block) if block else slq_group_size(dim, steps, runs, device=device, dtype=dtype)
    g = max(1, min(g, runs))
    budget = budget if budget is not None else no_budget()
    cap = device_capacity(settings_or_default(settings).max_device_vectors, dim, device, dtype)
    V0 = (
        starts.to(torch.float64)
        if starts is not None
        else rademacher(runs, dim, generator, dtype=torch.float64)
    )
    nodes, weights = [], []
    used, i, dropped = 0, 0, 0
    while i < runs:
        n = budget.allow(min(g, runs - i) * steps, used) // steps
        if i == 0:  # the first group always runs: up to MIN_SAMPLES runs in lockstep under a
            # time cap, never more than the group's memory allows
            n = max(n, 1 if budget.max_products is not None else min(MIN_SAMPLES, runs, g))
        if n == 0:
            break
        cut = budget.out_of_time if (budget.max_seconds is not None and i == 0) else None
        for a, b in _lanczos_runs(
            space_of(op), matvec, space_of(op).from_flat(V0[i : i + n]), steps, cap, cut
        ):
            used += len(a)
            if len(a) < min(MIN_NODES, steps) and cut is not None and cut():
                dropped += 1  # cut by the time cap before its third node: no estimate
                continue
            t, S = _tridiag_eig(a, b)
            nodes.append(t)
            weights.append(S[0, :] ** 2)
        i += n
    budget.spend(used)
    short = dropped > 0 or (any(len(t) < steps for t in nodes) and budget.out_of_time())
    return SLQResult(
        nodes, weights, dim, n_hvp=used, stopped_by_budget=i < runs or short, steps=steps
    )


# ---------------------------------------------------------------------------- declared costs


def slq_cost(dim: int, runs: int | tuple[int, int], steps: int) -> Cost:
    """What `slq` declares for ``runs`` runs (or a (least, most) range of runs) of ``steps``
    Lanczos steps, in lockstep: one product per run and step (at most ``dim`` steps), each run's
    basis, and each run's reorthogonalization against its own basis (twice)."""
    lo, hi = runs if isinstance(runs, tuple) else (runs, runs)
    m = min(steps, dim)
    return Cost(
        hvp=(lo * m, hi * m),
        block=min(lo, hi),
        vectors=(lo * m, hi * m),
        batched_vector_ops=(2 * lo * m**2, 2 * hi * m**2),
    )
