"""The key of a result: what must be equal for a stored value to be reused.

A result (one checkpoint × one measure: a sweep unit, an entry of ``measure``'s results.json) is
reused only when its key matches. The key covers

* the whole resolved configuration (`flatcli.config.Config.to_dict`) except the keys named in
  `NOT_IN_KEY`, each of which cannot change a value (the reason is beside it);
* the measure's own entry: its name, label, seed and options with their defaults filled in,
  and the measure's ``revision`` (a registry field, raised when its values change);
* the content hash of the checkpoint (for a ``save_pretrained`` folder, of every file loading
  reads: `flatcli.loading.checkpoints.checkpoint_files`), of its init checkpoint and
  per-checkpoint training set, and a fingerprint (size and sha256) of every data file or folder
  the configured splits read;
* the inputs no key of the config names (`implied_files`): the tokenizer files of the checkpoint
  folder a ``text`` split takes its tokenizer from (the first listed that holds one: reordering
  ``checkpoints`` can change it), and the Python file of a ``path/to/file.py:Class`` model target.

`keyed_paths` lists the files a job's keys cover; a test records every file a measurement opens
and checks it is among them.

The flatcli version is not part of it: a release that changes a measure's values raises that
measure's revision, so results of the others stay valid.

Caps (``runtime.budget`` and a measure's ``max_seconds``/``max_hvps``) are not in the key: a
cap that does not stop a measure leaves its value as it is. A result a cap did stop (status
``budget``) is reused only under the same caps (`caps`): raising a cap recomputes it.

File hashes are cached in the process by path, size, modification time and inode, so a large
data file is read once per process however many checkpoints share it.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from .loading.checkpoints import checkpoint_files, fingerprint
from .loading.factory import target_file
from .loading.load import implied_tokenizer
from .loading.text import tokenizer_files
from .measures import get_measure

# Config keys left out of every key, with why none of them can change a value.
NOT_IN_KEY: dict[str, str] = {
    "checkpoints": "which checkpoints run: each result is keyed by its own checkpoint's content",
    "measures": "the other measures: a result is keyed by its own measure's entry",
    "output.dir": "where results are written",
    "output.format": "how results are printed",
    "runtime.threads": "how many CPU threads compute the same products",
    "runtime.device": "where the products run, once runtime.precision fixes their arithmetic "
    "(with precision auto the device's type is in the key: auto is TF32 on a tensor-core GPU)",
    "runtime.allow_unsafe_pickle": "whether a checkpoint may be read at all; its bytes are keyed",
    "runtime.check_memory": "a check before the run that refuses it or lets it go unchanged",
    "runtime.cache_graphs": "whether a batch's gradient graph is kept between products or built "
    "again: the same graph, the same products",
    "runtime.budget": "a cap: a value it did not stop is the same; one it stopped (status "
    "budget) is reused only under the same caps",
}
# Entries of a measure (`flatcli.measures.MeasureSpec`) left out of its key.
SPEC_NOT_IN_KEY: dict[str, str] = {
    "max_seconds": "a cap, as runtime.budget",
    "max_hvps": "a cap, as runtime.budget",
}
CAPPED = "budget"  # the status of a result a cap stopped


def _drop(d: dict[str, Any], path: str) -> None:
    *head, last = path.split(".")
    for part in head:
        d = d.get(part) if isinstance(d, dict) else None
        if d is None:
            return
    if isinstance(d, dict):
        d.pop(last, None)


def config_in_key(config: dict[str, Any]) -> dict[str, Any]:
    """The part of ``config`` (`Config.to_dict`) a key covers: all of it but `NOT_IN_KEY`, the
    device kept as its type (``cuda:1`` → ``cuda``) while ``runtime.precision`` is auto."""
    d = copy.deepcopy(config)
    rt = d.get("runtime") if isinstance(d.get("runtime"), dict) else {}
    device = rt.get("device", "auto")
    for path in NOT_IN_KEY:
        _drop(d, path)
    if rt.get("precision", "auto") == "auto":
        rt["device"] = str(device).split(":")[0]
    return d


def spec_in_key(spec) -> dict[str, Any]:
    """The measure's entry as keyed: name, label, seed, options with defaults, revision."""
    return {
        "name": spec.name,
        "label": spec.label,
        "seed": spec.seed,
        "options": dataclasses.asdict(spec.parsed()),
        "revision": get_measure(spec.name).revision,
    }


def sha(obj: Any) -> str:
    """sha256 of ``obj`` as canonical JSON (sorted keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def measure_hash(config: dict[str, Any], spec) -> str:
    """Hash of the configuration a measure's value depends on (`config_in_key`, `spec_in_key`).

    ``config`` is ``Config.to_dict()``. Options are resolved (defaults filled in), so
    ``hessian_trace`` and ``{hessian_trace: {tol: <default>}}`` share results."""
    return sha({"config": config_in_key(config), "measure": spec_in_key(spec)})[:16]


def caps(config: dict[str, Any], spec) -> dict[str, Any] | None:
    """The caps a measure ran under (``runtime.budget``, ``max_seconds``, ``max_hvps``; None when
    uncapped): a result with status ``budget`` is reused only under equal caps."""
    rt = config.get("runtime") or {}
    out = {
        k: v
        for k, v in (
            ("budget", rt.get("budget")),
            ("max_seconds", spec.max_seconds),
            ("max_hvps", spec.max_hvps),
        )
        if v is not None
    }
    return out or None


def caps_hash(c: dict[str, Any] | None) -> str:
    """A short hash of `caps` ("" when uncapped)."""
    return "" if not c else sha(c)[:8]


def unit_id(fingerprints: dict[str, Any], mhash: str) -> str:
    """The key of one checkpoint × measure: its file fingerprints and the measure hash."""
    return sha({"fp": fingerprints, "measure": mhash})[:20]


# ------------------------------------------------------------------ file fingerprints
_HASHES: dict[tuple, str] = {}


def _file_sha(path: Path, st: os.stat_result) -> str:
    k = (str(path), st.st_size, st.st_mtime_ns, st.st_ino)
    got = _HASHES.get(k)
    if got is None:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        got = _HASHES[k] = h.hexdigest()
    return got


def content_hash(path: str | os.PathLike) -> str:
    """sha256 (first 16 hex digits) of a file's bytes, cached (`flatcli.loading.checkpoints.
    fingerprint` for directories)."""
    p = Path(path)
    if p.is_dir():
        return fingerprint(p)
    return _file_sha(p.resolve(), p.stat())[:16]


def file_fingerprint(path: str | os.PathLike) -> str | None:
    """``"<bytes>:<sha256>"`` of a file, or of a folder's files (names, sizes, contents, hidden
    files left out); None when missing."""
    p = Path(path).resolve()
    try:
        if not p.is_dir():
            st = p.stat()
            return f"{st.st_size}:{_file_sha(p, st)[:16]}"
        h, total = hashlib.sha256(), 0
        for q in sorted(q for q in p.rglob("*") if q.is_file()):
            rel = q.relative_to(p)
            if any(part.startswith(".") for part in rel.parts):
                continue
            st = q.stat()
            total += st.st_size
            h.update(f"{rel}\0{st.st_size}\0{_file_sha(q, st)}\n".encode())
        return f"{total}:{h.hexdigest()[:16]}"
    except FileNotFoundError:
        return None


def data_files(cfg) -> dict[str, Path]:
    """The files and folders the configured data splits read, by ``data.<split>.<key>``."""
    out = {}
    for split in ("train", "test"):
        src = getattr(cfg.data, split)
        if src is None:
            continue
        keys = {
            "tensors": ("path",),
            "imagefolder": ("path",),
            "text": ("path", "tokenizer"),
            "torchvision": ("root",),
        }.get(src.source, ())
        for k in keys:
            v = getattr(src, k)
            if v:
                out[f"data.{split}.{k}"] = cfg.resolve_path(v)
    return out


def implied_files(cfg) -> dict[str, list[Path]]:
    """Inputs no config key names, by what reads them: the tokenizer files of the checkpoint folder
    a ``text`` split takes its tokenizer from (``data.<split>.tokenizer``,
    `flatcli.loading.load.implied_tokenizer`), and the Python file of a ``path/to/file.py:Class``
    ``model.target`` (``model.target``: its code builds the model)."""
    out: dict[str, list[Path]] = {}
    for split in ("train", "test"):
        folder = implied_tokenizer(cfg, getattr(cfg.data, split))
        if folder is not None:
            out[f"data.{split}.tokenizer"] = tokenizer_files(folder)
    code = target_file(cfg.model.target or "", cfg.base_dir)
    if code is not None:
        out["model.target"] = [Path(code)]
    return out


def files_fingerprint(files: list[Path]) -> str | None:
    """``"<bytes>:<sha256>"`` of a list of files (names and contents); None when one is missing."""
    h, total = hashlib.sha256(), 0
    try:
        for q in files:
            q = Path(q).resolve()
            st = q.stat()
            total += st.st_size
            h.update(f"{q.name}\0{st.st_size}\0{_file_sha(q, st)}\n".encode())
    except FileNotFoundError:
        return None
    return f"{total}:{h.hexdigest()[:16]}"


def data_fingerprints(cfg) -> dict[str, str | None]:
    """`file_fingerprint` of every file `data_files` names, and `files_fingerprint` of the inputs
    `implied_files` finds."""
    out = {k: file_fingerprint(p) for k, p in data_files(cfg).items()}
    out.update({k: files_fingerprint(fs) for k, fs in implied_files(cfg).items()})
    return out


def keyed_paths(cfg, job) -> set[Path]:
    """Every file whose bytes are in the keys of ``job``'s results (resolved paths): the checkpoint
    (`flatcli.loading.checkpoints.checkpoint_files`), its init checkpoint and training set, the
    data files and folders, and the implied inputs. A test checks that loading opens no other."""

    def expand(p: Path) -> list[Path]:
        p = Path(p)
        return [q for q in p.rglob("*") if q.is_file()] if p.is_dir() else [p]

    paths = [*checkpoint_files(job.path)]
    if job.init_checkpoint is not None:
        paths += checkpoint_files(job.init_checkpoint)
    if job.train_data is not None:
        paths += expand(job.train_data)
    for p in data_files(cfg).values():
        paths += expand(p)
    for fs in implied_files(cfg).values():
        paths += fs
    return {Path(p).resolve() for p in paths}


def job_fingerprints(job, data: dict[str, str | None]) -> dict[str, Any]:
    """A checkpoint's fingerprints (its file, init checkpoint, own training set) with ``data``
    (`data_fingerprints`); OSError when a checkpoint file cannot be read."""
    return {
        "checkpoint": content_hash(job.path),
        "init": None if job.init_checkpoint is None else content_hash(job.init_checkpoint),
        "train_data": None if job.train_data is None else file_fingerprint(job.train_data),
        "data": data,
    }
