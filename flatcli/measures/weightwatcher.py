r"""WeightWatcher's power-law exponent α of each layer's eigenvalue spectrum (data-free).

Martin & Mahoney, "Predicting trends in the quality of state-of-the-art neural
networks without access to training or testing data", Nature Communications 12,
4122 (2021), and "Implicit self-regularization in deep neural networks", JMLR 22
(2021): the empirical spectral density (ESD) of :math:`X = W^\top W` of a trained
layer is heavy-tailed, :math:`\rho(\lambda) \sim \lambda^{-\alpha}` above some
:math:`\lambda_{\min}`; the better trained the layer, the smaller α (typically
2 to 4 for well-trained layers, above 6 for random-like ones).

Per layer (every ``nn.Linear`` and convolution weight, as WeightWatcher does):

* Eigenvalues: the squared singular values of W (those of :math:`W^\top W`;
  ``min(out, in)`` of them), not normalized (WeightWatcher's default
  ``normalize=False``). A convolution weight of shape (out, in, k_1, ...) is
  cut into one out × in matrix per kernel position, ``W[:, :, i, j]``, and the
  eigenvalues of all slices are pooled into one ESD (WeightWatcher's
  ``conv2D_Wmats`` with its default ``pool=True``; the PyTorch layout is known,
  so WeightWatcher's channels-first/last guess, which misreads convolutions with
  ``out + in < kh + kw``, is not needed; Conv1d and Conv3d are sliced the same way).
* Fit: WeightWatcher 0.7.7's own (`ww_fit`, its ``WW_powerlaw.WWFit``): the
  eigenvalues above 1e-5 (``EVALS_THRESH``; option ``evals_thresh``) are fitted to
  a continuous power law by maximum likelihood with :math:`x_{\min}` chosen by the
  Kolmogorov-Smirnov distance (Clauset, Shalizi & Newman 2009, eq. 3.1 and §3.3)
  when there are at least 20 of them, and by its small-sample fit below 20
  (bias-corrected MLE over tails of at least 8 points, :math:`x_{\min}` by the KS
  distance). The former fit used Clauset's recipe at every size
  (`fit_power_law`, which equals the ``powerlaw`` package): on a 10-eigenvalue
  layer (any 10-class head) it gave α = 5.17 where WeightWatcher gives 2.04, 2.14 vs 1.61 on the 10-eigenvalue layer of tests/measures/test_weightwatcher.py.
* Layers with fewer than ``min_evals`` eigenvalues (default 8, WeightWatcher
  0.7.7's ``DEFAULT_MIN_EVALS``; its docstring says 10), counted as it counts
  them (all ``min(out, in)`` eigenvalues, times the kernel positions of a
  convolution, before the threshold), are skipped and listed, with their number
  of eigenvalues above the threshold.

Where flatcli and WeightWatcher 0.7.7 (default ``analyze()``) still differ,
deliberately: a layer with fewer than 3 distinct eigenvalues above the threshold
is skipped here (WeightWatcher fits the degenerate set, α = 1 for one value);
layers with more than 15,000 eigenvalues or a dimension above 50,000
(WeightWatcher's ``max_evals``, ``max_N``) are fitted here and skipped there; the
reported ``sigma`` is (α − 1)/√n_tail also where WeightWatcher's small-sample
fallback reports −1/√N (a quirk of its bookkeeping); α itself is the same on
every layer both fit (tests/measures/test_weightwatcher.py, against the package).

Value: the mean of α over the fitted layers. Orientation: Martin & Mahoney find
that smaller α (heavier-tailed, better-trained layers) goes with better test
accuracy across architectures, so a larger mean α predicts a larger
generalization gap: the value is α as it is (larger = sharper in flatcli's
sense, i.e. a larger predicted gap). (Their reading is not monotone below
α ≈ 2, where layers may be over-trained; flatcli reports α itself.)

Diagnostics: ``alpha_hat`` = :math:`\hat\alpha = \sum_l \alpha_l \log_{10}
\lambda_{\max,l}` (Martin & Mahoney 2021's weighted alpha, a sum over the
fitted layers; larger = larger predicted gap), ``alpha_weighted_mean``
(WeightWatcher's summary ``alpha_weighted``, the mean of
:math:`\alpha_l \log_{10}\lambda_{\max,l}`), ``layers_fitted``,
``layers_skipped`` (names with their eigenvalue counts), and ``layers`` (per
layer: ``alpha``, ``xmin``, ``D`` (KS distance), ``sigma`` (the MLE's standard
error (α − 1)/√n_tail), ``n_evals``, ``n_tail``, ``lambda_max``,
``alpha_weighted``). ``stderr`` is the MLE standard error of the mean,
:math:`\sqrt{\sum_l \sigma_l^2}/L`.

Departure from WeightWatcher's defaults: its ``conv2d_norm`` multiplies pooled
convolution slices by :math:`\sqrt{1/2}` before the ESD, which halves their
eigenvalues; α is scale-free and identical, but WeightWatcher's
``alpha_weighted`` of a convolution is α·log10(2) smaller than here. BatchNorm is
not folded (as in WeightWatcher). The measure reads the parameters only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from . import Cost, Measure, MeasureResult, NotApplicable
from ._layers import selected, weight_matrices
from ._options import Integral, Real, opt

EVALS_THRESH = 1e-5  # WeightWatcher's EVALS_THRESH
_CHUNK = 256  # candidate x_min values evaluated at once


@dataclass(frozen=True)
class PowerLawFit:
    """A continuous power-law fit :math:`p(x) \\propto x^{-\\alpha}` for :math:`x \\ge x_{\\min}`.

    alpha: the MLE exponent; xmin: the chosen lower cut-off; D: its KS distance;
    sigma: the MLE's standard error (α − 1)/√n_tail; n_tail: points ≥ xmin;
    n: points fitted."""

    alpha: float
    xmin: float
    D: float
    sigma: float
    n_tail: int
    n: int


def fit_power_law(x) -> PowerLawFit:
    r"""Maximum-likelihood power-law fit with :math:`x_{\min}` chosen by the KS distance.

    Clauset, Shalizi & Newman (2009), SIAM Review 51, eq. 3.1 and §3.3, as the
    ``powerlaw`` package (Alstott et al. 2014) implements it for continuous data:

    * candidate :math:`x_{\min}`: the distinct data values below the maximum,
      the largest of them excluded (every tail keeps at least two distinct values);
    * for each, the closed-form MLE :math:`\alpha = 1 + n / \sum_{x_i \ge x_{\min}}
      \log(x_i / x_{\min})` over the n tail points;
    * the KS distance :math:`D = \max |F(x) - S(x)|` over the distinct tail
      values, F the fitted CDF :math:`1 - (x/x_{\min})^{1-\alpha}` and S the
      tail's empirical CDF counted strictly below x (the package's convention,
      ties handled alike);
    * the candidate with the smallest D (the first on ties).

    Unlike ``powerlaw`` 2.0, α is not restricted to its default range (0, 3)
    (nor refitted numerically outside (1.5, 3]): WeightWatcher's exponents
    reach 6 and more, and its own fitter has no such range either. Where the
    chosen α lies in (1.5, 3) and no candidate with α ≥ 3 has a smaller D, the
    result equals ``powerlaw.Fit(x).alpha`` / ``.xmin`` (tests/measures/test_weightwatcher.py).

    ``x``: positive values (non-positive ones are an error). Needs at least 3
    distinct values.
    """
    x = np.sort(np.asarray(x, dtype=np.float64))
    if x.size == 0 or x[0] <= 0 or not np.all(np.isfinite(x)):
        raise ValueError("fit_power_law needs finite positive values")
    u, first = np.unique(x, return_index=True)
    if len(u) < 3:
        raise ValueError(f"fit_power_law needs at least 3 distinct values. Got {len(u)} instead.")
    N = x.size
    logx = np.log(x)
    suffix = np.concatenate([np.cumsum(logx[::-1])[::-1], [0.0]])  # Σ_{t ≥ i} log x_t
    cand = np.arange(len(u) - 2)  # distinct values below the maximum, the last one excluded
    i0 = first[cand]
    n = (N - i0).astype(np.float64)
    alpha = 1.0 + n / (suffix[i0] - n * logx[i0])
    D = np.empty(len(cand))
    for s in range(0, len(cand), _CHUNK):
        k = cand[s : s + _CHUNK]
        lo = int(k[0])  # columns below the chunk's smallest candidate are outside every tail
        j = np.arange(lo, len(u))[None, :]
        mask = j >= k[:, None]
        ratio = u[None, lo:] / u[k][:, None]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            theo = 1.0 - np.power(ratio, 1.0 - alpha[k][:, None])
        emp = (first[None, lo:] - first[k][:, None]) / n[k][:, None]
        diff = np.where(mask, np.abs(theo - emp), -np.inf)
        D[s : s + len(k)] = diff.max(1)
    best = int(np.argmin(D))
    a = float(alpha[best])
    nt = int(n[best])
    return PowerLawFit(a, float(u[cand[best]]), float(D[best]), (a - 1) / math.sqrt(nt), nt, N)


SMALL_N_CUTOFF = (
    20  # WeightWatcher 0.7.7 (WW_powerlaw.SMALL_N_CUTOFF): below it, the small-sample fit
)
SMALL_N_TAIL = 8  # its k_min: the smallest tail the small-sample fit considers


def ww_fit(x) -> PowerLawFit:
    r"""WeightWatcher 0.7.7's power-law fit (``WW_powerlaw.WWFit``, its default ``pl_package``).

    On the sorted values :math:`x_0 \le \dots \le x_{N-1}`, every position
    :math:`i \le N-2` is a candidate :math:`x_{\min} = x_i` with the tail
    :math:`x_i, \dots, x_{N-1}` (n = N − i points, ties counted per position):

    * N ≥ 20 (`SMALL_N_CUTOFF`): the MLE :math:`\alpha_i = 1 + n / \sum_{j\ge i}\log(x_j/x_i)`
      and the KS distance :math:`D_i = \max_{j \ge i} |1 - (x_j/x_i)^{1-\alpha_i} - (j-i)/n|`;
      the first candidate with the smallest D. For distinct values this is
      `fit_power_law` with one more candidate, the two-point tail (D = 1 − e⁻² − ½ = 0.365).
    * N < 20: the small-sample fit (``fit_powerlaw_smallN``): only tails of n ≥ 8
      points, the bias-corrected MLE :math:`\alpha_i = 1 + (n - 1)/\sum_{j\ge i}\log(x_j/x_i)`
      (tails with that sum ≤ 1e-12 skipped), the first candidate with the smallest
      KS distance :math:`D_i` as above (``fit_powerlaw_smallN`` ranks them by
      :math:`D_i - 0.868/\sqrt n`, but ``WWFit.__init__`` then re-selects by the
      smallest D, and that is what it reports); when no tail qualifies (N < 8), the
      whole set is the tail.

    ``sigma`` = (α − 1)/√n as WeightWatcher reports it. Needs at least two values;
    tests/measures/test_weightwatcher.py compares it with the package on every regime.
    """
    x = np.sort(np.asarray(x, dtype=np.float64))
    if x.size < 2 or x[0] <= 0 or not np.all(np.isfinite(x)):
        raise ValueError("ww_fit needs at least two finite positive values")
    if x.size < SMALL_N_CUTOFF:
        return _ww_small_n(x)
    return _ww_standard(x)


def _ww_standard(x: np.ndarray) -> PowerLawFit:
    N = x.size
    logx = np.log(x)
    suffix = np.cumsum(logx[::-1])[::-1]  # Σ_{j ≥ i} log x_j
    i = np.arange(N - 1)
    n = (N - i).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        alpha = 1.0 + n / (suffix[:-1] - n * logx[:-1])
    D = np.ones(N - 1)
    for s in range(0, N - 1, _CHUNK):
        k = i[s : s + _CHUNK]
        j = np.arange(int(k[0]), N)[None, :]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            theo = 1.0 - np.power(x[None, int(k[0]) :] / x[k][:, None], 1.0 - alpha[k][:, None])
        emp = (j - k[:, None]) / n[k][:, None]
        d = np.where(j >= k[:, None], np.abs(theo - emp), -np.inf).max(1)
        D[s : s + len(k)] = np.where(alpha[k] > 1, d, 1.0)
    best = int(np.argmin(D))
    a = float(alpha[best])
    return PowerLawFit(
        a, float(x[best]), float(D[best]), (a - 1) / math.sqrt(N - best), int(N - best), N
    )


def _ww_small_n(x: np.ndarray) -> PowerLawFit:
    N = x.size
    logx = np.log(x)
    alpha, D = np.zeros(N - 1), np.ones(N - 1)
    for i in range(N - 1):
        n = N - i
        s = float(np.sum(logx[i:]) - n * logx[i])
        if n < SMALL_N_TAIL or s <= 1e-12:
            continue
        alpha[i] = 1.0 + (n - 1.0) / s
        D[i] = float(np.max(np.abs(np.arange(n) / n - (1.0 - (x[i:] / x[i]) ** (1.0 - alpha[i])))))
    if not alpha.any():  # no tail of 8 or more: the whole set
        s = float(np.sum(logx) - N * logx[0])
        if s <= 1e-12:
            return PowerLawFit(1.0, float(x[0]), 1.0, 0.0, N, N)
        alpha[0] = 1.0 + (N - 1.0) / s
        D[0] = float(np.max(np.abs(np.arange(N) / N - (1.0 - (x / x[0]) ** (1.0 - alpha[0])))))
    best = int(np.argmin(D))
    a, n = float(alpha[best]), N - best
    return PowerLawFit(a, float(x[best]), float(D[best]), (a - 1) / math.sqrt(n), n, N)


def layer_eigenvalues(W: torch.Tensor) -> np.ndarray:
    """Eigenvalues of :math:`W^\\top W` pooled over a convolution's kernel positions (float64)."""
    W = W.detach().double()
    if W.ndim == 2:
        mats = W[None]
    else:
        W3 = W.reshape(W.shape[0], W.shape[1], -1)  # (out, in, kernel positions)
        mats = W3.permute(2, 0, 1)  # one out × in matrix per position
    sv = torch.linalg.svdvals(mats.cpu())
    return np.sort((sv * sv).reshape(-1).numpy())


@dataclass(frozen=True)
class WeightWatcherOptions:
    """Options of ``weightwatcher_alpha``."""

    min_evals: int = opt(
        8,
        Integral(1, None),
        "skip layers with fewer eigenvalues (min(out, in) × kernel positions; WeightWatcher 0.7.7: 8)",
    )
    evals_thresh: float = opt(
        EVALS_THRESH,
        Real(0, None, "left"),
        "eigenvalues at or below this are left out of the fit (WeightWatcher: 1e-5)",
    )


def layer_fit(W: torch.Tensor, opts: WeightWatcherOptions) -> tuple[dict | None, int]:
    """(the layer's fit as reported per layer, or None when it is skipped; its number of eigenvalues
    above ``evals_thresh``). Skipped: fewer than ``min_evals`` eigenvalues in all, or fewer than 3
    distinct ones above the threshold."""
    ev = layer_eigenvalues(W)
    nz = ev[ev > opts.evals_thresh]
    if len(ev) < opts.min_evals or len(np.unique(nz)) < 3:
        return None, len(nz)
    f = ww_fit(nz)
    lam_max = float(ev[-1])
    return {
        "alpha": f.alpha,
        "xmin": f.xmin,
        "D": f.D,
        "sigma": f.sigma,
        "n_evals": int(len(ev)),
        "n_tail": f.n_tail,
        "lambda_max": lam_max,
        "alpha_weighted": f.alpha * math.log10(lam_max),
    }, len(nz)


class WeightwatcherAlpha(Measure):
    r"""Mean power-law exponent α over the layers; larger means a larger predicted gap.

    Each fitted layer l's eigenvalues λ of :math:`W_l^\top W_l` above :math:`x_{\min,l}`
    follow :math:`\rho(\lambda) \propto \lambda^{-\alpha_l}`; over the L fitted layers

    .. math::

        \bar\alpha = \frac1L \sum_{l=1}^{L} \alpha_l, \qquad
        \alpha_l = 1 + n_l \Big(\sum_{\lambda_j \ge x_{\min,l}}
        \ln\frac{\lambda_j}{x_{\min,l}}\Big)^{-1}

    (the maximum-likelihood fit over the :math:`n_l` tail eigenvalues; :math:`n_l - 1` in
    place of :math:`n_l` for a layer of fewer than 20 eigenvalues). See the module
    docstring for the ESD, the fit, α̂ and the orientation."""

    name = "weightwatcher_alpha"
    options = WeightWatcherOptions
    description = "WeightWatcher 0.7.7 α: mean over layers of the power-law exponent of the ESD of WᵀW (its MLE fit, x_min by KS; small-sample fit below 20 eigenvalues); α̂ = Σ α log λmax in diagnostics (data-free)."
    reference = (
        "Martin & Mahoney 2021 (Nature Communications 12:4122, α and weighted α̂; JMLR 22, heavy-tailed ESD); "
        "Clauset, Shalizi & Newman 2009 (SIAM Review, eq. 3.1 and §3.3)"
    )
    stochastic = False

    def declare_cost(self, o, d) -> Cost:
        """No pass over the data: one SVD per weight matrix (convolutions: one per kernel position)
        and a KS scan of O(n²) over its n eigenvalues."""
        return Cost()

    def compute(self, ctx, opts: WeightWatcherOptions) -> MeasureResult:
        p = ctx.problem
        layers, skipped = {}, []
        for wm in weight_matrices(ctx.model, selected(p), frozen=True):
            W = p.params.get(wm.param_name)
            if W is None:
                W = p.frozen.get(wm.param_name, wm.module.weight)
            fit, n_above = layer_fit(W, opts)
            if fit is None:
                skipped.append(f"{wm.module_name} ({n_above} eigenvalues)")
            else:
                layers[wm.module_name] = fit
        if not layers:  # a model too small (or too sparse) for the fit: the measure does not apply
            raise NotApplicable(
                "no layer has enough eigenvalues for a power-law fit "
                f"(min_evals = {opts.min_evals}); skipped: {', '.join(skipped) or '(no Linear/Conv layers)'}"
            )
        alphas = [v["alpha"] for v in layers.values()]
        weighted = [v["alpha_weighted"] for v in layers.values()]
        L = len(alphas)
        stderr = math.sqrt(sum(v["sigma"] ** 2 for v in layers.values())) / L
        return MeasureResult(
            value=float(np.mean(alphas)),
            stderr=stderr,
            diagnostics={
                "alpha_hat": float(sum(weighted)),
                "alpha_weighted_mean": float(np.mean(weighted)),
                "layers_fitted": L,
                "layers_skipped": ", ".join(skipped),
                "layers": layers,
            },
        )
