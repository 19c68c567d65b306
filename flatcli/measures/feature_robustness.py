r"""Feature robustness and representativeness (Petzka, Kamp, Adilova, Sminchisescu & Boley, NeurIPS 2021).

The paper splits the generalization gap of :math:`f = \psi \circ \phi` (eq. 5) into
*representativeness* and *feature robustness*:

.. math:: \mathcal E(f) - \mathcal E_{emp}(f, S) = \mathcal E_{Rep}^\phi(f, S, \Lambda_{\mathcal A})
   + \mathcal E_{\mathcal F}^\phi(f, S, \mathcal A).

Feature robustness (Def. 1, eq. 4) perturbs the features :math:`\phi(x)` that the
chosen ``nn.Linear`` layer receives (``layer``, default the last one, as in
``relative_flatness``) by a feature matrix A, :math:`\phi_A(x) = (I + A)\phi(x)`,
keeping everything before the layer fixed, and averages the loss increase over S
with the labels held constant (the paper's locally-constant-label assumption,
:math:`y(\phi_A(x_i)) = y_i`; the true labels of perturbed features are unknown):

.. math:: \mathcal E_{\mathcal F}(\delta) = \mathbb E_{O \sim \mathrm{Haar}(O_m)}
   \frac1n \sum_{i} \ell\big(\psi((I + \delta O)\phi(x_i)), y_i\big) - \ell(f(x_i), y_i),

the average over random orthogonal matrices of Theorem 5 (A = δO, ‖A‖ = δ).

Estimation. ``samples`` orthogonal matrices are drawn from the Haar measure (QR of a
Gaussian matrix with the signs of R's diagonal moved into Q, Mezzadri 2007),
seeded. Each is used as an antithetic pair ±O (both Haar-distributed): the
per-matrix value is :math:`\frac12[\mathcal E_F(\delta O) + \mathcal E_F(-\delta O)]`,
which cancels every odd power of δ, the first-order term included (so the δ²
term below holds at any θ, not only at a minimum). The value is the mean over
matrices, ``stderr`` its standard error. The same matrices serve every δ of the
curve ``δ, δ/2, …, δ/2^{curve−1}`` (common random numbers).

Theorem 5 check. Since the layer computes :math:`W(I + \delta O)\phi = (W + \delta WO)\phi`
(eq. 1/7), the antithetic value is :math:`\frac{\delta^2}{2}\mathrm{vec}(WO)^\top H_W
\mathrm{vec}(WO) + O(\delta^4)`, and :math:`\mathbb E_O[(WO)_{st}(WO)_{s't'}] =
\langle w_s, w_{s'}\rangle \delta_{tt'}/m` gives :math:`\mathcal E_F(\delta) =
\frac{\delta^2}{2m}\kappa + O(\delta^4)`, κ the relative flatness of the layer (Def. 3;
``relative_flatness`` computes it exactly). Diagnostics ``curve`` (per δ: ``e_f``,
``stderr``, ``ratio`` = 2m·E_F/δ², and the per-matrix values), ``kappa_limit``
(the ratio at the smallest δ, with ``kappa_limit_stderr``) and
``kappa_extrapolated`` (Richardson, :math:`(4r(\delta/2^{k}) - r(\delta/2^{k-1}))/3`
from the two smallest δ; the ratio is :math:`\kappa + c\delta^2 + \dots`): both
estimate κ; tests/measures/test_feature_robustness.py compares them with
``relative_flatness`` and, per matrix, with dense Hessians. Like Theorem 5 this
needs ψ twice differentiable: with a ReLU after the layer a perturbation that
moves a pre-activation across 0 adds a term of order ``|δ|`` (not δ²), so the ratio
approaches κ only once δ‖φ‖ is below every sample's distance to a kink.

``normalize_features: true`` perturbs the normalized features
:math:`\tilde\phi = \phi/\sigma` of Theorem 4 (σ the standard deviation over S, as
``relative_flatness``): :math:`\phi \to \phi + \mathrm{diag}(\sigma)\,\delta O\,
\mathrm{diag}(\sigma)^{-1}\phi` (features constant over S stay put). Then the value
is invariant to node-wise rescalings and the limit is the normalized κ.

Representativeness (``representativeness: true``; Sec. 2 eq. 3, Sec. 6, Prop. 2).
:math:`\mathcal E_{Rep}(f, S, \Lambda) = \mathcal E(f) - \frac1n\sum_i
\mathbb E_{\xi\sim\lambda_i}\,\ell(\psi(\phi(x_i) + \xi), y(\phi(x_i)+\xi))` compares the
risk with the risk under the mixture of local densities :math:`\lambda_i` around the
samples' features, i.e. under a kernel density estimate in feature space. The kernels
are Prop. 2's: :math:`\lambda_i` is the law of :math:`A\phi(x_i)` for the feature
matrices :math:`A \sim \mathcal A_\delta`, :math:`A = \delta r O` (O Haar, ‖A‖ < δ),
here with r = U^{1/m} (`ball_radii`), so that λ_i is the uniform density on the ball
of radius :math:`\delta\|\phi(x_i)\|` (eq. 6 with a constant k; `kernel_noise`). The
same distribution enters both terms of eq. 5: the bound's feature robustness is
:math:`\mathcal E_F(\mathcal A_\delta)` (``e_f_kernel``, the antithetic pairs ±δ r_s O_s
over the same matrices O_s), not the value's fixed ‖A‖ = δ; and the mixture's draws
are :math:`\xi_i = A\phi(x_i)`. (The former kernel N(0, (δ‖z‖)²I) has typical radius
√m·δ‖z‖, √m times outside Prop. 2's support: at m = 16 its representativeness was
−18.5 × E_F and the "bound" negative.) Sec. 6 approximates representativeness from S
alone by splitting S, fitting the density estimate on one part and measuring its error
on the other; here (`kde_representativeness`): ``kde_folds`` seeded folds; per fold,
the risk is estimated by the held-out part's mean loss and the mixture's risk by
``kde_samples`` kernel draws around every feature :math:`z_i` of the training part
(labels held constant as in Theorem 5); the estimate is their difference, averaged over
folds (``representativeness_stderr``: over folds). ``bound`` is
:math:`\mathcal E_F(\mathcal A_\delta) + \hat{\mathcal E}_{Rep}`, eq. 5's approximate
bound on the gap (Fig. 4; "technically not a bound anymore", Sec. 6). In the paper's
setting (ψ refitted per fold, tests/measures/test_feature_robustness.py) it lies above the
measured generalization gap, as in their Fig. 4. ``kde_loglik`` is the held-out mean
log-density of a fixed-bandwidth Gaussian ``sklearn.neighbors.KernelDensity``
(bandwidth δ·median‖z_i‖, exact sums) fitted on each training part: a smooth density
estimate's own error on the held-out part (the ball kernels give −∞ to any held-out
point outside every ball). Caveat, important: the authors refit their predictor ψ on
each fold's training part (their code for Fig. 4), so the held-out losses are test
losses; flatcli measures a given network trained on S, so for ``feature_robustness``
the held-out losses are training losses and the estimate is close to
:math:`-\mathcal E_F(\mathcal A_\delta)` (in expectation over the draws exactly so when
the folds are equal: the bound is then close to 0, and negative about as often as positive), i.e. it says
how the network's loss at its training features compares with its loss under the kernel
mixture, not how representative S is of unseen data. A negative ``bound`` bounds no gap
(a generalization gap can be negative, but a bound below 0 only restates that the two
estimates nearly cancel): it is reported unclamped, as computed, with status
``not_a_bound`` and ``bound_is_a_bound`` false, so that it cannot read as a bound; the
value (E_F(δ)) is unaffected. It bounds the gap approximately only in the paper's
setting (ψ refitted per fold) and where it is ≥ 0. `kde_representativeness` accepts a per-fold predictor for the paper's
use. The authors' code differs in two further ways, deliberately not copied: it
weights losses by raw kernel density values (which scale like :math:`h^{-m}`) and
passes δ‖φ(x_i)‖ as sample weights of a bandwidth-1 KDE rather than as bandwidths.

Larger values mean less robust features, a larger predicted gap: the value is
oriented like every flatcli measure (larger = sharper).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..engine.linalg.sem import mean_stderr
from ..errors import ConfigError, MeasurementError
from . import Cost, Measure, MeasureResult
from ._options import Bool, Integral, Optional, Real, Str, opt
from .relative_flatness import (
    _claim,
    _feature_std,
    _note,
    _run,
    find_layer,
    rows_only,
    rows_only_reason,
)

NAME = "feature_robustness"


@dataclass(frozen=True)
class FeatureRobustnessOptions:
    """Options of ``feature_robustness`` (see the measure's docstring)."""

    layer: str | None = opt(
        None, Optional(Str()), "module name of an nn.Linear layer (default: the last Linear)"
    )
    delta: float = opt(
        0.1, Real(0, None, "neither"), "perturbation size δ: features φ → (I + δO)φ, O orthogonal"
    )
    samples: int = opt(
        20, Integral(2, None), "random orthogonal matrices O (each used as the pair ±O)"
    )
    curve: int = opt(
        4, Integral(1, 20), "δ, δ/2, …, δ/2^(curve−1): the Theorem 5 curve (same matrices)"
    )
    normalize_features: bool = opt(
        False, Bool(), "perturb features divided by their std over S (Theorem 4)"
    )
    representativeness: bool = opt(
        False, Bool(), "also the KDE approximation of representativeness (Sec. 6) and the bound"
    )
    kde_folds: int = opt(
        5, Integral(2, None), "cross-validation folds of the representativeness estimate"
    )
    kde_samples: int = opt(
        4, Integral(1, None), "kernel draws per training point (representativeness)"
    )


def haar_orthogonal(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """(k, m, m) orthogonal matrices from the Haar measure on O(m) (Mezzadri 2007, float64)."""
    G = torch.randn(k, m, m, generator=gen, dtype=torch.float64)
    Q, R = torch.linalg.qr(G)
    d = torch.diagonal(R, dim1=-2, dim2=-1)
    return Q * torch.where(d < 0, -1.0, 1.0).to(Q)[:, None, :]


class _EditInput:
    """A forward pre-hook replacing the layer's input Φ by ``edit(Φ)`` while ``edit`` is set
    (the feature perturbations of Def. 1 and the feature noise ξ of the KDE)."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.edit = None

    def __enter__(self):
        self.handle = self.module.register_forward_pre_hook(self._hook)
        return self

    def __exit__(self, *exc):
        self.handle.remove()

    def _hook(self, mod, args):
        return None if self.edit is None else (self.edit(args[0]), *args[1:])


class FeatureRobustness(Measure):
    r"""Feature robustness :math:`\mathcal E_F(\delta)` of one Linear layer's input features,
    larger means a larger predicted gap. See the module docstring.

    Diagnostics: ``layer``, ``m`` (feature dimension), ``delta``, ``curve``,
    ``kappa_limit``, ``kappa_limit_stderr``, ``kappa_extrapolated``,
    ``normalize_features``, ``zero_std_features``, ``forward_passes``; with
    ``representativeness``: ``representativeness``, ``representativeness_stderr``,
    ``e_f_kernel`` (E_F under Prop. 2's A_δ) and its ``e_f_kernel_stderr``, ``bound``
    (their sum, kept as computed even when negative), ``bound_is_a_bound`` (bound ≥ 0),
    ``kde_bandwidth``, ``kde_loglik``, ``kde_folds``. Status ``not_a_bound`` when the
    bound is negative (the value, E_F(δ), is unaffected; see the module docstring).

    Options: ``layer`` (last Linear), ``delta`` (0.1), ``samples`` (20),
    ``curve`` (4), ``normalize_features`` (False), ``representativeness`` (False),
    ``kde_folds`` (5), ``kde_samples`` (4).
    """

    name = NAME
    options = FeatureRobustnessOptions
    description = "Feature robustness E_F(δ): mean loss increase when a Linear layer's input features become (I + δO)φ, O random orthogonal (≈ δ²κ/2m); KDE representativeness and bound optional."
    reference = "Petzka, Kamp, Adilova, Sminchisescu & Boley, NeurIPS 2021, Def. 1 (eq. 4), Thm. 5, eq. 5, Sec. 6 (KDE representativeness)"
    stochastic = True
    invariance_options = {"normalize_features": True}

    invariant = staticmethod(_claim)

    invariance_note = staticmethod(_note)

    def declare_cost(self, o, d) -> Cost:
        """Forward passes: the one at θ, two per draw and point of the curve (one more with
        ``normalize_features``); representativeness adds its draws and folds' passes and ``kde_folds``
        exact KDE evaluations (n_test × n_train kernel sums, not declared)."""
        forwards = 1 + 2 * o.samples * o.curve + int(o.normalize_features)
        if o.representativeness:
            forwards += 2 * o.samples + 2 + o.kde_samples * (o.kde_folds - 1)
        return Cost(forward=forwards)

    def applicable(self, o, p):
        return rows_only_reason(p, NAME)

    def compute(self, ctx, opts: FeatureRobustnessOptions) -> MeasureResult:
        p = ctx.problem
        name, module = find_layer(ctx.model, opts.layer, NAME)
        m = module.in_features
        dtype, dev = p.dtype, p.device
        inv = torch.ones(m, dtype=dtype, device=dev)
        scale = torch.ones(m, dtype=dtype, device=dev)
        zero_std = 0
        passes = 0
        if opts.normalize_features:
            sigma = _feature_std(p, module, name, NAME).to(dev)
            passes += 1
            keep = sigma > 0
            zero_std = int((~keep).sum())
            scale = torch.where(keep, sigma, torch.zeros_like(sigma)).to(dtype)
            inv = torch.where(
                keep,
                1.0 / torch.where(keep, sigma, torch.ones_like(sigma)),
                torch.zeros_like(sigma),
            ).to(dtype)
        Os = haar_orthogonal(m, opts.samples, ctx.generator()).to(dev, dtype)
        deltas = [opts.delta / 2**k for k in range(opts.curve)]
        sizes = torch.tensor(deltas, dtype=torch.float64)[:, None].expand(len(deltas), opts.samples)
        if (
            opts.representativeness
        ):  # one more row: A = ±δ r_s O_s, r_s from the kernel's radial law (Prop. 2)
            sizes = torch.cat(
                [sizes, opts.delta * ball_radii(opts.samples, m, ctx.generator(3))[None]]
            )
        rows_only(p, NAME)
        inc = _antithetic_increases(p, module, name, Os, sizes, inv, scale)
        passes += 1 + 2 * opts.samples * len(sizes)
        if ctx.engine is not None:
            ctx.engine.sum_(inc)
            ctx.engine.count(n_forward=passes)
        ef = inc[: len(deltas)] / p.n  # (curve, samples): per-matrix antithetic E_F
        mean, se = mean_stderr(ef, axis=1)
        if not bool(torch.isfinite(mean).all()):
            raise MeasurementError(f"{NAME}: the perturbed loss is not finite")
        curve = [
            {
                "delta": d,
                "e_f": float(mean[a]),
                "stderr": float(se[a]),
                "ratio": float(2 * m * mean[a] / d**2),
                "per_matrix": ef[a].tolist(),
            }
            for a, d in enumerate(deltas)
        ]
        r = [2 * m * float(mean[a]) / d**2 for a, d in enumerate(deltas)]
        diag = {
            "layer": name,
            "m": int(m),
            "delta": opts.delta,
            "curve": curve,
            "kappa_limit": r[-1],
            "kappa_limit_stderr": float(2 * m * se[-1] / deltas[-1] ** 2),
            "kappa_extrapolated": (4 * r[-1] - r[-2]) / 3 if len(r) > 1 else r[-1],
            "normalize_features": bool(opts.normalize_features),
            "zero_std_features": zero_std,
            "forward_passes": passes,
        }
        value = float(mean[0])
        if opts.representativeness:
            ek = inc[-1] / p.n
            diag["e_f_kernel"] = float(ek.mean())
            diag["e_f_kernel_stderr"] = float(mean_stderr(ek)[1])
            rep = representativeness(ctx, module, name, opts, scale)
            diag.update(rep)
            diag["bound"] = diag["e_f_kernel"] + rep["representativeness"]
            diag["bound_is_a_bound"] = diag["bound"] >= 0
        status = "not_a_bound" if opts.representativeness and diag["bound"] < 0 else "ok"
        return MeasureResult(value=value, stderr=float(se[0]), diagnostics=diag, status=status)


def _antithetic_increases(p, module, name, Os, sizes, inv, scale) -> torch.Tensor:
    """Σ over S of ½[ℓ(ψ(φ + A φ)) + ℓ(ψ(φ − A φ))] − ℓ(f) for A = sizes[a, s]·O_s, shape of ``sizes``
    (features edited in the normalized space: Φ + ((Φ∘inv) Aᵀ)∘scale)."""
    inc = torch.zeros(sizes.shape, dtype=torch.float64)
    with torch.no_grad(), _EditInput(module) as hook:
        for b in p.batches:
            out, _, _ = _run(p, module, name, b, measure=NAME)
            base = p.loss_fn.per_unit(out, b).double()
            for a in range(sizes.shape[0]):
                for s in range(sizes.shape[1]):
                    tot = torch.zeros_like(base)
                    for sign in (1.0, -1.0):
                        M = sign * float(sizes[a, s]) * Os[s]
                        hook.edit = lambda phi, M=M: phi + ((phi * inv) @ M.T) * scale
                        tot += p.loss_fn.per_unit(p.forward(p.params, b), b).double()
                        hook.edit = None
                    inc[a, s] += float((0.5 * tot - base).sum())
    return inc


def ball_radii(k: int, m: int, gen: torch.Generator) -> torch.Tensor:
    r"""The k radii r ∈ [0, 1) of the uniform distribution on the unit ball of :math:`\mathbb R^m`: r = U^{1/m}."""
    return torch.rand(k, generator=gen, dtype=torch.float64) ** (1.0 / m)


def kernel_noise(norms: torch.Tensor, m: int, delta: float, gen: torch.Generator) -> torch.Tensor:
    r"""One draw ξ_i per row of the kernel of Prop. 2 used here: uniform on the ball of radius δ‖z_i‖
    (eq. 6 with a constant k), i.e. :math:`\xi_i = \delta\|z_i\|\, r_i\, u_i`, u_i uniform on the sphere
    (a normalized Gaussian), r_i from `ball_radii`; the law of A z_i for A = δ r O, O Haar."""
    g = torch.randn(len(norms), m, generator=gen, dtype=torch.float64)
    u = g / g.norm(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    return u * (delta * norms * ball_radii(len(norms), m, gen))[:, None]


def representativeness(
    ctx, module, name, opts: FeatureRobustnessOptions, scale: torch.Tensor
) -> dict:
    """The cross-validated approximation of representativeness for the measured network."""
    p = ctx.problem
    if p.n < 2 * opts.kde_folds:
        raise ConfigError(
            f"The 'kde_folds' parameter of {NAME} ({opts.kde_folds}) needs at least "
            f"{2 * opts.kde_folds} samples; S has {p.n}."
        )
    eng = ctx.engine
    with torch.no_grad():
        Z = eng.gather(
            torch.cat([_run(p, module, name, b, measure=NAME)[1].double() for b in p.batches])
        ).cpu()
        own = eng.gather(
            torch.cat([p.loss_fn.per_unit(p.forward(p.params, b), b).double() for b in p.batches])
        ).cpu()
    sc = scale.double().cpu()
    inv = torch.where(
        sc > 0, 1.0 / torch.where(sc > 0, sc, torch.ones_like(sc)), torch.zeros_like(sc)
    )
    Zn = Z * inv  # the (normalized) feature space the kernels live in

    def kernel_loss(idx: np.ndarray, xi: torch.Tensor) -> np.ndarray:
        """ℓ(ψ(φ_i + ξ_i), y_i) for the samples ``idx``, noise ξ in the normalized space."""
        out = []
        with torch.no_grad(), _EditInput(module) as hook:
            for s in range(0, len(idx), p.batch_size):
                rows = p.batch.select(idx[s : s + p.batch_size])
                add = xi[s : s + p.batch_size].to(p.device, p.dtype) * scale
                hook.edit = lambda phi, add=add: phi + add
                out.append(p.loss_fn.per_unit(p.forward(p.params, rows), rows).double().cpu())
        return torch.cat(out).numpy()

    res = kde_representativeness(
        Zn.numpy(),
        lambda tr: (lambda te: own[te].numpy(), kernel_loss),
        opts.delta,
        opts.kde_folds,
        opts.kde_samples,
        ctx.generator(2),
    )
    if ctx.engine is not None:  # features and losses once, each training part kde_samples times
        ctx.engine.count(n_forward=2 + opts.kde_samples * (opts.kde_folds - 1))
    return res


def kde_representativeness(
    Z, fold_model, delta: float, folds: int, draws: int, gen: torch.Generator
) -> dict:
    r"""Cross-validated approximation of representativeness (eq. 3, Sec. 6); see the module docstring.

    Z: (n, m) features, in the space the kernels live in. ``fold_model(train_idx)``
    returns ``(held_out_loss, kernel_loss)`` for the predictor of that fold (the
    measured network: the same for every fold; the authors' experiment refits ψ on
    the fold's training part): ``held_out_loss(te)`` the losses
    :math:`\ell(f(x_j), y_j)` of held-out samples, ``kernel_loss(idx, xi)`` the
    losses :math:`\ell(\psi(z_i + \xi_i), y_i)` with the labels held constant. Per fold k,

    .. math:: \hat{\mathcal E}_{Rep,k} = \frac1{|T_k|}\sum_{j \in T_k} \ell(f(x_j), y_j)
       - \frac1{|S_k|}\sum_{i \in S_k} \frac1D\sum_{d=1}^{D} \ell(\psi(z_i + \xi_{id}), y_i),
       \qquad \xi_{id} \sim \lambda_i \text{ (uniform on the ball of radius } \delta\|z_i\|):

    the predictor's risk estimated on held-out points minus its risk under the
    mixture of Prop. 2's local densities around the training features (uniform on
    the balls of radius δ‖z_i‖, `kernel_noise`: a variable-bandwidth kernel density estimate),
    with D = ``draws`` seeded draws per point. Returns the mean over folds and its
    standard error over folds, and ``kde_loglik``: the held-out mean log-density of
    a fixed-bandwidth Gaussian ``sklearn.neighbors.KernelDensity`` (bandwidth
    δ·median‖z_i‖, exact sums) fitted on each training part, the density estimate's
    error on the held-out part."""
    from sklearn.neighbors import KernelDensity  # imported here: it costs ~0.5 s at start-up

    Z = np.asarray(Z, dtype=np.float64)
    n = Z.shape[0]
    norms = np.linalg.norm(Z, axis=1)
    h = float(delta * np.median(norms))
    perm = torch.randperm(n, generator=gen).numpy()
    parts = np.array_split(perm, folds)
    reps, logliks = [], []
    for k in range(folds):
        te = parts[k]
        tr = np.sort(np.concatenate([parts[j] for j in range(folds) if j != k]))
        held_out_loss, kernel_loss = fold_model(tr)
        risk = float(np.mean(held_out_loss(te)))
        mix = 0.0
        for _ in range(draws):
            xi = kernel_noise(torch.as_tensor(norms[tr]), Z.shape[1], delta, gen)
            mix += float(np.mean(kernel_loss(tr, xi)))
        reps.append(risk - mix / draws)
        if h > 0:
            kde = KernelDensity(bandwidth=h, kernel="gaussian", rtol=0, atol=0).fit(Z[tr])
            logliks.append(float(np.mean(kde.score_samples(Z[te]))))
    reps_a = np.asarray(reps)
    return {
        "representativeness": float(reps_a.mean()),
        "representativeness_stderr": mean_stderr(reps_a)[1],
        "kde_bandwidth": h,
        "kde_loglik": float(np.mean(logliks)) if logliks else math.nan,
        "kde_folds": folds,
    }
