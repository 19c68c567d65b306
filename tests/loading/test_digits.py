"""The digits source (`flatcli.loading.data.digits_split`): the same tensors, row for row, as
scikit-learn's load_digits split by train_test_split(test_size=0.3, random_state=0, stratify=y)
(the oracle, computed here), read without importing scikit-learn, and through scikit-learn when
its bundled file cannot be found."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from flatcli.errors import ConfigError
from flatcli.loading import data as D


def _sklearn_split():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = d.data.astype(np.float32) / 16.0
    y = d.target.astype(np.int64)
    xtr, xte, ytr, yte = train_test_split(
        x, y, test_size=D.DIGITS_TEST_FRACTION, random_state=0, stratify=y
    )
    return {"train": (xtr, ytr), "test": (xte, yte)}


def _equal(got, want):
    x, y = got
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    assert torch.equal(x, torch.from_numpy(want[0])) and torch.equal(y, torch.from_numpy(want[1]))


@pytest.mark.parametrize("split", ["train", "test"])
def test_rows_equal_scikit_learns_split(split):
    want = _sklearn_split()[split]
    _equal(D.digits_split(split), want)
    assert len(want[0]) == {"train": 1257, "test": 540}[split]


def test_without_the_bundled_file_scikit_learn_loads_it(monkeypatch):
    monkeypatch.setattr(D.importlib.util, "find_spec", lambda name: None)
    want = _sklearn_split()
    for split in ("train", "test"):
        _equal(D.digits_split(split), want[split])
    with pytest.raises(ConfigError, match="digits split must be 'train' or 'test'"):
        D.digits_split("val")


def test_reading_digits_imports_no_scikit_learn():
    code = (
        "import sys\nfrom flatcli.loading.data import digits_split\n"
        "x, y = digits_split('train')\nprint(tuple(x.shape), 'sklearn' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "(1257, 64) False"
