import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from flatcli.config import DataSource
from flatcli.errors import ConfigError
from flatcli.loading.checkpoints import (
    checkpoint_extras,
    extract_state_dict,
    load_checkpoint,
    read_checkpoint,
)
from flatcli.loading.data import apply_normalize, digits_split, load_split, subset
from flatcli.loading.factory import build_model


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


@pytest.mark.parametrize("nest", [None, "state_dict", "model", "model_state_dict"])
@pytest.mark.parametrize("prefix", ["", "module.", "_orig_mod.module."])
def test_state_dict_nesting_and_prefixes(tmp_path, nest, prefix):
    src = _model()
    sd = {prefix + k: v for k, v in src.state_dict().items()}
    obj = sd if nest is None else {nest: sd, "epoch": 3}
    torch.save(obj, tmp_path / "c.pt")
    dst = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    load_checkpoint(dst, tmp_path / "c.pt")
    for a, b in zip(src.parameters(), dst.parameters(), strict=True):
        assert torch.equal(a, b)


def test_safetensors(tmp_path):
    from safetensors.torch import save_file

    src = _model()
    save_file(src.state_dict(), str(tmp_path / "c.safetensors"))
    dst = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    load_checkpoint(dst, tmp_path / "c.safetensors")
    assert torch.equal(src[0].weight, dst[0].weight)


def test_full_pickle_refused_then_allowed(tmp_path):
    torch.save(_model(), tmp_path / "full.pt")
    with pytest.raises(
        ConfigError,
        match=r"full pickle that would import .*torch\.nn\.modules.*`allow_unsafe_pickle`",
    ):
        read_checkpoint(tmp_path / "full.pt")
    obj = read_checkpoint(tmp_path / "full.pt", allow_unsafe_pickle=True)
    assert isinstance(obj, nn.Module)
    sd = extract_state_dict(obj)
    assert "0.weight" in sd


def test_mismatch_lists_missing_unexpected_and_shapes(tmp_path):
    sd = _model().state_dict()
    sd["extra.weight"] = torch.zeros(1)
    del sd["2.bias"]
    sd["0.weight"] = torch.zeros(5, 4)
    torch.save(sd, tmp_path / "bad.pt")
    with pytest.raises(ConfigError) as e:
        load_checkpoint(_model(), tmp_path / "bad.pt")
    msg = str(e.value)
    assert "bad.pt does not match the model" in msg
    assert "missing keys: 2.bias" in msg and "unexpected keys: extra.weight" in msg
    assert "0.weight: checkpoint (5, 4) vs model (3, 4)" in msg


def test_missing_and_garbage_checkpoint(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint not found"):
        read_checkpoint(tmp_path / "none.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="junk.pt"):
        read_checkpoint(tmp_path / "junk.pt")


@pytest.mark.parametrize("allow", [False, True])
def test_random_bytes_are_not_a_checkpoint_and_never_unpickled(tmp_path, allow, monkeypatch):
    """A corrupt file is named as such; the unsafe flag is never suggested for it, and with the flag
    it is still not unpickled (torch.load(weights_only=False) is not called)."""
    (tmp_path / "corrupt.pt").write_bytes(np.random.default_rng(0).bytes(4096))
    real = torch.load

    def load(*a, weights_only=True, **k):
        assert weights_only, "a file that is not a torch.save file was unpickled"
        return real(*a, weights_only=weights_only, **k)

    monkeypatch.setattr(torch, "load", load)
    with pytest.raises(ConfigError) as e:
        read_checkpoint(tmp_path / "corrupt.pt", allow_unsafe_pickle=allow)
    msg = str(e.value)
    assert "corrupt.pt is not a readable checkpoint" in msg
    assert "--allow-unsafe-pickle" not in msg and "weights_only" not in msg


def test_a_directory_is_named_with_the_checkpoints_in_it(tmp_path):
    (tmp_path / "run").mkdir()
    with pytest.raises(
        ConfigError, match=r"run is a directory, not a checkpoint file; pass a checkpoint file"
    ):
        read_checkpoint(tmp_path / "run")
    for name in ("final.pt", "best.safetensors", "notes.txt"):
        (tmp_path / "run" / name).write_bytes(b"")
    with pytest.raises(
        ConfigError,
        match=r"is a directory, not a checkpoint file; it holds best.safetensors, final.pt: pass",
    ):
        read_checkpoint(tmp_path / "run")


def test_width_mismatch_hints_at_model_kwargs(tmp_path):
    torch.save(
        nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2)).state_dict(),
        tmp_path / "wide.pt",
    )
    with pytest.raises(
        ConfigError,
        match=r"shape mismatches: 0.weight: checkpoint \(5, 4\) vs model \(3, 4\).*"
        r"set them under model.kwargs or save them in the checkpoint as 'model_kwargs'",
    ):
        load_checkpoint(_model(), tmp_path / "wide.pt")


def test_unsafe_pickle_of_a_class_beside_the_config_loads_without_pythonpath(tmp_path, monkeypatch):
    """A full pickle of models.Net (trained by a script beside models.py) unpickles with
    --allow-unsafe-pickle when the config sits beside models.py, as model.target resolves it."""
    import sys

    from flatcli import api

    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "models.py").write_text(
        "from torch import nn\n"
        "class Net(nn.Sequential):\n"
        "    def __init__(self):\n"
        "        super().__init__(nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 10))\n"
    )
    sys.path.insert(0, str(proj))  # the user's training script, run from proj/
    try:
        import models

        torch.save(models.Net(), proj / "full.pt")
    finally:
        sys.path.remove(str(proj))
        del sys.modules["models"]
    monkeypatch.delitem(
        sys.modules, "models", raising=False
    )  # whatever loading imports is dropped after
    cfg = {
        "model": {"target": "models.py:Net"},
        "checkpoints": ["full.pt"],
        "data": {"train": {"source": "digits"}},
        "measure_data": {"num_samples": 32},
        "measures": ["frobenius_norm"],
        "runtime": {"device": "cpu"},
    }
    (proj / "config.yaml").write_text(__import__("yaml").safe_dump(cfg))
    monkeypatch.chdir(tmp_path)  # not the config's folder: nothing is importable by accident
    refused = api.measure(proj / "config.yaml")
    assert refused.rows[0].status == "error" and "models.Net" in refused.rows[0].error
    rep = api.measure(proj / "config.yaml", run=api.RunOptions(allow_unsafe_pickle=True))
    assert rep.rows[0].status == "ok", rep.rows[0].error
    assert str(proj) not in sys.path


def test_extras_carry_model_kwargs(tmp_path):
    torch.save(
        {"state_dict": _model().state_dict(), "model_kwargs": {"width": 3}, "hparams": {"lr": 0.1}},
        tmp_path / "c.pt",
    )
    ex = checkpoint_extras(read_checkpoint(tmp_path / "c.pt"))
    assert ex == {"model_kwargs": {"width": 3}, "hparams": {"lr": 0.1}}


def test_model_targets(tmp_path):
    m = build_model(
        "flatcli.demo.models:MLP", {"in_features": 4, "width": 3, "depth": 1, "num_classes": 2}
    )
    assert m.classifier.out_features == 2
    (tmp_path / "mymodels.py").write_text(
        "import torch\nclass Net(torch.nn.Linear):\n    def __init__(self, k=2):\n        super().__init__(3, k)\n"
    )
    m = build_model("mymodels.py:Net", {"k": 5}, base_dir=tmp_path)
    assert m.out_features == 5
    m = build_model("torchvision:resnet18", {"num_classes": 10})
    assert m.fc.out_features == 10
    with pytest.raises(
        ConfigError, match="torchvision has no model 'resnet19'; did you mean 'resnet18'"
    ):
        build_model("torchvision:resnet19")
    with pytest.raises(ConfigError, match="model.target: file not found"):
        build_model("nofile.py:Net", base_dir=tmp_path)
    with pytest.raises(ConfigError, match="model.kwargs do not fit"):
        build_model("flatcli.demo.models:MLP", {"nope": 1})
    with pytest.raises(ConfigError, match="must look like"):
        build_model("flatcli.demo.models.MLP")


def test_tensors_pt_and_npz(tmp_path):
    x = torch.randn(7, 3)
    y = torch.arange(7) % 2
    torch.save({"x": x, "y": y}, tmp_path / "d.pt")
    np.savez(tmp_path / "d.npz", x=x.numpy(), y=y.numpy())
    for name in ("d.pt", "d.npz"):
        b = load_split(DataSource(source="tensors", path=name), "train", tmp_path)
        xx, yy = b["x"], b["y"]
        assert torch.allclose(xx, x) and torch.equal(yy, y)
    torch.save({"inputs": x}, tmp_path / "e.pt")
    with pytest.raises(
        ConfigError,
        match=r"data.train.path: .*must hold 'x' and 'y', or named tensors such as input_ids, attention_mask, labels; found inputs",
    ):
        load_split(DataSource(source="tensors", path="e.pt"), "train", tmp_path)
    with pytest.raises(ConfigError, match="data.test.path: file not found"):
        load_split(DataSource(source="tensors", path="none.pt"), "test", tmp_path)


def _write_idx(path: Path, arr: np.ndarray):
    with open(path, "wb") as f:
        if arr.ndim == 3:
            f.write(struct.pack(">IIII", 2051, *arr.shape))
        else:
            f.write(struct.pack(">II", 2049, arr.shape[0]))
        f.write(arr.astype(np.uint8).tobytes())


def test_torchvision_mnist_layout(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    imgs = rng.integers(0, 256, (5, 28, 28))
    labels = np.array([0, 3, 9, 1, 3])
    for prefix in ("train", "t10k"):
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", imgs)
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)
    src = DataSource(
        source="torchvision", name="MNIST", root=str(tmp_path), kwargs={"train": False}
    )
    b = load_split(src, "test", tmp_path)
    x, y = b["x"], b["y"]
    assert x.shape == (5, 1, 28, 28) and x.dtype == torch.float32
    assert torch.allclose(x[:, 0] * 255, torch.tensor(imgs, dtype=torch.float32))
    assert y.tolist() == labels.tolist()
    with pytest.raises(ConfigError, match="never downloads"):
        load_split(
            DataSource(source="torchvision", name="MNIST", root=str(tmp_path / "empty")),
            "train",
            tmp_path,
        )
    with pytest.raises(ConfigError, match="torchvision.datasets has no data set 'MNISTT'"):
        load_split(DataSource(source="torchvision", name="MNISTT", root="x"), "train", tmp_path)


def test_imagefolder(tmp_path):
    from PIL import Image

    for cls, val in (("cat", 10), ("dog", 200)):
        (tmp_path / "img" / cls).mkdir(parents=True)
        for i in range(2):
            Image.fromarray(np.full((4, 4, 3), val + i, dtype=np.uint8)).save(
                tmp_path / "img" / cls / f"{i}.png"
            )
    b = load_split(DataSource(source="imagefolder", path="img"), "train", tmp_path)
    x, y = b["x"], b["y"]
    assert x.shape == (4, 3, 4, 4) and y.tolist() == [0, 0, 1, 1]
    assert abs(float(x[0, 0, 0, 0]) - 10 / 255) < 1e-6


def test_digits_split_fixed_and_disjoint():
    xtr, ytr = digits_split("train")
    xte, yte = digits_split("test")
    assert len(xtr) + len(xte) == 1797 and abs(len(xte) - 0.3 * 1797) < 1
    assert float(xtr.max()) <= 1.0
    xtr2, _ = digits_split("train")
    assert torch.equal(xtr, xtr2)


def test_synthetic_seeded_and_normalize(tmp_path):
    s = DataSource(source="synthetic", num_samples=10, input_shape=[2, 3], num_classes=4, seed=1)
    a = load_split(s, "train", tmp_path)
    b = load_split(s, "train", tmp_path)
    assert torch.equal(a["x"], b["x"]) and a["x"].shape == (10, 2, 3) and int(a["y"].max()) < 4
    x = torch.ones(3, 2, 4, 4)
    z = apply_normalize(x, {"mean": [1.0, 0.0], "std": [1.0, 2.0]})
    assert torch.allclose(z[:, 0], torch.zeros(3, 4, 4)) and torch.allclose(
        z[:, 1], torch.full((3, 4, 4), 0.5)
    )
    with pytest.raises(ConfigError, match="data.normalize has 3 entries"):
        apply_normalize(x, {"mean": [0, 0, 0], "std": [1, 1, 1]})


def test_subset_seeded_sorted():
    x = torch.arange(20).float()[:, None]
    y = torch.arange(20)
    a = subset((x, y), 5, seed=3)["y"]
    b = subset((x, y), 5, seed=3)["y"]
    assert torch.equal(a, b) and a.tolist() == sorted(a.tolist()) and len(a) == 5
    assert subset((x, y), "all", 0).rows == 20
