"""The text data source, Hugging Face loading rules and Conv1D weight matrices (no CLI runs)."""

import builtins
import math

import pytest
import torch
from torch import nn

from flatcli.api import measure_model
from flatcli.config import DataSource, from_dict
from flatcli.errors import ConfigError
from flatcli.loading import text as text_source
from flatcli.loading.checkpoints import fingerprint
from flatcli.loading.jobs import resolve_jobs
from flatcli.measures._layers import weight_matrices
from tests import hf_models as H


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    H.transformers()
    return H.save_tokenizer(tmp_path_factory.mktemp("tok") / "tok")


def _src(path, tok, **kw):
    return DataSource(source="text", path=str(path), text_field="text", tokenizer=str(tok), **kw)


# ---------------------------------------------------------------- the text source
def test_jsonl_is_tokenized_right_padded_and_cached(tmp_path, tok, monkeypatch):
    rows = H.text_rows(labels=True)
    data = H.write_jsonl(tmp_path / "d.jsonl", rows)
    cache = tmp_path / "cache"
    batch = text_source.load_text(
        _src(data, tok, label_field="label", max_length=6), "data.train", tmp_path, cache
    )
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert (
        batch["labels"].tolist() == [r["label"] for r in rows]
        and batch["labels"].dtype == torch.long
    )
    vocab = H.transformers().PreTrainedTokenizerFast.from_pretrained(tok).get_vocab()
    width = batch["input_ids"].shape[1]
    assert width == max(
        min(len(r["text"].split()), 6) for r in rows
    )  # padded to the longest, truncated at 6
    for r, ids, mask in zip(rows, batch["input_ids"], batch["attention_mask"], strict=True):
        words = r["text"].split()[:6]
        n = len(words)
        assert mask.tolist() == [1] * n + [0] * (width - n)  # right padding
        assert ids[:n].tolist() == [vocab[w] for w in words]
        assert (ids[n:] == vocab["[PAD]"]).all()
    files = list(cache.glob("d-*.pt"))
    assert len(files) == 1
    # a second load reads the cache (tokenizing again would fail here) ...
    monkeypatch.setattr(text_source, "tokenize", lambda *a, **k: pytest.fail("tokenized twice"))
    again = text_source.load_text(
        _src(data, tok, label_field="label", max_length=6), "data.train", tmp_path, cache
    )
    assert all(torch.equal(again[k], batch[k]) for k in batch)
    # ... and a different max_length is a different cache entry
    monkeypatch.undo()
    text_source.load_text(
        _src(data, tok, label_field="label", max_length=4), "data.train", tmp_path, cache
    )
    assert len(list(cache.glob("d-*.pt"))) == 2


def test_csv_pairs_and_one_line_errors(tmp_path, tok):
    data = tmp_path / "d.csv"
    data.write_text("text,other\nthe cat sat,a dog\nthe bird,birds fly over the park\n")
    b = text_source.load_text(
        _src(data, tok, text_pair_field="other", padding="max_length", max_length=10),
        "data.train",
        tmp_path,
    )
    assert b["input_ids"].shape == (2, 10) and b["attention_mask"].sum(1).tolist() == [5, 7]
    with pytest.raises(
        ConfigError,
        match=r"data.train.text_field: .*d.csv has no column 'body' \(columns: text, other\)",
    ):
        text_source.load_text(
            DataSource(source="text", path=str(data), text_field="body", tokenizer=str(tok)),
            "data.train",
            tmp_path,
        )
    with pytest.raises(ConfigError, match="data.train.label_field: .*must hold numbers"):
        text_source.load_text(_src(data, tok, label_field="other"), "data.train", tmp_path)
    with pytest.raises(ConfigError, match="data.train.tokenizer: directory not found"):
        text_source.load_text(_src(data, tmp_path / "nope"), "data.train", tmp_path)


def test_text_config_keys_are_validated():
    base = {"model": {"target": "x:y"}}
    with pytest.raises(ConfigError, match="'data.train.text_field' is required for source text"):
        from_dict(
            {**base, "data": {"train": {"source": "text", "path": "d.jsonl", "tokenizer": "k"}}}
        )
    with pytest.raises(ConfigError, match="'data.train.text_split' must be one of lines, windows"):
        from_dict(
            {**base, "data": {"train": {"source": "text", "path": "d.txt", "text_split": "pages"}}}
        )
    with pytest.raises(
        ConfigError, match="'data.train.max_length' is required with text_split: windows"
    ):
        from_dict(
            {
                **base,
                "data": {"train": {"source": "text", "path": "d.txt", "text_split": "windows"}},
            }
        )
    with pytest.raises(ConfigError, match="'data.train.text_split' applies to a .txt file only"):
        from_dict(
            {
                **base,
                "data": {
                    "train": {
                        "source": "text",
                        "path": "d.csv",
                        "text_field": "t",
                        "text_split": "lines",
                    }
                },
            }
        )
    # no tokenizer and no checkpoint folder holding one: one line when loading
    cfg = from_dict({**base, "data": {"train": {"source": "text", "path": "d.txt"}}})
    with pytest.raises(ConfigError, match="'data.train.tokenizer' is required for source text"):
        text_source.load_text(cfg.data.train, "data.train", ".")
    with pytest.raises(ConfigError, match="'data.train.text_field' needs data.train.source: text"):
        from_dict(
            {**base, "data": {"train": {"source": "tensors", "path": "d.pt", "text_field": "text"}}}
        )
    with pytest.raises(
        ConfigError, match="'data.train.max_length' is required with padding: max_length"
    ):
        from_dict(
            {
                **base,
                "data": {
                    "train": {
                        "source": "text",
                        "path": "d",
                        "text_field": "t",
                        "tokenizer": "k",
                        "padding": "max_length",
                    }
                },
            }
        )


def test_txt_one_document_per_line(tmp_path, tok):
    data = tmp_path / "corpus.txt"
    data.write_text(
        "\n".join(H.SENTENCES[:3]) + "\n\n  \n" + H.SENTENCES[3] + "\n"
    )  # blank lines skipped
    src = DataSource(source="text", path=str(data), tokenizer=str(tok))
    b = text_source.load_text(src, "data.train", tmp_path)
    vocab = H.transformers().PreTrainedTokenizerFast.from_pretrained(tok).get_vocab()
    assert set(b) == {"input_ids", "attention_mask"} and b["input_ids"].shape[0] == 4
    for s, ids, mask in zip(H.SENTENCES[:4], b["input_ids"], b["attention_mask"], strict=True):
        words = s.split()
        assert mask.tolist()[: len(words)] == [1] * len(words) and int(mask.sum()) == len(words)
        assert ids[: len(words)].tolist() == [vocab[w] for w in words]


def test_txt_one_document_in_max_length_windows(tmp_path, tok):
    data = tmp_path / "book.txt"
    data.write_text("\n".join(H.SENTENCES))
    words = " ".join(H.SENTENCES).split()  # 43 words, one token each
    src = DataSource(
        source="text", path=str(data), tokenizer=str(tok), text_split="windows", max_length=10
    )
    b = text_source.load_text(src, "data.train", tmp_path, tmp_path / "cache")
    vocab = H.transformers().PreTrainedTokenizerFast.from_pretrained(tok).get_vocab()
    n = len(words)
    assert b["input_ids"].shape == (math.ceil(n / 10), 10)
    flat = b["input_ids"][b["attention_mask"].bool()].tolist()
    assert flat == [vocab[w] for w in words]  # every token once, in order, windows of 10
    assert b["attention_mask"].sum(1).tolist() == [10] * (n // 10) + ([n % 10] if n % 10 else [])
    lines = text_source.load_text(
        DataSource(source="text", path=str(data), tokenizer=str(tok), text_split="lines"),
        "data.train",
        tmp_path,
        tmp_path / "cache",
    )
    assert lines["input_ids"].shape[0] == len(
        H.SENTENCES
    )  # the other split: a different cache entry
    with pytest.raises(
        ConfigError, match=r"data.train.path: .*must be .jsonl, .json, .csv, .tsv, .parquet or .txt"
    ):
        text_source.read_table(tmp_path / "x.md", "data.train")


def test_tokenizer_from_the_checkpoint_folder(tmp_path):
    from flatcli.loading.load import DataCache

    H.transformers()
    ckpt = H.save_gpt2(tmp_path / "gpt2")
    data = tmp_path / "c.txt"
    data.write_text("\n".join(H.SENTENCES))
    cfg = from_dict(
        {
            "model": {"source": "huggingface", "class": "AutoModelForCausalLM"},
            "checkpoints": [str(ckpt)],
            "data": {"train": {"source": "text", "path": str(data)}},
        }
    )
    with pytest.raises(
        ConfigError, match="'data.train.tokenizer' is required"
    ):  # the folder has none yet
        DataCache(cfg).get("train")
    H.save_tokenizer(ckpt)  # the tokenizer saved inside the checkpoint folder
    b = DataCache(cfg).get("train")
    ref = text_source.load_text(
        DataSource(source="text", path=str(data), tokenizer=str(ckpt)), "data.train", tmp_path
    )
    assert torch.equal(b["input_ids"], ref["input_ids"]) and b["input_ids"].shape[0] == len(
        H.SENTENCES
    )


# ---------------------------------------------------------------- model config and checkpoints
def test_model_config_keys_and_hash_stability():
    cfg = from_dict(
        {"model": {"source": "huggingface", "class": "AutoModelForCausalLM", "kwargs": {"a": 1}}}
    )
    assert cfg.model.class_ == "AutoModelForCausalLM"
    assert cfg.to_dict()["model"] == {
        "source": "huggingface",
        "target": "",
        "class": "AutoModelForCausalLM",
        "kwargs": {"a": 1},
    }
    plain = from_dict({"model": {"target": "m:f"}})
    assert plain.to_dict()["model"] == {
        "target": "m:f",
        "kwargs": {},
    }  # new keys at their defaults: not hashed
    with pytest.raises(
        ConfigError, match="'model.class' is required with model.source: huggingface"
    ):
        from_dict({"model": {"source": "huggingface"}})
    with pytest.raises(ConfigError, match="'model.class' needs model.source: huggingface"):
        from_dict({"model": {"target": "m:f", "class": "GPT2LMHeadModel"}})
    with pytest.raises(ConfigError, match="Did you mean 'model.class'"):
        from_dict({"model": {"source": "huggingface", "clas": "GPT2LMHeadModel"}})


def test_checkpoint_globs_match_directories_and_fingerprint_them(tmp_path):
    for name in ("checkpoint-1", "checkpoint-2"):
        d = tmp_path / "run" / name
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
        (d / "model.safetensors").write_bytes(name.encode())
        (d / "optimizer.pt").write_bytes(b"ignored")
    (tmp_path / "run" / "checkpoint-3.txt").write_text("a file")
    cfg = from_dict(
        {
            "model": {"source": "huggingface", "class": "AutoModel"},
            "checkpoints": ["run/checkpoint-*"],
        },
        base_dir=tmp_path,
    )
    jobs = resolve_jobs(cfg)
    assert [j.path.name for j in jobs] == ["checkpoint-1", "checkpoint-2"]
    a, b = (fingerprint(j.path) for j in jobs)
    assert a != b
    (jobs[0].path / "optimizer.pt").write_bytes(
        b"changed"
    )  # trainer state beside the weights: not read
    assert fingerprint(jobs[0].path) == a
    (jobs[0].path / "model.safetensors").write_bytes(b"other weights")
    assert fingerprint(jobs[0].path) != a


def test_missing_transformers_names_the_extra(monkeypatch):
    from flatcli.loading import hf

    real = builtins.__import__

    def no_transformers(name, *a, **k):
        if name == "transformers" or name.startswith("transformers."):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_transformers)
    with pytest.raises(
        ConfigError, match=r"needs the transformers package: pip install 'flatcli\[transformers\]'"
    ):
        hf.model_class("AutoModelForCausalLM")


def test_missing_config_json_is_one_line(tmp_path):
    from flatcli.loading.hf import check_directory

    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match=f"missing {tmp_path / 'config.json'}"):
        check_directory(tmp_path)


# ---------------------------------------------------------------- Conv1D (GPT-2's projections)
class ConvNet(nn.Module):
    """x → Conv1D(5→4) → tanh → Linear(4→3): Conv1D stores its weight (in × out)."""

    def __init__(self, conv1d_cls):
        super().__init__()
        self.proj = conv1d_cls(4, 5)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.proj(x)))


class LinearNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(5, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.proj(x)))


def test_conv1d_is_a_weight_matrix_with_outputs_as_rows():
    """A Conv1D network and the same network written with nn.Linear (weight transposed) give the same
    norms and normalized sharpness (rows = output nodes)."""
    H.transformers()
    from transformers.pytorch_utils import Conv1D

    conv = ConvNet(Conv1D).double()
    lin = LinearNet().double()
    with torch.no_grad():
        conv.proj.weight.normal_()
        conv.proj.bias.normal_()
        lin.proj.weight.copy_(conv.proj.weight.T)
        lin.proj.bias.copy_(conv.proj.bias)
        lin.head.load_state_dict(conv.head.state_dict())
    wm = {w.module_name: w for w in weight_matrices(conv)}
    assert set(wm) == {"proj", "head"} and wm["proj"].rows == 4 and wm["proj"].columns == 5
    assert torch.equal(wm["proj"].as_matrix(conv.proj.weight), conv.proj.weight.T)
    x = torch.randn(12, 5, dtype=torch.float64)
    y = torch.arange(12) % 3
    specs = ["frobenius_norm", "spectral_norm", {"normalized_sharpness": {"hessian_diag": "exact"}}]
    a = measure_model(conv, (x, y), specs, precision="fp64")
    b = measure_model(lin, (x, y), specs, precision="fp64")
    for k in ("frobenius_norm", "spectral_norm", "normalized_sharpness"):
        va, vb = a.results[k].value, b.results[k].value
        assert math.isfinite(va) and va == pytest.approx(vb, rel=1e-9), k
