r"""Relative flatness (Petzka, Kamp, Adilova, Sminchisescu & Boley, NeurIPS 2021, Def. 3).

Pick an ``nn.Linear`` layer (``layer``; default the last one registered in the
model, the classifier acting on the penultimate features :math:`\phi`). With
its weight :math:`W \in \mathbb{R}^{d \times m}` (rows :math:`w_s`) and output
:math:`z = W\phi(x) + b`,

.. math::

    \kappa = \sum_{s, s'} \langle w_s, w_{s'} \rangle \,\mathrm{Tr}(H_{s,s'}),

:math:`H_{s,s'}` the :math:`m \times m` block of :math:`\partial^2 L / \partial w_s \partial w_{s'}`.
Because :math:`z` is linear in :math:`W`, the per-sample Hessian in :math:`W` is
:math:`H_z \otimes \phi\phi^\top` with :math:`H_z = \nabla_z^2 \ell` the Hessian
of the per-sample loss with respect to the layer output *through the rest of
the network*. Hence, exactly and without any dense Hessian,

.. math:: \kappa = \frac1n \sum_{x \in S} \|\phi(x)\|^2 \,\langle W W^\top, H_z(x) \rangle .

:math:`H_z` is computed

* in closed form when the layer's output is the model's output:
  :math:`\mathrm{diag}(p) - pp^\top` (``p = softmax(z)``) for cross-entropy and
  :math:`2I` for ``mse``;
* otherwise by Hessian-vector products in :math:`z` through the rest of the
  network: :math:`z` of a whole batch is replaced by a leaf tensor (a forward
  hook), the per-sample losses are summed, and one batched double-backward with
  a vector repeated over the batch gives :math:`H_z(x) v` for every sample at
  once (the loss of sample :math:`x` depends on its own :math:`z` only: the
  model is in eval mode). :math:`\min(d, m)` products per batch: the unit
  vectors of :math:`\mathbb{R}^d` when :math:`d \le m`, else the columns of
  :math:`W`, using :math:`\langle WW^\top, H\rangle = \sum_j W_{:j}^\top H W_{:j}`.

``normalize_features: true`` applies the paper's Theorem 4: each feature
coordinate :math:`\phi_j` is divided by its standard deviation :math:`\sigma_j`
over S (population, ddof 0) and column :math:`j` of :math:`W` multiplied by it,
which leaves :math:`z` and :math:`H_z` unchanged; :math:`\kappa` is then
invariant to every node-wise rescaling. A feature with :math:`\sigma_j = 0`
(constant over S, e.g. a dead ReLU) is absorbed into the bias: it contributes
nothing. Without it, :math:`\kappa` is invariant to rescalings of layers before
the feature layer and to layer-wise rescalings, not to node-wise rescaling of
the features themselves. The measure claims invariance only with
``normalize_features: true`` (``flatcli check-invariance`` turns it on unless
it is set explicitly).

Deliberate departure: the standard deviation, not the variance. Theorem 4's
text divides by "the variance" :math:`\sigma_j` (its V = diag(σ_1, ...)); only
the standard deviation makes the measure invariant. A node-wise rescaling
:math:`\phi_j \to \alpha_j \phi_j` (incoming weights and bias × α_j, outgoing
column × 1/α_j) leaves :math:`\phi_j/\sigma_j` unchanged but turns
:math:`\phi_j/\sigma_j^2` into :math:`\phi_j/(\alpha_j\sigma_j^2)`; the cross
terms :math:`\phi_j^2 \langle W_{:k}W_{:k}^\top, H_z\rangle` then scale by
:math:`\alpha_k^2/\alpha_j^2`. Numbers (ReLU MLP 5-6-4, 25 samples, the
classifier's κ; tests/measures/test_relative_flatness.py), for α = 1, α = linspace(0.2, 5, 6)
and its reverse: std-normalized 0.2871, 0.2871, 0.2871; variance-normalized
0.4036, 5.671, 20.08; unnormalized 0.2960, 5.771, 11.04. (A layer-wise
rescaling, all α_j equal, leaves all three unchanged.)

Larger means sharper.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..engine import LayerCapture, NotApplicable
from ..errors import ConfigError, MeasurementError
from . import Cost, Measure, MeasureResult
from ._options import Bool, Optional, Str, opt


@dataclass(frozen=True)
class RelativeFlatnessOptions:
    """Options of ``relative_flatness``."""

    layer: str | None = opt(
        None, Optional(Str()), "module name of an nn.Linear layer (default: the last Linear)"
    )
    normalize_features: bool = opt(
        False,
        Bool(),
        "divide features by their std over S (Theorem 4; invariant to node-wise rescaling)",
    )


def find_layer(
    model: nn.Module, name: str | None, measure: str = "relative_flatness"
) -> tuple[str, nn.Linear]:
    """The ``nn.Linear`` named ``name`` (default: the last ``nn.Linear`` in ``named_modules`` order);
    ``measure`` names the measure in error messages."""
    modules = dict(model.named_modules())
    linears = [n for n, m in modules.items() if isinstance(m, nn.Linear)]
    if name is None:
        if not linears:
            raise ConfigError(f"{measure} needs an nn.Linear layer; the model has none")
        name = linears[-1]
    if name not in modules:
        import difflib

        hint = difflib.get_close_matches(name, linears, n=1)
        msg = f"The 'layer' parameter of {measure} names no module: {name!r}."
        msg += (
            f" Did you mean {hint[0]!r}?"
            if hint
            else f" Linear layers: {', '.join(linears) or '(none)'}."
        )
        raise ConfigError(msg)
    mod = modules[name]
    if not isinstance(mod, nn.Linear):
        raise ConfigError(
            f"The 'layer' parameter of {measure} must name an nn.Linear layer; {name!r} is "
            f"{type(mod).__name__}. Linear layers: {', '.join(linears) or '(none)'}."
        )
    return name, mod


def rows_only(problem, measure: str) -> None:
    """`NotApplicable` unless the loss scores one unit per row (per-sample features and losses)."""
    reason = rows_only_reason(problem, measure)
    if reason:
        raise NotApplicable(reason)


def rows_only_reason(problem, measure: str) -> str | None:
    """Why ``measure`` is not applicable when the loss scores many units per row (None: it is);
    the ``applicable`` check of the measures that need per-sample features."""
    if problem.loss_fn.units_are_rows:
        return None
    return (
        f"{measure} takes one feature vector and one loss per sample; loss "
        f"{problem.loss_name!r} scores many units (tokens) per row, so no layer qualifies "
        "(a classifier's head on (batch, features) inputs does, with cross_entropy or mse)"
    )


def feature_layers(problem) -> list[str]:
    """The ``nn.Linear`` layers that run once per forward pass on (batch, features) inputs: those
    the measure can use (one forward pass of one row with a hook on every Linear)."""
    shapes: dict[str, list[int]] = {}
    handles = []
    for n, m in problem.model.named_modules():
        if isinstance(m, nn.Linear):
            handles.append(
                m.register_forward_hook(
                    lambda mod, inp, out, n=n: shapes.setdefault(n, []).append(inp[0].ndim)
                )
            )
    try:
        with torch.no_grad():
            problem.forward(problem.params, problem.batch.select(slice(0, 1)))
    finally:
        for h in handles:
            h.remove()
    return [n for n, dims in shapes.items() if dims == [2]]


def _not_two_dimensional(problem, name: str, shape, measure: str) -> NotApplicable:
    ok = feature_layers(problem)
    return NotApplicable(
        f"layer {name!r} gets inputs of shape {shape}, not (batch, features); layers that "
        f"qualify: {', '.join(ok) if ok else 'none in this model'} (set {measure}'s 'layer')"
    )


def _run(problem, module, name, batch, measure="relative_flatness"):
    """(model output, layer input φ, layer output z) of one batch (a forward pass, no gradient)."""
    with LayerCapture(module) as cap, torch.no_grad():
        out = problem.forward(problem.params, batch)
    if len(cap.inputs) != 1:
        raise MeasurementError(
            f"{measure}: layer {name!r} ran {len(cap.inputs)} times in one forward pass; "
            "it must run exactly once (no weight sharing)"
        )
    phi, z = cap.inputs[0], cap.outputs[0]
    if phi.ndim != 2:
        raise _not_two_dimensional(problem, name, tuple(phi.shape), measure)
    return out, phi, z


def _feature_std(problem, module, name, measure="relative_flatness") -> torch.Tensor:
    """Population standard deviation over S of each input feature of the layer (Chan's merge, float64)."""
    parts = []
    with torch.no_grad():
        for b in problem.batches:
            _, phi, _ = _run(problem, module, name, b, measure=measure)
            phi = phi.double()
            bm = phi.mean(0)
            parts.append(torch.cat([phi.new_tensor([phi.shape[0]]), bm, ((phi - bm) ** 2).sum(0)]))
    if problem.dist.active:  # every rank's batches, in order
        parts = list(
            problem.dist.gather_cat(
                torch.stack(parts)
                if parts
                else torch.zeros(0, 1 + 2 * module.in_features, dtype=torch.float64)
            )
        )
    n_tot, mean, m2 = 0.0, None, None
    for part in parts:  # Chan et al.'s pairwise merge
        b, bm, bm2 = (
            float(part[0]),
            part[1 : 1 + module.in_features],
            part[1 + module.in_features :],
        )
        if mean is None:
            n_tot, mean, m2 = b, bm, bm2
        else:
            delta = bm - mean
            tot = n_tot + b
            mean = mean + delta * b / tot
            m2 = m2 + bm2 + delta**2 * n_tot * b / tot
            n_tot = tot
    return (m2 / n_tot).sqrt()


def _claim(opts: RelativeFlatnessOptions) -> bool | str:
    if opts.normalize_features:
        return True
    return "invariant to node-wise rescaling only with normalize_features: true (Theorem 4)"


def _note(a: MeasureResult, b: MeasureResult, opts: RelativeFlatnessOptions) -> str | None:
    if opts.normalize_features:
        return "measured with normalize_features: true (Petzka et al. 2021, Theorem 4)"
    return None


class RelativeFlatness(Measure):
    r"""Relative flatness :math:`\kappa` of one Linear layer, larger means sharper.

    Parameters (options)
    --------------------
    layer : str or None, default None — module name of an ``nn.Linear``; None picks the last one.
    normalize_features : bool, default False — Theorem 4's feature normalization
        (makes :math:`\kappa` invariant to node-wise rescaling).

    Diagnostics: ``layer``, ``method`` (``closed_form`` or ``hvp``), ``d``,
    ``m`` (output and input features), ``z_hvps`` (z-space products, each over a
    batch), ``mean_feature_norm2`` (mean ‖φ‖², normalized when asked),
    ``zero_std_features``.

    References: Petzka et al. (2021), "Relative Flatness and Generalization",
    NeurIPS, Definition 3 (κ), Theorem 4 (normalization), property (i) (the ridge
    identity κ = 2‖w‖² mean ‖x‖² for f(x) = w·x with squared loss).
    """

    name = "relative_flatness"
    options = RelativeFlatnessOptions
    description = "Relative flatness κ = mean ‖φ‖²⟨WWᵀ, H_z⟩ of a Linear layer (exact, no dense Hessian); node-rescaling invariant with normalize_features: true."
    reference = "Petzka, Kamp, Adilova, Sminchisescu & Boley, NeurIPS 2021, Def. 3 and Theorem 4"
    stochastic = False
    invariance_options = {"normalize_features": True}

    invariant = staticmethod(_claim)

    invariance_note = staticmethod(_note)

    def declare_cost(self, o, d) -> Cost:
        """Forward passes for the features (one more with ``normalize_features``); an inner layer
        adds the products of its per-batch Hessian block, which are not declared."""
        return Cost(forward=1 + int(o.normalize_features), grad=(0, 1))

    def applicable(self, o, p):
        return rows_only_reason(p, "relative_flatness")

    def compute(self, ctx, opts: RelativeFlatnessOptions) -> MeasureResult:
        p = ctx.problem
        rows_only(p, "relative_flatness")
        name, module = find_layer(ctx.model, opts.layer)
        wname = f"{name}.weight" if name else "weight"
        W = p.params.get(wname) if wname in p.params else p.frozen.get(wname)
        if W is None:
            raise MeasurementError(
                f"relative_flatness: weight {wname!r} not found among the model's parameters"
            )
        W = W.detach()
        d, m = W.shape
        scale = torch.ones(m, dtype=torch.float64, device=W.device)
        zero_std = 0
        if opts.normalize_features:
            sigma = _feature_std(p, module, name).to(W.device)
            keep = sigma > 0
            zero_std = int((~keep).sum())
            scale = torch.where(keep, sigma, torch.zeros_like(sigma))
        inv = torch.where(
            scale > 0,
            1.0 / torch.where(scale > 0, scale, torch.ones_like(scale)),
            torch.zeros_like(scale),
        )
        Wt = W.double() * scale[None, :]  # W̃ = W diag(σ)
        G = Wt @ Wt.T  # W̃W̃ᵀ (d × d)
        use_units = d <= m
        V = (
            torch.eye(d, dtype=torch.float64, device=W.device) if use_units else Wt.T.contiguous()
        )  # (k, d)
        total = 0.0
        feat = 0.0
        z_hvps = 0
        method = None
        for b in p.batches:
            with torch.no_grad():
                out, phi, z = _run(p, module, name, b)
            phin2 = ((phi.double() * inv[None, :]) ** 2).sum(1)  # ‖φ̃‖², (B,)
            final = out is z and p.loss_name in ("cross_entropy", "mse")
            if final and p.loss_name == "cross_entropy":
                pr = torch.softmax(z.double(), dim=1)
                q = (pr * torch.diagonal(G)[None, :]).sum(1) - ((pr @ G) * pr).sum(1)
                method = method or "closed_form"
            elif final:  # mse: ℓ = Σ_j (z_j − t_j)², H_z = 2I
                q = torch.full_like(phin2, 2.0 * float(torch.trace(G)))
                method = method or "closed_form"
            else:
                hv = ctx.engine.module_output_hvp(module, b, z, V.to(p.dtype)).double()  # (k, B, d)
                z_hvps += V.shape[0]
                q = (
                    torch.einsum("st,snt->n", G, hv)
                    if use_units
                    else torch.einsum("jt,jnt->n", V, hv)
                )
                method = "hvp"
            total += float((phin2 * q).sum())
            feat += float(phin2.sum())
        total, feat = p.dist.sum_float(total, feat)
        ctx.engine.count(
            n_forward=1 + int(opts.normalize_features)
        )  # the forward passes of _run above
        kappa = total / p.n
        if not math.isfinite(kappa):
            raise MeasurementError(f"relative_flatness is not finite ({kappa})")
        return MeasureResult(
            value=kappa,
            diagnostics={
                "layer": name,
                "method": method,
                "d": int(d),
                "m": int(m),
                "z_hvps": z_hvps,
                "normalize_features": bool(opts.normalize_features),
                "mean_feature_norm2": feat / p.n,
                "zero_std_features": zero_std,
            },
        )
