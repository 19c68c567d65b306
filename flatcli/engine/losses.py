r"""Losses as small plug-ins: what a loss is, per scored unit, and what measures need from it.

A loss scores *units*: a sample for ``cross_entropy`` and ``mse``, a predicted token for
``causal_lm``. The measurement loss is the mean over every scored unit of the whole
measurement set (and of every rank),

.. math:: L(\theta) = \frac{1}{U} \sum_{u} \ell_u(\theta), \qquad U = \text{number of scored units},

accumulated batch by batch as ``sum of the batch's unit losses / U``: a batch with more
tokens weighs more, never a mean of batch means.

A loss supplies
* ``units(batch)``: the scored units per row (known before any forward pass);
* ``scores(out, batch)``: the units' outputs ``Z`` (N, C), targets ``t`` and a mask of the N
  candidate units that are scored (``None``: all are); unit losses, accuracies, margins,
  per-unit derivatives and labels drawn from the model are all taken on these;
* ``unit_losses(Z, t)``; ``output_hvp(out, batch, V)``: the analytic product of the output-space
  Hessian :math:`\nabla_z^2 \ell` with V (for Gauss-Newton products and the analytic Hessian
  product), chunked over units so that large vocabularies never hold a graph through
  ``log_softmax``; ``ggn_factors(Z, t)``: columns :math:`a_k` with
  :math:`\sum_k a_k a_k^\top = \nabla_z^2\ell` per unit (the exact Gauss-Newton diagonal), for
  losses whose units are rows.

Adding a loss is one subclass registered in `LOSSES`, its name added to the rule ``loss``
(`flatcli.validation.LOSS_NAMES`; tests/project/test_architecture.py checks the two agree), plus a test
against ``torch.func.hessian`` of its own mean.
"""

from __future__ import annotations

import abc
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..errors import ConfigError, MeasurementError
from ..validation import validate
from .batch import Batch

IGNORE_INDEX = -100
_CHUNK_UNITS = 2048  # units per chunk of the analytic softmax products


class NotApplicable(MeasurementError):
    """A measure (or an engine product) does not apply to this model, loss or parameter selection;
    the measure's row gets status ``not_applicable`` with this message as the reason."""


class Loss(abc.ABC):
    """Base class: see the module docstring. Subclasses set ``name`` and implement `scores`,
    `unit_losses` and `output_hvp`."""

    name: ClassVar[str] = ""
    classification: ClassVar[bool] = True  # outputs are class scores: accuracy, margins, errors
    units_are_rows: ClassVar[bool] = True  # one scored unit per row (per-row Gauss-Newton factors)
    fused_head: ClassVar[bool] = False  # may fuse with an LM head (`flatcli.engine.lmhead`)
    per_token: ClassVar[bool] = False  # units are tokens: perplexities exp(loss) are metrics too
    # the gap `flatcli correlate` predicts by default (flatcli.analysis.targets says the same)
    gap: ClassVar[str] = "gen_gap"
    # the train loss below which a model counts as at a minimum (None: no such rule)
    minimum_loss: ClassVar[float | None] = None

    def units(self, batch: Batch) -> torch.Tensor:
        """Scored units per row, shape (rows,), float."""
        return torch.ones(batch.rows, dtype=torch.float64)

    def target(self, batch: Batch) -> torch.Tensor:
        """The batch's target tensor; a clear error when it has none."""
        t = batch.target
        if t is None:
            raise ConfigError(
                f"loss '{self.name}' needs a target: name it 'y' or 'labels' in the data"
            )
        return t

    @abc.abstractmethod
    def scores(
        self, out: torch.Tensor, batch: Batch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(Z (N, C), t, mask (N,) or None) of the N candidate units of a batch."""

    @abc.abstractmethod
    def unit_losses(self, Z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The loss of each unit, shape (N,)."""

    @abc.abstractmethod
    def output_hvp(self, out: torch.Tensor, batch: Batch, V: torch.Tensor) -> torch.Tensor:
        """:math:`\\nabla^2_{out}(\\sum_u \\ell_u) V` for V shaped like ``out`` (or (K, *out.shape))."""

    def ggn_factors(self, Z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Factor columns of the per-unit output Hessian, shape (C, N, C): row [k, u] is a_uk."""
        raise NotApplicable(f"loss '{self.name}' has no per-row Gauss-Newton factors")

    # ------------------------------------------------------------ derived
    def output_grad(self, out: torch.Tensor, batch: Batch) -> torch.Tensor:
        """∂(Σ_u ℓ_u)/∂out at ``out`` (detached; a first-order backward, no graph kept)."""
        z = out.detach().requires_grad_(True)
        with torch.enable_grad():
            s = self.sum(z, batch)
        return torch.autograd.grad(s, z)[0]

    def sum(self, out: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Σ of the scored units' losses of a batch (differentiable)."""
        Z, t, mask = self.scores(out, batch)
        ell = self.unit_losses(Z, t)
        return ell.sum() if mask is None else (ell * mask).sum()

    def per_unit(self, out: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The scored units' losses (U_batch,), in order (not for autograd through a mask)."""
        Z, t, mask = self.scores(out, batch)
        ell = self.unit_losses(Z, t)
        return ell if mask is None else ell[mask]

    def classes(self, out: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(Z (U, C), labels (U,)): the scored units' class scores and integer labels (accuracy,
        margins, 0-1 errors), or None when the outputs are not class scores."""
        Z, t, mask = self.scores(out, batch)
        return (Z, t) if mask is None else (Z[mask], t[mask])

    def correct(self, out: torch.Tensor, batch: Batch) -> int | None:
        """Scored units whose argmax is the label; None when the outputs are not class scores."""
        c = self.classes(out, batch)
        return None if c is None else int((c[0].argmax(-1) == c[1]).sum())

    def check(self, out: torch.Tensor, rows: Batch, data: Batch, where: str) -> None:
        """A `ConfigError` naming ``where`` when outputs and targets do not fit this loss: ``out`` is the
        model's output on ``rows`` (a few rows of ``data``, the whole split)."""
        self.scores(out, rows)


def _softmax_hvp(Z: torch.Tensor, V: torch.Tensor, chunk: int = _CHUNK_UNITS) -> torch.Tensor:
    r"""(diag(p) − p pᵀ) v per unit for logits Z (N, C) and V (..., N, C), in chunks of units:
    :math:`p \circ v - p\,(p \cdot v)` with p = softmax(Z); no graph is kept."""
    out = torch.empty_like(V)
    for i in range(0, Z.shape[0], chunk):
        p = torch.softmax(Z[i : i + chunk].detach(), dim=-1)
        v = V[..., i : i + chunk, :]
        pv = (p * v).sum(-1, keepdim=True)
        out[..., i : i + chunk, :] = p * (v - pv)
    return out


class CrossEntropy(Loss):
    """``cross_entropy``: ``F.cross_entropy`` of class scores (rows, C) against integer labels."""

    name = "cross_entropy"
    minimum_loss = 0.01  # Jiang et al. 2020 train every classifier to cross-entropy 0.01

    def scores(self, out, batch):
        """See `Loss.scores`."""
        t = self.target(batch)
        if out.ndim != 2:
            raise MeasurementError(
                f"loss 'cross_entropy' needs model outputs of shape (batch, classes). Got {tuple(out.shape)} instead."
            )
        return out, t.long(), None

    def unit_losses(self, Z, t):
        """See `Loss.unit_losses`."""
        return F.cross_entropy(Z, t, reduction="none")

    def output_hvp(self, out, batch, V):
        """See `Loss.output_hvp`."""
        return _softmax_hvp(out, V)

    def ggn_factors(self, Z, t):
        """See `Loss.ggn_factors`."""
        p = torch.softmax(Z, dim=1)
        eye = torch.eye(Z.shape[1], dtype=Z.dtype, device=Z.device)
        return p.T.sqrt()[:, :, None] * (eye[:, None, :] - p[None, :, :])

    def check(self, out, rows, data, where):
        """See `Loss.check`."""
        t = self.target(data)
        if t.ndim != 1:
            raise ConfigError(
                f"{where}: the labels of loss 'cross_entropy' must be one class index per row "
                f"(shape (rows,)). Got shape {tuple(t.shape)} instead (use loss mse for vector "
                "targets)."
            )
        if t.is_floating_point():
            _check_whole_labels(t, where)
        if out.ndim != 2:
            raise ConfigError(
                f"loss 'cross_entropy' needs outputs of shape (batch, classes); the model gives {tuple(out.shape)}"
            )
        _check_label_range(t, out.shape[-1], where)


class MSE(Loss):
    """``mse``: per-sample ``Σ_j (f_j(x) − y_j)²``; integer labels with more than one output are
    one-hot encoded; a single output is compared with ``y`` as is (``f(x) = w·x`` gives
    ``L = mean (w·x − y)²``)."""

    name = "mse"
    classification = False
    gap = "loss_gap"

    def scores(self, out, batch):
        """See `Loss.scores`."""
        t = self.target(batch)
        Z = out.reshape(out.shape[0], -1)
        if not t.is_floating_point() and Z.shape[1] > 1:
            target = F.one_hot(t.long(), Z.shape[1]).to(Z.dtype)
        else:
            target = t.reshape(Z.shape[0], -1).to(Z.dtype)
        return Z, target, None

    def unit_losses(self, Z, t):
        """See `Loss.unit_losses`."""
        return ((Z - t) ** 2).sum(dim=1)

    def output_hvp(self, out, batch, V):
        """See `Loss.output_hvp`."""
        return 2.0 * V

    def ggn_factors(self, Z, t):
        """See `Loss.ggn_factors`."""
        C = Z.shape[1]
        eye = torch.eye(C, dtype=Z.dtype, device=Z.device) * 2.0**0.5
        return eye[:, None, :].expand(C, Z.shape[0], C)

    def classes(self, out, batch):
        """See `Loss.classes`."""
        # class scores regressed on one-hot targets still have an accuracy, a margin, an error
        t = self.target(batch)
        if out.ndim == 2 and out.shape[1] > 1 and not t.is_floating_point():
            return out, t.long()
        return None


class CausalLM(Loss):
    r"""``causal_lm``: next-token cross-entropy in the Hugging Face convention.

    The logits at position t (shape (rows, T, V)) are scored against the labels at t + 1;
    labels are ``labels`` when the batch has them, else ``input_ids`` with the positions where
    ``attention_mask == 0`` set to −100; −100 is ignored. The loss is the mean over every
    scored token of the measurement set. Accuracy is next-token accuracy over the scored tokens.
    When the logits are the output of one ``nn.Linear`` (the LM head), the loss is computed fused
    with it, chunked over tokens, with an analytic double backward (`flatcli.engine.lmhead`), so
    no double-backward graph runs through ``log_softmax`` over the vocabulary.
    """

    name = "causal_lm"
    units_are_rows = False
    fused_head = True
    per_token = True
    gap = "loss_gap"  # the loss floor is the text's entropy: no minimum rule

    def labels(self, batch: Batch) -> torch.Tensor:
        """The (rows, T) labels before the shift (−100 where ignored)."""
        if "labels" in batch:
            return batch["labels"].long()
        if "input_ids" not in batch:
            raise ConfigError(
                "loss 'causal_lm' needs 'input_ids' (and optionally 'attention_mask', 'labels') in the data"
            )
        ids = batch["input_ids"].long()
        if "attention_mask" in batch:
            ids = ids.masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
        return ids

    def units(self, batch):
        """See `Loss.units`."""
        lab = self.labels(batch)[:, 1:]
        return (lab != IGNORE_INDEX).sum(1).to(torch.float64)

    def scores(self, out, batch):
        """See `Loss.scores`."""
        if out.ndim != 3:
            raise MeasurementError(
                f"loss 'causal_lm' needs logits of shape (batch, sequence, vocabulary). Got {tuple(out.shape)} instead."
            )
        lab = self.labels(batch)[:, 1:]
        Z = out[:, :-1, :].reshape(-1, out.shape[-1])
        t = lab.reshape(-1)
        mask = t != IGNORE_INDEX
        return Z, t.clamp_min(0), mask

    def unit_losses(self, Z, t):
        """See `Loss.unit_losses`."""
        return F.cross_entropy(Z, t, reduction="none")

    def output_hvp(self, out, batch, V):
        """See `Loss.output_hvp`: per sequence and chunk of positions, written into one output
        (the last position and ignored labels give 0); no other (tokens × vocabulary) tensor."""
        keep = (self.labels(batch)[:, 1:] != IGNORE_INDEX).to(out.dtype)[..., None]
        res = torch.zeros_like(V)
        for r in range(out.shape[0]):
            last = out.shape[1] - 1  # the last position predicts nothing
            for sl in (slice(i, min(i + _CHUNK_UNITS, last)) for i in range(0, last, _CHUNK_UNITS)):
                p = torch.softmax(out[r, sl].detach(), dim=-1)
                v = V[..., r, sl, :]
                res[..., r, sl, :] = p * (v - (p * v).sum(-1, keepdim=True)) * keep[r, sl]
        return res

    def check(self, out, rows, data, where):
        """See `Loss.check`."""
        if out.ndim != 3:
            raise ConfigError(
                f"loss 'causal_lm' needs logits of shape (batch, sequence, vocabulary); the model gives {tuple(out.shape)}"
            )
        lab = self.labels(data)
        scored = lab[lab != IGNORE_INDEX]
        if scored.numel():
            _check_label_range(scored, out.shape[-1], where)


def _check_whole_labels(t: torch.Tensor, where: str) -> None:
    """A `ConfigError` naming ``where`` and the first fractional label (cross-entropy's targets are
    class indices: rounding them silently would measure another problem)."""
    frac = t != torch.round(t)
    if bool(frac.any()):
        rows = frac.reshape(len(t), -1).any(1).nonzero().flatten()
        first = int(rows[0])
        value = float(t[first].reshape(-1)[frac[first].reshape(-1)][0])
        raise ConfigError(
            f"{where}: label {value:g} at row {first} is not a class index "
            f"({len(rows)} of {len(t)} rows hold fractional labels); loss 'cross_entropy' needs "
            "integer labels (use loss mse for real-valued targets)"
        )


def _check_label_range(t: torch.Tensor, classes: int, where: str) -> None:
    lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= classes:
        raise ConfigError(
            f"{where}: label {hi if hi >= classes else lo} is outside the model's {classes} outputs"
        )


LOSSES: dict[str, type[Loss]] = {c.name: c for c in (CrossEntropy, MSE, CausalLM)}


def get_loss(loss: str | Loss) -> Loss:
    """The loss plug-in named ``loss`` (an instance passes through); a `ConfigError` otherwise."""
    if isinstance(loss, Loss):
        return loss
    return LOSSES[validate("loss", loss)]()
