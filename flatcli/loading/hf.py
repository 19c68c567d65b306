"""Hugging Face models and tokenizers, strictly offline (the optional ``transformers`` extra).

``model: {source: huggingface, class: AutoModelForCausalLM, kwargs: {...}}`` builds each
checkpoint with ``transformers.<class>.from_pretrained(<checkpoint directory>, **kwargs)``:
the directory is what ``save_pretrained`` writes (``config.json`` and ``model.safetensors``,
or a sharded ``model.safetensors.index.json``). Loading never reaches a hub:
``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE`` are set before ``transformers`` is imported and
every call passes ``local_files_only=True``; weights are read from safetensors only
(``use_safetensors=True``). ``transformers`` is imported only here, only when a config uses it.

Attention: reverse-over-reverse Hessian products need attention that has a double backward.
PyTorch's fused ``scaled_dot_product_attention`` kernels have none (on this CPU build:
``derivative for aten::_scaled_dot_product_flash_attention_for_cpu_backward is not
implemented``), so flatcli loads models with ``attn_implementation="eager"`` (the same
function, written with matmuls and softmax) unless ``model.kwargs.attn_implementation`` says
otherwise; the choice is recorded in results.json (``model.attn_implementation``).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

import torch

from ..console import DEBUG_ENV
from ..errors import ConfigError
from .factory import model_dtype

EXTRA_HINT = "pip install 'flatcli[transformers]'"
DEFAULT_ATTENTION = "eager"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def offline() -> None:
    """Forbid any hub access for this process (set before ``transformers`` is imported)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def transformers_module(what: str = "model.source: huggingface"):
    """The ``transformers`` module, imported offline; a one-line `ConfigError` naming the extra
    when it is not installed."""
    offline()
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"{what} needs the transformers package: {EXTRA_HINT}") from None
    transformers.logging.set_verbosity_error()

    if os.environ.get(DEBUG_ENV):
        transformers.logging.enable_progress_bar()
    else:  # no "Loading weights" bars in flatcli's logs (they show with --debug)
        transformers.logging.disable_progress_bar()
    return transformers


def model_class(name: str):
    """The ``transformers`` class named ``name`` (``AutoModelForCausalLM``, ``GPT2LMHeadModel``...)."""
    tf = transformers_module()
    if not name:
        raise ConfigError(
            "config key 'model.class' is required with model.source: huggingface "
            "(e.g. AutoModelForCausalLM, AutoModelForSequenceClassification)"
        )
    try:
        cls = getattr(tf, name)
    except (AttributeError, ImportError, RuntimeError):
        cls = None
    if cls is None or not hasattr(cls, "from_pretrained"):
        names = [n for n in dir(tf) if n.startswith(("AutoModel", name[:4]))]
        hint = difflib.get_close_matches(name, names, n=1)
        raise ConfigError(
            f"model.class: transformers has no model class {name!r}"
            + (f"; did you mean {hint[0]!r}?" if hint else "")
        )
    return cls


def check_directory(path: str | os.PathLike) -> Path:
    """``path`` when it is a ``save_pretrained`` directory; a one-line `ConfigError` naming the
    missing file otherwise."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"checkpoint not found: {p}")
    if not p.is_dir():
        raise ConfigError(
            f"checkpoint {p} is a file; with model.source: huggingface a checkpoint is a "
            "save_pretrained directory (config.json + model.safetensors)"
        )
    if not (p / "config.json").is_file():
        raise ConfigError(
            f"checkpoint {p}: missing {p / 'config.json'} (not a save_pretrained directory)"
        )
    if not any((p / f).is_file() for f in WEIGHT_FILES):
        bins = sorted(q.name for q in p.glob("*.bin"))
        extra = (
            f" ({', '.join(bins)} found: flatcli reads safetensors only; re-save with "
            "save_pretrained(safe_serialization=True))"
            if bins
            else ""
        )
        raise ConfigError(f"checkpoint {p}: missing {p / WEIGHT_FILES[0]}{extra}")
    return p


def load_pretrained(
    class_name: str,
    path: str | os.PathLike,
    kwargs: dict[str, Any] | None = None,
    dtype: str = "float32",
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """``(model, info)``: the model of the directory ``path`` built by ``transformers.<class_name>``,
    offline, eval mode, ``use_cache`` off, in ``dtype`` (``model.dtype``: ``auto`` is the
    checkpoint's stored type, transformers' ``dtype="auto"``: config.json's ``dtype``/``torch_dtype``,
    else the safetensors tensors' type; ``model.kwargs.dtype`` wins when given); ``info`` is what
    results.json records (class, architecture, attention implementation, parameter count, tied
    parameters, dtype)."""
    cls = model_class(class_name)
    p = check_directory(path)
    kw = dict(kwargs or {})
    kw.setdefault("attn_implementation", DEFAULT_ATTENTION)
    if "torch_dtype" not in kw:
        kw.setdefault("dtype", "auto" if dtype == "auto" else getattr(torch, dtype))
    check_safetensors(p)
    try:
        model = cls.from_pretrained(str(p), local_files_only=True, use_safetensors=True, **kw)
    except (OSError, ValueError, TypeError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"checkpoint {p}: transformers.{class_name}.from_pretrained failed: {first}"
        ) from None
    if getattr(model.config, "use_cache", None):
        model.config.use_cache = False  # no key/value cache in the outputs
    model.eval()
    return model, describe(model, class_name)


def check_safetensors(folder: Path) -> None:
    """Every ``*.safetensors`` file of the folder has a readable header and holds its tensors' bytes
    (a truncated or damaged file is a `ConfigError` naming it, not the library's SafetensorError)."""
    import json
    import struct

    for f in sorted(Path(folder).glob("*.safetensors")):
        size = f.stat().st_size
        why = None
        try:
            with open(f, "rb") as fh:
                head = fh.read(8)
                n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
                meta = json.loads(fh.read(n)) if n is not None and 8 + n <= size else None
        except (OSError, ValueError, UnicodeDecodeError) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            meta = None
        if meta is None or not isinstance(meta, dict):
            why = why or "its header is incomplete"
        else:
            ends = [
                v["data_offsets"][1]
                for k, v in meta.items()
                if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v
            ]
            if 8 + n + max(ends, default=0) > size:
                why = f"it holds {size} bytes, its header describes {8 + n + max(ends)}"
        if why:
            raise ConfigError(
                f"checkpoint {f} is not a readable checkpoint (truncated or damaged: {why})"
            )


def check_positions(model, what: str, length: int | None, path) -> None:
    """A `ConfigError` naming both numbers when ``length`` exceeds the model's positions."""
    cfg = getattr(model, "config", None)
    limit = None
    for key in ("n_positions", "max_position_embeddings"):
        limit = limit or getattr(cfg, key, None)
    if length is not None and isinstance(limit, int) and length > limit:
        key = "n_positions" if getattr(cfg, "n_positions", None) else "max_position_embeddings"
        raise ConfigError(
            f"{what} is {length} but the model of {path} has {key} {limit}: "
            f"set max_length ≤ {limit}"
        )


def describe(model: torch.nn.Module, class_name: str = "") -> dict[str, Any]:
    """What results.json records about a Hugging Face model."""
    cfg = getattr(model, "config", None)
    tied = {}
    first: dict[int, str] = {}
    for n, q in model.named_parameters(remove_duplicate=False):
        k = first.setdefault(id(q), n)
        if k != n:
            tied[n] = k
    return {
        "source": "huggingface",
        "class": class_name,
        "model_class": type(model).__name__,
        "model_type": getattr(cfg, "model_type", None),
        "attn_implementation": getattr(cfg, "_attn_implementation", None),
        "parameters": int(sum(q.numel() for q in model.parameters())),
        "dtype": model_dtype(model),
        "tied": tied,
    }


def load_tokenizer(path: str | os.PathLike, where: str):
    """The tokenizer saved with ``save_pretrained`` in the directory ``path``, offline."""
    tf = transformers_module(f"{where}.tokenizer")
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"{where}.tokenizer: directory not found: {p}")
    try:
        return tf.AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"{where}.tokenizer: {p} is not a readable tokenizer directory: {first}"
        ) from None
