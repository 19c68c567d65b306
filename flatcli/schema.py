"""Schemas of the files flatcli reads back (sweep unit files, plan.json, results.json) and a
small validator for them.

A schema is a type name (``"str"``, ``"int"``, ``"float"``: an int or a float, ``"bool"``,
``"null"``, ``"dict"``, ``"list"``, ``"any"``), a tuple of alternatives, a one-element list
(every item matches it), a dict (its keys required, a key ending in ``?`` optional; other keys
allowed), `MapOf` (a dict whose values all match) or `OneOf` (one of some literal values).
`mismatch` returns the first place a value does not match, in words, or None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_TYPES = {
    "str": lambda v: isinstance(v, str),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "dict": lambda v: isinstance(v, dict),
    "list": lambda v: isinstance(v, list),
    "any": lambda v: True,
}


@dataclass(frozen=True)
class MapOf:
    """A dict with string keys whose every value matches ``values``."""

    values: Any


@dataclass(frozen=True)
class OneOf:
    """One of the literal ``choices``."""

    choices: tuple


def _describe(schema: Any) -> str:
    if isinstance(schema, str):
        return schema
    if isinstance(schema, tuple):
        return " or ".join(_describe(s) for s in schema)
    if isinstance(schema, OneOf):
        return " or ".join(repr(c) for c in schema.choices)
    return "list" if isinstance(schema, list) else "dict"


def _got(v: Any) -> str:
    text = repr(v)
    return f"{type(v).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


def mismatch(value: Any, schema: Any, where: str = "") -> str | None:
    """Where ``value`` does not match ``schema`` and how (``"result.value must be float or null;
    got str 'abc'"``), or None when it matches."""
    at = where or "the top level"
    if isinstance(schema, tuple):
        return _union(value, schema, where)
    if isinstance(schema, str):
        return (
            None if _TYPES[schema](value) else f"{at} must be {schema}. Got {_got(value)} instead."
        )
    if isinstance(schema, OneOf):
        return None if value in schema.choices else f"{at} must be {_describe(schema)}"
    if isinstance(schema, list):
        if not isinstance(value, list):
            return f"{at} must be a list. Got {_got(value)} instead."
        return _first(mismatch(item, schema[0], f"{where}[{i}]") for i, item in enumerate(value))
    if not isinstance(value, dict):
        return f"{at} must be a mapping. Got {_got(value)} instead."
    if isinstance(schema, MapOf):
        return _first(
            mismatch(v, schema.values, f"{where}.{k}" if where else str(k))
            for k, v in value.items()
        )
    return _first(_field(value, key, sub, where) for key, sub in schema.items())


def _first(found) -> str | None:
    return next((x for x in found if x), None)


def _union(value: Any, schema: tuple, where: str) -> str | None:
    if any(mismatch(value, s, where) is None for s in schema):
        return None
    inner = [s for s in schema if not isinstance(s, str)]
    if len(inner) == 1 and _describe(inner[0]) == _describe_of(value):
        return mismatch(value, inner[0], where)  # the right container: say what is inside
    return f"{where or 'the top level'} must be {_describe(schema)}. Got {_got(value)} instead."


def _field(value: dict, key: str, sub: Any, where: str) -> str | None:
    name = key.rstrip("?")
    path = f"{where}.{name}" if where else name
    if name not in value:
        return None if key.endswith("?") else f"{path} is missing"
    return mismatch(value[name], sub, path)


def _describe_of(value: Any) -> str:
    return "list" if isinstance(value, list) else "dict" if isinstance(value, dict) else ""


TEXT = ("str", "null")
NUMBER = ("float", "null")

# a sweep unit file, units/<id>.json (`flatcli.sweep.store.unit_record`)
UNIT = {
    "format": "int",
    "unit": "str",
    "key": "dict",
    "checkpoint": "str",
    "checkpoint_index": "int",
    "label": "str",
    "label_index": "int",
    "labels": ["str"],
    "status": "str",
    "error": TEXT,
    "error_kind": TEXT,
    "measure_error": TEXT,
    "measure_error_kind": TEXT,
    "result": (
        "null",
        {
            "value": NUMBER,
            "stderr": NUMBER,
            "status": "str",
            "seconds": NUMBER,
            "diagnostics": ("dict", "null"),
        },
    ),
    "metrics": (MapOf(NUMBER), "null"),
    "hparams": ("dict", "null"),
    "worker": {"device?": ("str", "null")},
    "sweep_id?": TEXT,  # the sweep run that wrote it (files of older versions: "run")
    "seconds": "float",
    "finished_at": "float",
}

# a measure's entry in results.json (`flatcli.run.results.Row.to_json`): NaN is null, ±inf a string
RESULT_VALUE = ("float", "null", OneOf(("inf", "-inf")))
RESULTS = {
    "rows": [
        {
            "checkpoint": "str",
            "measures": MapOf(
                {
                    "value": RESULT_VALUE,
                    "stderr?": RESULT_VALUE,
                    "status": "str",
                    "seconds?": NUMBER,
                    "diagnostics?": ("dict", "null"),
                }
            ),
            "keys?": MapOf("str"),
        }
    ],
    "config?": "dict",
}

# plan.json (`flatcli.sweep.plan.Plan.to_json`)
PLAN = {
    "format": "int",
    "version": "str",
    "config_hash": "str",
    "base_dir": "str",
    "config": "dict",
    "measures": [
        {
            "name": "str",
            "label": "str",
            "options": "dict",
            "seed": ("int", "null"),
            "max_seconds?": NUMBER,
            "max_hvps?": ("int", "null"),
        }
    ],
    "checkpoints": [
        {
            "checkpoint": "str",
            "path": "str",
            "init_checkpoint": TEXT,
            "train_data": TEXT,
            "hparams": "dict",
        }
    ],
    "units": [
        {
            "id": "str",
            "checkpoint_index": "int",
            "label": "str",
            "label_index": "int",
            "key": "dict",
        }
    ],
}
