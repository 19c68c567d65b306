"""One validation vocabulary (flatcli.validation, issue 28 point 3): a shared setting's bad value
reads the same from the config (YAML key), `Settings` (API parameter), the experiment spec, the
training `Recipe` and the engine's constructors, but for the subject."""

from __future__ import annotations

import pytest
import torch

from flatcli.config import from_dict
from flatcli.engine import CurvatureEngine, Problem
from flatcli.engine.losses import get_loss
from flatcli.errors import ConfigError
from flatcli.experiments.spec import load_spec
from flatcli.run.settings import Settings
from flatcli.threads import check_threads
from flatcli.training import Recipe
from flatcli.validation import SETTINGS, TRAINING, Either, Integral, OneOf, Optional, Real, validate
from tests.experiments.test_experiments import _write_spec

FP16 = (
    ": fp16 is not offered: float16's range (largest 65504, smallest normal 6.1e-5) does not hold second "
    "derivatives of a mean loss without loss scaling; use bf16 (float32's range)"
)

# (setting, bad value, the rule's words after the subject): written out by hand, the one wording
SHARED = [
    ("device", "mps", "must be auto, cpu, cuda or cuda:N. Got 'mps' instead."),
    ("device", "cuda:x", "must be auto, cpu, cuda or cuda:N. Got 'cuda:x' instead."),
    ("precision", "half", "must be one of auto, fp32, tf32, bf16, fp64. Got 'half' instead."),
    ("precision", "fp16", FP16),
    ("loss", "nll", "must be one of cross_entropy, mse, causal_lm. Got 'nll' instead."),
    (
        "hvp_mode",
        "backward",
        "must be one of auto, reverse, forward, finite_difference. Got 'backward' instead.",
    ),
    ("batch_size", 0, "must be an int ≥ 1. Got 0 instead."),
    ("batch_size", "big", "must be an int ≥ 1. Got 'big' instead."),
    ("num_samples", 0, "must be an int ≥ 1 or all. Got 0 instead."),
    ("num_samples", "some", "must be an int ≥ 1 or all. Got 'some' instead."),
    ("block_size", 0, "must be an int ≥ 1 or null. Got 0 instead."),
    ("seed", "x", "must be an int in [0, 9223372036854775807]. Got 'x' instead."),
    ("seed", 2**63, "must be an int in [0, 9223372036854775807]. Got 9223372036854775808 instead."),
    ("max_device_vectors", 0, "must be an int ≥ 1, auto or null. Got 0 instead."),
    ("recompute", "sometimes", "must be true, false or auto. Got 'sometimes' instead."),
    ("cache_graphs", "sometimes", "must be true, false or auto. Got 'sometimes' instead."),
    ("check_memory", "maybe", "must be a bool (true or false). Got 'maybe' instead."),
    (
        "budget",
        "soon",
        "must be a positive number of seconds or a duration like 90s, 10m, 1h or null. Got 'soon' instead.",
    ),
    ("threads", 0, "must be an int in [1, 4096] or auto. Got 0 instead."),
    ("threads", 10**30, f"must be an int in [1, 4096] or auto. Got {10**30} instead."),
]

CONFIG_KEY = {
    "device": "runtime.device",
    "precision": "runtime.precision",
    "loss": "loss",
    "hvp_mode": "runtime.hvp_mode",
    "batch_size": "measure_data.batch_size",
    "num_samples": "measure_data.num_samples",
    "block_size": "runtime.block_size",
    "seed": "runtime.seed",
    "max_device_vectors": "runtime.max_device_vectors",
    "recompute": "runtime.recompute",
    "cache_graphs": "runtime.cache_graphs",
    "budget": "runtime.budget",
    "threads": "runtime.threads",
    "check_memory": "runtime.check_memory",
}


def _said(subject: str, words: str) -> str:
    return subject + ("" if words.startswith(":") else " ") + words


def _message(fn, exc=ConfigError) -> str:
    with pytest.raises(exc) as e:
        fn()
    assert type(e.value) is exc
    return str(e.value)


def _nested(key: str, value) -> dict:
    out: dict = {}
    cur = out
    parts = key.split(".")
    for p in parts[:-1]:
        cur = cur.setdefault(p, {})
    cur[parts[-1]] = value
    return out


def _engine(**kw):
    p = Problem(torch.nn.Linear(3, 2), torch.randn(4, 3), torch.tensor([0, 1, 0, 1]))
    return CurvatureEngine(p, **kw)


ENGINE = {
    "precision",
    "hvp_mode",
    "block_size",
    "recompute",
    "max_device_vectors",
}  # ValueError, as ever


@pytest.mark.parametrize(("name", "bad", "words"), SHARED, ids=[f"{n}={b!r}" for n, b, _ in SHARED])
def test_a_shared_setting_reads_the_same_from_config_settings_and_engine(name, bad, words):
    key = CONFIG_KEY[name]
    assert _message(lambda: from_dict(_nested(key, bad), env={})) == _said(
        f"config key '{key}'", words
    )
    if (
        name == "threads"
    ):  # not a Settings field: the API entry points check it with `check_threads`
        assert _message(lambda: check_threads(bad, "threads")) == _said("threads", words)
    else:
        assert _message(lambda: Settings.build(**{name: bad})) == _said(name, words)
    if name in ENGINE:
        assert _message(lambda: _engine(**{name: bad}), ValueError) == _said(name, words)
    if name == "loss":
        assert _message(lambda: get_loss(bad)) == _said("loss", words)


@pytest.mark.parametrize(("name", "bad"), [("device", "mps"), ("batch_size", 0)])
def test_the_spec_and_the_recipe_say_the_measurement_rules_words(tmp_path, name, bad):
    """``device`` and ``batch_size`` are both measurement settings and training keys: one rule each."""
    words = next(w for n, b, w in SHARED if (n, b) == (name, bad))
    spec = _write_spec(tmp_path, **{f"training.{name}": bad})
    assert _message(lambda: load_spec(spec, quick=True)).endswith(f"training: {_said(name, words)}")
    assert _message(lambda: Recipe(**{name: bad})) == _said(name, words)
    assert TRAINING[name].check is SETTINGS[name].check


TRAINING_CASES = [
    ("optimizer", "rmsprop", "must be one of sgd, adam, adamw. Got 'rmsprop' instead."),
    ("lr", 0, "must be a float > 0. Got 0 instead."),
    ("lr", "1e-3", "must be a float > 0. Got '1e-3' instead."),
    ("momentum", 1.0, "must be a float in [0, 1). Got 1.0 instead."),
    ("weight_decay", -1.0, "must be a float ≥ 0. Got -1.0 instead."),
    ("l2", -0.5, "must be a float ≥ 0. Got -0.5 instead."),
    ("max_steps", 0, "must be an int ≥ 1. Got 0 instead."),
    ("eval_every", 0, "must be an int ≥ 1 or null. Got 0 instead."),
    ("dtype", "float16", "must be one of float32, float64. Got 'float16' instead."),
]


@pytest.mark.parametrize(
    ("name", "bad", "words"), TRAINING_CASES, ids=[f"{n}={b!r}" for n, b, _ in TRAINING_CASES]
)
def test_the_recipe_reads_the_same_from_the_spec_and_python(tmp_path, name, bad, words):
    spec = _write_spec(tmp_path, **{f"training.{name}": bad})
    assert _message(lambda: load_spec(spec, quick=True)).endswith(
        f".training: {_said(name, words)}"
    )
    assert _message(lambda: Recipe(**{name: bad})) == _said(name, words)


def test_good_values_pass_and_are_coerced_the_same_everywhere():
    cfg = from_dict(
        {"measure_data": {"batch_size": 16.0}, "runtime": {"budget": "2m", "threads": "3"}}, env={}
    )
    assert (cfg.measure_data.batch_size, cfg.runtime.budget, cfg.runtime.threads) == (16, 120.0, 3)
    st = Settings.build(batch_size=16.0, budget="2m", recompute=True)
    assert (st.batch_size, st.budget, st.recompute) == (16, 120.0, "true")
    assert type(st.batch_size) is int
    assert Recipe(lr=1, batch_size=None).lr == 1.0  # full batch stays allowed in Python
    for dev in ("auto", "cpu", "cuda", "cuda:1"):
        assert validate("device", dev) == dev


def test_the_checks_words():
    """Each constraint's words, from the numbers (not from another message)."""
    assert Integral(1).describe() == "an int ≥ 1"
    assert Integral(2, 5).describe() == "an int in [2, 5]"
    assert Integral().describe() == "an int"
    assert Real(0, 1, "neither").describe() == "a float in (0, 1)"
    assert Real(0, None, "neither").describe() == "a float > 0"
    assert Real(None, 3, "both").describe() == "a float ≤ 3"
    assert OneOf("a", "b").describe() == "one of a, b" and OneOf("all").describe() == "all"
    assert Optional(Either(Integral(1), OneOf("auto"))).describe() == "an int ≥ 1, auto or null"
    assert not Integral(1).ok(True) and not Real(0, 1).ok(float("nan"))
