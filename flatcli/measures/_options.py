"""Declarative validation of measure options, with scikit-learn style messages.

Each measure declares its options as a frozen dataclass whose fields carry a
constraint in ``metadata["check"]`` and a help string in ``metadata["help"]``::

    @dataclass(frozen=True)
    class TraceOptions:
        tol: float = opt(0.01, Real(0, 1, "neither"), "relative stderr to stop at")

`parse_options` turns a YAML/Python dict into that dataclass, or raises a
`ConfigError` such as "The 'tol' parameter of hessian_trace must be a float in
(0, 1). Got 0 instead."
"""

from __future__ import annotations

import abc
import dataclasses
import difflib
import math
from typing import Any

from ..errors import ConfigError


class Check(abc.ABC):
    """A constraint on one option value: `Real`, `Integral`, `OneOf`, ..."""

    @abc.abstractmethod
    def ok(self, v: Any) -> bool:
        """Whether ``v`` (after `coerce`) satisfies the constraint."""

    @abc.abstractmethod
    def describe(self) -> str:
        """The constraint in words, for error messages and ``flatcli measures``."""

    def coerce(self, v: Any) -> Any:
        return v


def _interval(lo, hi, closed: str) -> str:
    left = "[" if closed in ("both", "left") else "("
    right = "]" if closed in ("both", "right") else ")"
    lo_s = "-inf" if lo is None else repr(lo)
    hi_s = "inf" if hi is None else repr(hi)
    return f"{left}{lo_s}, {hi_s}{right}"


class Real(Check):
    """A float in an interval; ``closed`` in {"both", "left", "right", "neither"}."""

    def __init__(self, lo=None, hi=None, closed: str = "both"):
        self.lo, self.hi, self.closed = lo, hi, closed

    def coerce(self, v):
        if isinstance(v, bool):
            return v
        if isinstance(v, (int, float)):
            return float(v)
        if isinstance(v, str):  # YAML reads "1e-3" as a string
            try:
                return float(v)
            except ValueError:
                return v
        return v

    def ok(self, v):
        if not isinstance(v, float) or isinstance(v, bool) or not math.isfinite(v):
            return False
        lo_ok = self.lo is None or (v >= self.lo if self.closed in ("both", "left") else v > self.lo)
        hi_ok = self.hi is None or (v <= self.hi if self.closed in ("both", "right") else v < self.hi)
        return lo_ok and hi_ok

    def describe(self):
        return f"a float in {_interval(self.lo, self.hi, self.closed)}"


class Integral(Check):
    def __init__(self, lo=None, hi=None):
        self.lo, self.hi = lo, hi

    def coerce(self, v):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        return v

    def ok(self, v):
        if not isinstance(v, int) or isinstance(v, bool):
            return False
        return (self.lo is None or v >= self.lo) and (self.hi is None or v <= self.hi)

    def describe(self):
        return f"an int in {_interval(self.lo, self.hi, 'both')}"


class OneOf(Check):
    def __init__(self, *values):
        self.values = values

    def ok(self, v):
        return v in self.values

    def describe(self):
        return "one of " + ", ".join(repr(v) for v in self.values)


class Bool(Check):
    def ok(self, v):
        return isinstance(v, bool)

    def describe(self):
        return "a bool (true or false)"


class Str(Check):
    def ok(self, v):
        return isinstance(v, str) and v != ""

    def describe(self):
        return "a non-empty string"


class Optional(Check):
    """``None`` or whatever ``inner`` accepts."""

    def __init__(self, inner: Check):
        self.inner = inner

    def coerce(self, v):
        return None if v is None else self.inner.coerce(v)

    def ok(self, v):
        return v is None or self.inner.ok(v)

    def describe(self):
        return f"{self.inner.describe()} or null"


def opt(default: Any, check: Check, help: str = "") -> Any:
    """A dataclass field with a constraint and a help text."""
    return dataclasses.field(default=default, metadata={"check": check, "help": help})


def option_fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "check" in f.metadata]


def parse_options(cls, raw: dict[str, Any] | None, measure: str):
    """Validate ``raw`` against the options dataclass ``cls`` of ``measure``.

    ``None`` values are dropped so that unset CLI/Python defaults never override a
    measure's own defaults.
    """
    raw = {k: v for k, v in (raw or {}).items() if v is not None}
    fields = {f.name: f for f in option_fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            hint = difflib.get_close_matches(key, list(fields), n=1)
            valid = ", ".join(fields) or "(none)"
            msg = f"Unknown option '{key}' for measure {measure}."
            msg += f" Did you mean '{hint[0]}'?" if hint else f" Valid options: {valid}."
            raise ConfigError(msg)
        check: Check = fields[key].metadata["check"]
        given = value
        value = check.coerce(value)
        if not check.ok(value):
            raise ConfigError(
                f"The '{key}' parameter of {measure} must be {check.describe()}. Got {given!r} instead."
            )
        kwargs[key] = value
    return cls(**kwargs)


def describe_options(cls) -> list[tuple[str, str, str]]:
    """(name, default, help) for every option of ``cls``."""
    out = []
    for f in option_fields(cls):
        out.append((f.name, repr(f.default), f.metadata.get("help", "")))
    return out
