"""The context a measure runs in is typed: its problem, its engine and the work one checkpoint's
measures share (`MeasureCache`), one typed part per kind of work."""

import dataclasses
import typing

import torch

from flatcli.engine import CurvatureEngine, Problem
from flatcli.measures import MeasureCache, MeasureContext, MeasureSpec, run_measure
from tests.oracles import mlp_problem


def test_the_context_and_the_cache_are_typed():
    names = {"Problem": Problem, "CurvatureEngine": CurvatureEngine}  # annotation-only imports
    hints = typing.get_type_hints(MeasureContext, localns=names)
    assert hints["problem"] is Problem
    assert hints["engine"] == CurvatureEngine | None
    assert hints["cache"] is MeasureCache
    for f in dataclasses.fields(MeasureCache):
        assert typing.get_type_hints(MeasureCache)[f.name] is not typing.Any, f.name
    assert isinstance(MeasureContext(None, None).cache, MeasureCache)


def test_measures_share_their_work_through_the_typed_cache():
    p = mlp_problem()
    eng = CurvatureEngine(p)
    cache = MeasureCache()
    opts = {"hessian_diag": "auto"}
    first = run_measure(
        MeasureSpec("normalized_sharpness", "a", opts), MeasureContext(p, eng, cache=cache)
    )
    assert cache.hessian_diagonal and cache.ggn_diagonal and cache.diagonal_parts
    again = run_measure(
        MeasureSpec("normalized_sharpness", "b", opts), MeasureContext(p, eng, cache=cache)
    )
    assert again.diagnostics.get("diag_shared") is True
    assert again.value == first.value
    assert again.diagnostics["n_hvp"] == 0 and again.diagnostics["n_vjp"] == 0
    spectrum = MeasureSpec("hessian_spectrum", "s", {"top_k": 1, "slq_runs": 4, "slq_steps": 5})
    run_measure(spectrum, MeasureContext(p, eng, cache=cache))
    assert cache.slq_runs  # local_entropy and the trace's near-zero floor read them here
    assert all(isinstance(v, torch.Tensor) for v in cache.ggn_diagonal.values())
