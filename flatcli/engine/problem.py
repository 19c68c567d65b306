r"""The measurement problem: a model as functional parameters over a fixed data set.

The loss is the sample-weighted mean of the per-sample loss over the whole
measurement set S,

.. math:: L(\theta) = \frac{1}{n} \sum_{(x, y) \in S} \ell(f_\theta(x), y),

accumulated batch by batch as ``sum(per-sample losses) / n``, so an uneven last
batch carries exactly its share. The model is never mutated: parameters are
detached copies passed through :func:`torch.func.functional_call`, and the
model is kept in eval mode while measuring (see `eval_mode`).

Losses:
* ``cross_entropy``: ``F.cross_entropy`` with integer labels.
* ``mse``: per-sample ``sum_j (f_j(x) - y_j)^2``; integer labels with more than
  one output are one-hot encoded; a single output is compared with ``y`` as is,
  so ``f(x) = w.x`` gives ``L = mean (w.x - y)^2``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.func import functional_call

from ..errors import ConfigError, MeasurementError

LOSSES = ("cross_entropy", "mse")


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


def per_sample_loss(out: torch.Tensor, y: torch.Tensor, loss: str) -> torch.Tensor:
    """Per-sample losses, shape (B,)."""
    if loss == "cross_entropy":
        if out.ndim != 2:
            raise MeasurementError(
                f"loss 'cross_entropy' needs model outputs of shape (batch, classes); got {tuple(out.shape)}"
            )
        return F.cross_entropy(out, y.long(), reduction="none")
    if loss == "mse":
        out2 = out.reshape(out.shape[0], -1)
        if y.dtype in (torch.int64, torch.int32, torch.int16, torch.uint8) and out2.shape[1] > 1:
            target = F.one_hot(y.long(), out2.shape[1]).to(out2.dtype)
        else:
            target = y.reshape(out2.shape[0], -1).to(out2.dtype)
        return ((out2 - target) ** 2).sum(dim=1)
    raise ConfigError(f"The 'loss' key must be one of {', '.join(LOSSES)}. Got {loss!r} instead.")


def nonfinite_tensors(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating tensors holding NaN or inf."""
    return [n for n, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def not_finite(where: str = "the checkpoint", loss: float | None = None,
               tensors: list[str] | None = None) -> MeasurementError:
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
    x, y : torch.Tensor
        The measurement set, in a fixed order.
    loss : {"cross_entropy", "mse"}
    batch_size : int
        Samples per forward pass. Results do not depend on it.
    device, dtype : where and in which floating type to compute
        (float64 for exact tests).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        loss: str = "cross_entropy",
        batch_size: int = 256,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        if loss not in LOSSES:
            raise ConfigError(f"The 'loss' key must be one of {', '.join(LOSSES)}. Got {loss!r} instead.")
        if len(x) != len(y):
            raise ConfigError(f"inputs and labels differ in length: {len(x)} vs {len(y)}")
        if len(x) == 0:
            raise ConfigError("the measurement set is empty")
        self.model = model
        self.loss_name = loss
        self.batch_size = int(batch_size)
        first = next(iter(model.parameters()), None)
        self.device = torch.device(device) if device is not None else (
            first.device if first is not None else torch.device("cpu")
        )
        self.dtype = dtype or (first.dtype if first is not None else torch.float32)
        named = list(model.named_parameters())
        self.names = [n for n, p in named if p.requires_grad]
        self.params = {
            n: p.detach().to(self.device, self.dtype).clone() for n, p in named if p.requires_grad
        }
        self.frozen = {
            n: p.detach().to(self.device, self.dtype) for n, p in named if not p.requires_grad
        }
        self.buffers = {
            n: (b.detach().to(self.device, self.dtype) if b.is_floating_point() else b.detach().to(self.device))
            for n, b in model.named_buffers()
        }
        self.shapes = [self.params[n].shape for n in self.names]
        self.numels = [self.params[n].numel() for n in self.names]
        self.num_params = int(sum(self.numels))
        x = x.to(self.device)
        if x.is_floating_point():
            x = x.to(self.dtype)
        y = y.to(self.device)
        if loss == "mse" and y.is_floating_point():
            y = y.to(self.dtype)
        self.x, self.y = x, y
        self.n = len(x)
        self.batches = [
            (x[i : i + self.batch_size], y[i : i + self.batch_size]) for i in range(0, self.n, self.batch_size)
        ]

    # ------------------------------------------------------------ parameters
    @property
    def theta(self) -> torch.Tensor:
        """The trainable parameters as one flat vector (a copy)."""
        return self.flatten(self.params)

    def flatten(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """The parameters ``params`` (name → tensor) as one flat vector, in ``names`` order."""
        return torch.cat([params[n].reshape(-1) for n in self.names])

    def unflatten(self, vec: torch.Tensor) -> dict[str, torch.Tensor]:
        """The flat vector ``vec`` as name → tensor views (inverse of `flatten`)."""
        chunks = torch.split(vec, self.numels)
        return {n: c.view(s) for n, c, s in zip(self.names, chunks, self.shapes, strict=True)}

    def param_slices(self) -> dict[str, slice]:
        """Where each named parameter lives in the flat vector."""
        out, i = {}, 0
        for n, k in zip(self.names, self.numels, strict=True):
            out[n] = slice(i, i + k)
            i += k
        return out

    # ------------------------------------------------------------ evaluation
    def forward(self, params: dict[str, torch.Tensor] | torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Model outputs on ``x`` with the functional parameters ``params`` (a dict or a flat vector)."""
        if isinstance(params, torch.Tensor):
            params = self.unflatten(params)
        return functional_call(self.model, {**params, **self.frozen, **self.buffers}, (x,))

    def per_sample_loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Per-sample losses of outputs ``out`` against labels ``y``, shape (B,)."""
        return per_sample_loss(out, y, self.loss_name)

    def batch_loss_sum(self, params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Sum of per-sample losses on one batch (divide by ``n`` for its share of L)."""
        return self.per_sample_loss(self.forward(params, x), y).sum()

    def loss(self, params=None) -> torch.Tensor:
        """L(θ): the sample-weighted mean loss over the measurement set (differentiable)."""
        params = self.params if params is None else params
        total = None
        for x, y in self.batches:
            s = self.batch_loss_sum(params, x, y)
            total = s if total is None else total + s
        return total / self.n

    @torch.no_grad()
    def evaluate(self, params=None) -> tuple[float, float]:
        """(mean loss, accuracy) over the measurement set; accuracy is NaN for non-class outputs."""
        params = self.params if params is None else params
        loss_sum, correct = 0.0, 0
        classify = True
        for x, y in self.batches:
            out = self.forward(params, x)
            loss_sum += float(self.per_sample_loss(out, y).sum())
            if out.ndim == 2 and out.shape[1] > 1 and not y.is_floating_point():
                correct += int((out.argmax(1) == y).sum())
            else:
                classify = False
        return loss_sum / self.n, (correct / self.n if classify else float("nan"))
