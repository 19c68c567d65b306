"""A forward hook on one module: what `CurvatureEngine.module_io` and `module_output_hvp` (and
measures that look inside a layer) use to read a layer's input and output or to replace its output."""

from __future__ import annotations

import torch

from ..errors import MeasurementError


class LayerCapture:
    """A forward hook that records a module's input and output, or replaces its output
    (``with LayerCapture(module) as cap: model(x)``; then ``cap.single()``)."""

    def __init__(self, module: torch.nn.Module, replace: torch.Tensor | None = None):
        self.module, self.replace = module, replace
        self.inputs: list[torch.Tensor] = []
        self.outputs: list[torch.Tensor] = []

    def __enter__(self):
        self.handle = self.module.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc):
        self.handle.remove()

    def _hook(self, mod, inp, out):
        self.inputs.append(inp[0])
        self.outputs.append(out)
        return self.replace

    def single(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(input, output) of the one call; a module that ran 0 or several times is an error."""
        if len(self.inputs) != 1:
            raise MeasurementError(
                f"the layer ran {len(self.inputs)} times in one forward pass; it must run exactly once "
                "(no weight sharing)"
            )
        return self.inputs[0], self.outputs[0]
