"""The Lightning and Hugging Face callbacks: a tiny training end to end on CPU, the trainer's own
logger receives the tracker's columns, and the training is the untracked one's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flatcli.tracking import Tracker, log_columns

MEASURES = ["hessian_lambda_max", "gradient_norm"]


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 4, generator=g)
    return x, (x[:, 0] > 0).long()


def test_log_columns_pick_values_costs_and_thresholds():
    row = {
        "step": 3,
        "lr": 0.1,
        "tracking_loss": 0.5,
        "overhead": 0.1,
        "a": 2.0,
        "a_stderr": None,
        "a_n_hvp": 9,
        "a_status": "ok",
        "a_converged": True,
        "a_lambda_2": 1.5,
        "a_threshold": float("nan"),
    }
    assert log_columns(row, ["a"], "c/") == {
        "c/tracking_loss": 0.5,
        "c/overhead": 0.1,
        "c/a": 2.0,
        "c/a_n_hvp": 9.0,
        "c/a_lambda_2": 1.5,
    }


# ---------------------------------------------------------------------------- Lightning


def _lightning_run(tmp_path, tracked: bool):
    L = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import Logger

    from flatcli.tracking.lightning_callback import CurvatureCallback

    class Recorder(Logger):
        def __init__(self):
            super().__init__()
            self.calls = []

        name, version = "recorder", "0"

        def log_metrics(self, metrics, step=None):
            self.calls.append((step, dict(metrics)))

        def log_hyperparams(self, params, *args, **kwargs):
            pass

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Dropout(0.2), nn.Linear(6, 2))

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, idx):
            x, y = batch
            return nn.functional.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    L.seed_everything(0, verbose=False)
    module = Module()
    x, y = _data()
    loader = torch.utils.data.DataLoader(list(zip(x, y, strict=True)), batch_size=8, shuffle=True)
    rec = Recorder()
    callbacks = []
    if tracked:
        tracker = Tracker(module, (x[:16], y[:16]), "cross_entropy", MEASURES, every=2)
        callbacks.append(CurvatureCallback(tracker))
    trainer = L.Trainer(
        max_steps=6,
        logger=rec,
        callbacks=callbacks,
        accelerator="cpu",
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        log_every_n_steps=1000,
    )
    trainer.fit(module, loader)
    return module, rec


def test_lightning_callback_logs_through_the_trainers_logger(tmp_path):
    module, rec = _lightning_run(tmp_path, tracked=True)
    plain, _ = _lightning_run(tmp_path, tracked=False)
    ours = [(s, m) for s, m in rec.calls if "curvature/hessian_lambda_max" in m]
    assert [s for s, _ in ours] == [2, 4, 6]
    for _, m in ours:
        assert {"curvature/gradient_norm", "curvature/hessian_lambda_max_n_hvp"} <= set(m)
        assert m["curvature/hessian_lambda_max"] > 0
    for a, b in zip(module.state_dict().values(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------- Hugging Face


class HFNet(nn.Module):
    """A module the Trainer accepts: forward(x, labels) returns the loss and the logits."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))

    def forward(self, x, labels=None):
        logits = self.net(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


def _hf_run(tmp_path, tracked: bool):
    from tests.hf_models import transformers

    tf = transformers()
    from flatcli.tracking.hf_callback import track_trainer

    class Recorder(tf.TrainerCallback):
        def __init__(self):
            self.logs = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs or {}))

    torch.manual_seed(0)
    model = HFNet()
    x, y = _data()
    rows = [{"x": a, "labels": b} for a, b in zip(x, y, strict=True)]
    args = tf.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=6,
        per_device_train_batch_size=8,
        learning_rate=1e-2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=1000,
        disable_tqdm=True,
        seed=0,
    )
    rec = Recorder()
    trainer = tf.Trainer(model=model, args=args, train_dataset=rows, callbacks=[rec])
    if tracked:
        tracker = Tracker(
            model, {"x": x[:16], "labels": y[:16]}, "cross_entropy", MEASURES, every=3
        )
        track_trainer(trainer, tracker)
    trainer.train()
    return model, rec, trainer


def test_hf_callback_logs_through_trainer_log(tmp_path):
    model, rec, trainer = _hf_run(tmp_path / "a", tracked=True)
    plain, _, _ = _hf_run(tmp_path / "b", tracked=False)
    ours = [m for m in rec.logs if "curvature/hessian_lambda_max" in m]
    assert len(ours) == 2  # steps 3 and 6
    assert all(
        m["curvature/hessian_lambda_max"] > 0 and "curvature/gradient_norm" in m for m in ours
    )
    history = [h for h in trainer.state.log_history if "curvature/hessian_lambda_max" in h]
    assert [h["step"] for h in history] == [3, 6]
    for a, b in zip(model.state_dict().values(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_an_unbound_hf_callback_is_refused(tmp_path):
    from tests.hf_models import transformers

    transformers()
    from flatcli.errors import ConfigError
    from flatcli.tracking.hf_callback import CurvatureTrainerCallback

    x, y = _data()
    cb = CurvatureTrainerCallback(Tracker(HFNet(), (x, y), "cross_entropy", MEASURES))
    with pytest.raises(ConfigError, match="track_trainer"):
        cb.on_train_begin(None, None, None)


def test_the_core_imports_no_framework():
    import subprocess
    import sys

    code = (
        "import sys, flatcli.tracking, flatcli.measures; flatcli.measures.list_measures();"
        "print(sorted(m for m in ('lightning', 'pytorch_lightning', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
