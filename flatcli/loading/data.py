"""Data sets as in-memory batches of named tensors (`flatcli.engine.batch.Batch`).

Sources (config ``data.train`` / ``data.test``):

* ``tensors``: ``path`` to a ``.pt`` file (read with ``weights_only=True``) or an
  ``.npz``, holding ``x`` and ``y`` (images or features and class labels, as always),
  or any named tensors with a common first dimension: ``input_ids``,
  ``attention_mask``, ``token_type_ids``, ``pixel_values``, ``labels``... (``x`` goes
  to the model positionally, ``y``/``labels`` is the target, every other key is passed
  by keyword; see `flatcli.engine.batch`). A ``(x, y)`` pair also works.
* ``torchvision``: ``name`` of a ``torchvision.datasets`` class, ``root``,
  ``kwargs`` (e.g. ``{train: false}``); never downloads unless ``download: true``.
  Images become float tensors in [0, 1] (``ToTensor``).
* ``imagefolder``: ``path`` to a ``class_x/xxx.png`` tree (all images one size).
* ``digits``: scikit-learn's bundled 8×8 digits (1,797 images, 64 features
  scaled to [0, 1]), split once into a fixed stratified train/test split
  (70/30, ``random_state=0``); ``split`` defaults to the key it sits under.
* ``synthetic``: ``num_samples`` Gaussian inputs of ``input_shape`` with labels
  from a fixed random linear teacher over ``num_classes`` classes, seeded.
* ``text``: a local JSON-lines, CSV or Parquet file of texts tokenized by a local tokenizer
  directory (`flatcli.loading.text`; needs ``pip install 'flatcli[transformers]'``), giving
  ``input_ids``, ``attention_mask`` and, with ``label_field``, ``labels``.
* ``modular_addition``: every pair (a, b) of residues mod ``kwargs.p`` (default 97) as token ids
  ``x = (a, b, p)`` (int64, shape (N, 3); token p is ``=``) with ``labels = (a + b) mod p``
  (Power et al. 2022), generated in memory. A permutation of the p² pairs seeded by ``seed``
  (default 0) puts its first ``kwargs.test_fraction`` (default 0.3) in the test split and the
  next ``kwargs.train_fraction`` (default 0.5) in the train split (round(f_test · p²) and
  round((f_test + f_train) · p²) − round(f_test · p²) pairs), so the test split does not
  depend on the training fraction and, for one seed, smaller training sets are subsets of
  larger ones; ``split`` (train | test) defaults to the key it sits under; rows come in pair
  order. The token ids stay integers everywhere (no ``data.normalize``).
* ``mnist1d``: MNIST-1D (Greydanus 2020; ``pip install mnist1d``), generated
  procedurally and offline by ``mnist1d.data.make_dataset``: ``num_samples``
  signals in total (default 5000) of length 40 over 10 classes, ``seed``
  (default 0), any other generator parameter under ``kwargs`` (``train_split``,
  default 0.8, ``iid_noise_scale``, ``shuffle_seq``, ...); ``split`` (train |
  test) defaults to the key it sits under and picks a side of the generator's
  own split. Deterministic, cached in-process, and the global NumPy / ``random``
  states are left as they were.

Every source but ``tensors`` and ``modular_addition`` gives ``x`` and ``y``: ``digits`` gives x of shape (N, 64)
(the 8×8 images flattened, floats in [0, 1]) and y in 0..9; ``mnist1d`` x of shape (N, 40).

``data.normalize: {mean: [...], std: [...]}`` is applied to ``x`` (or ``pixel_values``)
per channel (inputs of shape (N, C, ...)) or per feature / globally for flat inputs.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import os
import random
import zipfile
from pathlib import Path

import numpy as np
import torch

from ..engine.batch import Batch
from ..errors import ConfigError
from .text import load_text

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


def _named(obj: dict, where: str, path: Path) -> Batch:
    """Named tensors from a file: ``x``/``y`` converted as always, every other array kept as is."""
    if "x" in obj and "y" in obj:
        x, y = _to_tensor_pair(obj["x"], obj["y"], where)
        rest = {k: v for k, v in obj.items() if k not in ("x", "y")}
        obj = {"x": x, "y": y, **rest}
    out = {}
    for k, v in obj.items():
        try:
            out[str(k)] = v if isinstance(v, torch.Tensor) else torch.as_tensor(np.asarray(v))
        except (TypeError, ValueError, RuntimeError):
            raise ConfigError(f"{where}.path: {path}: '{k}' is not an array of numbers") from None
    if (
        not any(k in out for k in ("x", "input_ids", "pixel_values", "inputs_embeds"))
        and len(out) < 2
    ):
        raise ConfigError(
            f"{where}.path: {path} must hold 'x' and 'y', or named tensors such as input_ids, "
            f"attention_mask, labels; found {', '.join(out) or 'nothing'}"
        )
    return Batch(out, where=f"{where}.path {path}")


def _load_tensors(path: Path, where: str) -> Batch:
    if path.is_dir():
        raise ConfigError(
            f"{where}.path: {path} is a directory; give a .pt or .npz file of named tensors"
        )
    if not path.is_file():
        raise ConfigError(f"{where}.path: file not found: {path}")
    if path.suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as z:
                return _named({k: z[k] for k in z.files}, where, path)
        except ValueError as e:  # an object array (pickled): never loaded
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(f"{where}.path: {path} cannot be read safely: {first}") from None
        except (OSError, EOFError, zipfile.BadZipFile) as e:
            raise ConfigError(f"{where}.path: {path} is not a readable .npz file ({e})") from None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ConfigError(
            f"{where}.path: {path} is not a tensor file readable with weights_only=True ({e})"
        ) from None
    if isinstance(obj, (tuple, list)) and len(obj) == 2:
        return Batch.of(_to_tensor_pair(obj[0], obj[1], where))
    if not isinstance(obj, dict):
        raise ConfigError(
            f"{where}.path: {path} must hold a dict of named tensors (x and y, or input_ids, "
            f"attention_mask, labels, ...) or an (x, y) pair; found {type(obj).__name__}"
        )
    return _named(obj, where, path)


def _stack_dataset(ds, where: str):
    xs, ys = [], []
    loader = torch.utils.data.DataLoader(ds, batch_size=1024, shuffle=False, num_workers=0)
    try:
        for xb, yb in loader:
            xs.append(xb)
            ys.append(torch.as_tensor(yb))
    except RuntimeError as e:
        raise ConfigError(
            f"{where}: samples cannot be stacked (images of different sizes?): {e}"
        ) from None
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
        ds = cls(
            root=str(root),
            download=bool(src.download),
            transform=transforms.ToTensor(),
            **(src.kwargs or {}),
        )
    except RuntimeError as e:  # "Dataset not found or corrupted. You can use download=True..."
        raise ConfigError(
            f"{where}: {src.name} not found under {root} ({e}); flatcli never downloads unless 'download: true'"
        ) from None
    except TypeError as e:
        raise ConfigError(
            f"{where}.kwargs do not fit torchvision.datasets.{src.name}: {e}"
        ) from None
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


DIGITS_SPLIT = Path(__file__).with_name("digits_split.txt")  # the split's row order, frozen


def digits_split(split: str):
    """scikit-learn's digits with flatcli's fixed stratified 70/30 split: the rows in the order
    ``train_test_split(test_size=0.3, random_state=0, stratify=y)`` gives them, kept in
    `DIGITS_SPLIT` (a test checks them against scikit-learn). The images are read from
    scikit-learn's bundled file without importing scikit-learn (~1 s of a process's start-up);
    where that file is not found, through ``sklearn.datasets.load_digits``."""
    if split not in ("train", "test"):
        raise ConfigError(f"digits split must be 'train' or 'test'. Got {split!r} instead.")
    x, y = _digits()
    rows = torch.as_tensor(_digits_rows()[split])
    return x[rows], y[rows]


@functools.cache
def _digits_rows() -> dict[str, list[int]]:
    out = {}
    for line in DIGITS_SPLIT.read_text().splitlines():
        if line and not line.startswith("#"):
            name, *rows = line.split()
            out[name] = [int(r) for r in rows]
    return out


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 digits: x (floats in [0, 1], shape (1797, 64)) and y, in scikit-learn's order."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(roots[0], "datasets", "data", "digits.csv.gz") if roots else None
    if path is not None and path.is_file():
        data = np.loadtxt(path, delimiter=",")  # what load_digits reads
        images, target = data[:, :-1], data[:, -1].astype(int)
    else:
        from sklearn.datasets import load_digits

        d = load_digits()
        images, target = d.data, d.target
    x = torch.from_numpy(images.astype(np.float32) / 16.0)
    return x, torch.from_numpy(target.astype(np.int64))


MNIST1D_DEFAULT_SAMPLES = 5000
# make_dataset's parameters that a config may set under ``kwargs`` (num_samples and seed have
# their own keys; the download URL is never used)
MNIST1D_KWARGS = (
    "train_split", "template_len", "padding", "scale_coeff", "max_translation", "corr_noise_scale",
    "iid_noise_scale", "shear_scale", "shuffle_seq", "final_seq_length",
)  # fmt: skip


def _frozen(v):
    return tuple(_frozen(i) for i in v) if isinstance(v, (list, tuple)) else v


@functools.lru_cache(maxsize=8)
def _mnist1d_arrays(num_samples: int, seed: int, items: tuple) -> dict[str, np.ndarray]:
    try:
        from mnist1d.data import get_dataset_args, make_dataset
        from mnist1d.utils import ObjectView
    except ImportError:
        raise ConfigError(
            "data source 'mnist1d' needs the mnist1d package: pip install 'flatcli[experiments]'"
        ) from None
    args = get_dataset_args(as_dict=True)
    args.update({k: list(v) if isinstance(v, tuple) else v for k, v in items})
    args.update(num_samples=num_samples, seed=seed)
    np_state, py_state = np.random.get_state(), random.getstate()
    try:  # make_dataset seeds NumPy's and Python's global generators: restore them afterwards
        d = make_dataset(ObjectView(args))
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)
    out = {k: np.ascontiguousarray(d[k]) for k in ("x", "y", "x_test", "y_test")}
    for a in out.values():
        a.setflags(write=False)
    return out


def mnist1d_split(
    split: str,
    num_samples: int | None = None,
    seed: int = 0,
    kwargs: dict | None = None,
    where: str = "data",
):
    """MNIST-1D generated offline (``mnist1d.data.make_dataset``); ``split`` is 'train' or 'test'.

    ``num_samples`` counts both splits together (default 5000, the generator's); ``kwargs``
    holds further generator parameters (`MNIST1D_KWARGS`). The same arguments always give
    the same tensors (cached per process)."""
    if split not in ("train", "test"):
        raise ConfigError(
            f"{where}.split: mnist1d split must be 'train' or 'test'. Got {split!r} instead."
        )
    n = MNIST1D_DEFAULT_SAMPLES if num_samples is None else num_samples
    if isinstance(n, bool) or not isinstance(n, int) or n < 20:
        raise ConfigError(
            f"{where}.num_samples: mnist1d needs an int ≥ 20 (two per class at least). Got {n!r} instead."
        )
    kwargs = dict(kwargs or {})
    for k in kwargs:
        if k not in MNIST1D_KWARGS:
            hint = difflib.get_close_matches(str(k), MNIST1D_KWARGS, n=1)
            raise ConfigError(
                f"{where}.kwargs: mnist1d has no parameter {k!r}."
                + (
                    f" Did you mean {hint[0]!r}?"
                    if hint
                    else f" Valid: {', '.join(MNIST1D_KWARGS)}."
                )
            )
    frac = kwargs.get("train_split", 0.8)
    if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 < frac < 1:
        raise ConfigError(
            f"{where}.kwargs.train_split must be a float in (0, 1). Got {frac!r} instead."
        )
    per_class = n // 10
    n_train = int(per_class * 10 * frac)
    if n_train < 1 or n_train >= per_class * 10:
        raise ConfigError(
            f"{where}: num_samples {n} with train_split {frac} leaves an empty split ({n_train} of {per_class * 10} for training)"
        )
    try:
        d = _mnist1d_arrays(
            int(n), int(seed), tuple(sorted((k, _frozen(v)) for k, v in kwargs.items()))
        )
    except ConfigError:
        raise
    except Exception as e:  # a generator parameter of the wrong type or range
        raise ConfigError(
            f"{where}: mnist1d could not generate the data with these parameters: {type(e).__name__}: {e}"
        ) from None
    x, y = (d["x"], d["y"]) if split == "train" else (d["x_test"], d["y_test"])
    return _to_tensor_pair(torch.tensor(x), torch.tensor(y), where)


MODULAR_KWARGS = {"p": 97, "train_fraction": 0.5, "test_fraction": 0.3}


def modular_addition_split(
    split: str, kwargs: dict | None = None, seed: int = 0, where: str = "data"
) -> Batch:
    """The ``split`` ('train' or 'test') of a + b mod p: ``x`` (N, 3) int64 token ids (a, b, p) and
    ``labels`` (N,) int64; ``kwargs``: ``p``, ``train_fraction``, ``test_fraction`` (`MODULAR_KWARGS`)."""
    if split not in ("train", "test"):
        raise ConfigError(
            f"{where}.split: modular_addition split must be 'train' or 'test'. Got {split!r} instead."
        )
    for k in kwargs or {}:
        if k not in MODULAR_KWARGS:
            hint = difflib.get_close_matches(str(k), list(MODULAR_KWARGS), n=1)
            raise ConfigError(
                f"{where}.kwargs: modular_addition has no parameter {k!r}."
                + (
                    f" Did you mean {hint[0]!r}?"
                    if hint
                    else f" Valid: {', '.join(MODULAR_KWARGS)}."
                )
            )
    a = {**MODULAR_KWARGS, **(kwargs or {})}
    p, ftr, fte = a["p"], a["train_fraction"], a["test_fraction"]
    if isinstance(p, bool) or not isinstance(p, int) or p < 2:
        raise ConfigError(f"{where}.kwargs.p must be an int ≥ 2. Got {p!r} instead.")
    for k, f in (("train_fraction", ftr), ("test_fraction", fte)):
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f < 1:
            raise ConfigError(
                f"{where}.kwargs.{k} must be a fraction in (0, 1). Got {f!r} instead."
            )
    n_test = round(fte * p * p)
    n_train = (
        round((fte + ftr) * p * p) - n_test
    )  # rounded cumulatively: fractions summing to 1 take every pair
    if fte + ftr > 1 + 1e-9 or min(n_test, n_train) < 1:
        raise ConfigError(
            f"{where}.kwargs: train_fraction {ftr} + test_fraction {fte} of the {p * p} pairs must "
            "be ≤ 1 and leave each split at least one pair"
        )
    perm = torch.randperm(p * p, generator=torch.Generator().manual_seed(int(seed)))
    pairs = (perm[:n_test] if split == "test" else perm[n_test : n_test + n_train]).sort().values
    x = torch.stack([pairs // p, pairs % p, torch.full_like(pairs, p)], 1)
    return Batch({"x": x, "labels": (x[:, 0] + x[:, 1]) % p}, where=where)


def synthetic(num_samples: int = 512, input_shape=(64,), num_classes: int = 10, seed: int = 0):
    """Seeded Gaussian inputs of ``input_shape`` with uniform random labels (tests and smoke runs)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, *input_shape, generator=g)
    teacher = torch.Generator().manual_seed(12345)  # one teacher for every split
    d = int(np.prod(input_shape))
    w = torch.randn(d, num_classes, generator=teacher)
    y = (x.reshape(num_samples, -1) @ w).argmax(1)
    return x, y


def load_split(
    src, key: str, base_dir: Path, normalize=None, cache_dir: Path | None = None
) -> Batch:
    """Load the split configured as ``data.<key>``: a `Batch` of named tensors on the CPU
    (``cache_dir``: where the ``text`` source keeps its tokenized tensors)."""
    where = f"data.{key}"
    base_dir = Path(base_dir)
    kind = src.source
    if kind == "text":
        return check_finite_data(load_text(src, where, base_dir, cache_dir), where)
    if kind == "modular_addition":
        if normalize:
            raise ConfigError(
                f"{where}: modular_addition gives token ids; data.normalize does not apply"
            )
        return modular_addition_split(src.split or key, src.kwargs, src.seed, where)
    if kind == "tensors":
        if not src.path:
            raise ConfigError(f"{where}.path is required for source tensors")
        p = Path(os.path.expanduser(src.path))
        p = p if p.is_absolute() else base_dir / p
        batch = check_finite_data(_load_tensors(p, where), f"{where} ({p})")
        return _normalized_finite(batch, normalize, where) if normalize else batch
    if kind == "torchvision":
        x, y = _load_torchvision(src, base_dir, where)
    elif kind == "imagefolder":
        x, y = _load_imagefolder(src, base_dir, where)
    elif kind == "digits":
        x, y = digits_split(src.split or key)
    elif kind == "mnist1d":
        x, y = mnist1d_split(src.split or key, src.num_samples, src.seed, src.kwargs, where)
    elif kind == "synthetic":
        x, y = synthetic(
            src.num_samples or 512,
            tuple(src.input_shape or [64]),
            src.num_classes or 10,
            src.seed + (0 if key == "train" else 1),
        )
    else:  # validated earlier
        raise ConfigError(f"{where}.source: unknown source {kind!r}")
    batch = check_finite_data(Batch({"x": x, "y": y}, where=where), where)
    return _normalized_finite(batch, normalize, where) if normalize else batch


def check_finite_data(batch: Batch, where: str) -> Batch:
    """``batch`` when every floating tensor in it is finite; else a `ConfigError` naming ``where``
    (the split, and the file when there is one), the tensor and its first row holding NaN or inf."""
    for name, t in batch.items():
        if not t.is_floating_point() or t.numel() == 0:
            continue
        bad = ~torch.isfinite(t.reshape(len(t), -1)).all(1)
        if not bool(bad.any()):
            continue
        rows = bad.nonzero().flatten()
        first = int(rows[0])
        cells = t[first].reshape(-1)
        value = float(cells[~torch.isfinite(cells)][0])
        raise ConfigError(
            f"{where}: '{name}' holds {value} at row {first} "
            f"({len(rows)} of {len(t)} rows hold NaN/inf); fix or drop those rows"
        )
    return batch


def _normalized_finite(batch: Batch, normalize: dict, where: str) -> Batch:
    """`normalized`, checked again (a zero ``std`` makes inf or NaN)."""
    return check_finite_data(normalized(batch, normalize), f"{where} after data.normalize")


def normalized(batch: Batch, normalize: dict) -> Batch:
    """``data.normalize`` applied to the batch's ``x`` (else ``pixel_values``)."""
    key = "x" if "x" in batch else ("pixel_values" if "pixel_values" in batch else None)
    if key is None:
        raise ConfigError(
            "data.normalize needs inputs named 'x' or 'pixel_values'; the data has "
            + ", ".join(batch)
        )
    return batch.replace(**{key: apply_normalize(batch[key], normalize)})


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
    raise ConfigError(
        f"data.normalize has {mean.numel()} entries but inputs have shape {tuple(x.shape[1:])}"
    )


def subset(data, num_samples, seed: int) -> Batch:
    """A seeded random subset of ``num_samples`` rows of ``data`` (a `Batch` or an (x, y) pair;
    everything for 'all'), in the data's order."""
    batch = Batch.of(data)
    n = batch.rows
    if num_samples == "all" or num_samples is None or num_samples >= n:
        return batch
    g = torch.Generator().manual_seed(int(seed))
    idx = torch.randperm(n, generator=g)[: int(num_samples)].sort().values
    return batch.select(idx)
