"""The grid of options and sizes on which every measure's declared cost is pinned.

``python tools/cost_grid.py OUT.json.gz`` writes, for every registered measure, each option set of
`option_sets` and each `Dims` of `dims_grid`, the counters `flatcli.measures.MeasureSpec.estimate`
returns. ``tests/measures/data/cost_declarations.json.gz`` was written by this script from the
measures' estimate functions as they stood before the estimators declared their costs; the test
``tests/measures/test_cost_declarations.py`` replays the same inputs against the declarations.
"""

from __future__ import annotations

import dataclasses
import gzip
import itertools
import json
import random
import sys

from flatcli.measures import Dims, MeasureSpec, list_measures
from flatcli.validation import Bool, Integral, OneOf, Optional, option_fields, parse_options

INTS = (1, 2, 3, 4, 5, 7, 10, 16, 25, 50, 64, 100, 400, 1000)
SIZES = (1, 2, 5, 17, 64, 67, 500, 4810, 100_000, 1_000_000)
SEED = 47


def _candidates(check) -> list:
    """Values of one option worth trying (its checks decide which are valid)."""
    if isinstance(check, Bool):
        return [False, True]
    if isinstance(check, OneOf):
        return list(check.values)
    if isinstance(check, Optional):
        return [None, *_candidates(check.inner)]
    if isinstance(check, Integral):
        return list(INTS)
    return []


def _valid(cls, raw: dict, name: str) -> bool:
    try:
        parse_options(cls, raw, name)
    except Exception:
        return False
    return True


def option_sets(info, extra: int = 12) -> list[dict]:
    """The defaults, each option alone at each candidate value, and ``extra`` seeded random mixes."""
    fields = {f.name: _candidates(f.metadata["check"]) for f in option_fields(info.options)}
    fields = {k: v for k, v in fields.items() if v}
    sets = [{}]
    for k, values in fields.items():
        sets += [{k: v} for v in values]
    rng = random.Random(f"{SEED}-{info.name}")
    for _ in range(extra * bool(fields)):
        sets.append({k: rng.choice(v) for k, v in fields.items()})
    out, seen = [], set()
    for raw in sets:
        key = json.dumps(raw, sort_keys=True)
        if key not in seen and _valid(info.options, raw, info.name):
            seen.add(key)
            out.append(raw)
    return out


def _split(P: int, parts: int) -> tuple[int, ...]:
    base = [P // parts] * parts
    base[0] += P - sum(base)
    return tuple(t for t in base if t > 0)


def dims_grid() -> list[Dims]:
    """P from 1 to 10⁶, verify on and off, max_basis unset and set, one or several tensors."""
    out = []
    for P, verify, max_basis, parts in itertools.product(
        SIZES, (False, True), (None, 8, 40), (1, 3)
    ):
        tensors = _split(P, min(parts, P))
        matrices = tensors[::2] if len(tensors) > 1 else tensors
        matrix_tensors = tuple(range(0, len(tensors), 2)) if len(tensors) > 1 else (0,)
        out.append(
            Dims(
                P=P,
                n=100,
                C=10 if parts > 1 else 1,
                tensors=tensors,
                matrices=matrices,
                verify=verify,
                max_basis=max_basis,
                matrix_tensors=matrix_tensors,
            )
        )
    return out


def dims_json(d: Dims) -> dict:
    """The fields of ``d`` a declaration reads (JSON: no dtype)."""
    return {f.name: getattr(d, f.name) for f in dataclasses.fields(d) if f.name != "dtype"}


def rows() -> list[list]:
    """[measure, options, dims, estimate] for the whole grid."""
    dims = dims_grid()
    out = []
    for info in list_measures():
        for raw in option_sets(info):
            spec = MeasureSpec(info.name, info.name, raw)
            for d in dims:
                est = spec.estimate(d)
                est = None if est is None else {k: list(v) for k, v in sorted(est.items())}
                out.append([info.name, raw, dims_json(d), est])
    return out


if __name__ == "__main__":
    data = rows()
    with gzip.open(sys.argv[1], "wt") as fh:
        json.dump(data, fh, separators=(",", ":"))
    print(f"{len(data)} rows")
