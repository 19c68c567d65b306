"""The work an estimator declares before it runs: products, passes, vectors and vector operations.

Each estimator of `flatcli.engine.linalg` declares its `Cost` with a function beside it
(`lanczos_cost`, `hutchinson_cost`, `slq_cost`, ...), from the same objects its stopping rule
reads (`KrylovStop`, `ProbeStop`, `DiagonalCheck`, `certified_min_steps`, `basis_floor`, the
near-zero floor's runs). A measure composes those declarations (``+``, `Cost.then`,
`Cost.either`); ``--dry-run``, budgets and the memory prediction read the composition
(`Cost.estimate`).

Every quantity is a (least, most) pair: the least a run spends when its first check passes, the
most it may spend before a cap. A quantity left ``None`` is not declared (a counter: none spent;
``block``: one vector a product; ``vectors``: one product's block).

>>> a = Cost(hvp=(8, 100), block=1, vectors=104)
>>> (a + Cost(hvp=16, forward=1)).estimate()["n_hvp"]
(24, 116)
>>> a.either(Cost(hvp=50)).estimate()["n_hvp"]
(8, 100)
>>> a.summary()
'8–100 products, 104 P-vectors kept'
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

Range = tuple[int, int]

# Cost field → the engine counter it predicts (`flatcli.engine.CurvatureEngine.counters`).
COUNTERS = {"hvp": "n_hvp", "grad": "n_grad", "forward": "n_forward", "vjp": "n_vjp"}
# Cost field → the key of the estimate `flatcli.measures.MeasureSpec.estimate` returns.
KEYS = {
    **COUNTERS,
    "block": "hvp_block",
    "vectors": "vectors",
    "vector_ops": "vector_ops",
    "batched_vector_ops": "batched_vector_ops",
}
_SUMMED = ("hvp", "grad", "forward", "vjp", "vector_ops", "batched_vector_ops")
# What `Cost.summary` calls each quantity.
WORDS = {
    "hvp": ("product", "products"),
    "grad": ("gradient pass", "gradient passes"),
    "forward": ("forward pass", "forward passes"),
    "vjp": ("VJP pass", "VJP passes"),
    "vectors": ("P-vector kept", "P-vectors kept"),
}


def _pair(v) -> Range | None:
    if v is None:
        return None
    if isinstance(v, tuple):
        return int(v[0]), int(v[1])
    return int(v), int(v)


def _add(a: Range | None, b: Range | None) -> Range | None:
    if a is None or b is None:
        return a if b is None else b
    return a[0] + b[0], a[1] + b[1]


def _widest(a: Range | None, b: Range | None) -> Range | None:
    if a is None or b is None:
        return a if b is None else b
    return max(a[0], b[0]), max(a[1], b[1])


def _span(a: Range | None, b: Range | None) -> Range | None:
    if a is None or b is None:
        return a if b is None else b
    return min(a[0], b[0]), max(a[1], b[1])


def _block(a: int | None, b: int | None) -> int | None:
    """The vectors per product of two parts: the smaller block (0, the engine's, is the largest)."""
    if a is None or b is None:
        return a if b is None else b
    if 0 in (a, b):
        return max(a, b) if min(a, b) == 0 else 0
    return min(a, b)


@dataclass(frozen=True)
class Cost:
    """What one run of an estimator (or a measure) spends, each quantity as (least, most).

    Attributes
    ----------
    hvp, grad, forward, vjp : (int, int) or None
        Hessian(-like) products, gradient passes, forward passes and VJP passes over the
        measurement set (full-set equivalents; the engine's counters ``n_hvp``, ``n_grad``,
        ``n_forward``, ``n_vjp``).
    block : int or None
        The vectors one product call multiplies (0: the engine's block size).
    vectors : (int, int) or None
        The P-length vectors the estimator keeps at once (a basis, a sketch, probes).
    vector_ops : (int, int) or None
        P-length dot products and axpys of its own (reorthogonalization against one basis).
    batched_vector_ops : (int, int) or None
        Those of runs in lockstep, each against its own basis (SLQ).

    An int given for a pair means (n, n).
    """

    hvp: Range | None = None
    grad: Range | None = None
    forward: Range | None = None
    vjp: Range | None = None
    block: int | None = None
    vectors: Range | None = None
    vector_ops: Range | None = None
    batched_vector_ops: Range | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if f.name != "block":
                object.__setattr__(self, f.name, _pair(getattr(self, f.name)))

    def _combine(self, other: Cost, vectors) -> Cost:
        out = {k: _add(getattr(self, k), getattr(other, k)) for k in _SUMMED}
        out["vectors"] = vectors(self.vectors, other.vectors)
        return Cost(**out, block=_block(self.block, other.block))

    def __add__(self, other: Cost) -> Cost:
        """Both parts' work, their vectors held at once (counted together)."""
        return self._combine(other, _add)

    def then(self, other: Cost) -> Cost:
        """``self``, then ``other``: the work adds up, the vectors of the larger part are kept."""
        return self._combine(other, _widest)

    def either(self, other: Cost) -> Cost:
        """One of two parts, chosen while running: the least of the two, the most of the two (a
        quantity one part does not declare counts as 0 there)."""
        out = {}
        for k in _SUMMED:
            a, b = getattr(self, k), getattr(other, k)
            out[k] = None if a is None and b is None else _span(a or (0, 0), b or (0, 0))
        return Cost(
            **out,
            block=_block(self.block, other.block),
            vectors=_span(self.vectors, other.vectors),
        )

    def optional(self) -> Cost:
        """The same work, which a run may also skip entirely (least 0 of every counter and
        vector operation; the vectors it keeps when it runs stay declared)."""
        return dataclasses.replace(
            self, **{k: (0, getattr(self, k)[1]) for k in _SUMMED if getattr(self, k) is not None}
        )

    def products(self) -> Cost:
        """Only the products and passes (no block, vectors or vector operations)."""
        return Cost(**{k: getattr(self, k) for k in COUNTERS})

    def estimate(self) -> dict[str, tuple[int, int]]:
        """The declared quantities under their estimate keys (`KEYS`), each as (least, most)."""
        out = {}
        for name, key in KEYS.items():
            v = getattr(self, name)
            if v is not None:
                out[key] = (v, v) if name == "block" else v
        return out

    def summary(self) -> str:
        """The declared products, passes and vectors in words (``"8–100 products, 104 P-vectors
        kept"``; ``"no products or passes"`` when it declares none)."""
        parts = []
        for name, word in WORDS.items():
            v = getattr(self, name)
            if v is None or v[1] == 0:
                continue
            lo, hi = min(v), v[1]
            word = word[hi != 1]
            parts.append(f"{lo:,}–{hi:,} {word}" if lo != hi else f"{hi:,} {word}")
        return ", ".join(parts) or "no products or passes"
