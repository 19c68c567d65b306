r"""The Hessian diagonal for the Tsuzuku et al. (2020) family, and its options.

`normalized_sharpness`, `fisher_rao_term` and `ns_bound` all need
:math:`D = \mathrm{diag}(\nabla^2 L)`; the estimator is chosen by
``hessian_diag``:

* ``auto`` (default): the exact Gauss-Newton diagonal
  (`flatcli.engine.CurvatureEngine.ggn_diagonal`), verified tensor by tensor
  against the Hessian (`flatcli.engine.linalg.checked_gauss_newton_diagonal`):
  exact :math:`H_{ii}` at ``check`` coordinates per tensor (unit-vector HVPs;
  catches a wrong Gauss-Newton diagonal), and the remainder block
  :math:`P_t(H - G)P_t` applied to ``check_probes`` seeded Gaussian probes per
  tensor (one HVP and one GGN product each). Networks that are piecewise linear
  in each tensor (Linear/Conv, ReLU/leaky ReLU, max/avg pooling, BatchNorm in
  eval mode, no weight used twice) have :math:`P_t(H - G)P_t = 0`, so their
  Hessian diagonal *is* the Gauss-Newton diagonal: the checks pass and the
  result is exact, nonnegative and deterministic (so rescaling-equivariant),
  whatever the size of the weights (zero, tiny, pruned). A tensor whose check
  fails (tanh, GELU, softmax attention, tied weights...) gets its exact diagonal
  from unit-vector HVPs, smallest tensors first, within ``max_exact`` products;
  beyond that its residual :math:`\mathrm{diag}(H - G)` is estimated by
  ``samples`` Rademacher probes (unbiased, not rescaling-equivariant; reported in
  ``diag_estimated``). The tolerance is :math:`\sqrt{\epsilon}` of the working
  precision (float64: 1.5e-8; float32: 3.5e-4; TF32 on CUDA: 3.1e-2), relative.
  Guarantee (proof in `checked_gauss_newton_diagonal`): a tensor whose Hessian
  diagonal differs from the Gauss-Newton one by δ in some entry is declared exact
  with probability at most :math:`(5.6\,\tau\,\mathrm{Tr}\,G_{tt}/\delta + 1.6\cdot 10^{-8})^{k}`
  (k = ``check_probes``, τ ≈ the tolerance): for δ = 1% of the tensor's
  Gauss-Newton trace ≤ 7e-11 in float64 with the default k = 2; float32 resolves
  errors of ≥ 10% of the trace (≤ 4e-4). The former check (3 coordinates only)
  passed on a fused-QKV attention block and on a layer with 2 tanh and 14 ReLU
  rows while the Fisher-Rao term was 4% and 2-8% off (tests/measures/test_normalized_sharpness.py).
  Cost: C per-sample vector-Jacobian passes over S (C outputs; ``n_vjp``), plus
  ``check`` HVPs and 2·``check_probes`` products per tensor, plus the unit vectors of curved tensors.
* ``ggn``: the Gauss-Newton diagonal alone (exact for piecewise-linear
  networks, the Gauss-Newton part otherwise).
* ``exact``: one unit-vector HVP per parameter (small models and tests).
* ``scaled``: eq. 29 in the limit :math:`r \to 0`,
  :math:`\frac1m \sum_s s \circ H(|\theta| \circ s) / |\theta|`
  (`flatcli.engine.linalg.scaled_diagonal`); rescaling-equivariant sample by
  sample, but its noise at coordinate i grows like :math:`1/|\theta_i|`: unusable
  with zero or tiny weights (pruned networks), and the clamp
  :math:`\max(\hat D, 0)` turns that noise into an upward bias.
* ``finite_difference``: eqs. 29–30 with radius ``radius``: two gradients per
  sample; works for non-smooth networks.
* ``hutchinson``: :math:`\frac1m\sum_z z \circ Hz` (not rescaling-equivariant).

Why ``auto`` is the default (``docs/benchmarks/data/ns_diag.json``, float64, NS against
the unit-vector ``exact`` value): on a 5-4-4-3 ReLU MLP with one last-layer
weight at 0 / 1e-6, and with 30% of every layer pruned, the former default
``scaled`` (64 samples) gave 11.6× / 3.8× / 807× the exact NS, ``hutchinson``
(64) 1.10× / 1.10× / 1.03×; on the demo MLP trained on digits (2.4k and 3.5k
parameters) ``scaled`` gave 1.61× and 1.48×, and 2900× and 2300× once 50% of
each layer was pruned, ``hutchinson`` 1.12–1.16×; ``auto`` matched ``exact`` to
3e-16 in every case with 9 HVPs and 3 or 10 VJP passes (``exact``: 59 to 3466 HVPs).

Stochastic estimates are returned in ``min(8, samples)`` groups so measures can
report a delete-a-group jackknife standard error (`jackknife`), which includes
the jackknife estimate of the bias (the clamp's bias is of order of the noise).
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from ..engine import NotApplicable, linalg
from ._options import Integral, OneOf, Real, opt

JACKKNIFE_GROUPS = 8
ESTIMATORS = ("auto", "ggn", "exact", "scaled", "finite_difference", "hutchinson")


@dataclass(frozen=True)
class DiagonalOptions:
    hessian_diag: str = opt(
        "auto",
        OneOf(*ESTIMATORS),
        "Hessian-diagonal estimator (auto: exact Gauss-Newton diagonal, verified; exact: one HVP per parameter)",
    )
    samples: int = opt(64, Integral(1, None), "random probes of the stochastic diagonal estimators")
    radius: float = opt(
        1e-3, Real(0, None, "neither"), "relative perturbation radius r of finite_difference"
    )
    eps: float = opt(
        1e-8,
        Real(0, None, "neither"),
        "ε added to |θ| (finite_difference) or replacing |θ| = 0 (scaled)",
    )
    check: int = opt(
        3,
        Integral(1, None),
        "coordinates per tensor where auto checks H_ii against the Gauss-Newton G_ii",
    )
    check_probes: int = opt(
        2,
        Integral(1, None),
        "Gaussian probes per tensor where auto checks the remainder block P(H − G)P is zero",
    )
    max_exact: int = opt(
        4096, Integral(0, None), "most unit-vector HVPs auto spends on tensors whose check fails"
    )


@dataclass
class DiagonalEstimate:
    """A Hessian diagonal over the flat parameter vector (float64, CPU).

    ``fixed`` is the deterministic part; ``groups`` holds (sum over a group of
    random probes, group size) of the stochastic part (empty when exact).
    """

    fixed: torch.Tensor
    groups: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    info: dict = field(default_factory=dict)

    @property
    def stochastic(self) -> bool:
        return bool(self.groups)

    def mean(self) -> torch.Tensor:
        if not self.groups:
            return self.fixed
        n = sum(k for _, k in self.groups)
        return self.fixed + sum(s for s, _ in self.groups) / n

    def leave_one_out(self) -> Iterator[torch.Tensor]:
        """The diagonal without each group in turn (for the jackknife)."""
        n = sum(k for _, k in self.groups)
        total = sum(s for s, _ in self.groups)
        for s, k in self.groups:
            yield self.fixed + (total - s) / (n - k)


def jackknife(
    est: DiagonalEstimate, fn: Callable[[torch.Tensor], float], full: float
) -> tuple[float | None, float]:
    r"""(stderr, bias) of ``fn(diagonal)`` by the delete-a-group jackknife.

    With leave-one-group-out values :math:`v_g` (G groups), the standard error
    :math:`\sqrt{\frac{G-1}{G}\sum_g (v_g - \bar v)^2}` and the bias estimate
    :math:`(G-1)(\bar v - v)`. The returned stderr is
    :math:`\sqrt{\mathrm{se}^2 + \mathrm{bias}^2}`, so that a bias of the clamp
    :math:`\max(\hat D, 0)` is covered rather than hidden. (None, 0) when exact.
    """
    if len(est.groups) < 2:
        return None, 0.0
    loo = np.asarray([fn(d) for d in est.leave_one_out()])
    G = len(loo)
    se = math.sqrt((G - 1) / G * float(((loo - loo.mean()) ** 2).sum()))
    bias = (G - 1) * (float(loo.mean()) - full)
    return math.sqrt(se * se + bias * bias), bias


def check_tolerance(problem) -> float:
    """√ε of the working precision (TF32 counts as ε = 2⁻¹⁰ on CUDA when enabled)."""
    eps = torch.finfo(problem.dtype).eps
    if (
        problem.device.type == "cuda"
        and problem.dtype == torch.float32
        and torch.backends.cuda.matmul.allow_tf32
    ):
        eps = 2.0**-10
    return math.sqrt(eps)


def _groups(samples: int) -> list[int]:
    G = min(JACKKNIFE_GROUPS, samples)
    return [samples // G + (1 if g < samples % G else 0) for g in range(G)]


def _fd_group(
    eng, theta: torch.Tensor, k: int, radius: float, eps: float, generator
) -> torch.Tensor:
    """Sum over k Rademacher samples of s ∘ (∇L(θ + r v) − ∇L(θ − r v)) / (2 r (|θ| + ε)), v = (|θ| + ε) ∘ s."""
    a = theta.abs() + eps
    acc = torch.zeros(theta.numel(), dtype=torch.float64)
    S = linalg.rademacher(k, theta.numel(), generator, theta.device, theta.dtype)
    for s in S:
        v = radius * a * s
        _, gp = eng.loss_grad(theta + v)
        _, gm = eng.loss_grad(theta - v)
        acc += (s * (gp - gm) / (2 * radius * a)).double().cpu()
    return acc


def _ggn_diagonal(eng, method: str) -> torch.Tensor:
    """The exact Gauss-Newton diagonal; where the loss cannot give it (``causal_lm``: every token of a
    sequence shares the row's backward pass) `NotApplicable` with the alternatives. ``auto`` does not
    switch estimators silently: a stochastic diagonal of a large model is noisy, and NS of a noisy
    diagonal is not comparable with NS of an exact one across a sweep."""
    try:
        return eng.ggn_diagonal().double().cpu()
    except NotApplicable:
        raise NotApplicable(
            f"hessian_diag: {method} needs the exact Gauss-Newton diagonal, which loss "
            f"{eng.problem.loss_name!r} cannot give (it scores many units per row); choose hessian_diag: "
            "scaled (rescaling-equivariant, samples HVPs), hutchinson (samples HVPs) or exact (one HVP per parameter)"
        ) from None


def estimate_diagonal(
    ctx, opts: DiagonalOptions, tensors: list[str] | None = None
) -> DiagonalEstimate:
    """The Hessian diagonal by ``opts.hessian_diag``; ``tensors``: the parameter names that matter (default all).

    Only ``auto`` uses ``tensors`` (it checks and completes only those); every
    estimator returns the full-length vector.

    Shared within one checkpoint's run: ``normalized_sharpness``, ``ns_bound`` and
    ``fisher_rao_term`` need the same diagonal, so the first computes it and the others take it
    from ``ctx.cache`` (one per checkpoint) when everything it depends on is equal: the
    estimator and its options, the seed, the problem (θ, data, parameter selection) and, for
    ``auto``, the tensors it checks. A shared estimate spends no products and says so
    (``diag_shared`` in the diagnostics); its values are those of the first computation.
    """
    key = _diagonal_key(ctx, opts, tensors)
    cache = ctx.cache.hessian_diagonal
    if key in cache:
        est = cache[key]
        return DiagonalEstimate(est.fixed, list(est.groups), {**est.info, "diag_shared": True})
    est = _estimate_diagonal(ctx, opts, tensors)
    cache[key] = est
    return est


def _diagonal_key(ctx, opts: DiagonalOptions, tensors: list[str] | None) -> tuple:
    """What a diagonal estimate depends on (the problem by identity: one per checkpoint's run)."""
    p = ctx.problem
    fields = tuple(getattr(opts, f.name) for f in dataclasses.fields(DiagonalOptions))
    names = None
    if opts.hessian_diag == "auto":
        names = tuple(tensors) if tensors is not None else tuple(p.names)
    return id(p), id(ctx.engine), ctx.seed, fields, names


def _estimate_diagonal(
    ctx, opts: DiagonalOptions, tensors: list[str] | None = None
) -> DiagonalEstimate:
    """`estimate_diagonal` without the cache."""
    eng, p = ctx.engine, ctx.problem
    P = p.num_params
    method = opts.hessian_diag
    info: dict = {"hessian_diag": method}
    if method == "exact":
        d = linalg.exact_diagonal(eng.hessian(), settings=eng.estimator_settings)
        return DiagonalEstimate(d, info=info)
    if method == "ggn":
        return DiagonalEstimate(_shared_ggn(ctx, method), info=info)
    if method == "auto":
        return _auto_diagonal(ctx, opts, tensors, info)
    gen = ctx.generator()
    theta = p.theta
    groups = []
    for k in _groups(opts.samples):
        if method == "scaled":
            mean, _ = linalg.scaled_diagonal(
                eng.hessian(),
                theta,
                samples=k,
                eps=opts.eps,
                generator=gen,
                settings=eng.estimator_settings,
            )
            groups.append((mean * k, k))
        elif method == "hutchinson":
            mean, _ = linalg.hutchinson_diagonal(
                eng.hessian(), samples=k, generator=gen, settings=eng.estimator_settings
            )
            groups.append((mean * k, k))
        else:
            groups.append((_fd_group(eng, theta, k, opts.radius, opts.eps, gen), k))
    return DiagonalEstimate(torch.zeros(P, dtype=torch.float64), groups, info)


@dataclass
class _TensorPart:
    """One tensor's part of the ``auto`` diagonal, kept for the checkpoint: its check's largest
    gap, whether it is curved, and its exact values (None: left to the residual probes)."""

    gap: float
    curved: bool
    values: torch.Tensor | None
    unit_vectors: int  # the unit-vector HVPs its exact values took beyond the check
    size: int


def _shared_ggn(ctx, method: str) -> torch.Tensor:
    """The exact Gauss-Newton diagonal, computed once per checkpoint (``ctx.cache``)."""
    store = ctx.cache.ggn_diagonal
    key = (id(ctx.problem), id(ctx.engine))
    if key not in store:
        store[key] = _ggn_diagonal(ctx.engine, method)
    return store[key]


def _auto_diagonal(ctx, opts: DiagonalOptions, tensors, info: dict) -> DiagonalEstimate:
    """``auto`` with each tensor's check and exact values computed at most once per checkpoint,
    whichever measures ask for it (``ctx.cache``): only the tensors not seen before are checked
    (their draws seeded by the tensor's name, so a tensor's check is the same whatever is checked
    with it), within ``max_exact`` less the unit vectors of the exact tensors reused. The residual
    probes of tensors left to them are drawn for each request."""
    eng, p = ctx.engine, ctx.problem
    g = _shared_ggn(ctx, "auto")
    slices = p.param_slices()
    names = [n for n in (tensors if tensors is not None else p.names) if n in slices]
    fields = tuple(getattr(opts, f.name) for f in dataclasses.fields(DiagonalOptions))
    key = (id(p), id(eng), ctx.seed, fields[1:])  # every option but the estimator's name
    known: dict[str, _TensorPart] = ctx.cache.diagonal_parts.setdefault(key, {})
    new = [n for n in names if n not in known]
    reused = sum(known[n].unit_vectors for n in names if n in known)
    rules = _rules(opts, check_tolerance(p), reused)
    res = None
    if new:
        res = linalg.checked_gauss_newton_diagonal(
            eng.hessian(),
            eng.ggn(),
            g,
            p.theta,
            {n: slices[n] for n in new},
            rules=rules,
            generator=lambda name: _draws(ctx, name),
            settings=eng.estimator_settings,
        )
        for n in new:
            sl, size = slices[n], slices[n].stop - slices[n].start
            done = n in res.exact and size > min(opts.check, size)
            values = None if n in res.estimated else res.diag[sl].clone()
            known[n] = _TensorPart(
                res.checked[n], n in res.curved, values, size if done else 0, size
            )
    diag = g.clone()
    for n in names:
        if known[n].values is not None:
            diag[slices[n]] = known[n].values
    estimated = [n for n in names if known[n].values is None]
    groups = []
    if estimated and res is not None and res.estimated == estimated:
        groups = res.residual_groups
    elif estimated:  # tensors left to the probes by an earlier request: their residual again
        groups = _residual(ctx, opts, [slices[n] for n in estimated])
    curved = [n for n in names if known[n].curved]
    info.update(
        diag_check_tol=rules.tol,
        diag_check_max_gap=max((known[n].gap for n in names), default=0.0),
        diag_curved=curved,
        diag_exact_by_unit_vectors=sorted(  # smallest first, as they were done
            [n for n in curved if known[n].values is not None], key=lambda n: known[n].size
        ),
        diag_estimated=estimated,
        diag_exact=not estimated,
    )
    if not new:
        info["diag_shared"] = True
    return DiagonalEstimate(diag, groups, info)


def _draws(ctx, name: str) -> torch.Generator:
    """The generator of one tensor's checks (seeded by the measure's seed and the tensor's name);
    the measure's own for the residual probes (``name`` "residual")."""
    return ctx.generator(0 if name == "residual" else 1 + zlib.crc32(name.encode()) % 2**31)


def _residual(ctx, opts: DiagonalOptions, slices: list[slice]) -> list:
    """The residual probes over ``slices`` (`flatcli.engine.linalg.residual_groups`)."""
    eng, p = ctx.engine, ctx.problem
    mask = torch.zeros(p.num_params, dtype=p.dtype, device=p.theta.device)
    for sl in slices:
        mask[sl] = 1.0
    gen = _draws(ctx, "residual")
    return linalg.residual_groups(
        eng.hessian(),
        eng.ggn(),
        mask,
        opts.samples,
        JACKKNIFE_GROUPS,
        gen,
        eng.estimator_settings.block(),
    )


def diagonal_reason(opts: DiagonalOptions, problem) -> str | None:
    """Why `estimate_diagonal` will end ``not_applicable`` on ``problem`` (None: it will not): the
    Gauss-Newton diagonals (``ggn``, ``auto``) need a loss that scores one unit per row."""
    if opts.hessian_diag in ("ggn", "auto") and not problem.loss_fn.units_are_rows:
        return (
            f"hessian_diag: {opts.hessian_diag} needs the exact Gauss-Newton diagonal, which loss "
            f"{problem.loss_name!r} cannot give (it scores many units per row); choose hessian_diag: "
            "scaled, hutchinson or exact"
        )
    return None


def _rules(opts: DiagonalOptions, tol: float = 0.0, reused: int = 0) -> linalg.DiagonalCheck:
    """The checks of the ``auto`` diagonal (``reused``: unit vectors of exact tensors kept)."""
    return linalg.DiagonalCheck(
        tol=tol,
        check=opts.check,
        probes=opts.check_probes,
        max_exact=max(0, opts.max_exact - reused),
        samples=opts.samples,
        groups=JACKKNIFE_GROUPS,
    )


def diagonal_cost(opts: DiagonalOptions, dims, tensors: tuple[int, ...]) -> linalg.Cost:
    """The products `estimate_diagonal` spends over ``tensors`` (their sizes), from its estimator's
    declaration (`flatcli.engine.linalg.checked_diagonal_cost` under ``auto``)."""
    m = opts.hessian_diag
    if m == "exact":
        return linalg.exact_diagonal_cost(dims.P).products()
    if m == "ggn":
        return linalg.Cost(vjp=dims.C)
    if m in ("scaled", "hutchinson"):
        return linalg.sampled_diagonal_cost(opts.samples)
    if m == "finite_difference":
        return linalg.Cost(grad=2 * opts.samples)
    return linalg.checked_diagonal_cost(tensors, dims.C, _rules(opts))


def _least(cost: linalg.Cost) -> dict[str, int]:
    return {k: v[0] for k, v in cost.products().estimate().items()}


def diagonal_shared(opts: DiagonalOptions, dims, indices) -> dict:
    """The parts of `diagonal_cost`'s least work over the tensors at ``indices`` (into
    ``dims.tensors``) that another measure's diagonal may have computed (`estimate_diagonal`'s
    cache), each as the counters it spends: under ``auto`` the Gauss-Newton diagonal (C VJP
    passes, once per checkpoint) and each tensor's check (by tensor and options); under another
    estimator the whole diagonal (by options and tensors)."""
    fields = tuple(getattr(opts, f.name) for f in dataclasses.fields(DiagonalOptions))
    indices = tuple(indices)
    if opts.hessian_diag != "auto":
        cost = diagonal_cost(opts, dims, tuple(dims.tensors[i] for i in indices))
        return {("diagonal", fields, indices): _least(cost)}
    parts: dict = {("ggn_diagonal",): {"n_vjp": dims.C}}
    for i in indices:
        check = linalg.diagonal_check_cost(dims.tensors[i], _rules(opts))
        parts["check", fields[1:], i] = _least(check)
    return parts


def equivariance_claim(opts: DiagonalOptions) -> bool | str:
    """Whether the diagonal transforms exactly like the Hessian's under function-preserving rescalings."""
    if opts.hessian_diag == "hutchinson":
        return "hessian_diag: hutchinson probes are not rescaling-equivariant (invariant only in expectation)"
    return True
