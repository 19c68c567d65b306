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
  mismatches, naming the file.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError

NEST_KEYS = ("state_dict", "model_state_dict", "model", "net")
PREFIXES = ("module.", "_orig_mod.")


def fingerprint(path: str | os.PathLike) -> str:
    """sha256 of the file's bytes (first 16 hex digits): the checkpoint's identity in sweeps. For a
    ``save_pretrained`` directory: of the names and bytes of its ``config.json`` and safetensors
    files (optimizer states and other files a trainer leaves beside them are not read)."""
    p = Path(path)
    h = hashlib.sha256()
    files = [p]
    if p.is_dir():
        files = sorted(q for q in p.iterdir() if q.is_file() and (q.name == "config.json" or ".safetensors" in q.name))
        if not files:
            raise FileNotFoundError(f"{p} holds no config.json or safetensors file")
    for q in files:
        if q is not p:
            h.update(q.name.encode() + b"\0")
        with open(q, "rb") as f:
            for chunk in iter(lambda f=f: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def read_checkpoint(path: str | os.PathLike, allow_unsafe_pickle: bool = False) -> Any:
    """The raw object stored in a checkpoint file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"checkpoint not found: {p}")
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(p))
        except Exception as e:
            raise ConfigError(f"checkpoint {p}: not a readable safetensors file ({e})") from e
    try:
        return torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle.UnpicklingError and friends
        if allow_unsafe_pickle:
            try:
                return torch.load(p, map_location="cpu", weights_only=False)
            except Exception as e2:
                raise ConfigError(f"checkpoint {p}: cannot be read even as a full pickle ({e2})") from e2
        needed = []
        try:
            from torch.serialization import get_unsafe_globals_in_checkpoint

            needed = get_unsafe_globals_in_checkpoint(str(p))
        except Exception:
            pass
        if needed or "weights_only" in str(e) or "Unsupported global" in str(e):
            names = ", ".join(needed[:8]) + (" ..." if len(needed) > 8 else "")
            raise ConfigError(
                f"checkpoint {p} is a full pickle that would import {names or 'arbitrary classes'}; "
                "save a state_dict instead, or pass --allow-unsafe-pickle if you trust this file"
            ) from None
        raise ConfigError(f"checkpoint {p}: not a readable torch checkpoint ({type(e).__name__}: {e})") from None


def extract_state_dict(obj: Any, path: str | os.PathLike = "<checkpoint>") -> dict[str, torch.Tensor]:
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
        raise ConfigError(f"checkpoint {path} holds no state_dict (looked at the top level and under {', '.join(NEST_KEYS)})")
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
        return {k: v for k, v in obj.items() if not isinstance(v, torch.Tensor) and k not in NEST_KEYS}
    return {}


def load_into(model: torch.nn.Module, sd: dict[str, torch.Tensor], path: str | os.PathLike = "<checkpoint>") -> None:
    """Load ``sd`` strictly, with an error that lists every mismatch."""
    own = model.state_dict()
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    shapes = [
        f"{k}: checkpoint {tuple(sd[k].shape)} vs model {tuple(own[k].shape)}"
        for k in own
        if k in sd and tuple(sd[k].shape) != tuple(own[k].shape)
    ]
    # num_batches_tracked is harmless when absent
    missing = [k for k in missing if not k.endswith("num_batches_tracked")]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append("missing keys: " + ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else ""))
        if unexpected:
            parts.append("unexpected keys: " + ", ".join(unexpected[:6]) + (" ..." if len(unexpected) > 6 else ""))
        if shapes:
            parts.append("shape mismatches: " + "; ".join(shapes[:6]) + (" ..." if len(shapes) > 6 else ""))
        raise ConfigError(f"checkpoint {path} does not match the model: " + "; ".join(parts))
    model.load_state_dict(sd, strict=False)


def load_checkpoint(model: torch.nn.Module, path: str | os.PathLike, allow_unsafe_pickle: bool = False) -> dict[str, Any]:
    """Load a checkpoint file into ``model``; return the extras stored beside the weights."""
    obj = read_checkpoint(path, allow_unsafe_pickle)
    sd = extract_state_dict(obj, path)
    load_into(model, sd, path)
    return checkpoint_extras(obj)
