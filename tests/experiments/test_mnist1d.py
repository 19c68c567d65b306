"""The mnist1d data source: procedural, offline, deterministic, side-effect free."""

import random

import numpy as np
import pytest
import torch

from flatcli.config import DataSource, from_dict
from flatcli.errors import ConfigError
from flatcli.loading import data as data_mod
from flatcli.loading.data import load_split, mnist1d_split

pytest.importorskip("mnist1d")


def test_mnist1d_splits_shapes_and_determinism(tmp_path):
    src = DataSource(source="mnist1d", num_samples=200, seed=3, kwargs={"train_split": 0.75})
    xtr, ytr = load_split(src, "train", tmp_path).values()
    xte, yte = load_split(src, "test", tmp_path).values()
    assert xtr.shape == (150, 40) and xte.shape == (50, 40)
    assert xtr.dtype == torch.float32 and ytr.dtype == torch.int64
    assert set(ytr.tolist()) <= set(range(10)) and len(set(ytr.tolist())) == 10
    # the generator's own split of one data set: no signal appears in both
    assert not any(torch.equal(a, b) for a in xte[:10] for b in xtr)
    data_mod._mnist1d_arrays.cache_clear()
    xtr2, ytr2 = load_split(src, "train", tmp_path).values()  # regenerated, not cached
    assert torch.equal(xtr, xtr2) and torch.equal(ytr, ytr2)
    other = load_split(
        DataSource(source="mnist1d", num_samples=200, seed=4, kwargs={"train_split": 0.75}),
        "train",
        tmp_path,
    )
    assert not torch.equal(xtr, other["x"])


@pytest.mark.slow
def test_mnist1d_split_key_and_default_sizes():
    x, _ = mnist1d_split("train")
    assert x.shape == (4000, 40)  # the generator's defaults: 5000 signals, 80/20
    src = DataSource(source="mnist1d", split="test")
    assert load_split(src, "train", ".")["x"].shape == (1000, 40)  # 'split' wins over the key


def test_mnist1d_returns_fresh_tensors():
    x, y = mnist1d_split("train", 100)
    x.zero_()
    y.zero_()
    x2, y2 = mnist1d_split("train", 100)
    assert float(x2.abs().sum()) > 0 and int(y2.max()) > 0


def test_mnist1d_leaves_global_generators_alone():
    np.random.seed(123)
    random.seed(123)
    data_mod._mnist1d_arrays.cache_clear()
    mnist1d_split("train", 100, seed=9)
    a, b = np.random.rand(), random.random()
    np.random.seed(123)
    random.seed(123)
    assert a == np.random.rand() and b == random.random()


@pytest.mark.parametrize(
    ("kwargs", "num_samples", "split", "match"),
    [
        (
            {"iid_noise": 0.1},
            100,
            "train",
            r"data.train.kwargs: mnist1d has no parameter 'iid_noise'. Did you mean 'iid_noise_scale'\?",
        ),
        ({"url": "http://x"}, 100, "train", r"no parameter 'url'"),
        ({"train_split": 1.5}, 100, "train", r"train_split must be a float in \(0, 1\). Got 1.5"),
        ({}, 5, "train", r"data.train.num_samples: mnist1d needs an int ≥ 20"),
        ({"train_split": 0.01}, 20, "train", r"leaves an empty split"),
        ({}, 100, "valid", r"mnist1d split must be 'train' or 'test'. Got 'valid'"),
        ({"template_len": "long"}, 100, "train", r"mnist1d could not generate the data"),
    ],
)
def test_mnist1d_bad_input_is_a_config_error(kwargs, num_samples, split, match):
    src = DataSource(source="mnist1d", num_samples=num_samples, kwargs=kwargs, split=split)
    with pytest.raises(ConfigError, match=match):
        load_split(src, "train", ".")


def test_mnist1d_missing_package_says_how_to_install(monkeypatch):
    import sys

    data_mod._mnist1d_arrays.cache_clear()
    monkeypatch.setitem(sys.modules, "mnist1d.data", None)
    with pytest.raises(ConfigError, match=r"pip install 'flatcli\[experiments\]'"):
        mnist1d_split("train", 100, seed=11)
    data_mod._mnist1d_arrays.cache_clear()


def test_config_accepts_mnist1d_and_suggests_it():
    cfg = from_dict(
        {
            "data": {
                "train": {
                    "source": "mnist1d",
                    "num_samples": 300,
                    "seed": 1,
                    "kwargs": {"train_split": 0.5},
                }
            }
        },
        env={},
    )
    assert cfg.data.train.source == "mnist1d" and cfg.data.train.kwargs == {"train_split": 0.5}
    with pytest.raises(ConfigError, match="Did you mean 'mnist1d'"):
        from_dict({"data": {"train": {"source": "mnist_1d"}}}, env={})
