r"""Norm baselines (Jiang et al. 2020, §C; Neyshabur et al. 2017; Bartlett et al. 2017).

Weight matrices W_l are every ``nn.Linear`` weight and every convolution weight
reshaped to (out_channels × in_channels·kh·kw) (see `flatcli.measures._layers`);
biases are not weight matrices.

BatchNorm: every norm measure here (except ``inverse_margin``, which only uses
the network's outputs) is computed on the model with BatchNorm folded into the
preceding Linear/Conv layer (`flatcli.measures._bn`): W' = diag(γ/√(σ²+ε)) W,
b' = s∘(b − μ) + β with the running statistics, so the value does not depend on
how a scale is split between a weight and its normalization. The folded copy
computes exactly the same function in eval mode; BatchNorms that cannot be
folded are listed in the diagnostic ``unfolded_batchnorm``.
"""

from __future__ import annotations

import math

import torch
from torch.func import functional_call

from ..engine.losses import NotApplicable
from ..errors import ConfigError
from . import Cost, Measure, MeasureResult
from ._bn import Folded, fold_batchnorm, init_buffers
from ._layers import class_outputs_or_error, selected, weight_matrices


def folded_model(ctx) -> Folded:
    """The measurement model (problem parameters and buffers) with BatchNorm folded."""
    p = ctx.problem
    return fold_batchnorm(ctx.model, {**p.params, **p.frozen}, p.buffers, dtype=p.dtype)


def _bn_diag(f: Folded) -> dict:
    return {"folded_batchnorm": len(f.pairs), "unfolded_batchnorm": ",".join(f.unfolded)}


def _weights(f: Folded, names=None) -> dict[str, torch.Tensor]:
    """Folded weight matrices (rows × rest) in float64, by module name (``names``: only those of
    the selected parameters, `flatcli.measures._layers.selected`)."""
    return {
        wm.module_name: wm.as_matrix(wm.module.weight.detach()).double()
        for wm in weight_matrices(f.module, names, frozen=True)
    }


def _parameters_only(o, d) -> Cost:
    """No pass over the data (the parameters only)."""
    return Cost()


class FrobeniusNorm(Measure):
    r""":math:`\sum_l \|W_l\|_F^2` over Linear and Conv weights (biases excluded, BatchNorm
    folded). Larger means a larger predicted gap. Diagnostics: ``layers`` (per layer)."""

    name = "frobenius_norm"
    description = (
        "Sum over weight matrices of the squared Frobenius norm, Σ_l ‖W_l‖_F² (BatchNorm folded)."
    )
    reference = "Jiang et al. 2020 (§C, eq. 40 'frob'); Neyshabur et al. 2017"

    declare_cost = staticmethod(_parameters_only)

    def compute(self, ctx, opts) -> MeasureResult:
        f = folded_model(ctx)
        per_layer = {
            name: float((w * w).sum()) for name, w in _weights(f, selected(ctx.problem)).items()
        }
        return MeasureResult(
            value=float(sum(per_layer.values())), diagnostics={"layers": per_layer, **_bn_diag(f)}
        )


class SpectralNorm(Measure):
    r""":math:`\sum_l \log \|W_l\|_2^2` (the log of :math:`\prod_l \|W_l\|_2^2`), with
    ‖·‖₂ the largest singular value of the folded weight matrix (conv weights
    reshaped to out × in·k). Larger means a larger predicted gap. Diagnostics:
    ``layers`` (per-layer ‖W_l‖₂)."""

    name = "spectral_norm"
    description = (
        "Log of the product of squared spectral norms, Σ_l log ‖W_l‖₂² (BatchNorm folded)."
    )
    reference = "Jiang et al. 2020 (§C, eq. 33 'log-prod-of-spec'); Bartlett et al. 2017; Neyshabur et al. 2018"

    def declare_cost(self, o, d) -> Cost:
        """No pass over the data: one SVD per weight matrix."""
        return Cost()

    def compute(self, ctx, opts) -> MeasureResult:
        f = folded_model(ctx)
        per_layer = {
            name: float(torch.linalg.matrix_norm(w, ord=2))
            for name, w in _weights(f, selected(ctx.problem)).items()
        }
        value = float(sum(2.0 * math.log(s) if s > 0 else -math.inf for s in per_layer.values()))
        return MeasureResult(value=value, diagnostics={"layers": per_layer, **_bn_diag(f)})


def _path_norm_reason(problem) -> str | None:
    """Why path_norm does not apply (named inputs: no single input to feed ones to), or None."""
    if "x" in problem.batch:
        return None
    return f"path_norm feeds an all-ones input 'x' to the model; this data has named inputs ({', '.join(problem.batch)})"


class PathNorm(Measure):
    r""":math:`\sum f_{\theta^2}(\mathbf 1)`: every parameter (weights and biases, after
    BatchNorm folding) squared, the network evaluated in eval mode on an all-ones
    input shaped like one sample of the measurement set, the outputs summed. For a
    ReLU network without biases this is the sum over input-output paths of the
    product of squared weights. Larger means a larger predicted gap. Invariant to node-wise
    rescaling of ReLU networks (each path's product of squared weights, biases included, keeps
    its value), and the measure claims it."""

    name = "path_norm"
    description = "Path norm: square every parameter, feed an all-ones input, sum the outputs (BatchNorm folded)."
    reference = "Jiang et al. 2020 (§C, eq. 44 'path.norm'); Neyshabur, Salakhutdinov & Srebro 2015"
    invariant = True

    def declare_cost(self, o, d) -> Cost:
        """One forward pass of a single all-ones input (not a pass over the data)."""
        return Cost()

    def applicable(self, o, p):
        return _path_norm_reason(p)

    def compute(self, ctx, opts) -> MeasureResult:
        p = ctx.problem
        reason = _path_norm_reason(p)
        if reason:
            raise NotApplicable(reason)
        x1 = p.batch["x"][:1]
        if not x1.is_floating_point():
            raise ConfigError(
                "path_norm needs floating-point inputs (an all-ones input is fed to the model)"
            )
        f = folded_model(ctx)
        sq = {n: t * t for n, t in f.params().items()}
        with torch.no_grad():
            out = functional_call(f.module, {**sq, **f.buffers()}, (torch.ones_like(x1),))
        value = float(out.double().sum())
        diag = _bn_diag(f)
        if f.unfolded:
            diag["note"] = (
                "BatchNorm left unfolded: its parameters are squared, its running statistics kept"
            )
        return MeasureResult(
            value=value, diagnostics=diag, status="ok" if math.isfinite(value) else "non_finite"
        )


class DistanceFromInit(Measure):
    r""":math:`\sum_l \|W_l - W^0_l\|_F^2` over the folded weight matrices of the
    checkpoint and of the initialization (each folded with its own BatchNorm
    statistics; init statistics from the init checkpoint, or a fresh BatchNorm's
    0/1 when it holds none). Needs the config key ``init_checkpoint`` (or a
    manifest column). Larger means a larger predicted gap."""

    name = "distance_from_init"
    description = "Squared distance from initialization Σ_l ‖W_l − W_l⁰‖_F² (needs init_checkpoint; BatchNorm folded)."
    reference = (
        "Jiang et al. 2020 (§C, eq. 41 'dist.init' / frob-distance); Nagarajan & Kolter 2019"
    )
    needs_init = True

    declare_cost = staticmethod(_parameters_only)

    def compute(self, ctx, opts) -> MeasureResult:
        if ctx.init_params is None:
            raise ConfigError(
                "measure distance_from_init needs the initial parameters: set the config key 'init_checkpoint' "
                "(or an 'init_checkpoint' manifest column; Python: init_state=...)"
            )
        p = ctx.problem
        missing = [n for n in p.names if n not in ctx.init_params]
        if missing:
            raise ConfigError(
                f"init_checkpoint lacks parameters {', '.join(missing[:5])}"
                + (" ..." if len(missing) > 5 else "")
            )
        f = folded_model(ctx)
        init_params = {n: ctx.init_params[n].to(p.device, p.dtype) for n in p.names}
        f0 = fold_batchnorm(
            ctx.model,
            {**init_params, **p.frozen},
            {**p.buffers, **init_buffers(ctx)},
            dtype=p.dtype,
        )
        w, w0 = _weights(f, selected(p)), _weights(f0, selected(p))
        per_layer = {name: float(((w[name] - w0[name].to(w[name])) ** 2).sum()) for name in w}
        return MeasureResult(
            value=float(sum(per_layer.values())), diagnostics={"layers": per_layer, **_bn_diag(f)}
        )


class InverseMargin(Measure):
    r""":math:`1/\gamma^2` with γ the 10th percentile (linear interpolation,
    ``torch.quantile``) over the measurement set of the output margin
    :math:`f_y(x) - \max_{j \ne y} f_j(x)`. Larger means a larger predicted gap.
    When γ ≤ 0 (more than 10% of S misclassified or on the boundary) the margin
    carries no scale: the value is ``inf`` (worse than any positive margin) with
    status ``non_positive_margin``; γ is in the diagnostic ``margin``. A function of the
    outputs only, so invariant to every function-preserving reparameterization."""

    name = "inverse_margin"
    description = (
        "Inverse squared margin 1/γ², γ the 10th percentile over S of f_y − max_{j≠y} f_j."
    )
    reference = "Jiang et al. 2020 (§C, eq. 21 '1/margin²'); Bartlett et al. 2017"
    invariant = True

    def declare_cost(self, o, d) -> Cost:
        """One forward pass over the measurement set."""
        return Cost(forward=1)

    def compute(self, ctx, opts) -> MeasureResult:
        def margin(Z, t):
            class_outputs_or_error(Z, t, "inverse_margin")
            Z = Z.double()
            fy = Z.gather(1, t.long()[:, None])[:, 0]
            return fy - Z.scatter(1, t.long()[:, None], -math.inf).max(1).values

        m = ctx.engine.per_unit(margin, classes=True)
        gamma = float(torch.quantile(m, 0.1))
        diag = {"margin": gamma, "median_margin": float(m.median())}
        if gamma <= 0:
            return MeasureResult(value=math.inf, diagnostics=diag, status="non_positive_margin")
        return MeasureResult(value=1.0 / gamma**2, diagnostics=diag)
