"""Tiny Hugging Face models, a tokenizer and text files for the transformer tests.

Everything is built from configs with random weights and written with ``save_pretrained``
into a folder the test owns: no download, no hub. The sizes keep the dense float64 Hessians
of the exact tests small (P ≈ 1k parameters).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SENTENCES = [
    "the cat sat on the mat",
    "a dog ran in the park",
    "the bird sang a song",
    "my cat likes the warm sun",
    "a small dog sat",
    "the park was green and quiet today",
    "birds fly over the park",
    "the dog and the cat play",
]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]


def transformers():
    """The transformers module imported offline, or skip the test."""
    import pytest

    from flatcli.loading.hf import offline

    offline()
    return pytest.importorskip("transformers")


def save_tokenizer(folder: Path, *, bert: bool = False) -> Path:
    """A word-level tokenizer over `SENTENCES` (+ specials) saved with save_pretrained; ``bert``
    adds the [CLS] … [SEP] template and token type ids."""
    tf = transformers()
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = sorted({w for s in SENTENCES for w in s.split()})
    vocab = {t: i for i, t in enumerate(SPECIALS + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    names = ["input_ids", "attention_mask"]
    if bert:
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
        )
        names = ["input_ids", "token_type_ids", "attention_mask"]
    fast = tf.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", model_input_names=names
    )
    fast.save_pretrained(folder)
    return folder


def vocab_size() -> int:
    """The tokenizer's vocabulary size."""
    return len(SPECIALS) + len({w for s in SENTENCES for w in s.split()})


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    """One JSON object per line."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def save_gpt2(folder: Path, seed: int = 0, n_embd: int = 8, **kw) -> Path:
    """A 1-layer GPT-2 LM head model (tied lm_head/wte), eager attention."""
    tf = transformers()
    torch.manual_seed(seed)
    cfg = tf.GPT2Config(
        vocab_size=vocab_size(),
        n_positions=16,
        n_embd=n_embd,
        n_layer=1,
        n_head=2,
        bos_token_id=3,
        eos_token_id=3,
        pad_token_id=0,
        **kw,
    )
    tf.GPT2LMHeadModel(cfg).save_pretrained(folder)
    return folder


def save_bert(folder: Path, seed: int = 0, hidden: int = 8) -> Path:
    """A 1-layer BERT sequence classifier over 2 labels."""
    tf = transformers()
    torch.manual_seed(seed)
    cfg = tf.BertConfig(
        vocab_size=vocab_size(),
        hidden_size=hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=16,
        type_vocab_size=2,
        num_labels=2,
        pad_token_id=0,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    tf.BertForSequenceClassification(cfg).save_pretrained(folder)
    return folder


def save_vit(folder: Path, seed: int = 0, hidden: int = 8) -> Path:
    """A 1-layer ViT image classifier on 8×8 single-channel images (4 patches) over 3 labels."""
    tf = transformers()
    torch.manual_seed(seed)
    cfg = tf.ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=1,
        hidden_size=hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=2 * hidden,
        num_labels=3,
    )
    tf.ViTForImageClassification(cfg).save_pretrained(folder)
    return folder


def text_rows(labels: bool = False) -> list[dict]:
    """`SENTENCES` as rows (unequal lengths), with alternating labels when asked."""
    return [{"text": s, **({"label": i % 2} if labels else {})} for i, s in enumerate(SENTENCES)]


def image_tensors(path: Path, n: int = 6, seed: int = 0) -> Path:
    """A tensors file of ``pixel_values`` (n, 1, 8, 8) and ``labels`` in 0..2."""
    g = torch.Generator().manual_seed(seed)
    torch.save(
        {"pixel_values": torch.randn(n, 1, 8, 8, generator=g), "labels": torch.arange(n) % 3}, path
    )
    return path
