"""Model factories from a target string.

* ``pkg.module:Callable`` — imported module attribute.
* ``path/to/file.py:Callable`` — a file, relative paths resolved against the
  config file's folder.
* ``torchvision:NAME`` — ``torchvision.models.get_model(NAME, **kwargs)``
  (never downloads weights: ``weights`` must not be set).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch

from .. import validation
from ..errors import ConfigError

MODEL_DTYPES = validation.MODEL_DTYPES  # the vocabulary is declared once, in flatcli.validation


def _load_file_module(path: Path):
    if not path.is_file():
        raise ConfigError(f"model.target: file not found: {path}")
    name = "flatcli_user_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except Exception as e:
        del sys.modules[name]
        raise ConfigError(f"model.target: importing {path} failed: {type(e).__name__}: {e}") from e
    return mod


def _target_file(left: str, base_dir: Path | str) -> Path | None:
    """The file of a ``path/to/file.py`` target's left part (relative to ``base_dir``), None for a
    module name."""
    if not (left.endswith(".py") or "/" in left or "\\" in left):
        return None
    p = Path(left)
    return p if p.is_absolute() else Path(base_dir) / p


def target_file(target: str, base_dir: Path | str = ".") -> Path | None:
    """The Python file a ``path/to/file.py:Class`` ``model.target`` runs (None for a module)."""
    return _target_file(target.rsplit(":", 1)[0], base_dir) if target and ":" in target else None


def import_dirs(target: str, base_dir: Path | str = ".") -> list[Path]:
    """The folders a full pickled checkpoint may import its classes from, besides ``sys.path``: the
    config file's folder and, for a ``path/to/file.py:Class`` target, that file's folder. A model
    class in ``models.py`` beside the config then unpickles as ``models.Class`` without PYTHONPATH."""
    dirs = [Path(base_dir).resolve()]
    left = target.rsplit(":", 1)[0] if target and ":" in target else ""
    f = _target_file(left, base_dir)
    if f is not None:
        dirs.append(f.resolve().parent)
    return list(dict.fromkeys(dirs))


@contextlib.contextmanager
def importable(dirs: list[Path]):
    """``dirs`` at the front of ``sys.path`` inside (those that were not there are removed after)."""
    added = [str(d) for d in dirs if str(d) not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        for d in added:
            if d in sys.path:
                sys.path.remove(d)


def resolve_target(target: str, base_dir: Path | str = "."):
    """The callable named by ``target``."""
    if not target or ":" not in target:
        raise ConfigError(
            f"config key 'model.target' must look like 'pkg.module:Class', 'path/to/file.py:Class' "
            f"or 'torchvision:NAME'. Got {target!r} instead."
        )
    left, attr = target.rsplit(":", 1)
    if left == "torchvision":
        import torchvision

        available = torchvision.models.list_models()
        if attr not in available:
            import difflib

            hint = difflib.get_close_matches(attr, available, n=1)
            raise ConfigError(
                f"model.target: torchvision has no model {attr!r}"
                + (f"; did you mean {hint[0]!r}?" if hint else "")
            )

        def factory(**kw):
            if kw.get("weights") not in (None,):
                raise ConfigError(
                    "model.kwargs.weights: flatcli never downloads weights; load a checkpoint instead"
                )
            return torchvision.models.get_model(attr, **kw)

        return factory
    p = _target_file(left, base_dir)
    if p is not None:
        mod = _load_file_module(p)
    else:
        try:
            mod = importlib.import_module(left)
        except ImportError as e:
            hint = _module_hint(left)
            raise ConfigError(
                f"model.target: cannot import module {left!r}: {e}"
                + (f"; did you mean '{hint}:{attr}'?" if hint else "")
            ) from e
    obj = mod
    done: list[str] = []
    for part in attr.split("."):
        if not hasattr(obj, part):
            hint = _name_hint(part, obj)
            where = ".".join([*done, hint]) if hint else ""
            raise ConfigError(
                f"model.target: {left!r} has no attribute {attr!r}"
                + (f"; did you mean '{left}:{where}'?" if hint else "")
            )
        obj = getattr(obj, part)
        done.append(part)
    if not callable(obj):
        raise ConfigError(f"model.target: {target!r} is not callable")
    return obj


def _closest(word: str, names: list[str]) -> str | None:
    """The name of ``names`` nearest to ``word`` (`difflib`; a match but for case first), or None."""
    import difflib

    same = [n for n in names if n.lower() == word.lower()]
    if same:
        return same[0]
    hits = difflib.get_close_matches(word, names, n=1, cutoff=0.6)
    return hits[0] if hits else None


def _name_hint(word: str, obj: Any) -> str | None:
    """The public callable of ``obj`` (a module's classes and functions) nearest to ``word``."""
    names = [n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None))]
    return _closest(word, names)


def _module_hint(name: str) -> str | None:
    """For a module ``pkg.modle`` that does not import: the importable ``pkg.module`` nearest to
    it (a sibling module of the package), or None."""
    import pkgutil

    parent, _, last = name.rpartition(".")
    try:
        path = importlib.import_module(parent).__path__ if parent else None
    except (ImportError, AttributeError):
        return None
    mods = [m.name for m in pkgutil.iter_modules(path)] if path is not None else []
    hit = _closest(last, mods)
    return f"{parent}.{hit}" if hit and parent else hit


def check_target(cfg) -> None:
    """A `ConfigError` now, before any checkpoint, when the config's Python model target does not
    resolve (a typo in ``model.target``): said once, not once per checkpoint."""
    if cfg.model.source != "python":
        return
    if not cfg.model.target:
        raise ConfigError("config key 'model.target' is required")
    resolve_target(cfg.model.target, cfg.base_dir)


def build_model(
    target: str, kwargs: dict[str, Any] | None = None, base_dir: Path | str = "."
) -> torch.nn.Module:
    """Build the model ``target`` (``pkg.mod:Callable``, ``file.py:Callable``, ``torchvision:NAME``)
    with ``kwargs``; a `ConfigError` naming the target when it fails."""
    factory = resolve_target(target, base_dir)
    try:
        model = factory(**(kwargs or {}))
    except ConfigError:
        raise
    except TypeError as e:
        raise ConfigError(f"model.kwargs do not fit {target}: {e}") from e
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"model.target {target!r} returned {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def model_dtype(model: torch.nn.Module) -> str:
    """The floating type of the model's parameters (``float32``, ``bfloat16``...; ``mixed`` when they
    differ, e.g. a class that keeps some modules in float32)."""
    kinds = {
        str(q.dtype).removeprefix("torch.") for q in model.parameters() if q.is_floating_point()
    }
    return kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else "float32")


def stored_dtype(sd: dict[str, torch.Tensor], path: Path | str) -> str | None:
    """``model.dtype: auto`` for a Python model: the one floating type of a ``.safetensors`` file's
    tensors (None, i.e. the model as its factory builds it, float32 as a rule, for torch.save files
    and for safetensors files whose tensors mix types)."""
    if Path(path).suffix != ".safetensors":
        return None
    kinds = {str(t.dtype).removeprefix("torch.") for t in sd.values() if t.is_floating_point()}
    return kinds.pop() if len(kinds) == 1 and next(iter(kinds)) in MODEL_DTYPES else None


def in_dtype(model: torch.nn.Module, dtype: str | None) -> torch.nn.Module:
    """``model`` with its floating parameters and buffers in ``dtype`` (a `MODEL_DTYPES` name other
    than ``auto``; None leaves it as it is)."""
    return model if dtype is None else model.to(getattr(torch, dtype))
