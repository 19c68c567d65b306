"""The ``text`` data source: a local table of texts tokenized by a local tokenizer.

``data.train: {source: text, path: data/train.jsonl, text_field: text, tokenizer: tok/, max_length: 128}``

* ``path``: JSON lines (``.jsonl``; ``.json`` as JSON lines or one JSON array), CSV (``.csv``)
  or Parquet (``.parquet``, needs ``pyarrow``), read with pandas; nothing is downloaded.
* ``path`` may also be plain text (``.txt``, UTF-8), read two ways, ``text_split``:
  ``lines`` (default): one document per non-empty line (``text_field`` not needed);
  ``windows``: the whole file is one document, tokenized once (no special tokens added) and cut
  into consecutive windows of ``max_length`` tokens (required), the last one shorter (padded,
  masked) when the token count is not a multiple; ``label_field``/``text_pair_field`` do not
  apply to ``.txt``.
* ``text_field``: the column of texts; ``text_pair_field``: an optional second segment
  (sentence pairs, as BERT's MNLI inputs); ``label_field``: optional class labels (integers;
  they become ``labels``, the target of ``cross_entropy``). Without ``label_field`` the batch
  holds ``input_ids`` and ``attention_mask`` only, which is what ``loss: causal_lm`` needs: its
  labels are the input ids with padded positions ignored (`flatcli.engine.losses.CausalLM`).
* ``tokenizer``: a directory written by ``save_pretrained`` (read offline by
  ``transformers.AutoTokenizer``); when omitted with ``model.source: huggingface``, the first
  checkpoint folder holding a tokenizer (``tokenizer.json`` or ``tokenizer_config.json``, as
  ``save_pretrained`` of a tokenizer writes them) is used (`checkpoint_tokenizer`); ``max_length`` (default: the tokenizer's), ``truncation``
  (default true) and ``padding``: ``longest`` (default: every row padded to the longest row
  of the file) or ``max_length``. Padding is always on the right, so positions count from 0 in
  every row; a tokenizer without a pad token pads with its end-of-text token (padded positions
  are masked out, their id never matters). ``token_type_ids`` are kept when the tokenizer
  returns them (its ``model_input_names``), as ``transformers`` does.

Tokenization happens once per data set: the tensors are cached in ``<cache_dir>`` (flatcli
measure/sweep: ``OUTDIR/tokenized/``) under a key of the file's bytes, the tokenizer
directory's files, the fields, ``max_length``, padding, truncation and the ``tokenizers``
version; a later run (or another sweep worker) loads them with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

import torch

from ..engine.batch import Batch
from ..errors import ConfigError
from ..tempfiles import temp_prefix
from .checkpoints import fingerprint
from .hf import load_tokenizer

CACHE_VERSION = 1
TOKENIZED_DIR = "tokenized"  # the cache's folder in an output directory


def load_text(src, where: str, base_dir: Path, cache_dir: Path | None = None) -> Batch:
    """The text split ``src`` (a `flatcli.config.DataSource` with ``source: text``) as a `Batch` of
    ``input_ids``, ``attention_mask`` (``token_type_ids``) and, with ``label_field``, ``labels``;
    read from ``cache_dir`` when it was tokenized before."""
    path = _resolve(src.path, base_dir)
    if src.tokenizer is None:
        raise ConfigError(
            f"config key '{where}.tokenizer' is required for source text "
            "(no checkpoint folder holds a tokenizer)"
        )
    tok_dir = _resolve(src.tokenizer, base_dir)
    if not path.is_file():
        raise ConfigError(f"{where}.path: file not found: {path}")
    if not tok_dir.is_dir():
        raise ConfigError(f"{where}.tokenizer: directory not found: {tok_dir}")
    key = cache_key(src, path, tok_dir)
    cached = None if cache_dir is None else Path(cache_dir) / f"{path.stem}-{key}.pt"
    if cached is not None and cached.is_file():
        try:
            return Batch(
                torch.load(cached, map_location="cpu", weights_only=True),
                where=f"{where} (cache {cached})",
            )
        except Exception:  # an unreadable cache file is rebuilt
            pass
    batch = tokenize(src, path, tok_dir, where)
    if cached is not None:
        _atomic_save(dict(batch.items()), cached)
    return batch


def _resolve(p: str, base_dir: Path) -> Path:
    q = Path(os.path.expanduser(str(p)))
    return q if q.is_absolute() else Path(base_dir) / q


def _dir_hash(d: Path) -> str:
    h = hashlib.sha256()
    for q in sorted(x for x in d.rglob("*") if x.is_file()):
        h.update(str(q.relative_to(d)).encode() + b"\0" + fingerprint(q).encode())
    return h.hexdigest()[:16]


def cache_key(src, path: Path, tok_dir: Path) -> str:
    """The cache key of a tokenized split (see the module docstring)."""
    try:
        import tokenizers

        tv = tokenizers.__version__
    except ImportError:
        tv = None
    spec = {
        "v": CACHE_VERSION,
        "file": fingerprint(path),
        "tokenizer": _dir_hash(tok_dir),
        "tokenizers": tv,
        "fields": [src.text_field, src.text_pair_field, src.label_field],
        "max_length": src.max_length,
        "padding": src.padding,
        "truncation": src.truncation,
    }
    if getattr(src, "text_split", None):
        spec["text_split"] = src.text_split
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def read_table(path: Path, where: str):
    """The file as a pandas DataFrame (JSON lines, JSON, CSV or Parquet by suffix)."""
    import pandas as pd

    suffix = path.suffix.lower()
    try:
        if suffix in (".jsonl", ".ndjson"):
            return pd.read_json(path, lines=True)
        if suffix == ".json":
            try:
                return pd.read_json(path, lines=True)
            except ValueError:
                return pd.read_json(path)
        if suffix in (".csv", ".tsv"):
            return pd.read_csv(path, sep="\t" if suffix == ".tsv" else ",")
        if suffix == ".parquet":
            return pd.read_parquet(path)
    except ImportError as e:
        raise ConfigError(
            f"{where}.path: reading {path.name} needs a Parquet engine: pip install pyarrow ({e})"
        ) from None
    except ValueError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"{where}.path: {path} is not readable as {suffix[1:]}: {first}"
        ) from None
    raise ConfigError(f"{where}.path: {path} must be .jsonl, .json, .csv, .tsv, .parquet or .txt")


def _column(table, field: str, key: str, where: str, path: Path) -> list:
    if field not in table.columns:
        cols = ", ".join(map(str, table.columns))
        raise ConfigError(f"{where}.{key}: {path} has no column {field!r} (columns: {cols})")
    return table[field].tolist()


def _texts(table, field: str, key: str, where: str, path: Path) -> list[str]:
    values = _column(table, field, key, where, path)
    for i, v in enumerate(values):
        if not isinstance(v, str):
            raise ConfigError(
                f"{where}.{key}: row {i} of {path} has no text in {field!r} (got {v!r})"
            )
    return values


def _labels(table, field: str, where: str, path: Path) -> torch.Tensor:
    values = _column(table, field, "label_field", where, path)
    try:
        t = torch.as_tensor(values)
    except (TypeError, ValueError, RuntimeError):
        raise ConfigError(
            f"{where}.label_field: the {field!r} column of {path} must hold numbers "
            "(integer class ids); map names to ids before measuring"
        ) from None
    if t.is_floating_point() and bool((t == t.round()).all()):
        t = t.long()
    return t if t.is_floating_point() else t.long()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# what a tokenizer's from_pretrained may read in its folder (config.json names its class when
# tokenizer_config.json does not)
TOKENIZER_READS = re.compile(
    r"(tokenizer.*\.json|special_tokens_map\.json|added_tokens\.json|vocab\..*|merges\.txt"
    r"|.*\.model|chat_template.*|config\.json|preprocessor_config\.json)"
)


def tokenizer_files(folder: str | os.PathLike) -> list[Path]:
    """The files of ``folder`` a saved tokenizer is read from (`TOKENIZER_READS`), sorted."""
    d = Path(folder)
    if not d.is_dir():
        return []
    return sorted(q for q in d.iterdir() if q.is_file() and TOKENIZER_READS.fullmatch(q.name))


def checkpoint_tokenizer(folders) -> Path | None:
    """The first of ``folders`` (checkpoint directories) holding a saved tokenizer, or None."""
    for d in folders:
        d = Path(d)
        if d.is_dir() and any((d / f).is_file() for f in TOKENIZER_FILES):
            return d
    return None


def _read_txt(path: Path, where: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{where}.path: {path} is not UTF-8 text: {e.reason} at byte {e.start}"
        ) from None


def _pad_token(tok, tok_dir: Path, where: str) -> None:
    tok.padding_side = "right"
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ConfigError(
                f"{where}.tokenizer: {tok_dir} has neither a pad nor an end-of-text token; "
                "set one (tokenizer.pad_token = ...) and save it again"
            )
        tok.pad_token = tok.eos_token


def _windows(tok, text: str, max_length: int, path: Path, where: str) -> dict:
    """One document cut into windows of max_length tokens (the last one padded and masked)."""
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) < 2:
        raise ConfigError(f"{where}.path: {path} holds fewer than 2 tokens")
    rows = [ids[i : i + max_length] for i in range(0, len(ids), max_length)]
    if len(rows[-1]) < 2:  # a 1-token window has no next-token target
        rows.pop()
    input_ids = torch.full((len(rows), len(rows[0])), int(tok.pad_token_id), dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for r, w in enumerate(rows):
        input_ids[r, : len(w)] = torch.as_tensor(w)
        mask[r, : len(w)] = 1
    return {"input_ids": input_ids, "attention_mask": mask}


def _tokenize_txt(src, path: Path, tok, tok_dir: Path, where: str) -> Batch:
    text = _read_txt(path, where)
    if src.label_field or src.text_pair_field:
        raise ConfigError(
            f"{where}: label_field and text_pair_field need a table (.jsonl, .csv, ...), not {path.name}"
        )
    if (src.text_split or "lines") == "windows":
        return Batch(
            _windows(tok, text, int(src.max_length), path, where), where=f"{where}.path {path}"
        )
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise ConfigError(f"{where}.path: {path} holds no non-empty lines")
    enc = tok(
        lines,
        max_length=src.max_length,
        truncation=bool(src.truncation),
        padding="max_length" if src.padding == "max_length" else "longest",
        return_tensors="pt",
    )
    return Batch(
        {k: v for k, v in enc.items() if isinstance(v, torch.Tensor)}, where=f"{where}.path {path}"
    )


def tokenize(src, path: Path, tok_dir: Path, where: str) -> Batch:
    """Read and tokenize the split (no cache)."""
    if path.suffix.lower() == ".txt":
        tok = load_tokenizer(tok_dir, where)
        _pad_token(tok, tok_dir, where)
        return _tokenize_txt(src, path, tok, tok_dir, where)
    table = read_table(path, where)
    if len(table) == 0:
        raise ConfigError(f"{where}.path: {path} holds no rows")
    texts = _texts(table, src.text_field, "text_field", where, path)
    pairs = (
        _texts(table, src.text_pair_field, "text_pair_field", where, path)
        if src.text_pair_field
        else None
    )
    tok = load_tokenizer(tok_dir, where)
    _pad_token(tok, tok_dir, where)
    enc = tok(
        texts,
        pairs,
        max_length=src.max_length,
        truncation=bool(src.truncation),
        padding="max_length" if src.padding == "max_length" else "longest",
        return_tensors="pt",
    )
    out = {k: v for k, v in enc.items() if isinstance(v, torch.Tensor)}
    if src.label_field:
        out["labels"] = _labels(table, src.label_field, where, path)
    return Batch(out, where=f"{where}.path {path}")


def _atomic_save(obj: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=temp_prefix(path), suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
