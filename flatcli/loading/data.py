"""Data sets as in-memory tensors ``(x, y)``.

Sources (config ``data.train`` / ``data.test``):

* ``tensors``: ``path`` to a ``.pt`` file holding a dict with ``x`` and ``y``
  (read with ``weights_only=True``) or an ``.npz`` with arrays ``x`` and ``y``.
* ``torchvision``: ``name`` of a ``torchvision.datasets`` class, ``root``,
  ``kwargs`` (e.g. ``{train: false}``); never downloads unless ``download: true``.
  Images become float tensors in [0, 1] (``ToTensor``).
* ``imagefolder``: ``path`` to a ``class_x/xxx.png`` tree (all images one size).
* ``digits``: scikit-learn's bundled 8×8 digits (1,797 images, 64 features
  scaled to [0, 1]), split once into a fixed stratified train/test split
  (70/30, ``random_state=0``); ``split`` defaults to the key it sits under.
* ``synthetic``: ``num_samples`` Gaussian inputs of ``input_shape`` with labels
  from a fixed random linear teacher over ``num_classes`` classes, seeded.

``data.normalize: {mean: [...], std: [...]}`` is applied per channel (inputs of
shape (N, C, ...)) or per feature / globally for flat inputs.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError

DIGITS_TEST_FRACTION = 0.3


def _to_tensor_pair(x, y, where: str):
    x = torch.as_tensor(np.asarray(x)) if not isinstance(x, torch.Tensor) else x
    y = torch.as_tensor(np.asarray(y)) if not isinstance(y, torch.Tensor) else y
    if len(x) != len(y):
        raise ConfigError(f"{where}: x has {len(x)} samples but y has {len(y)}")
    if x.is_floating_point():
        x = x.float()
    elif x.dtype == torch.uint8:
        x = x.float() / 255.0
    else:
        x = x.float()
    if not y.is_floating_point():
        y = y.long()
    return x, y


def _load_tensors(path: Path, where: str):
    if not path.is_file():
        raise ConfigError(f"{where}.path: file not found: {path}")
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as z:
            if "x" not in z or "y" not in z:
                raise ConfigError(f"{where}.path: {path} must hold arrays 'x' and 'y'; found {', '.join(z.files)}")
            return _to_tensor_pair(z["x"], z["y"], where)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ConfigError(f"{where}.path: {path} is not a tensor file readable with weights_only=True ({e})") from None
    if isinstance(obj, (tuple, list)) and len(obj) == 2:
        return _to_tensor_pair(obj[0], obj[1], where)
    if not isinstance(obj, dict) or "x" not in obj or "y" not in obj:
        keys = ", ".join(map(str, obj.keys())) if isinstance(obj, dict) else type(obj).__name__
        raise ConfigError(f"{where}.path: {path} must hold a dict with 'x' and 'y'; found {keys}")
    return _to_tensor_pair(obj["x"], obj["y"], where)


def _stack_dataset(ds, where: str):
    xs, ys = [], []
    loader = torch.utils.data.DataLoader(ds, batch_size=1024, shuffle=False, num_workers=0)
    try:
        for xb, yb in loader:
            xs.append(xb)
            ys.append(torch.as_tensor(yb))
    except RuntimeError as e:
        raise ConfigError(f"{where}: samples cannot be stacked (images of different sizes?): {e}") from None
    if not xs:
        raise ConfigError(f"{where}: the data set is empty")
    return _to_tensor_pair(torch.cat(xs), torch.cat(ys), where)


def _load_torchvision(src, base_dir: Path, where: str):
    import torchvision
    from torchvision import transforms

    if not src.name or not hasattr(torchvision.datasets, src.name):
        raise ConfigError(f"{where}.name: torchvision.datasets has no data set {src.name!r}")
    if not src.root:
        raise ConfigError(f"{where}.root is required for source torchvision")
    root = Path(os.path.expanduser(src.root))
    root = root if root.is_absolute() else base_dir / root
    cls = getattr(torchvision.datasets, src.name)
    try:
        ds = cls(root=str(root), download=bool(src.download), transform=transforms.ToTensor(), **(src.kwargs or {}))
    except RuntimeError as e:  # "Dataset not found or corrupted. You can use download=True..."
        raise ConfigError(
            f"{where}: {src.name} not found under {root} ({e}); flatcli never downloads unless 'download: true'"
        ) from None
    except TypeError as e:
        raise ConfigError(f"{where}.kwargs do not fit torchvision.datasets.{src.name}: {e}") from None
    return _stack_dataset(ds, where)


def _load_imagefolder(src, base_dir: Path, where: str):
    from torchvision import datasets, transforms

    if not src.path:
        raise ConfigError(f"{where}.path is required for source imagefolder")
    root = Path(os.path.expanduser(src.path))
    root = root if root.is_absolute() else base_dir / root
    if not root.is_dir():
        raise ConfigError(f"{where}.path: folder not found: {root}")
    try:
        ds = datasets.ImageFolder(str(root), transform=transforms.ToTensor(), **(src.kwargs or {}))
    except (FileNotFoundError, RuntimeError) as e:
        raise ConfigError(f"{where}.path: {root}: {e}") from None
    return _stack_dataset(ds, where)


def digits_split(split: str):
    """scikit-learn's digits with flatcli's fixed stratified 70/30 split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = d.data.astype(np.float32) / 16.0
    y = d.target.astype(np.int64)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=DIGITS_TEST_FRACTION, random_state=0, stratify=y)
    if split == "train":
        return torch.from_numpy(xtr), torch.from_numpy(ytr)
    if split == "test":
        return torch.from_numpy(xte), torch.from_numpy(yte)
    raise ConfigError(f"digits split must be 'train' or 'test'; got {split!r}")


def synthetic(num_samples: int = 512, input_shape=(64,), num_classes: int = 10, seed: int = 0):
    """Seeded Gaussian inputs of ``input_shape`` with uniform random labels (tests and smoke runs)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, *input_shape, generator=g)
    teacher = torch.Generator().manual_seed(12345)  # one teacher for every split
    d = int(np.prod(input_shape))
    w = torch.randn(d, num_classes, generator=teacher)
    y = (x.reshape(num_samples, -1) @ w).argmax(1)
    return x, y


def load_split(src, key: str, base_dir: Path, normalize=None):
    """Load the split configured as ``data.<key>``; returns (x, y) tensors on CPU."""
    where = f"data.{key}"
    base_dir = Path(base_dir)
    kind = src.source
    if kind == "tensors":
        if not src.path:
            raise ConfigError(f"{where}.path is required for source tensors")
        p = Path(os.path.expanduser(src.path))
        x, y = _load_tensors(p if p.is_absolute() else base_dir / p, where)
    elif kind == "torchvision":
        x, y = _load_torchvision(src, base_dir, where)
    elif kind == "imagefolder":
        x, y = _load_imagefolder(src, base_dir, where)
    elif kind == "digits":
        x, y = digits_split(src.split or key)
    elif kind == "synthetic":
        x, y = synthetic(
            src.num_samples or 512,
            tuple(src.input_shape or [64]),
            src.num_classes or 10,
            src.seed + (0 if key == "train" else 1),
        )
    else:  # validated earlier
        raise ConfigError(f"{where}.source: unknown source {kind!r}")
    if normalize:
        x = apply_normalize(x, normalize)
    return x, y


def apply_normalize(x: torch.Tensor, normalize: dict) -> torch.Tensor:
    """``(x - mean) / std`` per channel (``data.normalize``); a `ConfigError` for malformed keys."""
    try:
        mean = torch.as_tensor(normalize["mean"], dtype=x.dtype)
        std = torch.as_tensor(normalize["std"], dtype=x.dtype)
    except KeyError as e:
        raise ConfigError(f"data.normalize needs 'mean' and 'std'; missing {e}") from None
    if mean.numel() != std.numel():
        raise ConfigError("data.normalize: 'mean' and 'std' differ in length")
    if mean.numel() == 1:
        return (x - mean) / std
    if x.ndim >= 2 and x.shape[1] == mean.numel():
        shape = [1, -1] + [1] * (x.ndim - 2)
        return (x - mean.view(shape)) / std.view(shape)
    raise ConfigError(f"data.normalize has {mean.numel()} entries but inputs have shape {tuple(x.shape[1:])}")


def subset(x: torch.Tensor, y: torch.Tensor, num_samples, seed: int):
    """A seeded random subset of ``num_samples`` (or everything for 'all'), in a fixed order."""
    n = len(x)
    if num_samples == "all" or num_samples is None or num_samples >= n:
        return x, y
    g = torch.Generator().manual_seed(int(seed))
    idx = torch.randperm(n, generator=g)[: int(num_samples)].sort().values
    return x[idx], y[idx]
