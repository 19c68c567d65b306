"""Every input of a value is in its key: the files a measurement opens are all fingerprinted
(flatcli.keys.keyed_paths), a tokenizer taken from the first checkpoint folder is keyed, so
swapping it or reordering the checkpoints recomputes instead of reusing stale values."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import torch
import yaml

import tests.hf_models as H
from flatcli import api
from flatcli.keys import data_fingerprints, keyed_paths
from flatcli.loading.jobs import resolve_jobs

_OPENED: list[str] = []
_RECORDING = [False]


def _audit(event: str, args) -> None:
    if _RECORDING[0] and event == "open" and isinstance(args[0], (str, bytes, Path)):
        _OPENED.append(
            str(args[0], "utf-8", "replace") if isinstance(args[0], bytes) else str(args[0])
        )


sys.addaudithook(_audit)  # Python's own opens (open, io.open, os.open) raise "open" events


def record_opens(monkeypatch, fn):
    """The files ``fn()`` opens: Python-level opens, plus safetensors and tokenizers files read by
    native code (wrapped where transformers calls them)."""
    import transformers.modeling_utils as mu
    import transformers.tokenization_utils_tokenizers as tt

    real_open, real_tok = mu.safe_open, tt.TokenizerFast

    def safe_open(path, *a, **k):
        _OPENED.append(str(path))
        return real_open(path, *a, **k)

    class Tok:
        from_str = staticmethod(real_tok.from_str)

        @staticmethod
        def from_file(path, *a, **k):
            _OPENED.append(str(path))
            return real_tok.from_file(path, *a, **k)

        def __new__(cls, *a, **k):
            return real_tok(*a, **k)

    monkeypatch.setattr(mu, "safe_open", safe_open)
    monkeypatch.setattr(tt, "TokenizerFast", Tok)
    _OPENED.clear()
    _RECORDING[0] = True
    try:
        out = fn()
    finally:
        _RECORDING[0] = False
    return out, {Path(p).resolve() for p in _OPENED}


def save_tokenizer(folder: Path, permute: bool = False) -> Path:
    """`tests.hf_models.save_tokenizer`, with the words' ids reversed when ``permute``: the same
    vocabulary size, other token ids (a changed tokenizer a model still runs with)."""
    H.save_tokenizer(folder)
    if permute:
        import json

        p = folder / "tokenizer.json"
        d = json.loads(p.read_text())
        vocab = d["model"]["vocab"]
        words = [w for w in vocab if w not in H.SPECIALS]
        ids = sorted(vocab[w] for w in words)
        for w, i in zip(words, reversed(ids), strict=True):
            vocab[w] = i
        p.write_text(json.dumps(d))
    return folder


def lm_project(root: Path, order=("a", "b")) -> Path:
    """Two GPT-2 folders, each with its own tokenizer (b's ids permuted), a text split naming no
    tokenizer: it comes from the first folder listed."""
    for name, seed in (("a", 0), ("b", 1)):
        if not (root / name).is_dir():
            H.save_gpt2(root / name, seed=seed, n_embd=4)
            save_tokenizer(root / name, permute=name == "b")
    H.write_jsonl(root / "lm.jsonl", H.text_rows())
    cfg = root / "c.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "model": {"source": "huggingface", "class": "AutoModelForCausalLM"},
                "checkpoints": [str(root / n) for n in order],
                "data": {
                    "train": {
                        "source": "text",
                        "path": "lm.jsonl",
                        "text_field": "text",
                        "max_length": 12,
                    }
                },
                "measure_data": {"batch_size": 3},
                "loss": "causal_lm",
                "measures": [
                    "frobenius_norm",
                    {"hessian_trace": {"min_probes": 2, "max_probes": 2}},
                ],
            }
        )
    )
    return cfg


def _not_keyed(cfg_path: Path, opened: set[Path], out: Path) -> set[Path]:
    """The files under the project that were opened but are in no key: none but the config
    (its resolved content is keyed), the manifest (which checkpoints run; each is keyed by its
    content) and the bytecode Python compiles from a keyed source."""
    cfg = api.load(cfg_path)
    keyed = set()
    for job in resolve_jobs(cfg):
        keyed |= keyed_paths(cfg, job)
    root = cfg_path.parent.resolve()
    inputs = {p for p in opened if root in p.parents and out.resolve() not in (p, *p.parents)}
    manifest = {(root / "man.csv").resolve()}
    # bytecode, and the temp file Python writes it through (``net.cpython-311.pyc.<id>``, then
    # renamed) where bytecode is written (PYTHONDONTWRITEBYTECODE unset, as in CI)
    compiled = {
        p
        for p in inputs
        if p.parent.name == "__pycache__" and re.fullmatch(r"[^.]+\..+\.pyc(\.\d+)?", p.name)
    }
    assert all(
        (p.parent.parent / (p.name.split(".")[0] + ".py")).resolve() in keyed for p in compiled
    )
    return inputs - keyed - {cfg_path.resolve()} - manifest - compiled


def test_every_file_a_language_model_measurement_opens_is_keyed(tmp_path, monkeypatch):
    H.transformers()
    cfg = lm_project(tmp_path)
    out = tmp_path / "o"
    rep, opened = record_opens(monkeypatch, lambda: api.measure(cfg, outdir=out))
    assert rep.exit_code == 0
    assert (tmp_path / "a" / "tokenizer.json").resolve() in opened  # the recording sees it
    assert (tmp_path / "a" / "model.safetensors").resolve() in opened
    assert _not_keyed(cfg, opened, out) == set()


def test_every_file_a_state_dict_measurement_opens_is_keyed(tmp_path, monkeypatch):
    """A model built from a .py file beside the config, tensors data, an init checkpoint."""
    (tmp_path / "net.py").write_text(
        "import torch\n\nclass Net(torch.nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.l = torch.nn.Linear(4, 3)\n"
        "    def forward(self, x):\n        return self.l(x)\n"
    )
    torch.manual_seed(0)
    for name in ("m.pt", "init.pt"):
        torch.save({"l.weight": torch.randn(3, 4), "l.bias": torch.randn(3)}, tmp_path / name)
    torch.save({"x": torch.randn(10, 4), "y": torch.randint(0, 3, (10,))}, tmp_path / "d.pt")
    (tmp_path / "man.csv").write_text("path,init_checkpoint,lr\nm.pt,init.pt,0.1\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "model": {"target": "net.py:Net"},
                "checkpoints": {"manifest": "man.csv"},
                "data": {"train": {"source": "tensors", "path": "d.pt"}},
                "measures": ["frobenius_norm", "distance_from_init"],
            }
        )
    )
    out = tmp_path / "o"
    rep, opened = record_opens(monkeypatch, lambda: api.measure(cfg, outdir=out))
    assert rep.exit_code == 0, rep.rows[0].error
    assert (tmp_path / "init.pt").resolve() in opened and (tmp_path / "d.pt").resolve() in opened
    assert _not_keyed(cfg, opened, out) == set()


def _reused(cfg: Path, out: Path) -> list[bool]:
    seen: list[bool] = []
    api.measure(
        cfg,
        outdir=out,
        resume=True,
        reporting=api.Reporting(on_measure=lambda row, lab, reused: seen.append(reused)),
    )
    return seen


def test_a_swapped_tokenizer_or_reordered_checkpoints_recompute(tmp_path):
    H.transformers()
    cfg = lm_project(tmp_path)
    out = tmp_path / "o"
    first = api.measure(cfg, outdir=out)
    assert _reused(cfg, out) == [True] * 4  # nothing changed: all reused
    before = data_fingerprints(api.load(cfg))
    # the tokenizer in the first folder changes: every value recomputes (measure and sweep)
    shutil.copy(tmp_path / "b" / "tokenizer.json", tmp_path / "a" / "tokenizer.json")
    assert data_fingerprints(api.load(cfg)) != before
    assert _reused(cfg, out) == [False] * 4
    assert api.sweep(cfg, tmp_path / "s", log=None).computed == 4
    save_tokenizer(tmp_path / "a")  # back to a's own
    assert api.sweep(cfg, tmp_path / "s", log=None).computed == 4
    assert _reused(cfg, out) == [False] * 4
    # reordered: b's tokenizer now; recomputed, and equal to a fresh run in that order
    cfg2 = lm_project(tmp_path, order=("b", "a"))
    assert _reused(cfg2, out) == [False] * 4
    fresh = api.measure(cfg2, outdir=tmp_path / "fresh")
    again = api.measure(cfg2, outdir=out, resume=True)
    for r, f in zip(again.rows, fresh.rows, strict=True):
        assert r.checkpoint == f.checkpoint
        for lab in ("frobenius_norm", "hessian_trace"):
            assert r.results[lab].value == f.results[lab].value
        assert r.metrics["train_loss"] == f.metrics["train_loss"]
    by_name = {Path(r.checkpoint).name: r for r in first.rows}
    assert (
        by_name["a"].metrics["train_loss"]
        != {Path(r.checkpoint).name: r for r in fresh.rows}["a"].metrics["train_loss"]
    )  # the tokenizer changed a's inputs: its loss differs
    # the sweep folder holds units of both tokenizer contents: the ones it reuses are those of
    # b's content (computed while a's folder held it), and equal the fresh values
    api.sweep(cfg2, tmp_path / "s", log=None)
    swept = {Path(r.checkpoint).name: r for r in api.collect_report(tmp_path / "s").rows}
    for f in fresh.rows:
        for lab in ("frobenius_norm", "hessian_trace"):
            assert swept[Path(f.checkpoint).name].results[lab].value == f.results[lab].value
