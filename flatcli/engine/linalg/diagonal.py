r"""Diagonal estimators: exact unit blocks, Hutchinson (Bekas, Kokiopoulou & Saad 2007), the
scaled diagonal and the Gauss-Newton diagonal checked against the Hessian (Tsuzuku et al. 2020,
eq. 29).

`checked_gauss_newton_diagonal`'s guarantee of check 2 (a false pass is a tensor declared exact whose diagonal
is not). In exact arithmetic a tensor with :math:`R_{tt} \ne 0` fails with
probability 1. With the tolerance: a pass implies :math:`\|R_{tt}z\| \le
\tau\|G_{tt}z\|`, :math:`\tau = \mathrm{tol}/(1-\mathrm{tol})`; if some
:math:`|R_{ii}| = \delta`, the row :math:`r_i` of :math:`R_{tt}` has norm
:math:`\ge \delta`, so :math:`r_i^\top z \sim N(0, \|r_i\|^2)` lands in
:math:`[-a, a]` with probability :math:`\le a\sqrt{2/\pi}/\delta`, and Gaussian
concentration gives :math:`\|G_{tt}z\| \le 7\|G_{tt}\|_F \le 7\,\mathrm{Tr}\,G_{tt}`
except with probability :math:`e^{-18} < 1.6\cdot10^{-8}`. Hence one probe passes with probability at most

.. math:: p_1 = 5.6\,\tau\,\mathrm{Tr}(G_{tt})/\delta + 1.6\cdot10^{-8},

and all ``probes`` independent probes with probability at most :math:`p_1^{\text{probes}}`.
For a diagonal error of 1% of :math:`\mathrm{Tr}\,G_{tt}` (δ = 0.01 Tr): float64
(tol 1.5e-8) :math:`p_1 \le 8.4\cdot10^{-6}`, two probes :math:`\le 7\cdot10^{-11}`;
float32 (tol 3.5e-4) :math:`p_1 \le 0.2`, two probes :math:`\le 0.04`, so larger
errors (≥ 10% of the trace: ≤ 4e-4) are what float32 resolves. A block with
:math:`R_{tt} \ne 0` but a zero diagonal (a bilinear interaction between two
rows of one tensor) is flagged too: its diagonal is then computed exactly, a
cost, not an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ._common import EstimatorSettings, MatVec, as_operator, rademacher, settings_or_default
from .declarations import Cost
from .sem import mean_stderr_of_sums
from .stop import DiagonalCheck
from .vectors import space_of


def _unit_block_diagonal(
    matvec: MatVec, idx: torch.Tensor, dim: int, *, block: int, device, dtype
) -> torch.Tensor:
    """Exact diagonal entries H_ii for the coordinates ``idx`` (one unit-vector product each), float64 CPU."""
    out = torch.empty(len(idx), dtype=torch.float64)
    for s in range(0, len(idx), block):
        rows = idx[s : s + block]
        E = torch.zeros(len(rows), dim, device=device, dtype=dtype)
        E[torch.arange(len(rows)), rows.to(E.device)] = 1.0
        HE = matvec(E)
        out[s : s + len(rows)] = HE[torch.arange(len(rows)), rows.to(HE.device)].double().cpu()
    return out


def exact_diagonal(op, *, settings: EstimatorSettings | None = None):
    """The diagonal of H from unit-vector products (P products, ``settings.block_size`` at a time;
    small models only). ``op``: an operator or anything `as_operator` takes.

    Parameters
    ----------
    op : CurvatureOperator or Operator
        The symmetric operator: a `flatcli.engine.operators.CurvatureOperator`, or anything
        `as_operator` takes (a bare ``V (K, P) -> H V`` as ``as_operator(mv, dim)``); it gives P,
        and the device and dtype of the vectors.
    settings : EstimatorSettings, optional
        The vectors per product call (``block_size``).

    Returns
    -------
    torch.Tensor
        diag(H), length P.
    """
    op = as_operator(op)
    space, matvec, device, dtype = space_of(op), op.matmat_rows, op.device, op.dtype
    if space.parts is not None:  # unit vectors made flat on the CPU, multiplied part by part

        def matvec(E):
            return space.to_flat(op.matmat_rows(space.native(space.from_flat(E))))

        device, dtype = "cpu", torch.float64
    return _unit_block_diagonal(
        matvec,
        torch.arange(op.dim),
        op.dim,
        block=settings_or_default(settings).block(),
        device=device,
        dtype=dtype,
    )


def hutchinson_diagonal(op, *, samples: int, generator, settings: EstimatorSettings | None = None):
    r"""Plain diagonal estimator (Bekas et al. 2007)
    :math:`\mathrm{diag}(H) \approx \frac1m\sum_i z_i \circ H z_i`, Rademacher :math:`z_i`.
    Probes go ``settings.block_size`` at a time.

    Parameters
    ----------
    op : CurvatureOperator or Operator
        The symmetric operator: a `flatcli.engine.operators.CurvatureOperator`, or anything
        `as_operator` takes (a bare ``V (K, P) -> H V`` as ``as_operator(mv, dim)``); it gives P,
        and the device and dtype of the vectors.
    samples : int
        Rademacher probes.
    generator : torch.Generator
        Seeded CPU generator of the probes.
    settings : EstimatorSettings, optional
        The vectors per product call (``block_size``).

    Returns
    -------
    mean, stderr : torch.Tensor
        The estimate of diag(H) and its per-coordinate standard error (float64, CPU).
    """
    op = as_operator(op)
    space, block = space_of(op), settings_or_default(settings).block()
    flat = space.parts is None  # the sums stay on the device, else they gather on the CPU
    acc = torch.zeros(op.dim, dtype=torch.float64, device=op.device if flat else "cpu")
    acc2 = torch.zeros_like(acc)
    done = 0
    while done < samples:
        k = min(block, samples - done)
        Z = space.probes(k, generator)
        D = space.apply(lambda z, hz: (z * hz).double(), Z, op.matmat_rows(Z))
        acc += space.to_flat(space.apply(lambda d: d.sum(0, keepdim=not flat), D)).reshape(-1)
        acc2 += space.to_flat(space.apply(lambda d: (d * d).sum(0, keepdim=not flat), D)).reshape(
            -1
        )
        done += k
    return mean_stderr_of_sums(acc.cpu(), acc2.cpu(), samples)


def scaled_diagonal(
    op,
    theta: torch.Tensor,
    *,
    samples: int,
    eps: float = 1e-8,
    generator,
    settings: EstimatorSettings | None = None,
):
    r"""The ``|θ|``-scaled diagonal estimator (Tsuzuku et al. 2020, eq. 29 as r → 0):

    .. math:: D \approx \frac1m \sum_i s_i \circ H(|\theta| \circ s_i) \,/\, |\theta|,

    with Rademacher ``s_i`` and exact HVPs; ``|θ|`` is replaced by ``|θ| + eps``
    only where θ = 0. Unbiased for diag(H), and it transforms like the true
    diagonal under node rescaling sample by sample. Probes go ``settings.block_size`` at a time (vectors on
    θ's device, in θ's dtype).

    Parameters
    ----------
    op : CurvatureOperator or Operator
        The symmetric operator: a `flatcli.engine.operators.CurvatureOperator`, or anything
        `as_operator` takes (a bare ``V (K, P) -> H V`` as ``as_operator(mv, dim)``); it gives P,
        and the device and dtype of the vectors.
    theta : torch.Tensor
        The parameters θ (flat); the probes are on its device, in its dtype.
    samples : int
        Rademacher probes.
    eps : float
        Replaces ``|θ|`` where θ = 0.
    generator : torch.Generator
        Seeded CPU generator of the probes.
    settings : EstimatorSettings, optional
        The vectors per product call (``block_size``).

    Returns
    -------
    mean, stderr : torch.Tensor
        The estimate of diag(H) and its per-coordinate standard error.
    """
    op = as_operator(op, theta.numel(), device=theta.device, dtype=theta.dtype)
    matvec, block = op.matmat_rows, settings_or_default(settings).block()
    a = theta.detach().abs()
    a = torch.where(a == 0, torch.full_like(a, eps), a)
    dim = theta.numel()
    acc = torch.zeros(dim, dtype=torch.float64, device=theta.device)
    acc2 = torch.zeros(dim, dtype=torch.float64, device=theta.device)
    done = 0
    while done < samples:
        k = min(block, samples - done)
        S = rademacher(k, dim, generator, theta.device, theta.dtype)
        D = ((S * matvec(S * a)) / a).double()
        acc += D.sum(0)
        acc2 += (D * D).sum(0)
        done += k
    return mean_stderr_of_sums(acc.cpu(), acc2.cpu(), samples)


@dataclass
class CheckedDiagonal:
    r"""A Hessian diagonal built on the exact Gauss-Newton diagonal (`checked_gauss_newton_diagonal`).

    diag: float64 CPU vector: exact entries (Gauss-Newton where verified, unit-vector
        products for curved tensors); for tensors in ``estimated`` the Gauss-Newton part only.
    residual_groups: (sum over a group of probes, group size) of the residual
        :math:`z \circ (H - G) z` on the ``estimated`` tensors; empty when everything is exact.
    checked: tensor name → its largest relative gap: at the checked coordinates
        |H_ii − G_ii| / max(|H_ii|, |G_ii|), and over its Gaussian probes z
        ‖P_t(H − G)z‖ / max(‖P_t Hz‖, ‖P_t Gz‖).
    curved: tensors whose check found H ≠ G; ``exact``: those of them done by unit vectors;
    ``estimated``: those left to the residual probes (over ``max_exact``).
    """

    diag: torch.Tensor
    residual_groups: list = field(default_factory=list)
    checked: dict = field(default_factory=dict)
    curved: list = field(default_factory=list)
    exact: list = field(default_factory=list)
    estimated: list = field(default_factory=list)
    tol: float = 0.0
    n_hvp: int = 0
    n_ggnvp: int = 0


def _check_coordinates(g: torch.Tensor, t: torch.Tensor, k: int, generator) -> torch.Tensor:
    """Up to k coordinates of one tensor: the largest Gauss-Newton entry, the largest |θ|, then seeded random ones."""
    n = g.numel()
    if k >= n:
        return torch.arange(n)
    picked = [int(torch.argmax(g)), int(torch.argmax(t.abs()))]
    perm = torch.randperm(n, generator=generator)
    for j in perm.tolist():
        if len(set(picked)) >= k:
            break
        picked.append(j)
    return torch.tensor(sorted(set(picked))[:k])


def _relative_gap(diff: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|diff| / max(|a|, |b|) elementwise, 0 where a and b both vanish."""
    scale = torch.maximum(a.abs(), b.abs())
    gap = diff.abs() / scale.clamp_min(torch.finfo(torch.float64).tiny)
    return torch.where(scale == 0, torch.zeros_like(gap), gap)


def remainder_block_gaps(
    hvp,
    ggnvp: MatVec,
    tensors: dict[str, slice],
    *,
    probes: int,
    generator: torch.Generator,
    settings: EstimatorSettings | None = None,
) -> dict[str, float]:
    r"""Per tensor t (name → slice): the largest relative gap
    :math:`\|P_t(H - G)z\| / \max(\|P_t Hz\|, \|P_t Gz\|)` over ``probes`` seeded
    standard Gaussian probes z supported on t (0 where both products vanish).

    The gap is 0 exactly when the remainder block :math:`P_t(H - G)P_t` maps z to 0,
    which for a nonzero block has probability 0. ``hvp``: an operator or anything `as_operator`
    takes (P, device, dtype); probes are multiplied ``settings.block_size`` at
    a time (one Hessian and one Gauss-Newton product each).

    Parameters
    ----------
    hvp : CurvatureOperator or Operator
        Hessian products.
    ggnvp : callable
        Gauss-Newton products ``V (K, P) -> G V``.
    tensors : dict of str to slice
        Each tensor's slice of the flat vector.
    probes : int
        Gaussian probes per tensor.
    generator : torch.Generator
        Seeded CPU generator of the probes.
    settings : EstimatorSettings, optional
        The vectors per product call (``block_size``).

    Returns
    -------
    dict of str to float
        The largest relative gap per tensor.
    """
    hvp = as_operator(hvp)
    dim, device, dtype = hvp.dim, hvp.device, hvp.dtype
    block = settings_or_default(settings).block()
    rows = [
        (name, sl, z)
        for name, sl in tensors.items()
        for z in torch.randn(
            probes, sl.stop - sl.start, generator=_gen(generator, name), dtype=torch.float64
        )
    ]
    worst = dict.fromkeys(tensors, 0.0)
    for s in range(0, len(rows), block):
        chunk = rows[s : s + block]
        Z = torch.zeros(len(chunk), dim, device=device, dtype=dtype)
        for r, (_, sl, z) in enumerate(chunk):
            Z[r, sl] = z.to(device, dtype)
        HZ, GZ = hvp(Z), ggnvp(Z)
        for r, (name, sl, _) in enumerate(chunk):
            h, g = HZ[r, sl].double(), GZ[r, sl].double()
            gap = _relative_gap((h - g).norm(), h.norm(), g.norm())
            worst[name] = max(worst[name], float(gap))
    return worst


def _coordinate_check(hvp, g, th, tensors, check, generator, *, block, device, dtype):
    """(coordinates, their exact H_ii, owner name per coordinate, tensor → largest relative gap)."""
    coords, owner = [], []
    for name, sl in tensors.items():
        local = _check_coordinates(g[sl], th[sl], check, _gen(generator, name))
        coords.append(local + sl.start)
        owner += [name] * len(local)
    idx = torch.cat(coords)
    h = _unit_block_diagonal(hvp, idx, th.numel(), block=block, device=device, dtype=dtype)
    gap = _relative_gap(h - g[idx], h, g[idx])
    gaps = {}
    for name in tensors:
        sel = torch.tensor([o == name for o in owner])
        gaps[name] = float(gap[sel].max()) if bool(sel.any()) else 0.0
    return idx, h, owner, gaps


def _gen(generator, name: str) -> torch.Generator:
    """``generator``, or ``generator(name)`` when it is a function of the tensor's name (draws
    that do not depend on which other tensors are checked in the same call)."""
    return generator(name) if callable(generator) else generator


def residual_groups(hvp, ggnvp, mask, samples, groups, generator, block: int):
    """``groups`` groups of (Σ z ∘ (Hz − Gz), size) over ``samples`` Rademacher probes supported on
    ``mask``, ``block`` at a time; ``hvp`` an operator or anything `as_operator` takes (its device
    and dtype; the mask's length, device and dtype otherwise)."""
    hvp = as_operator(hvp, mask.numel(), device=mask.device, dtype=mask.dtype)
    device, dtype = hvp.device, hvp.dtype
    G_ = max(1, min(groups, samples))
    out = []
    for k in [samples // G_ + (1 if j < samples % G_ else 0) for j in range(G_)]:
        acc = torch.zeros(mask.numel(), dtype=torch.float64)
        done = 0
        while done < k:
            kk = min(block, k - done)
            Z = rademacher(kk, mask.numel(), generator, device, dtype) * mask
            R = hvp(Z) - ggnvp(Z)
            acc += (Z * R.to(Z.dtype)).double().sum(0).cpu()
            done += kk
        out.append((acc, k))
    return out


def checked_gauss_newton_diagonal(
    hvp: MatVec,
    ggnvp: MatVec,
    ggn_diag: torch.Tensor,
    theta: torch.Tensor,
    tensors: dict[str, slice],
    *,
    rules: DiagonalCheck,
    generator: torch.Generator,
    settings: EstimatorSettings | None = None,
):
    r"""The Hessian diagonal from the exact Gauss-Newton diagonal, verified tensor by tensor.

    :math:`\mathrm{diag}(H) = \mathrm{diag}(G) + \mathrm{diag}(R)` with
    :math:`R = \sum_{i,c} \partial_{z_c}\ell_i\, \nabla^2 z_{ic}`. Where the outputs
    are piecewise linear in a tensor t *jointly* (Linear/Conv weights and biases
    followed by ReLU-type activations, pooling, BatchNorm in eval mode, each used
    once), the whole block :math:`R_{tt} = P_t R P_t` vanishes. Two checks per
    tensor of ``tensors`` (name → slice of the flat vector); it is *curved* when one fails
    (``tol``, ``check``, ``probes``, ``max_exact``, ``samples``, ``groups``: fields of ``rules``, a
    `DiagonalCheck`; ``hvp`` is an operator or anything `as_operator` takes, ``settings.block_size``
    vectors per product, vectors on θ's device in θ's dtype):

    1. coordinates: at ``check`` coordinates (the largest :math:`G_{ii}`, the largest
       :math:`|\theta_i|`, seeded random ones; all of a tensor that small)
       :math:`|H_{ii} - G_{ii}| \le \mathrm{tol}\cdot\max(|H_{ii}|, |G_{ii}|)`, with
       :math:`H_{ii}` from unit-vector products: catches a wrong ``ggn_diag``;
    2. the remainder block (`remainder_block_gaps`), for tensors larger than
       ``check``: :math:`\|P_t(H - G)z\| \le \mathrm{tol}\cdot\max(\|P_tHz\|, \|P_tGz\|)`
       for ``probes`` seeded Gaussian probes z supported on t.

    Guarantee of check 2: a false pass has probability at most :math:`p_1^{\text{probes}}`,
    :math:`p_1 = 5.6\,\tau\,\mathrm{Tr}(G_{tt})/\delta + 1.6\cdot10^{-8}` (proof in the module docstring).

    Curved tensors, smallest first, get their exact diagonal from unit vectors
    while the products stay within ``max_exact``; the rest keep
    :math:`\mathrm{diag}(G)` plus the residual estimated by ``samples``
    Rademacher probes :math:`z` supported on them,
    :math:`\widehat{\mathrm{diag}}(R) = \frac1m\sum z \circ (Hz - Gz)`, returned in
    ``groups`` groups for a jackknife.

    Exact (no randomness in the result) unless some tensor lands in ``estimated``. ``generator``:
    one generator for every draw, or a function of a tensor's name giving its own (the residual
    probes: of the name "residual"), so that a tensor's checks do not depend on the others.
    Cost: ``check`` HVPs per tensor, ``probes`` HVPs and GGN products per tensor
    larger than ``check``, the unit vectors of the exact curved tensors, and
    ``samples`` HVPs and GGN products when a residual is estimated.

    Parameters
    ----------
    hvp : CurvatureOperator or Operator
        Hessian products (anything `as_operator` takes).
    ggnvp : callable
        Gauss-Newton products ``V (K, P) -> G V``.
    ggn_diag : torch.Tensor
        The exact Gauss-Newton diagonal, length P.
    theta : torch.Tensor
        The parameters θ (flat).
    tensors : dict of str to slice
        Each tensor's slice of the flat vector.
    rules : DiagonalCheck
        ``tol``, ``check``, ``probes``, ``max_exact``, ``samples``, ``groups``.
    generator : torch.Generator
        Seeded CPU generator of the checks' coordinates and probes (``settings``: the block size).

    Returns
    -------
    CheckedDiagonal
        The diagonal, the curved tensors (exact or ``estimated``), the checks' outcomes and the
        products spent.
    """
    dim = theta.numel()
    device, dtype = theta.device, theta.dtype
    hvp = as_operator(hvp, dim, device=device, dtype=dtype)
    tol, check, probes, samples = rules.tol, rules.check, rules.probes, rules.samples
    g = ggn_diag.detach().double().cpu()
    th = theta.detach().cpu()
    out = CheckedDiagonal(diag=g.clone(), tol=tol)
    if not tensors:
        return out
    kw = {"block": settings_or_default(settings).block(), "device": device, "dtype": dtype}
    idx, h, owner, out.checked = _coordinate_check(hvp, g, th, tensors, check, generator, **kw)
    out.n_hvp += len(idx)
    large = {n: sl for n, sl in tensors.items() if sl.stop - sl.start > check}
    if large and probes > 0:
        blocks = remainder_block_gaps(
            hvp, ggnvp, large, probes=probes, generator=generator, settings=settings
        )
        out.checked.update({n: max(out.checked[n], v) for n, v in blocks.items()})
        out.n_hvp += probes * len(large)
        out.n_ggnvp += probes * len(large)
    out.curved = [n for n in tensors if out.checked[n] > tol]
    budget = rules.max_exact
    for name in sorted(out.curved, key=lambda n: tensors[n].stop - tensors[n].start):
        sl = tensors[name]
        size = sl.stop - sl.start
        mine = torch.tensor([o == name for o in owner])
        if int(mine.sum()) == size:  # the check already computed all of it
            out.diag[idx[mine]] = h[mine]
            out.exact.append(name)
        elif size <= budget:
            out.diag[sl] = _unit_block_diagonal(hvp, torch.arange(sl.start, sl.stop), dim, **kw)
            out.n_hvp += size
            budget -= size
            out.exact.append(name)
        else:
            out.estimated.append(name)
    if out.estimated:
        mask = torch.zeros(dim, dtype=dtype, device=device)
        for name in out.estimated:
            mask[tensors[name]] = 1.0
        out.residual_groups = residual_groups(
            hvp, ggnvp, mask, samples, rules.groups, _gen(generator, "residual"), kw["block"]
        )
        out.n_hvp += samples
        out.n_ggnvp += samples
    return out


# ---------------------------------------------------------------------------- declared costs


def exact_diagonal_cost(dim: int) -> Cost:
    """`exact_diagonal`: one product per coordinate, unit vectors in the engine's blocks."""
    return Cost(hvp=dim, block=0)


def sampled_diagonal_cost(samples: int) -> Cost:
    """`hutchinson_diagonal` and `scaled_diagonal`: one product per sample."""
    return Cost(hvp=samples)


def diagonal_check_cost(size: int, rules: DiagonalCheck) -> Cost:
    """The check of one tensor of ``size`` coordinates in `checked_gauss_newton_diagonal`: its
    ``check`` coordinates (all of a smaller tensor), and two products per probe when the
    coordinates do not cover it."""
    return Cost(hvp=min(rules.check, size) + (2 * rules.probes if size > rules.check else 0))


def checked_diagonal_cost(sizes, outputs: int, rules: DiagonalCheck) -> Cost:
    """`checked_gauss_newton_diagonal` over tensors of ``sizes``: the Gauss-Newton diagonal
    (``outputs`` VJP passes), every tensor's check (`diagonal_check_cost`), and at most
    ``max_exact`` unit vectors of curved tensors and two products per residual sample."""
    checks = Cost(hvp=0)
    for size in sizes:
        checks = checks + diagonal_check_cost(size, rules)
    rest = min(rules.max_exact, sum(sizes)) + 2 * rules.samples
    return Cost(vjp=outputs) + checks + Cost(hvp=(0, rest))
