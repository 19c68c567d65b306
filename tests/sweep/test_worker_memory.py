"""Flat memory in long sweeps: the data cache keeps a byte budget (least recently used dropped
first) and a unit leaves nothing behind in torch.fx's source caches."""

from __future__ import annotations

import collections
import linecache
import random

import pytest
import torch

import flatcli.loading.load as pipeline
from flatcli.engine.batch import Batch
from flatcli.measures._bn import fold_batchnorm
from tests.helpers import TinyBN, conv_bn_setup


class _Cfg:
    """The little of a Config that DataCache reads."""

    class data:
        train = test = None
        normalize = None

    base_dir = "."


@pytest.mark.parametrize("seed", range(20))
def test_data_cache_is_an_lru_within_its_budget(monkeypatch, seed):
    """Random access sequences over splits of random sizes: the cache holds what an LRU of the same
    byte budget holds (the split just loaded always kept), loads exactly its misses, and returns
    each split's own tensors."""
    rng = random.Random(seed)
    sizes = {f"d{i}.pt": rng.randint(1, 50) for i in range(8)}  # rows of 8 float64 each
    budget = rng.randint(10, 200) * 64
    loads = []

    def load_split(src, split, base_dir, normalize, cache_dir):
        loads.append(src.path)
        n = sizes[src.path]
        return Batch({"x": torch.full((n, 8), float(len(src.path))), "y": torch.zeros(n)})

    monkeypatch.setattr(pipeline, "load_split", load_split)
    cache = pipeline.DataCache(_Cfg(), max_bytes=budget)
    ref: collections.OrderedDict[str, int] = collections.OrderedDict()
    misses = 0
    for _ in range(60):
        path = rng.choice(list(sizes))
        got = cache.get("train", path)
        assert got.rows == sizes[path]
        if path in ref:
            ref.move_to_end(path)
        else:
            misses += 1
            ref[path] = sizes[path] * 8 * 4 + sizes[path] * 4  # float32 x and y
            while len(ref) > 1 and sum(ref.values()) > budget:
                ref.popitem(last=False)
        assert [k.split(":", 1)[1] for k in cache._cache] == list(ref)
        assert sum(map(pipeline.batch_nbytes, cache._cache.values())) == sum(ref.values())
    assert len(loads) == misses


def test_data_cache_default_budget_from_the_environment(monkeypatch):
    monkeypatch.delenv("FLATCLI_DATA_CACHE_MB", raising=False)
    assert pipeline.DataCache(_Cfg()).max_bytes == pipeline.DATA_CACHE_MB * 2**20
    monkeypatch.setenv("FLATCLI_DATA_CACHE_MB", "3")
    assert pipeline.DataCache(_Cfg()).max_bytes == 3 * 2**20


@pytest.mark.slow
def test_folding_leaves_no_generated_source_behind():
    """Each fold traces the model with torch.fx; the traced code must not stay cached."""
    from torch.fx.graph_module import _loader

    models = [TinyBN(), conv_bn_setup()[0]]
    for m in models:
        fold_batchnorm(m)  # warm-up
    before = (len(linecache.cache), len(_loader.eval_cache))
    for _ in range(25):
        for m in models:
            assert fold_batchnorm(m).pairs
    assert (len(linecache.cache), len(_loader.eval_cache)) == before
