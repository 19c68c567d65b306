r"""Sharpness family: worst-case and average perturbations, Keskar's ε-sharpness, GAM.

Let :math:`c = |\theta| + \eta` (adaptive, ASAM's η = 0.01) or :math:`c = 1`
(standard). Adaptive scaling follows ASAM's reference implementation: every
parameter whose name contains ``weight`` (Linear/Conv weights, normalization
scales) gets :math:`c_i = |\theta_i| + \eta`; every other parameter (biases)
gets :math:`c_i = 1`. All perturbations go through functional parameters
(``problem.batch_loss_sum(problem.unflatten(theta + delta), x, y)``); the model
is never touched.

Which loss each measure uses:

* ``sharpness_worst``: the *m-sharpness* mean over batches B of size
  ``batch_size`` of a partition of the measurement set S (shuffled once with the
  measure's seed), each batch weighted by ``|B|/n``, of that batch's own worst case.
  With ``batch_size ≥ n`` it is the worst case of the full-set loss L.
* ``sharpness_average``, ``keskar_sharpness``, ``first_order_flatness``: the
  full-set loss L over S.

Ascent. Maximizations use Auto-PGD (Croce & Hein, ICML 2020, Alg. 1): initial
step 2ρ, momentum α = 0.75, checkpoints :math:`w_j = \lceil p_j N\rceil` with
:math:`p_0 = 0, p_1 = 0.22, p_{j+1} = p_j + \max(p_j - p_{j-1} - 0.03, 0.06)`;
at a checkpoint the step is halved and the iterate restarted from the best point
when fewer than 75% of the steps since the last checkpoint increased the
objective (condition 1) or the step was not halved at the last checkpoint and the
best value did not improve since (condition 2). Steps are normalized gradients
(ℓ2) or gradient signs (ℓ∞), projected onto the ball. Each restart starts from a
seeded random point inside the ball (uniform in the ball / box): at an exact
minimum the gradient vanishes and an ascent from δ = 0 never moves.
``sharpness_worst`` also starts from the top Hessian eigenvectors (``eigen_starts``:
±ρv in ℓ2, refined sign corners in ℓ∞) and, in ℓ∞, searches the box corners with the true
loss (exhaustively when 2^P ≤ ``corners``; see its docstring). δ = 0 is
kept as a candidate, so worst-case values are ≥ 0, and the value is the maximum
over restarts. A non-finite perturbed loss stops the ascent and is reported with
status ``non_finite`` (value ``inf`` for +inf, ``nan`` for NaN), never clipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..engine import linalg
from ..engine.linalg.sem import mean_stderr
from ..errors import ConfigError
from . import Cost, Measure, MeasureResult
from ._ascent import _direction, _nonfinite_value, apgd, random_start, scale_vector
from ._options import Bool, Integral, OneOf, Optional, Real, opt

# ---------------------------------------------------------------- sharpness_worst


@dataclass(frozen=True)
class WorstOptions:
    """Options of ``sharpness_worst``."""

    rho: float = opt(
        0.05, Real(0, None, "neither"), "radius ρ of the perturbation ball ‖δ/c‖_p ≤ ρ"
    )
    norm: str = opt("l2", OneOf("l2", "linf"), "ball: l2 or linf")
    adaptive: bool = opt(False, Bool(), "scale by c = |θ| + η on weights (ASAM); c = 1 otherwise")
    eta: float = opt(0.01, Real(0, None, "left"), "η of the adaptive scale c = |θ| + η")
    batch_size: int = opt(
        128, Integral(1, None), "m of m-sharpness: batch size of the per-batch worst case"
    )
    steps: int = opt(20, Integral(0, None), "Auto-PGD iterations per restart")
    restarts: int = opt(1, Integral(1, None), "random restarts; the maximum is reported")
    eigen_starts: int = opt(
        1,
        Integral(0, None),
        "top eigenvectors v of the scaled Hessian CHC whose ± starts (ρ·sign(v) in linf, ρv in l2) "
        "begin extra ascents in every batch; 0: random starts only",
    )
    first_order: bool = opt(False, Bool(), "SAM's one-step value instead of the ascent")
    corners: int = opt(
        4096,
        Integral(0, None),
        "linf: loss evaluations per batch for the corner search: every one of the 2^P corners when 2^P ≤ corners, "
        "else one-flip local searches of the true loss (when P ≤ corners); 0: off",
    )


MODEL_RANK = 10  # Ritz pairs in the low-rank model of CHC used by the corner search
MAX_FLIPS = 64  # most one-coordinate flips of the corner search per start


def corner_search(s: torch.Tensor, V: torch.Tensor, lam: torch.Tensor, max_flips: int = MAX_FLIPS):
    r"""Best-improvement one-flip local search for :math:`\max_{s \in \{\pm1\}^P} \sum_i \lambda_i (v_i^\top s)^2`.

    ``V`` (k, P) and ``lam`` (k,) are Ritz pairs of CHC: the low-rank model of the
    quadratic :math:`s^\top CHC s`. Flipping :math:`s_j` changes the model by
    :math:`\sum_i \lambda_i (4V_{ij}^2 - 4 s_j V_{ij} (v_i^\top s))`; the best flip is
    taken while it gains, at most ``max_flips`` times. Returns the corner."""
    s = s.clone()
    proj = V @ s
    lam_v2 = lam @ (V * V)
    for _ in range(max_flips):
        gain = 4.0 * (lam_v2 - s * ((lam * proj) @ V))
        j = int(torch.argmax(gain))
        if float(gain[j]) <= 1e-12 * max(1.0, float((lam * proj * proj).sum())):
            break
        proj = proj - 2.0 * s[j] * V[:, j]
        s[j] = -s[j]
    return s


def eigen_starts(ctx, c: torch.Tensor, k: int, rho: float, norm: str):
    """(starts, HVPs, patterns, stopped by the budget): ascent starts from the top-k eigenvectors v_i of CHC (C = diag(c)),
    and (ℓ∞) the ± refined sign corners of all the model's Ritz vectors, starts of `corner_maximum`.

    Lanczos through the engine's HVPs of the full-set loss at θ (at least 20 and at
    most 60 products, stopped once the top ``k`` Ritz residuals, ℓ∞: ``max(k, MODEL_RANK)``
    for the corner search's model, are at most 1e-2 relative), seeded. ℓ2 uses only the
    top ``k``: waiting for 10 pairs there cost 60 instead of about 20 products (a tiny GPT-2
    under ``-m all``). ℓ2: ±ρ·v_i. ℓ∞: ±ρ·s_i with s_i the corner
    `corner_search` reaches from sign(v_i) on the rank-``MODEL_RANK`` Ritz model of
    CHC (no further HVPs)."""
    p, eng = ctx.problem, ctx.engine
    k = min(k, p.num_params)
    rank = min(max(k, MODEL_RANK) if norm == "linf" else max(k, 1), p.num_params)
    before = eng.counters()["n_hvp"]
    H = eng.hessian()
    r = linalg.lanczos(
        linalg.as_operator(lambda V: c * H(c * V), p.num_params, device=p.device, dtype=p.dtype),
        k=rank,
        generator=ctx.generator(7),
        return_vectors=True,
        stop=_eigen_stop(ctx.budget, eng.estimator_settings.max_basis_vectors),
    )
    V = r.ritz_vectors
    V = V / V.norm(dim=1, keepdim=True)
    lam = torch.as_tensor(r.eigenvalues[: V.shape[0]], dtype=V.dtype, device=V.device)
    starts, patterns = [], []
    for i, v in enumerate(V):
        if norm == "linf":
            sgn = corner_search(torch.where(v >= 0, 1.0, -1.0).to(V), V, lam)
            patterns += [sgn, -sgn]
        if i < k:
            z = rho * (sgn if norm == "linf" else v)
            starts += [z, -z]
    return starts, eng.counters()["n_hvp"] - before, patterns, r.stopped_by_budget


def m_batches(problem, batch_size: int, gen: torch.Generator):
    """The measurement set's rows shuffled once with ``gen`` and cut into batches of ``batch_size``
    rows (every rank draws the same permutation; the engine splits each batch over the ranks)."""
    perm = torch.randperm(problem.rows, generator=gen)
    return problem.batch.select(perm).split(batch_size)


def _best_ascent(fg, starts, opts, stop=None) -> tuple[float, str, int, bool, list]:
    """(best value, the kind of start that won, step halvings, finite, each ascent's best point) of
    Auto-PGD from every start; δ = 0 is a candidate (value 0, kind "zero"); a non-finite value stops at once.
    ``stop()`` true (a budget) ends the ascent under way and skips the remaining starts."""
    best, won, reductions, points = 0.0, "zero", 0, []
    for kind, z0 in starts:
        if points and stop is not None and stop():
            break
        r = apgd(fg, z0, opts.rho, opts.norm, opts.steps, stop=stop)
        reductions += r.reductions
        if not r.finite:
            return r.value, won, reductions, False, points
        points.append(r.z)
        if r.value > best:
            best, won = r.value, kind
    return best, won, reductions, True, points


def _all_corners(P: int, chunk: int = 1024):
    """Every s ∈ {±1}^P, in blocks of ``chunk`` rows (binary counting)."""
    bits = 2 ** torch.arange(P - 1, -1, -1)
    for start in range(0, 2**P, chunk):
        idx = torch.arange(start, min(start + chunk, 2**P))
        yield torch.where((idx[:, None] // bits) % 2 == 1, 1.0, -1.0).to(torch.float64)


def _one_flip_search(
    f, s: torch.Tensor, value: float, budget: int
) -> tuple[float, torch.Tensor, int, bool]:
    """Best-improvement one-flip local search of f over corners from s: (value, corner, evaluations, whether
    it stopped at a one-flip local maximum rather than at the budget)."""
    used = 0
    while used + len(s) <= budget:
        vals = []
        for j in range(len(s)):
            t = s.clone()
            t[j] = -t[j]
            vals.append(f(t))
        used += len(s)
        j = max(range(len(s)), key=vals.__getitem__)
        if not vals[j] > value:
            return value, s, used, True
        s = s.clone()
        s[j] = -s[j]
        value = vals[j]
    return value, s, used, False


def corner_maximum(f, P: int, starts: list[torch.Tensor], budget: int) -> tuple[float, int, str]:
    r"""The largest f(s) over corners s ∈ {±1}^P found within ``budget`` evaluations: (value, evaluations, mode).

    ``mode`` "exhaustive": 2^P ≤ budget, every corner evaluated (the exact maximum over corners);
    "local": one-flip local searches of f (`_one_flip_search`) from each sign pattern of ``starts`` in turn,
    each ending at a corner no single flip improves; "budget": the budget ran out during a search;
    "off": P > budget (a single sweep does not fit). f may return non-finite values; they are skipped."""

    def safe(t):
        v = f(t)
        return v if math.isfinite(v) else -math.inf

    if P <= 30 and 2**P <= budget:
        return max(safe(t) for block in _all_corners(P) for t in block), 2**P, "exhaustive"
    if P > budget:
        return -math.inf, 0, "off"
    best, used, seen, mode = -math.inf, 0, set(), "local"
    for z in starts:
        s = torch.where(z >= 0, 1.0, -1.0).to(torch.float64).cpu()
        key = tuple(s.tolist())
        if key in seen or used + 1 + P > budget:
            mode = mode if key in seen else "budget"
            continue
        seen.add(key)
        v0 = safe(s)
        v, _, k, done = _one_flip_search(safe, s, v0, budget - used - 1)
        used += 1 + k
        best = max(best, v)
        mode = mode if done else "budget"
    return best, used, mode


def _eigen_stop(budget=None, max_basis=None) -> linalg.KrylovStop:
    """The stop of the Lanczos behind the eigenvector starts."""
    return linalg.KrylovStop(
        tol=1e-2, min_steps=20, max_steps=60, budget=budget, max_basis=max_basis
    )


class SharpnessWorst(Measure):
    r"""Worst-case sharpness, larger means sharper.

    .. math:: S = \sum_B \frac{|B|}{n} \max_{\|\delta / c\|_p \le \rho} L_B(\theta + \delta) - L_B(\theta)

    over the batches B (size ``batch_size``) of the measurement set shuffled with
    the seed; p ∈ {2, ∞}; c as in the module docstring. The inner maximum is taken
    by Auto-PGD in the rescaled coordinates z = δ/c from ``restarts`` seeded
    random starts and, with ``eigen_starts = k > 0`` (default 1), from the 2k
    starts ±ρ·v_i (ℓ2) or ±ρ·s_i (ℓ∞), v_1..v_k the top eigenvectors of the
    scaled full-set Hessian CHC (C = diag(c)), found by Lanczos through the
    engine's HVPs (20 to 60 products), and s_i the corner of the box reached from
    sign(v_i) by a best-improvement one-flip search (at most 64 flips) on the
    rank-10 Ritz model Σ_j λ_j (v_jᵀs)² of sᵀCHCs (no further HVPs); δ = 0 is
    kept as a candidate. Why: at a minimum the increase is ½zᵀCHCz to second order, whose
    maximum over the ℓ2 ball is ρ·v_1 and over the box a corner, a problem the
    sign of the top eigenvector approximates (spectral rounding) and the flip
    search refines (a fixed point s = sign(CHCs) of the sign-gradient ascent need
    not be a one-flip maximum), and which a sign-gradient ascent from a random
    start often misses: on least squares at its exact minimum (5 to 16
    parameters, ρ = 0.1) one random start alone reached 50-76% of the best corner
    on some problems where the default reaches it (tests/measures/test_sharpness.py). The
    same full-set eigenvectors start the ascent of every m-batch (they approximate
    the batch Hessians' top directions). Diagnostic ``best_start`` counts the
    batches whose maximum came from an ``eigen``, a ``random`` start, the ``corner`` search or ``zero``.

    ℓ∞ corner search (``corners``, default 4096 loss evaluations per batch). After the
    ascents, the corners z = ρs, s ∈ {±1}^P, are searched with the true batch loss
    (`corner_maximum`): when 2^P ≤ ``corners`` (P ≤ 12 by default) every corner is
    evaluated, so the value is at least the exact maximum over the corners (which is the
    maximum over the box when the loss is convex in δ, e.g. at a minimum of a quadratic);
    otherwise, while a sweep fits (P ≤ ``corners``), best-improvement one-flip searches run
    from the sign pattern of every ascent's best point and from ± the refined sign corners
    of the 10 Ritz vectors, each ending at a corner no single flip improves, until the
    budget is spent. That second mode is a heuristic, not a certificate: on Linear(2, 3) →
    ReLU → Linear(3, 2) nets (17 parameters) with cross-entropy, 40 seeds × ρ ∈ {0.05, 0.2},
    it reached the brute-force corner maximum in all 80 cases (428 evaluations on
    average), where the ascents alone reached 56–100% (below 99% in 17 of 80); an
    independent review found it in 47 of 48 cases at 14–16 parameters, the
    48th (a 2→2→3 net, ρ = 0.5) stopping 3.2% below after 140 evaluations. What it
    guarantees: a corner no single flip improves, at least as good as every start's
    corner; for the exact corner maximum set ``corners`` ≥ 2^P. Beyond
    P > ``corners`` only the ascents run. Diagnostics ``corner_search`` (``exhaustive``,
    ``local``, ``budget`` when a search was cut short, ``off``) and ``corner_evals``.
    ``first_order: true`` gives
    SAM's one-step value instead: z = ρ ∇_z/‖∇_z‖ (ℓ2) or ρ sign(∇_z) (ℓ∞) with
    :math:`\nabla_z = c \circ \nabla L_B(\theta)`, and the loss difference there
    (at an exact minimum the gradient is round-off and its direction arbitrary:
    the one-step value is then that of some direction of the ball; use the ascent).

    Caps (``max_seconds``, ``max_hvps``, ``runtime.budget``) stop the eigen-start Lanczos early
    (rougher starts), and on one process a time cap also ends the ascents (the best point so
    far, remaining starts skipped; under torchrun the ascents always run): status ``budget``,
    the value a lower bound of the maximum.

    Diagnostics: ``batches``, ``batch_min``, ``batch_max``, ``batch_stderr``
    (spread across batches, not an error of the maximum), ``reductions`` (Auto-PGD
    step halvings), ``n_grad``/``n_forward`` (full-set equivalents), ``n_hvp``
    (Lanczos products), ``best_start_eigen``/``best_start_random``/``best_start_zero``.
    """

    name = "sharpness_worst"
    stops_early = True  # its estimator checks the budget between blocks
    options = WorstOptions
    description = "Worst-case (m-)sharpness: mean over batches of max_{‖δ/c‖_p≤ρ} L_B(θ+δ) − L_B(θ) (Auto-PGD)."
    reference = (
        "Keskar et al. 2017; Foret et al. 2021 (SAM, eq. 1); Kwon et al. 2021 (ASAM, eq. 8); "
        "Andriushchenko et al. 2023 (m-sharpness, §2); Croce & Hein 2020 (Auto-PGD, Alg. 1)"
    )
    stochastic = True
    invariant = False

    def declare_cost(self, o, d) -> Cost:
        """Auto-PGD's gradient passes from every start, the corner search's forward passes, and the
        products of the Lanczos behind the eigenvector starts."""
        if o.first_order:
            return Cost(grad=1, forward=1)
        lanczos = Cost(hvp=0)
        if o.eigen_starts > 0:
            lanczos = linalg.lanczos_cost(d.P, _eigen_stop()).products()
        evals = (o.restarts + 2 * min(o.eigen_starts, d.P)) * (o.steps + 1)
        corners = o.corners if o.norm == "linf" and d.P <= o.corners else 0
        return Cost(grad=(1, evals), forward=(1, 1 + corners)) + lanczos

    def compute(self, ctx, opts: WorstOptions) -> MeasureResult:
        p = ctx.problem
        c = scale_vector(p, opts.adaptive, opts.eta)
        gen = ctx.generator()
        batches = m_batches(p, opts.batch_size, gen)
        eig_starts, lanczos_hvps, patterns, stopped = [], 0, [], False
        if not opts.first_order and opts.eigen_starts > 0:
            eig_starts, lanczos_hvps, patterns, stopped = eigen_starts(
                ctx, c, opts.eigen_starts, opts.rho, opts.norm
            )
        # Each batch's random starts come from the generator state at that batch (the draws of one
        # process, batch after batch), so that the batches can be solved on any rank
        # (engine.map_batches) with the same starts; only the states are kept, not the draws.
        states = []
        for _ in batches:
            states.append(gen.get_state())
            for _ in range(0 if opts.first_order else opts.restarts):
                random_start(p.num_params, opts.rho, opts.norm, gen, "cpu", torch.float64)
        work = list(zip(batches, states, strict=True))
        fired: list[bool] = []

        def stop() -> bool:  # one process only: ranks would have to agree inside map_batches
            late = ctx.budget.out_of_time()
            fired.extend([True] if late else [])
            return late

        own = None if p.dist.active else stop
        outcomes = ctx.engine.map_batches(
            work,
            lambda item: _batch_worst(ctx, item[0], c, opts, eig_starts, patterns, item[1], own),
        )
        stopped = stopped or bool(fired)
        return _worst_result(p, opts, work, outcomes, len(eig_starts), lanczos_hvps, stopped)


def _worst_result(
    p, opts: WorstOptions, work, outcomes, n_eigen: int, lanczos_hvps: int, stopped: bool
) -> MeasureResult:
    """`sharpness_worst`'s value (the ``|B|/n``-weighted mean of the batches' maxima) and diagnostics
    from the batches' outcomes ``(best, winning start, reductions, corner evaluations, mode)``."""
    tally = {
        "wins": {"eigen": 0, "random": 0, "zero": 0, "corner": 0},
        "reductions": 0,
        "corner_evals": 0,
        "corner_modes": set(),
    }
    per_batch: list[float] = []
    weights: list[float] = []
    for (mb, _), (best, won, red, evals, mode) in zip(work, outcomes, strict=True):
        per_batch.append(best)
        weights.append(p.units(mb) / p.n)
        if won is not None:
            tally["wins"][won] += 1
        tally["reductions"] += red
        tally["corner_evals"] += evals
        if mode is not None:
            tally["corner_modes"].add(mode)
    diag = {
        "batches": len(work),
        "batch_min": min(per_batch),
        "batch_max": max(per_batch),
        "reductions": tally["reductions"],
        "lanczos_hvps": lanczos_hvps,
        "eigen_starts": n_eigen,
        **{f"best_start_{k}": v for k, v in tally["wins"].items()},
    }
    if opts.norm == "linf" and not opts.first_order:
        modes = tally["corner_modes"]
        diag["corner_search"] = next(
            (m for m in ("off", "budget", "local") if m in modes), "exhaustive"
        )
        diag["corner_evals"] = tally["corner_evals"]
    bad = [v for v in per_batch if not math.isfinite(v)]
    if bad:
        diag["non_finite_batches"] = len(bad)
        return MeasureResult(value=_nonfinite_value(bad), diagnostics=diag, status="non_finite")
    value = sum(w * v for w, v in zip(weights, per_batch, strict=True))
    if len(per_batch) > 1:
        diag["batch_stderr"] = mean_stderr(per_batch)[1]
    return MeasureResult(value=value, diagnostics=diag, status="budget" if stopped else "ok")


def _batch_worst(ctx, mb, c, opts: WorstOptions, eig_starts, patterns, random_state, stop=None):
    """One batch's worst case: SAM's step, or the ascents from ``eig_starts`` and ``restarts``
    random starts drawn from the generator state ``random_state``, and (ℓ∞) the corner search.
    Returns (value, the start that won or None, Auto-PGD reductions, corner evaluations,
    corner-search mode or None): the batch's whole record, so that batches can be solved on
    different ranks."""
    p, eng = ctx.problem, ctx.engine
    theta = p.theta
    base, g0 = eng.batch_loss_grad(mb, theta, need_grad=opts.first_order)
    if not math.isfinite(base):
        return base, None, 0, 0, None
    if opts.first_order:
        z = opts.rho * _direction(c * g0, opts.norm)
        val, _ = eng.batch_loss_grad(mb, theta + c * z, need_grad=False)
        return val - base, None, 0, 0, None

    def fg(z):
        val, gr = eng.batch_loss_grad(mb, theta + c * z)
        return val - base, (c * gr if gr is not None else None)

    gen = torch.Generator()
    gen.set_state(random_state)
    starts = [("eigen", z) for z in eig_starts] + [
        ("random", random_start(p.num_params, opts.rho, opts.norm, gen, p.device, p.dtype))
        for _ in range(opts.restarts)
    ]
    best, won, red, ok, points = _best_ascent(fg, starts, opts, stop)
    evals, mode = 0, None
    if ok and opts.norm == "linf" and opts.corners > 0:

        def f(sgn):
            z = opts.rho * sgn.to(theta.device, theta.dtype)
            return eng.batch_loss_grad(mb, theta + c * z, need_grad=False)[0] - base

        value, evals, mode = corner_maximum(f, p.num_params, points + patterns, opts.corners)
        if value > best:
            best, won = value, "corner"
    return best, won, red, evals, mode


# ---------------------------------------------------------------- sharpness_average


@dataclass(frozen=True)
class AverageOptions:
    """Options of ``sharpness_average``."""

    rho: float = opt(
        0.01, Real(0, None, "neither"), "noise scale ρ: δ = ρ·c∘N(0, I) (l2) or ρ·c∘U[−1, 1] (linf)"
    )
    norm: str = opt("l2", OneOf("l2", "linf"), "l2: Gaussian noise; linf: uniform in the box")
    adaptive: bool = opt(False, Bool(), "scale by c = |θ| + η on weights (ASAM); c = 1 otherwise")
    eta: float = opt(0.01, Real(0, None, "left"), "η of the adaptive scale c = |θ| + η")
    samples: int = opt(20, Integral(2, None), "Monte-Carlo draws")


class SharpnessAverage(Measure):
    r"""Average-case sharpness over the full measurement-set loss, larger means sharper.

    .. math:: S_{avg} = \mathbb{E}_\delta\, L(\theta + \delta) - L(\theta),\quad
       \delta = \rho\, c \circ \xi,\ \xi \sim N(0, I)\ (\ell_2)\ \text{or}\ U[-1, 1]^P\ (\ell_\infty)

    estimated with ``samples`` seeded draws; ``stderr`` is the standard error of
    the mean. It can be negative (θ is not a minimum) and is reported as it is.
    At a minimum of a quadratic, ℓ2 gives :math:`\tfrac12\rho^2\mathrm{Tr}(C H C)`.
    """

    name = "sharpness_average"
    options = AverageOptions
    description = "Average sharpness E_δ L(θ+δ) − L(θ), δ = ρ·c∘N(0,I) or uniform in the box (may be negative)."
    reference = (
        "Jiang et al. 2020 (§C, sharpness-based measures); Kwon et al. 2021 (adaptive scale); "
        "Andriushchenko et al. 2023 (average-case sharpness, eq. 2)"
    )
    stochastic = True

    def declare_cost(self, o, d) -> Cost:
        """One forward pass at θ and one per perturbation (``samples``)."""
        return Cost(forward=o.samples + 1)

    def compute(self, ctx, opts: AverageOptions) -> MeasureResult:
        p, eng = ctx.problem, ctx.engine
        theta = p.theta
        c = scale_vector(p, opts.adaptive, opts.eta)
        gen = ctx.generator()
        base = eng.loss()
        vals = []
        for _ in range(opts.samples):
            if opts.norm == "l2":
                xi = torch.randn(p.num_params, generator=gen, dtype=torch.float64)
            else:
                xi = torch.rand(p.num_params, generator=gen, dtype=torch.float64) * 2 - 1
            delta = opts.rho * c * xi.to(p.device, p.dtype)
            vals.append(eng.loss(theta + delta) - base)
        t = torch.tensor(vals, dtype=torch.float64)
        diag = {"samples": opts.samples, "loss": base}
        if not bool(torch.isfinite(t).all()):
            bad = [v for v in vals if not math.isfinite(v)]
            diag["non_finite_samples"] = len(bad)
            return MeasureResult(value=_nonfinite_value(bad), diagnostics=diag, status="non_finite")
        mean, se = mean_stderr(t)
        return MeasureResult(value=float(mean), stderr=float(se), diagnostics=diag)


# ---------------------------------------------------------------- keskar_sharpness


@dataclass(frozen=True)
class KeskarOptions:
    """Options of ``keskar_sharpness``."""

    epsilon: float = opt(
        1e-3, Real(0, None, "neither"), "box half-width factor: |y_i| ≤ ε(|θ_i| + 1)"
    )
    subspace: int | None = opt(
        None, Optional(Integral(1, None)), "dimension of a random subspace (null: full space)"
    )
    steps: int = opt(20, Integral(0, None), "Auto-PGD iterations of the box-constrained ascent")


class KeskarSharpness(Measure):
    r"""Keskar et al. (2017) sharpness, larger means sharper.

    .. math:: \phi = \frac{100\,(\max_{y \in C_\epsilon} L(\theta + A y) - L(\theta))}{1 + L(\theta)},\quad
       C_\epsilon = \{ |y_i| \le \epsilon (|(A^+\theta)_i| + 1) \}

    Full space: A = I. ``subspace: d``: A is a seeded P × d matrix with i.i.d.
    N(0, 1/P) entries (columns of unit norm in expectation, so A = I is the
    d = P limit) and :math:`A^+ = (A^\top A)^{-1}A^\top`; it holds P·d numbers.
    The maximum is taken by ℓ∞ Auto-PGD (``steps`` iterations) in coordinates
    scaled by the box, from a seeded random start, y = 0 kept as a candidate
    (Keskar et al. used 10 L-BFGS-B iterations). Full-set loss over S.
    """

    name = "keskar_sharpness"
    stops_early = True  # its estimator checks the budget between blocks
    options = KeskarOptions
    description = (
        "Keskar's ε-sharpness: 100·(max over the box |y_i| ≤ ε(|θ_i|+1) of L(θ+y) − L(θ))/(1+L(θ))."
    )
    reference = "Keskar et al. 2017 (ICLR, eq. 4, Metric 2.1)"
    stochastic = True

    def declare_cost(self, o, d) -> Cost:
        """Auto-PGD's gradient passes (up to ``steps`` + 1) and the forward pass at θ."""
        return Cost(grad=(1, o.steps + 1), forward=1)

    def compute(self, ctx, opts: KeskarOptions) -> MeasureResult:
        p, eng = ctx.problem, ctx.engine
        theta = p.theta
        gen = ctx.generator()
        base = eng.loss()
        if not math.isfinite(base):
            return MeasureResult(
                value=_nonfinite_value([base]), diagnostics={"loss": base}, status="non_finite"
            )
        if opts.subspace is None:
            c = theta.abs() + 1.0
            A = None
            dim = p.num_params

            def fg(z):
                val, g = eng.loss_grad(theta + c * z)
                return val - base, c * g
        else:
            d = opts.subspace
            if d > p.num_params:
                raise ConfigError(
                    f"The 'subspace' parameter of keskar_sharpness must be at most the number of parameters "
                    f"({p.num_params}). Got {d} instead."
                )
            A = (
                torch.randn(p.num_params, d, generator=gen, dtype=torch.float64)
                / math.sqrt(p.num_params)
            ).to(p.device, p.dtype)
            coords = torch.linalg.solve(A.T @ A, A.T @ theta)  # A⁺θ
            c = coords.abs() + 1.0
            dim = d

            def fg(z):
                val, g = eng.loss_grad(theta + A @ (c * z))
                return val - base, c * (A.T @ g)

        z0 = random_start(dim, opts.epsilon, "linf", gen, p.device, p.dtype)
        r = apgd(fg, z0, opts.epsilon, "linf", opts.steps, stop=ctx.budget.out_of_time)
        diag = {"loss": base, "dimension": dim, "reductions": r.reductions}
        if not r.finite:
            return MeasureResult(
                value=_nonfinite_value([r.value]), diagnostics=diag, status="non_finite"
            )
        best = max(0.0, r.value)
        diag["max_increase"] = best
        return MeasureResult(
            value=100.0 * best / (1.0 + base),
            diagnostics=diag,
            status="budget" if r.stopped else "ok",
        )


# ---------------------------------------------------------------- first_order_flatness


@dataclass(frozen=True)
class FirstOrderOptions:
    """Options of ``first_order_flatness``."""

    rho: float = opt(0.05, Real(0, None, "neither"), "radius ρ of the ball ‖θ' − θ‖ ≤ ρ")
    steps: int = opt(
        20,
        Integral(0, None),
        "Auto-PGD iterations of the ascent on ‖∇L‖ (one gradient + one HVP each)",
    )


class FirstOrderFlatness(Measure):
    r"""First-order flatness (Zhang et al. 2023), larger means sharper.

    .. math:: R^{(1)}_\rho(\theta) = \rho \max_{\|\theta' - \theta\| \le \rho} \|\nabla L(\theta')\|

    by ℓ2 Auto-PGD on :math:`\|\nabla L\|`, whose gradient is
    :math:`H \nabla L / \|\nabla L\|` (one HVP per step), from a seeded random
    point of the ball, θ' = θ kept as a candidate. Full-set loss over S.
    The value is R; the diagnostic ``r_over_rho2`` = R/ρ² equals λmax(H) at a
    minimum of a quadratic (the paper's Lemma 4.1). ``max_grad_norm`` is the
    maximum of ‖∇L‖ found. A time cap (``max_seconds``, ``runtime.budget``) ends the ascent
    early with the best point so far (a lower bound of the maximum), status ``budget``.
    """

    name = "first_order_flatness"
    stops_early = True  # its estimator checks the budget between blocks
    options = FirstOrderOptions
    description = (
        "GAM's first-order flatness R = ρ·max_{‖θ'−θ‖≤ρ} ‖∇L(θ')‖ (value R; R/ρ² in diagnostics)."
    )
    reference = "Zhang et al. 2023 (GAM, CVPR, Def. 3.1 and Lemma 4.1)"
    stochastic = True

    def declare_cost(self, o, d) -> Cost:
        """Auto-PGD on the gradient norm: a gradient and a product per step (up to ``steps`` + 1),
        and the gradients at θ and at the start."""
        return Cost(grad=(2, o.steps + 2), hvp=(0, o.steps + 1))

    def compute(self, ctx, opts: FirstOrderOptions) -> MeasureResult:
        p, eng = ctx.problem, ctx.engine
        theta = p.theta
        gen = ctx.generator()
        _, g_at = eng.loss_grad(theta)
        g0 = float(g_at.norm())

        def fg(d):  # ∇L and H∇L at the same point from one graph (loss_grad keeps it for the HVP)
            th = theta + d
            _, g = eng.loss_grad(th, keep_graph=True)
            gn = float(g.norm())
            if not math.isfinite(gn):
                return gn, None
            if gn == 0:
                return 0.0, torch.zeros_like(g)
            return gn, eng.hessian(th) @ (g / gn)

        d0 = random_start(p.num_params, opts.rho, "l2", gen, p.device, p.dtype)
        r = apgd(fg, d0, opts.rho, "l2", opts.steps, stop=ctx.budget.out_of_time)
        diag = {"grad_norm_at_theta": g0, "reductions": r.reductions}
        if not r.finite or not math.isfinite(g0):
            return MeasureResult(
                value=_nonfinite_value([r.value, g0]), diagnostics=diag, status="non_finite"
            )
        best = max(g0, r.value)
        R = opts.rho * best
        diag.update(max_grad_norm=best, r_over_rho2=R / opts.rho**2)
        return MeasureResult(value=R, diagnostics=diag, status="budget" if r.stopped else "ok")
