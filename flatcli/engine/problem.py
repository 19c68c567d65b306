r"""The measurement problem: (model, batches, loss, parameter selection, reduction).

The loss is the mean of the per-unit loss over every scored unit u of the whole
measurement set S (a unit is a sample for ``cross_entropy``/``mse``, a predicted
token for ``causal_lm``, see `flatcli.engine.losses`),

.. math:: L(\theta) = \frac{1}{U} \sum_{u \in S} \ell_u(\theta),

accumulated batch by batch as ``sum of the batch's unit losses / U``, so an uneven
last batch, or a batch with more tokens, carries exactly its share; across ranks
the sums are added (`flatcli.engine.dist`). θ is the selected parameters
(`flatcli.engine.params`); the others stay fixed. The model is never mutated:
parameters are detached copies passed through :func:`torch.func.functional_call`,
and the model is kept in eval mode while measuring (see `eval_mode`). Tied tensors
(GPT-2's head and embedding) are resolved once, when the problem is built: every
alias name is given its canonical tensor and ``functional_call`` runs with
``tie_weights=False``, which skips the module walk it otherwise repeats on every
forward pass (``functional_call`` of a 64-16-16-10 MLP on 128 rows: 96 instead of 127 µs,
medians of 20 interleaved rounds, one thread of the 2-core CPU machine).

Padding rows are frozen coordinates. PyTorch zeroes the gradient of the row ``padding_idx`` of an
``nn.Embedding`` (BERT's word embedding: the pad token 0) in every backward through the lookup, so
training never moves that row; but the forward pass still reads it, so the Hessian H of L has
nonzero entries there, and the products disagree. With M the diagonal 0/1 matrix that zeroes the
row's entries of a flat vector, forward-over-reverse computes :math:`M H v` while double backward
computes :math:`M H M v` (its second backward goes through the lookup's masked backward too), and
the Gauss-Newton product (a JVP, which carries the row's tangent, then a masked VJP)
:math:`M G v`: operators that are not symmetric, whatever Lanczos, SLQ and Hutchinson assume (a
tiny float64 BERT: forward and reverse 4.9e-4 apart, relative; docs/benchmarks/data/padding_modes.json). When the
weight is tied to an output head, the head's gradient reaches the row unmasked and no mode gives a
clean matrix: then the row is trained, so it is not masked, and the lookups of that weight run
without ``padding_idx`` inside the problem's forward, which makes every product the true Hessian
there (a tie is found by storage: the weight is also a parameter of another module, as BERT's MLM
decoder or a tied LM head; a weight used directly in ``forward`` is not seen and stays masked). The engine takes every curvature as :math:`M A M` (A the Hessian, the Gauss-Newton
matrix or their finite differences), the curvature of the loss restricted to the coordinates
training can move: symmetric, the same in every product mode. The rows' flat indices are found
once, here (`padding_index`: every ``nn.Embedding`` with a ``padding_idx`` whose weight is selected;
None when there is none, so other models take no extra step); `mask` applies M, and the engine
applies it around every product (`flatcli.engine.curvatures.Curvature`), to gradients (a no-op
unless a tied head reaches the row), to the directions of per-unit directional derivatives and to
the exact Gauss-Newton diagonal. Measures that move θ themselves (random or ascent perturbations)
are not masked: a perturbation of the row does change the loss when the pad token is attended (a
tokenizer's padding, the pad token only under ``attention_mask`` 0, leaves the loss independent of
the row, and every product was already symmetric there).
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch.func import functional_call

from ..errors import ConfigError, MeasurementError
from .batch import Batch, model_output
from .dist import Dist
from .lmhead import HeadCapture, find_head, fused_loss_sum
from .losses import IGNORE_INDEX, LOSSES, get_loss
from .params import ParamSelection

__all__ = ["Problem", "eval_mode", "LOSSES", "not_finite", "nonfinite_tensors"]


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module):
    """Put every submodule in eval mode; restore each one's own mode afterwards."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, t in modes:
            m.train(t)


def nonfinite_tensors(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating tensors holding NaN or inf."""
    return [
        n for n, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())
    ]


def not_finite(
    where: str = "the checkpoint", loss: float | None = None, tensors: list[str] | None = None
) -> MeasurementError:
    """The one error every command raises for a checkpoint whose loss is NaN or inf (exit code 1):
    ``the loss at <where> is not finite (<loss>)[: NaN/inf in <tensors>]``."""
    msg = f"the loss at {where} is not finite" + (f" ({loss})" if loss is not None else "")
    if tensors:
        more = f" and {len(tensors) - 3} more" if len(tensors) > 3 else ""
        msg += f": NaN/inf in {', '.join(tensors[:3])}{more}"
    return MeasurementError(msg)


class Problem:
    """A model with functional parameters over a measurement set.

    Parameters
    ----------
    model : torch.nn.Module
        The network. It is not modified; put it in eval mode with `eval_mode`
        around any use of the problem (the API does).
    data : a `flatcli.engine.batch.Batch` (named tensors), a mapping of tensors, or ``x``
        with ``y`` given: the measurement set, in a fixed order.
    loss : a loss name (``cross_entropy``, ``mse``, ``causal_lm``) or a `flatcli.engine.losses.Loss`.
    batch_size : rows per forward pass. Results do not depend on it.
    device, dtype : where, and the floating type of θ, the data and the products (float64 for exact
        tests).
    compute_dtype : the floating type the model's forward runs in (default ``dtype``). Lower than
        ``dtype`` (bfloat16 with ``runtime.precision: bf16``): θ, the other parameters, the buffers
        and the floating inputs are cast to it inside `forward`, whose output is cast back to
        ``dtype``, so the loss and its sum over units are computed in ``dtype`` (the LM head too:
        its input and weight are cast back before the fused head); the casts are differentiable,
        so gradients and curvature products come back in ``dtype``, computed in ``compute_dtype``
        through the model. `full_precision` runs the forward in ``dtype`` for a while (the
        verification products).
    params : the parameter selection (`flatcli.engine.params.ParamSelection` or
        ``{include: [...], exclude: [...]}``); default every trainable parameter.
    dist : the ranks (`flatcli.engine.dist.Dist`); each computes over its shard of rows.
    fused_head : for a loss that allows it (``causal_lm``) and a model whose logits are the output of
        one ``nn.Linear``, compute the loss fused with that head, chunked over tokens
        (`flatcli.engine.lmhead`; ``head`` names it). False keeps the plain path (comparisons).

    Attributes
    ----------
    batch : the whole measurement set (every rank holds it), on ``device``.
    batches : this rank's batches.
    rows : rows of the whole set; ``n`` : scored units of the whole set (U, the normalizer).
    names, params, frozen, buffers : the selected parameters (θ) and everything else.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        data,
        y: torch.Tensor | None = None,
        *,
        loss="cross_entropy",
        batch_size: int = 256,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        params=None,
        dist: Dist | None = None,
        fused_head: bool = True,
        compute_dtype: torch.dtype | None = None,
    ):
        batch = Batch.of(data, y, where="the measurement set")
        if batch.rows == 0:
            raise ConfigError("the measurement set is empty")
        self.model = model
        self.loss_fn = get_loss(loss)
        self.loss_name = self.loss_fn.name
        self.batch_size = int(batch_size)
        self.dist = dist or Dist()
        first = next(iter(model.parameters()), None)
        self.device = (
            torch.device(device)
            if device is not None
            else (first.device if first is not None else torch.device("cpu"))
        )
        self.dtype = dtype or (first.dtype if first is not None else torch.float32)
        self.compute_dtype = compute_dtype or self.dtype
        self.selection = ParamSelection.of(params)
        self._set_parameters(model)
        self.batch = batch.to(self.device, self.dtype)
        self.rows = batch.rows
        units = self.loss_fn.units(self.batch)
        self.row_units = units
        self.n = int(units.sum())
        if self.n == 0:
            raise ConfigError(
                f"the measurement set has no scored units for loss '{self.loss_name}' "
                "(every label is ignored)"
            )
        self.shard = self.dist.shard(self.rows)
        self.batches = (
            self.batch.select(self.shard).split(self.batch_size) if self._local_rows else []
        )
        self.head: str | None = None
        self.fused_head = bool(fused_head)
        if fused_head and self.loss_fn.fused_head:
            self.head = find_head(
                model, lambda b: self._call(self.params, b), self.batch.select(slice(0, 2))
            )
        self._head_module = dict(model.named_modules())[self.head] if self.head else None

    def derive(self, model: torch.nn.Module) -> Problem:
        """The same problem (measurement set, loss, batch size, device, dtype, parameter selection,
        ranks, fused head) over another ``model``, e.g. a BatchNorm-folded copy: the one supported
        way to build a problem for another model, so that no setting is dropped on the way."""
        return Problem(
            model,
            self.batch,
            loss=self.loss_fn,
            batch_size=self.batch_size,
            device=self.device,
            dtype=self.dtype,
            params=self.selection,
            dist=self.dist,
            fused_head=self.fused_head,
        )

    def _set_parameters(self, model: torch.nn.Module) -> None:
        names = self.selection.select(model)
        chosen = set(names)
        named = dict(model.named_parameters())
        self.names = names
        numels = [named[n].numel() for n in names]
        # one flat storage, the parameters views of it: products read θ there without a copy (theta_flat)
        self._flat = torch.empty(int(sum(numels)), device=self.device, dtype=self.dtype)
        self.params = {}
        i = 0
        for n, k in zip(names, numels, strict=True):
            self._flat[i : i + k].copy_(named[n].detach().reshape(-1))
            self.params[n] = self._flat[i : i + k].view(named[n].shape)
            i += k
        self.frozen = {
            n: q.detach().to(self.device, self.dtype) for n, q in named.items() if n not in chosen
        }
        self.buffers = {
            n: (
                b.detach().to(self.device, self.dtype)
                if b.is_floating_point()
                else b.detach().to(self.device)
            )
            for n, b in model.named_buffers()
        }
        canonical = {id(t): n for n, t in [*named.items(), *model.named_buffers()]}
        self.aliases = {
            n: canonical[id(t)]
            for n, t in [
                *model.named_parameters(remove_duplicate=False),
                *model.named_buffers(remove_duplicate=False),
            ]
            if canonical[id(t)] != n
        }  # tied names → the name their tensor is given under
        self.shapes = [self.params[n].shape for n in self.names]
        self.numels = [self.params[n].numel() for n in self.names]
        self.num_params = int(sum(self.numels))
        self.padding_index = self._padding_index(model)

    def _padding_index(self, model: torch.nn.Module) -> torch.Tensor | None:
        """Flat indices of the selected embedding rows that PyTorch never trains (the ``padding_idx``
        row of every ``nn.Embedding`` whose weight is in θ and not tied to a module that trains
        the row), sorted; None when there is none. A tied row (its tensor is also another
        module's parameter, e.g. BERT's MLM decoder, found by storage like the selection's shared
        weights) is trained through that module: it stays unmasked, and its lookups run without
        ``padding_idx`` (`_untied_lookups`), so the products are the true Hessian there."""
        slices = self.param_slices()
        canonical = {id(q): n for n, q in model.named_parameters()}
        rows, self._untied_lookups = [], []
        for mod in model.modules():
            if not isinstance(mod, torch.nn.Embedding) or mod.padding_idx is None:
                continue
            name = canonical.get(id(mod.weight))
            if name not in slices:
                continue
            if self._trained_elsewhere(model, mod):
                self._untied_lookups.append(mod)
                continue
            start = (
                slices[name].start + int(mod.padding_idx) * mod.embedding_dim
            )  # nn.Embedding makes it >= 0
            rows.append(torch.arange(start, start + mod.embedding_dim))
        if not rows:
            return None
        return torch.unique(torch.cat(rows)).to(self.device)

    @staticmethod
    def _trained_elsewhere(model: torch.nn.Module, emb: torch.nn.Embedding) -> bool:
        """Whether ``emb.weight`` is also the parameter of a module other than an ``nn.Embedding``
        with the same ``padding_idx`` (a tied output head): that module's gradient trains the row."""
        for mod in model.modules():
            for q in mod.parameters(recurse=False):
                if q is not emb.weight or mod is emb:
                    continue
                same = isinstance(mod, torch.nn.Embedding) and mod.padding_idx == emb.padding_idx
                if not same:
                    return True
        return False

    @contextlib.contextmanager
    def _lookups_unmasked(self):
        """The tied padding embeddings (`_padding_index`) without ``padding_idx`` while the
        forward runs (it only masks the lookup's backward, which autograd records at the call)."""
        mods = getattr(self, "_untied_lookups", [])
        old = [m.padding_idx for m in mods]
        for m in mods:
            m.padding_idx = None
        try:
            yield
        finally:
            for m, k in zip(mods, old, strict=True):
                m.padding_idx = k

    def mask(self, x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        """M x: ``x`` (..., P) with the entries of the padding rows (`padding_index`) set to 0 (a copy
        unless ``inplace``); ``x`` itself when the problem has none (module docstring)."""
        idx = self.padding_index
        if idx is None:
            return x
        idx = idx.to(x.device)
        return x.index_fill_(-1, idx, 0) if inplace else x.index_fill(-1, idx, 0)

    @property
    def _local_rows(self) -> int:
        return self.shard.stop - self.shard.start

    @property
    def local_units(self) -> int:
        """Scored units in this rank's shard."""
        return int(self.row_units[self.shard].sum())

    @property
    def unit_offset(self) -> int:
        """Index of this rank's first unit in the global unit order."""
        return int(self.row_units[: self.shard.start].sum())

    # ------------------------------------------------------------ parameters
    @property
    def theta(self) -> torch.Tensor:
        """The selected parameters as one flat vector (a copy)."""
        return self.flatten(self.params)

    @property
    def theta_flat(self) -> torch.Tensor:
        """The selected parameters as one flat vector *shared* with ``params`` (not a copy: read it,
        never write it). What the curvature products read at the model's θ: `theta` would copy P
        numbers per product (1.24 GB at 311M parameters)."""
        return self._flat

    def flatten(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """The parameters ``params`` (name → tensor) as one flat vector, in ``names`` order."""
        return torch.cat([params[n].reshape(-1) for n in self.names])

    def unflatten(self, vec: torch.Tensor) -> dict[str, torch.Tensor]:
        """The flat vector ``vec`` as name → tensor views (inverse of `flatten`)."""
        chunks = torch.split(vec, self.numels)
        return {n: c.view(s) for n, c, s in zip(self.names, chunks, self.shapes, strict=True)}

    def param_slices(self) -> dict[str, slice]:
        """Where each selected parameter lives in the flat vector."""
        out, i = {}, 0
        for n, k in zip(self.names, self.numels, strict=True):
            out[n] = slice(i, i + k)
            i += k
        return out

    def units(self, batch: Batch) -> int:
        """Scored units of a batch of rows."""
        return int(self.loss_fn.units(batch).sum())

    # ------------------------------------------------------------ evaluation
    @property
    def lowered(self) -> bool:
        """Whether the forward runs in a lower floating type than θ (``compute_dtype`` < ``dtype``)."""
        return self.compute_dtype != self.dtype

    def check_finite(self, value: float, where: str = "the checkpoint") -> float:
        """``value`` (L(θ), e.g. `flatcli.engine.CurvatureEngine.loss`); a non-finite one raises
        `not_finite`, naming the parameters and buffers that hold NaN/inf."""
        if not math.isfinite(value):
            raise not_finite(
                where, value, nonfinite_tensors({**self.params, **self.frozen, **self.buffers})
            )
        return value

    @contextlib.contextmanager
    def full_precision(self):
        """Inside, the forward runs in ``dtype`` (θ's type): the verification view of a bf16 problem."""
        old = self.compute_dtype
        self.compute_dtype = self.dtype
        try:
            yield self
        finally:
            self.compute_dtype = old

    def _call(self, params: dict[str, torch.Tensor] | torch.Tensor, batch: Batch) -> torch.Tensor:
        """The model's output on ``batch`` in ``compute_dtype`` (see the class docstring)."""
        if isinstance(params, torch.Tensor):
            params = self.unflatten(params)
        args, kwargs = batch.model_inputs()
        tensors = {**params, **self.frozen, **self.buffers}
        if self.lowered:
            low = self.compute_dtype
            tensors = {n: t.to(low) if t.is_floating_point() else t for n, t in tensors.items()}
            args = tuple(a.to(low) if a.is_floating_point() else a for a in args)
            kwargs = {k: v.to(low) if v.is_floating_point() else v for k, v in kwargs.items()}
        for alias, name in self.aliases.items():
            tensors[alias] = tensors[name]
        with self._lookups_unmasked():
            out = functional_call(self.model, tensors, args, kwargs, tie_weights=False)
        return model_output(out)

    def forward(self, params: dict[str, torch.Tensor] | torch.Tensor, batch: Batch) -> torch.Tensor:
        """Model outputs on ``batch`` with the functional parameters ``params`` (a dict or a flat
        vector), in ``dtype`` (computed in ``compute_dtype``)."""
        out = self._call(params, batch)
        return out.to(self.dtype) if self.lowered and out.is_floating_point() else out

    def batch_loss_sum(self, params, batch: Batch) -> torch.Tensor:
        """Sum of the unit losses of one batch (divide by ``n`` for its share of L); fused with the
        LM head when there is one (``head``)."""
        if self._head_module is None:
            return self.loss_fn.sum(self.forward(params, batch), batch)
        with HeadCapture(self._head_module) as cap:
            self._call(params, batch)
        ((h, W, b),) = cap.seen
        if self.lowered:  # the head's softmax and the sum over tokens in θ's type
            h, W, b = h.to(self.dtype), W.to(self.dtype), (None if b is None else b.to(self.dtype))
        labels = self.loss_fn.labels(batch)[:, 1:].reshape(-1)
        hh = h[:, :-1, :].reshape(-1, h.shape[-1])
        return fused_loss_sum(hh, W, b, labels, labels != IGNORE_INDEX)

    def loss(self, params=None) -> torch.Tensor:
        """L(θ) over this rank's batches, differentiable: the whole set's loss in one process
        (what the exact tests differentiate with ``torch.func.hessian``)."""
        params = self.params if params is None else params
        total = None
        for b in self.batches:
            s = self.batch_loss_sum(params, b)
            total = s if total is None else total + s
        return total / self.n

    @torch.no_grad()
    def evaluate(self, params=None) -> tuple[float, float]:
        """(mean loss, accuracy) over the measurement set (every rank); accuracy is NaN for
        outputs that are not class scores."""
        params = self.params if params is None else params
        loss_sum, correct, unclassified = 0.0, 0.0, 0.0
        for b in self.batches:
            out = self.forward(params, b)
            loss_sum += float(self.loss_fn.sum(out, b))
            c = self.loss_fn.correct(out, b)
            if c is None:
                unclassified = 1.0
            else:
                correct += c
        loss_sum, correct, unclassified = self.dist.sum_float(loss_sum, correct, unclassified)
        return loss_sum / self.n, (correct / self.n if unclassified == 0 else float("nan"))

    def check_targets(self, where: str) -> None:
        """A `ConfigError` naming ``where`` when the targets do not fit the model's outputs and the loss
        (labels outside the classes, wrong output shape), from one forward pass of two rows."""
        b = self.batch.select(slice(0, 2))
        with torch.no_grad():
            out = self.forward(self.params, b)
        self.loss_fn.check(out, b, self.batch, where)
