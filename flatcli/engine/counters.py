"""The engine's cost counters: products and passes in full-set equivalents.

`Counters` is what `flatcli.engine.CurvatureEngine.counters` reports and measures return as their
cost (a gradient over a batch of u of the U units counts u/U), so the figures are the same
whatever the batching or the number of ranks; `count` writes one value.
"""

from __future__ import annotations


def count(x: float) -> float:
    """A counter value: an int when whole, else the fraction (rounded to 6 digits)."""
    return int(x) if float(x).is_integer() else round(float(x), 6)


class Counters:
    """``n_hvp`` (Hessian-, GGN- and finite-difference products, one per vector), ``n_ggnvp``,
    ``n_grad`` and ``n_forward`` (full-set equivalents), ``n_vjp`` (passes of per-sample
    vector-Jacobian products, C per exact Gauss-Newton diagonal), ``oom_retries``, ``fallbacks``.

    They count the logical work of the whole set, the same on every rank: a full-set gradient
    is 1 whatever the number of ranks; a per-batch product driven by a measure (``module_output_hvp``)
    counts its batch times the number of ranks (exact when the shards are equal)."""

    def __init__(self, units: int):
        self.units = units
        self.n_hvp = 0
        self.n_ggnvp = 0
        self.grad_units = 0.0
        self.forward_units = 0.0
        self.n_vjp = 0
        self.oom_retries = 0
        self.fallbacks = 0

    _FIELDS = (
        "n_hvp",
        "n_ggnvp",
        "grad_units",
        "forward_units",
        "n_vjp",
        "oom_retries",
        "fallbacks",
    )

    def as_raw(self) -> list[float]:
        """The raw counts (units, not full-set equivalents), in `_FIELDS` order."""
        return [float(getattr(self, k)) for k in self._FIELDS]

    def add_raw(self, values: list[float]) -> None:
        """Add raw counts in `_FIELDS` order (e.g. the other ranks' share of `map_batches` work)."""
        for k, v in zip(self._FIELDS, values, strict=True):
            cur = getattr(self, k)
            setattr(self, k, cur + (v if isinstance(cur, float) else int(round(v))))

    def merge(self, other: Counters) -> None:
        """Add another engine's counts (over the same units: a BatchNorm-folded copy of the problem)."""
        for k in self._FIELDS:
            setattr(self, k, getattr(self, k) + getattr(other, k))

    @property
    def n_grad(self) -> float:
        """Gradients, in full-set equivalents."""
        return count(self.grad_units / self.units)

    @property
    def n_forward(self) -> float:
        """Forward passes without a gradient, in full-set equivalents."""
        return count(self.forward_units / self.units)

    def as_dict(self) -> dict[str, float]:
        """Every counter by name."""
        return {
            "n_hvp": self.n_hvp,
            "n_ggnvp": self.n_ggnvp,
            "n_grad": self.n_grad,
            "n_forward": self.n_forward,
            "n_vjp": self.n_vjp,
            "oom_retries": self.oom_retries,
            "fallbacks": self.fallbacks,
        }
