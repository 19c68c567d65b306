r"""BatchNorm running statistics recomputed for parameters that were never trained as such.

A point on a path between two networks, θ(t), has no running statistics of its
own: the endpoints' statistics (or their interpolation) are the mean and
variance of other weights' activations. As Garipov et al. (NeurIPS 2018) do
for their curves (``update_bn`` in their code), the statistics are recomputed
for each evaluated θ(t) on the training data, and the point is then evaluated
in eval mode:

* every BatchNorm layer with running statistics starts from the reset state
  (mean 0, variance 1, no batches tracked);
* one forward pass per data batch with the BatchNorm layers in train mode and
  every other module in eval mode (dropout stays off, so the statistics are
  those of the network that is evaluated);
* the update factor of batch k (``momentum`` in PyTorch's convention
  ``r ← (1 − m)·r + m·s_k``) is ``m_k = n_k / (n_1 + … + n_k)``, so that

  .. math:: \mu = \sum_k \frac{n_k}{n} \bar z_k, \qquad
            \sigma^2 = \sum_k \frac{n_k}{n} s_k^2,

  the sample-weighted mean of the batch means and of the (unbiased) batch
  variances — PyTorch's ``momentum=None`` cumulative average, weighted by
  batch size so that an uneven last batch carries exactly its share (the
  weighting Garipov et al.'s ``update_bn`` uses).

Everything runs through :func:`torch.func.functional_call` on a private copy
of the model; the caller's model, parameters and buffers are never touched.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch.func import functional_call
from torch.nn.modules.batchnorm import _BatchNorm


def batchnorm_layers(model: torch.nn.Module) -> dict[str, _BatchNorm]:
    """The BatchNorm layers of ``model`` that keep running statistics, by module name."""
    return {
        n: m
        for n, m in model.named_modules()
        if isinstance(m, _BatchNorm) and m.track_running_stats and m.running_mean is not None
    }


def batchnorm_buffer_names(model: torch.nn.Module) -> list[str]:
    """Names of the running-statistics buffers (mean, variance, batch count) of ``model``."""
    out = []
    for n, m in batchnorm_layers(model).items():
        pre = f"{n}." if n else ""
        out += [pre + "running_mean", pre + "running_var"]
        if m.num_batches_tracked is not None:
            out.append(pre + "num_batches_tracked")
    return out


class BatchNormRecomputer:
    """Recompute BatchNorm running statistics of ``model`` at given parameters.

    Parameters
    ----------
    model : the network (not modified: a private copy is made once, cast to
        ``device`` and ``dtype``).
    device, dtype : where and in which floating type the forward passes run.

    Call it as ``recompute(params, batches, buffers)`` with ``params`` the
    trainable parameters (name → tensor), ``batches`` an iterable of (x, y)
    and ``buffers`` the other buffers to use (name → tensor, e.g. the model's
    own); it returns the recomputed running statistics, name → tensor, for
    every name in `batchnorm_buffer_names`.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device | str, dtype: torch.dtype):
        self.work = copy.deepcopy(model).to(device=device, dtype=dtype)
        for m in self.work.modules():  # BatchNorm in train mode, every other module in eval mode
            m.train(isinstance(m, _BatchNorm))
        self.layers = batchnorm_layers(self.work)
        self.names = batchnorm_buffer_names(self.work)
        self.dtype = dtype
        self.device = torch.device(device)

    def _fresh(self) -> dict[str, torch.Tensor]:
        out = {}
        for n, m in self.layers.items():
            pre = f"{n}." if n else ""
            out[pre + "running_mean"] = torch.zeros(
                m.num_features, device=self.device, dtype=self.dtype
            )
            out[pre + "running_var"] = torch.ones(
                m.num_features, device=self.device, dtype=self.dtype
            )
            if m.num_batches_tracked is not None:
                out[pre + "num_batches_tracked"] = torch.zeros(
                    (), device=self.device, dtype=torch.long
                )
        return out

    @torch.no_grad()
    def __call__(
        self,
        params: dict[str, torch.Tensor],
        batches: Iterable,
        buffers: dict[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """The running statistics of the network at ``params``, one pass over ``batches``.

        ``buffers`` supplies the non-BatchNorm buffers (BatchNorm ones in it
        are ignored); returns name → tensor for every name in ``self.names``.
        """
        state = self._fresh()
        fixed = {k: v for k, v in (buffers or {}).items() if k not in state}
        seen = 0
        for batch in batches:  # `flatcli.engine.batch.Batch` objects
            b = batch.rows
            for m in self.layers.values():
                m.momentum = b / (seen + b)
            args, kwargs = batch.model_inputs()
            functional_call(self.work, {**fixed, **params, **state}, args, kwargs)
            seen += b
        return state
