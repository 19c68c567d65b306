"""Smaller trust items: bad inputs are one line with exit code 2, a pickle posing as a pre-zip torch
file is never unpickled, a file matched twice is measured once, a full disk during a sweep names
its folder, and a removed output folder stops `measure` with exit code 1."""

from __future__ import annotations

import errno
import importlib
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from flatcli.errors import ConfigError
from flatcli.loading.checkpoints import read_checkpoint
from tests.helpers import cli_output, write_project
from tests.oracles import cli as run


class _Touch:
    """A pickle payload: unpickling it creates ``path``."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_a_pickle_posing_as_a_legacy_torch_file_is_never_unpickled(tmp_path):
    from torch.serialization import MAGIC_NUMBER, PROTOCOL_VERSION

    pwned = tmp_path / "PWNED"
    forged = [
        pickle.dumps(MAGIC_NUMBER, protocol=2) + pickle.dumps(_Touch(pwned), protocol=2),
        pickle.dumps(MAGIC_NUMBER, protocol=2)
        + pickle.dumps(PROTOCOL_VERSION, protocol=2)
        + pickle.dumps(_Touch(pwned), protocol=2),
        pickle.dumps(MAGIC_NUMBER) + b"\x80\x02garbage",
    ]
    for i, data in enumerate(forged):
        p = tmp_path / f"f{i}.pt"
        p.write_bytes(data)
        with pytest.raises(ConfigError, match="not a readable checkpoint"):
            read_checkpoint(p, allow_unsafe_pickle=True)
        assert not pwned.exists(), i
    # genuine pre-zip and zip files still load: a state dict, and a full pickle with the flag
    sd = {"w": torch.arange(3.0)}
    legacy = tmp_path / "legacy.pt"
    torch.save(sd, legacy, _use_new_zipfile_serialization=False)
    assert torch.equal(read_checkpoint(legacy)["w"], sd["w"])
    assert torch.equal(read_checkpoint(legacy, allow_unsafe_pickle=True)["w"], sd["w"])
    full = tmp_path / "full.pt"
    torch.save(torch.nn.Linear(2, 1), full, _use_new_zipfile_serialization=False)
    assert isinstance(read_checkpoint(full, allow_unsafe_pickle=True), torch.nn.Linear)
    with pytest.raises(ConfigError, match="full pickle|not a readable"):
        read_checkpoint(full)


@pytest.fixture
def project(tmp_path):
    return write_project(tmp_path / "p", measures=["frobenius_norm"], n_ckpt=2)


def _variant(project: Path, name: str, mutate) -> Path:
    d = yaml.safe_load(project.read_text())
    mutate(d)
    path = project.parent / f"{name}.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


def _tensors(project: Path, name: str, x, y) -> str:
    torch.save({"x": x, "y": y}, project.parent / name)
    return name


def _split(which, path):
    return lambda d: d["data"].__setitem__(which, {"source": "tensors", "path": path})


CASES = {
    "empty_test": (
        lambda p: _split(
            "test", _tensors(p, "e.pt", torch.zeros(0, 16), torch.zeros(0, dtype=torch.long))
        ),
        "data.test: the split holds no examples",
    ),
    "features": (
        lambda p: _split(
            "train", _tensors(p, "f.pt", torch.randn(8, 12), torch.zeros(8, dtype=torch.long))
        ),
        "data.train: the model cannot take these inputs (per row: x (12,)",
    ),
    "y_2d": (
        lambda p: _split(
            "train", _tensors(p, "y.pt", torch.randn(8, 16), torch.zeros(8, 2, dtype=torch.long))
        ),
        "must be one class index per row (shape (rows,)). Got shape (8, 2) instead",
    ),
    "npz_object": (
        lambda p: (
            np.savez(p.parent / "o.npz", x=np.array([object(), 1], dtype=object), y=np.zeros(2)),
            _split("train", "o.npz"),
        )[1],
        "o.npz cannot be read safely: Object arrays cannot be loaded",
    ),
    "seed": (
        lambda p: lambda d: d["runtime"].__setitem__("seed", 10**30),
        "'runtime.seed' must be an int in [0, ",
    ),
    "threads": (
        lambda p: lambda d: d["runtime"].__setitem__("threads", 10**30),
        "'runtime.threads' must be an int in [1, 4096]",
    ),
    "data_seed": (
        lambda p: lambda d: d["measure_data"].__setitem__("seed", -1),
        "'measure_data.seed' must be an int in [0, ",
    ),
    "label_list": (
        lambda p: lambda d: d.__setitem__("measures", [{"frobenius_norm": {"label": ["a", "b"]}}]),
        "'measures[0].frobenius_norm.label' must be a name (text). Got ['a', 'b'] instead.",
    ),
    "options_list": (
        lambda p: lambda d: d.__setitem__("measures", [{"frobenius_norm": [1, 2]}]),
        "'measures[0].frobenius_norm' must be a mapping of options",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_inputs_exit_2_with_one_line(project, case, tmp_path):
    make, message = CASES[case]
    cfg = _variant(project, case, make(project))
    res = run("measure", "-c", cfg, "-o", tmp_path / "o")
    text = cli_output(res)
    assert res.exit_code == 2, text
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert errors and all(message in e for e in errors), text
    assert "Traceback" not in text and "RuntimeError" not in text


def test_a_file_matched_by_a_glob_and_named_is_measured_once(project, tmp_path, monkeypatch):
    import csv

    monkeypatch.chdir(project.parent)
    res = run("measure", "-c", project, "m0.pt", "m*.pt", "./m1.pt", "-o", tmp_path / "o")
    assert res.exit_code == 0, cli_output(res)
    rows = list(csv.DictReader(open(tmp_path / "o" / "results.csv")))
    assert [r["checkpoint"] for r in rows] == ["m0.pt", "m1.pt"]


def test_a_full_disk_during_a_sweep_names_the_folder(project, tmp_path, monkeypatch):
    store = importlib.import_module("flatcli.sweep.store")

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "atomic_write", full)
    res = run("sweep", "-c", project, "-o", tmp_path / "s")
    text = cli_output(res)
    assert res.exit_code == 1, text
    assert f"error: could not write {tmp_path / 's' / 'units'} (No space left on device)" in text


def test_a_removed_output_folder_stops_measure_with_exit_1(tmp_path, monkeypatch):
    cfg = write_project(tmp_path / "p", measures=["frobenius_norm", "hessian_trace"])
    am = importlib.import_module("flatcli.api.measure")
    out = tmp_path / "o"
    real, calls = am._Saver.save, []

    def save(self, rows, current):
        calls.append(1)
        if len(calls) == 2:
            shutil.rmtree(out)
        return real(self, rows, current)

    monkeypatch.setattr(am._Saver, "save", save)
    res = run("measure", "-c", cfg, "-o", out)
    text = " ".join(cli_output(res).split())
    assert res.exit_code == 1, text
    assert f"could not write {out} (the folder was removed during the run)" in text
    assert not out.exists()  # never created again behind the user's back
