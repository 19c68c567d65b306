"""The pre-flight (`flatcli.run.preflight`): one check per checkpoint before any data is loaded, the
same in `measure`, `sweep`, the landscape views and the invariance check; each checkpoint loaded
once."""

import importlib
import sys
from collections import Counter
from pathlib import Path

from flatcli.cli import app
from tests.helpers import cli_output, write_project
from tests.oracles import runner


def _spy(monkeypatch, module: str, name: str, calls: list) -> None:
    """Record the arguments of every call of ``module.name``, wherever a flatcli module bound it."""
    import flatcli.api  # noqa: F401  (every module that binds it)

    orig = getattr(importlib.import_module(module), name)

    def spy(*args, **kwargs):
        calls.append(args)
        return orig(*args, **kwargs)

    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("flatcli") and getattr(mod, name, None) is orig:
            monkeypatch.setattr(mod, name, spy)


def _cli(*args):
    res = runner.invoke(app, [str(a) for a in args])
    return res, cli_output(res)


COMMANDS = {
    "measure": lambda cfg, tmp: ("measure", "-c", cfg, "-o", tmp / "m"),
    "sweep": lambda cfg, tmp: ("sweep", "-c", cfg, "-o", tmp / "s"),
    "landscape slice": lambda cfg, tmp: (
        "landscape",
        "slice",
        tmp / "p" / "m0.pt",
        "-c",
        cfg,
        "-o",
        tmp / "l",
    ),
    "landscape interpolate": lambda cfg, tmp: (
        "landscape",
        "interpolate",
        tmp / "p" / "m0.pt",
        tmp / "p" / "m1.pt",
        "-c",
        cfg,
        "-o",
        tmp / "i",
    ),
    "invariance": lambda cfg, tmp: ("check-invariance", tmp / "p" / "m0.pt", "-c", cfg),
}


def test_a_params_pattern_matching_nothing_stops_every_command_before_the_data(
    tmp_path, monkeypatch
):
    """``measure``, ``sweep``, the landscape views and the invariance check: exit 2, one line
    naming the pattern, and the data loader never called."""
    cfg = write_project(tmp_path / "p", extra={"params": {"include": ["nomatch.*"]}})
    loads: list = []
    _spy(monkeypatch, "flatcli.loading.data", "load_split", loads)
    for name, argv in COMMANDS.items():
        res, text = _cli(*argv(cfg, tmp_path))
        assert res.exit_code == 2, (name, text)
        assert "'nomatch.*' matches no trainable parameter" in text, (name, text)
        assert "Traceback" not in text, (name, text)
        assert loads == [], (name, loads)


def test_measure_loads_and_checks_each_checkpoint_once(tmp_path, monkeypatch):
    """`measure` of 2 checkpoints: ``load_model`` once per checkpoint (the pre-flight's model is the
    one measured) and, with ``runtime.check_memory``, ``check_model`` once per checkpoint."""
    from flatcli import api

    cfg = write_project(
        tmp_path / "p",
        measures=["frobenius_norm"],
        extra={"runtime": {"device": "cpu", "seed": 0, "check_memory": True}},
    )
    loads: list = []
    checks: list = []
    _spy(monkeypatch, "flatcli.run.measuring", "load_model", loads)
    _spy(monkeypatch, "flatcli.run.memory", "check_model", checks)
    report = api.measure(cfg)
    assert report.exit_code == 0
    per_path = Counter(Path(a[1]).name for a in loads)
    assert per_path == {"m0.pt": 1, "m1.pt": 1}, per_path
    assert len(checks) == 2, len(checks)


def test_a_max_length_above_the_positions_stops_every_command_before_the_data(
    tmp_path, monkeypatch
):
    """A text split's ``max_length`` above a GPT-2's ``n_positions`` (16): ``measure``, ``sweep``
    and a landscape view exit 2 naming both numbers, and nothing is tokenized or loaded."""
    import yaml

    from tests import hf_models as H

    H.transformers()
    gpt2 = H.save_gpt2(tmp_path / "gpt2", n_embd=4)
    cfg = tmp_path / "c.yaml"
    text = {
        "source": "text",
        "path": str(H.write_jsonl(tmp_path / "lm.jsonl", H.text_rows())),
        "text_field": "text",
        "tokenizer": str(H.save_tokenizer(tmp_path / "tok")),
        "max_length": 32,
    }
    cfg.write_text(
        yaml.safe_dump(
            {
                "model": {"source": "huggingface", "class": "AutoModelForCausalLM"},
                "checkpoints": [str(gpt2)],
                "data": {"train": text},
                "measure_data": {"batch_size": 3},
                "measures": ["frobenius_norm"],
                "runtime": {"device": "cpu"},
            }
        )
    )
    loads: list = []
    _spy(monkeypatch, "flatcli.loading.data", "load_split", loads)
    for argv in (
        ("measure", "-c", cfg, "-o", tmp_path / "m"),
        ("sweep", "-c", cfg, "-o", tmp_path / "s"),
        ("landscape", "slice", gpt2, "-c", cfg, "-o", tmp_path / "l"),
    ):
        res, text_out = _cli(*argv)
        assert res.exit_code == 2, (argv[0], text_out)
        assert "data.train.max_length is 32" in text_out and "n_positions 16" in text_out, text_out
        assert loads == [], (argv[0], loads)
