"""The how-to page's Lightning and Hugging Face examples run (the plain loop is a sphinx doctest):
each ``python`` block of docs/howto/track-training.md is executed with the names it assumes bound
to tiny stand-ins."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

PAGE = Path(__file__).resolve().parents[2] / "docs" / "howto" / "track-training.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)


def test_the_page_has_the_three_ways_in():
    text = PAGE.read_text()
    assert "```{doctest}" in text and len(_blocks()) == 2


def test_the_lightning_example_runs(tmp_path, monkeypatch):
    L = pytest.importorskip("lightning.pytorch")
    monkeypatch.chdir(tmp_path)

    class MyLightningModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(3, 2)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, idx):
            return nn.functional.cross_entropy(self(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    x, y = torch.randn(16, 3), torch.randint(0, 2, (16,))
    loader = torch.utils.data.DataLoader(list(zip(x, y, strict=True)), batch_size=4)
    code = _blocks()[0].replace(
        "max_steps=5000", "max_steps=4, logger=False, enable_progress_bar=False"
    )
    code = code.replace("every=50", "every=2")
    env = {
        "MyLightningModule": MyLightningModule,
        "x_track": x,
        "y_track": y,
        "train_loader": loader,
    }
    exec(compile(code, str(PAGE), "exec"), env)
    rows = env["tracker"].rows
    assert [r["step"] for r in rows] == [2, 4] and (tmp_path / "runs/track/track.csv").is_file()


def test_the_hugging_face_example_runs(tmp_path, monkeypatch):
    from tests.hf_models import transformers

    tf = transformers()
    monkeypatch.chdir(tmp_path)
    cfg = tf.GPT2Config(vocab_size=20, n_positions=16, n_embd=8, n_layer=1, n_head=2)
    cfg._attn_implementation = "eager"  # fused attention has no second derivative
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 20, (8, 6))
    mask = torch.ones_like(ids)
    train = [
        {"input_ids": a, "attention_mask": m, "labels": a} for a, m in zip(ids, mask, strict=True)
    ]
    args = tf.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    code = _blocks()[1].replace("budget=0.1", "every=1")
    env = {
        "Trainer": tf.Trainer,
        "model": model,
        "args": args,
        "train": train,
        "ids": ids,
        "mask": mask,
    }
    exec(compile(code, str(PAGE), "exec"), env)
    logged = [h for h in env["trainer"].state.log_history if "curvature/hessian_lambda_max" in h]
    assert [h["step"] for h in logged] == [1, 2, 3]
