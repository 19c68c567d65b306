"""Declarative validation of measure options (the vocabulary lives in `flatcli.validation`).

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

from ..validation import (
    Bool,
    Check,
    Either,
    Integral,
    OneOf,
    Optional,
    Real,
    Str,
    describe_options,
    opt,
    option_fields,
    parse_options,
)

__all__ = [
    "Bool",
    "Check",
    "Either",
    "Integral",
    "OneOf",
    "Optional",
    "Real",
    "Str",
    "describe_options",
    "opt",
    "option_fields",
    "parse_options",
]
