"""Bad data is named when it is loaded: NaN/inf in any split's inputs or targets, and fractional
labels under cross-entropy (one line naming the split, the tensor and the first bad row)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml

from flatcli import api
from flatcli.config import DataSource
from flatcli.engine.batch import Batch
from flatcli.errors import ConfigError
from flatcli.loading.data import check_finite_data, load_split
from tests.helpers import write_project


@pytest.mark.parametrize("seed", range(25))
def test_first_bad_row_named(seed):
    """Over random shapes, tensors and NaN/inf positions, the error names the tensor and the
    smallest bad row; a clean batch passes unchanged."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(3, 40, (1,), generator=g))
    shape = (n, *[int(k) for k in torch.randint(1, 4, (int(torch.randint(0, 3, (1,))),))])
    tensors = {
        "x": torch.randn(shape, generator=g),
        "y": torch.randint(0, 3, (n,), generator=g).float(),
        "mask": torch.ones(n, dtype=torch.long),
    }
    assert check_finite_data(Batch(tensors), "data.train") is not None
    name = ["x", "y"][seed % 2]
    t = tensors[name]
    rows = torch.randperm(n, generator=g)[: 1 + seed % 3]
    bad = [float("nan"), float("inf"), float("-inf")][seed % 3]
    for r in rows.tolist():
        t.reshape(n, -1)[r, int(torch.randint(0, t[0].numel(), (1,), generator=g))] = bad
    with pytest.raises(ConfigError) as e:
        check_finite_data(Batch(tensors), "data.test")
    msg = str(e.value)
    assert msg.startswith(f"data.test: '{name}' holds {bad} at row {int(rows.min())} ")
    assert f"({len(set(rows.tolist()))} of {n} rows" in msg


def _tensors_file(tmp: Path, name: str, x, y) -> str:
    torch.save({"x": x, "y": y}, tmp / name)
    return name


def test_load_split_names_file_and_normalize(tmp_path):
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    x[6, 2] = float("nan")
    src = DataSource(source="tensors", path=_tensors_file(tmp_path, "d.pt", x, y))
    with pytest.raises(ConfigError, match=r"^data.test \(.*d.pt\): 'x' holds nan at row 6 "):
        load_split(src, "test", tmp_path)
    ok = DataSource(source="tensors", path=_tensors_file(tmp_path, "ok.pt", x.nan_to_num(), y))
    with pytest.raises(ConfigError, match=r"after data.normalize: 'x' holds"):
        load_split(ok, "train", tmp_path, {"mean": 0.0, "std": 0.0})


def _project(tmp: Path, train, test, measures=("frobenius_norm",)) -> Path:
    cfg = write_project(tmp, n_ckpt=1, measures=list(measures))
    c = yaml.safe_load(cfg.read_text())
    c["data"] = {
        "train": {"source": "tensors", "path": _tensors_file(tmp, "train.pt", *train)},
        "test": {"source": "tensors", "path": _tensors_file(tmp, "test.pt", *test)},
    }
    cfg.write_text(yaml.safe_dump(c))
    return cfg


def _data(n=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)


@pytest.mark.parametrize("split", ["train", "test"])
def test_nan_in_a_split_is_a_config_error(tmp_path, split):
    """NaN in the test split (or the training inputs) stops the run with exit code 2 naming the
    split, the tensor and the row; gen_gap is never computed from a NaN test loss."""
    x, y = _data()
    bad = x.clone()
    bad[11, 5] = float("nan")
    cfg = _project(
        tmp_path, (bad, y) if split == "train" else (x, y), (bad, y) if split == "test" else (x, y)
    )
    with pytest.raises(ConfigError, match=rf"^data.{split} \(.*\): 'x' holds nan at row 11 ") as e:
        api.measure(cfg, outdir=tmp_path / "out")
    assert e.value.exit_code == 2


def test_nan_in_a_checkpoints_own_train_data_names_it(tmp_path):
    """A manifest's per-checkpoint training set with NaN: that checkpoint's row names the file
    (exit code 2), not 'the loss at the checkpoint is not finite'."""
    x, y = _data()
    cfg = _project(tmp_path, (x, y), (x, y))
    bad = x.clone()
    bad[3, 0] = float("inf")
    _tensors_file(tmp_path, "own.pt", bad, y)
    (tmp_path / "sweep.csv").write_text("path,train_data\nm0.pt,own.pt\n")
    c = yaml.safe_load(cfg.read_text())
    c["checkpoints"] = {"manifest": "sweep.csv"}
    cfg.write_text(yaml.safe_dump(c))
    rep = api.measure(cfg, outdir=tmp_path / "out")
    assert rep.exit_code == 2
    assert re.search(r"own.pt\): 'x' holds inf at row 3 ", rep.rows[0].error), rep.rows[0].error
    assert "not finite" not in rep.rows[0].error


def test_fractional_labels_under_cross_entropy(tmp_path):
    """Labels 0.5, 1.5 under cross_entropy: exit code 2 naming the split and the first one; whole
    float labels (1.0, 2.0) are class indices and measure as the integer ones do."""
    x, y = _data()
    frac = y.float()
    frac[4] += 0.5
    cfg = _project(tmp_path / "a", (x, frac), (x, y), ["hessian_trace"])
    rep = api.measure(cfg, outdir=tmp_path / "a" / "out")
    assert rep.exit_code == 2
    assert rep.rows[0].error.startswith("data.train: label ")
    assert f"label {float(frac[4]):g} at row 4 is not a class index" in rep.rows[0].error
    whole = api.measure(_project(tmp_path / "b", (x, y.float()), (x, y), ["frobenius_norm"]))
    ints = api.measure(_project(tmp_path / "c", (x, y), (x, y), ["frobenius_norm"]))
    assert whole.exit_code == 0
    assert whole.rows[0].metrics == ints.rows[0].metrics
