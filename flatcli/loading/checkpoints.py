"""Checkpoint loading: state dicts (torch.save), safetensors, opt-in full pickles.

* ``torch.load(weights_only=True)`` always first. A file that holds a whole
  pickled module is refused with the list of classes it would need to import
  (``torch.serialization.get_unsafe_globals_in_checkpoint``) unless
  ``allow_unsafe_pickle`` is set.
* A state dict may be nested under ``state_dict``, ``model``,
  ``model_state_dict`` (or ``net``); ``module.`` (DataParallel) and
  ``_orig_mod.`` (torch.compile) prefixes are stripped.
* A dict checkpoint may carry ``model_kwargs`` (merged over ``model.kwargs``,
  so one config covers a sweep over widths) and ``hparams`` (read by
  ``hparams.from_keys``).
* A mismatch with the model lists missing and unexpected keys and shape
  mismatches, naming the file (shape mismatches with a hint about
  ``model_kwargs``).
* A file that is not a torch.save file (random bytes, truncated) is "not a
  readable checkpoint", never an invitation to ``--allow-unsafe-pickle``;
  a directory is named as one, with the checkpoint-like files in it.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any

import torch

from ..engine.problem import nonfinite_tensors, not_finite
from ..errors import ConfigError
from .factory import importable

NEST_KEYS = ("state_dict", "model_state_dict", "model", "net")
PREFIXES = ("module.", "_orig_mod.")


PRETRAINED_READS = ("config.json", "generation_config.json")  # besides safetensors and code


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The files loading a checkpoint reads: the file itself; for a ``save_pretrained`` directory
    its ``config.json``, ``generation_config.json``, safetensors files (and their index) and
    Python files (the model code ``trust_remote_code`` runs). Optimizer states and other files a
    trainer leaves beside them are not read; a tokenizer there is keyed as data
    (`flatcli.keys.data_fingerprints`)."""
    p = Path(path)
    if not p.is_dir():
        return [p]
    files = sorted(
        q
        for q in p.iterdir()
        if q.is_file()
        and (q.name in PRETRAINED_READS or ".safetensors" in q.name or q.suffix == ".py")
    )
    if not files:
        raise FileNotFoundError(f"{p} holds no config.json or safetensors file")
    return files


def fingerprint(path: str | os.PathLike) -> str:
    """sha256 of the file's bytes (first 16 hex digits): the checkpoint's identity in sweeps. For a
    ``save_pretrained`` directory: of the names and bytes of the files loading reads
    (`checkpoint_files`)."""
    p = Path(path)
    h = hashlib.sha256()
    files = checkpoint_files(p)
    for q in files:
        if q is not p:
            h.update(q.name.encode() + b"\0")
        with open(q, "rb") as f:
            for chunk in iter(lambda f=f: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def natural_key(path: str | Path) -> list:
    """Sort key that orders digit runs by value: ``epoch_2`` before ``epoch_10``, ``bs16``, ``bs64``,
    ``bs256`` (digit runs and the text between them alternate, so the keys always compare)."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", str(path))]


CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".safetensors", ".pkl", ".tar")


def missing_checkpoint(path: str | os.PathLike, where: str = "") -> ConfigError:
    """The error for a checkpoint path that is not a file (``where`` prefixes it, e.g. "--pca: "): a
    directory, naming the checkpoint-like files in it if any, or not found."""
    p = Path(path)
    if not p.is_dir():
        return ConfigError(f"{where}checkpoint not found: {p}")
    found = sorted(
        (q.name for q in p.iterdir() if q.is_file() and q.suffix in CHECKPOINT_SUFFIXES),
        key=natural_key,
    )
    inside = (
        f"; it holds {', '.join(found[:5])}{' ...' if len(found) > 5 else ''}: pass one of them"
        if found
        else "; pass a checkpoint file (a torch.save file or .safetensors)"
    )
    return ConfigError(f"{where}checkpoint {p} is a directory, not a checkpoint file{inside}")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# pickle opcodes that import or call something: none may appear in the header of a pre-zip file
_CODE_OPS = {
    "GLOBAL", "STACK_GLOBAL", "REDUCE", "INST", "OBJ", "NEWOBJ", "NEWOBJ_EX", "BUILD",
    "EXT1", "EXT2", "EXT4", "PERSID", "BINPERSID",
}  # fmt: skip


def _plain_pickle(f) -> list | None:
    """The (opcode name, argument) pairs of the next pickle in ``f``, read without running it;
    None when it is not a pickle or holds an opcode that imports or calls (`_CODE_OPS`)."""
    import pickletools

    try:
        ops = [(op.name, arg) for op, arg, _ in pickletools.genops(f)]  # stops at STOP
    except Exception:
        return None
    return None if any(name in _CODE_OPS for name, _ in ops) else ops


def _legacy_torch_file(p: Path) -> bool:
    """Whether ``p`` is a pre-zip torch.save file, checked without unpickling anything: torch's
    magic number, its protocol version and the system-info dict, each a pickle of plain data (a
    pickle that merely starts with the magic number, then imports or calls, is not: torch would
    unpickle its second part while reading the header)."""
    from torch.serialization import MAGIC_NUMBER, PROTOCOL_VERSION

    try:
        with open(p, "rb") as f:
            magic, version, info = _plain_pickle(f), _plain_pickle(f), _plain_pickle(f)
    except OSError:
        return False
    if magic is None or version is None or info is None:
        return False
    return any(a == MAGIC_NUMBER for _, a in magic) and any(
        a == PROTOCOL_VERSION for _, a in version
    )


def pickle_globals(p: Path) -> list[str] | None:
    """The classes a torch.save file would import when unpickled fully ([] for a plain state dict,
    or a pre-zip file, whose classes are not listed); None when ``p`` is not a torch.save file at
    all (random bytes, a truncated or foreign file): such a file must never be unpickled."""
    from torch.serialization import get_unsafe_globals_in_checkpoint

    try:
        return list(get_unsafe_globals_in_checkpoint(str(p)))
    except Exception:
        return [] if _legacy_torch_file(p) else None


def read_checkpoint(
    path: str | os.PathLike, allow_unsafe_pickle: bool = False, import_dirs=()
) -> Any:
    """The raw object stored in a checkpoint file.

    ``torch.load(weights_only=True)`` first. A file that is not a torch.save file (or safetensors)
    is "not a readable checkpoint", whatever ``allow_unsafe_pickle`` says. A full pickle is refused
    with the classes it would import, unless ``allow_unsafe_pickle``: it is then unpickled with
    ``import_dirs`` (`flatcli.loading.factory.import_dirs`) importable, so that its classes resolve
    the way ``model.target`` does."""
    p = Path(path)
    if not p.is_file():
        raise missing_checkpoint(p)
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(p))
        except Exception as e:
            raise ConfigError(f"checkpoint {p}: not a readable safetensors file ({e})") from e
    try:
        return torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle.UnpicklingError and friends
        return _read_refused(p, e, allow_unsafe_pickle, import_dirs)


def _read_refused(p: Path, e: Exception, allow_unsafe_pickle: bool, import_dirs) -> Any:
    """A file ``torch.load(weights_only=True)`` refused: unpickle it fully when allowed and it is a
    torch.save file, else the error that says which of the two it is."""
    needed = pickle_globals(p)
    if needed is None:
        raise ConfigError(
            f"checkpoint {p} is not a readable checkpoint: neither a torch.save file nor "
            "safetensors (truncated, corrupt, or another format)"
        ) from None
    if allow_unsafe_pickle:
        try:
            with importable(list(import_dirs)):
                return torch.load(p, map_location="cpu", weights_only=False)
        except ModuleNotFoundError as e2:
            raise ConfigError(
                f"checkpoint {p}: unpickling it needs the module {e2.name!r}, which is not importable from the "
                f"config's folder, the model.target file's folder or PYTHONPATH"
            ) from None
        except Exception as e2:
            raise ConfigError(
                f"checkpoint {p}: cannot be read even as a full pickle ({_first_line(e2)})"
            ) from e2
    if needed:
        names = ", ".join(needed[:8]) + (" ..." if len(needed) > 8 else "")
        raise ConfigError(
            f"checkpoint {p} is a full pickle that would import {names}; "
            "save a state_dict instead, or pass `allow_unsafe_pickle` if you trust this file"
        ) from None
    raise ConfigError(
        f"checkpoint {p}: not a readable torch checkpoint ({type(e).__name__}: {_first_line(e)})"
    ) from None


def extract_state_dict(
    obj: Any, path: str | os.PathLike = "<checkpoint>"
) -> dict[str, torch.Tensor]:
    """The state dict inside a loaded checkpoint (top level or nested under a usual key; prefixes
    ``module.``/``_orig_mod.`` stripped); a `ConfigError` naming ``path`` when there is none."""
    if isinstance(obj, torch.nn.Module):
        obj = obj.state_dict()
    if isinstance(obj, dict):
        for k in NEST_KEYS:
            if k in obj and isinstance(obj[k], (dict, torch.nn.Module)):
                inner = obj[k]
                obj = inner.state_dict() if isinstance(inner, torch.nn.Module) else inner
                break
    if not isinstance(obj, dict) or not any(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ConfigError(
            f"checkpoint {path} holds no state_dict (looked at the top level and under {', '.join(NEST_KEYS)})"
        )
    sd = {}
    for k, v in obj.items():
        if not isinstance(v, torch.Tensor):
            continue
        key = k
        changed = True
        while changed:
            changed = False
            for pre in PREFIXES:
                if key.startswith(pre):
                    key = key[len(pre) :]
                    changed = True
        sd[key] = v
    return sd


def checkpoint_extras(obj: Any) -> dict[str, Any]:
    """Non-tensor entries stored beside the state dict (e.g. an ``hparams`` dict)."""
    if isinstance(obj, dict):
        return {
            k: v for k, v in obj.items() if not isinstance(v, torch.Tensor) and k not in NEST_KEYS
        }
    return {}


def state_mismatch(
    state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]
) -> tuple[list, list, list]:
    """(names missing from ``state``, names not in ``ref``, ``(name, shape, ref shape)`` of
    tensors whose shapes differ): the one comparison of two state dicts that loading a
    checkpoint and the landscape views' "same architecture" checks share."""
    missing = [k for k in ref if k not in state]
    extra = [k for k in state if k not in ref]
    shapes = [
        (k, tuple(state[k].shape), tuple(ref[k].shape))
        for k in ref
        if k in state and tuple(state[k].shape) != tuple(ref[k].shape)
    ]
    return missing, extra, shapes


def load_into(
    model: torch.nn.Module, sd: dict[str, torch.Tensor], path: str | os.PathLike = "<checkpoint>"
) -> None:
    """Load ``sd`` strictly, with an error that lists every mismatch."""
    missing, unexpected, mismatched = state_mismatch(sd, model.state_dict())
    shapes = [f"{k}: checkpoint {a} vs model {b}" for k, a, b in mismatched]
    # num_batches_tracked is harmless when absent
    missing = [k for k in missing if not k.endswith("num_batches_tracked")]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(
                "missing keys: " + ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else "")
            )
        if unexpected:
            parts.append(
                "unexpected keys: "
                + ", ".join(unexpected[:6])
                + (" ..." if len(unexpected) > 6 else "")
            )
        if shapes:
            parts.append(
                "shape mismatches: " + "; ".join(shapes[:6]) + (" ..." if len(shapes) > 6 else "")
            )
        hint = (
            (
                "; if it was built with other model arguments (e.g. a width), set them under model.kwargs or "
                "save them in the checkpoint as 'model_kwargs' beside its 'state_dict'"
            )
            if shapes
            else ""
        )
        raise ConfigError(f"checkpoint {path} does not match the model: " + "; ".join(parts) + hint)
    model.load_state_dict(sd, strict=False)


def check_state(
    state: dict[str, torch.Tensor],
    ref: dict[str, torch.Tensor],
    label: str,
    ref_label: str,
    context: str,
) -> None:
    """`ConfigError` naming the checkpoint and tensor unless ``state`` matches ``ref`` in names and
    shapes, and `MeasurementError` unless its floating-point tensors are finite. ``context`` names
    what compares them (``landscape pca``, ``landscape connect``) at the start of the message."""
    missing, extra, mismatched = state_mismatch(state, ref)
    if missing or extra or mismatched:
        parts = [f"{k} {a} vs {b}" for k, a, b in mismatched[:3]]
        if missing:
            parts.append(f"missing {', '.join(missing[:3])}")
        if extra:
            parts.append(f"not in {ref_label}: {', '.join(extra[:3])}")
        raise ConfigError(
            f"{context}: checkpoint {label} has a different architecture than {ref_label}: "
            + "; ".join(parts)
        )
    bad = nonfinite_tensors(state)
    if bad:
        raise not_finite(f"checkpoint {label}", None, bad)


def load_checkpoint(
    model: torch.nn.Module, path: str | os.PathLike, allow_unsafe_pickle: bool = False
) -> dict[str, Any]:
    """Load a checkpoint file into ``model``; return the extras stored beside the weights."""
    obj = read_checkpoint(path, allow_unsafe_pickle)
    sd = extract_state_dict(obj, path)
    load_into(model, sd, path)
    return checkpoint_extras(obj)
