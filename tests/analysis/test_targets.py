"""What correlate predicts: derived gaps and expressions of columns, the default per loss, the
minimum rule per loss, collapsed notes and a CMI warning that never says "nan"."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from flatcli import api
from flatcli.analysis.correlation import correlate_table
from flatcli.analysis.rendering import notes
from flatcli.analysis.statistics import check_cmi_grid
from flatcli.analysis.table import as_table
from flatcli.analysis.targets import CLASSIFIER_LOSSES, default_target, minimum_rule, resolve_target
from flatcli.cli import app
from flatcli.engine.losses import LOSSES
from flatcli.errors import ConfigError
from tests.oracles import runner


def lm_frame(seed: int, n: int = 8, ppl: bool = True) -> pd.DataFrame:
    """A language-model results table: two measures, losses per token, a 2 × n/2 grid."""
    rng = np.random.default_rng(seed)
    train = rng.uniform(1.0, 3.0, n)
    test = train + rng.uniform(0.0, 0.5, n)
    df = pd.DataFrame(
        {
            "checkpoint": [f"m{i}" for i in range(n)],
            "lam": rng.normal(size=n),
            "lam_status": "ok",
            "norm": rng.normal(size=n),
            "norm_status": "ok",
            "train_loss": train,
            "train_acc": rng.uniform(0.2, 0.5, n),
            "test_loss": test,
            "test_acc": rng.uniform(0.2, 0.5, n),
            "hp_width": [16, 32] * (n // 2),
            "hp_wd": np.repeat(np.arange(n // 2), 2),
        }
    )
    if ppl:
        df["train_ppl"], df["test_ppl"] = np.exp(train), np.exp(test)
    return df


@pytest.mark.parametrize("seed", range(20))
def test_expressions_and_derived_targets_equal_numpy(seed):
    df = lm_frame(seed)
    t = as_table(df)
    cases = {
        "test_loss - train_loss": df.test_loss - df.train_loss,
        "test_loss-train_loss": df.test_loss - df.train_loss,
        "test_acc / train_acc": df.test_acc / df.train_acc,
        "log(test_ppl) - log(train_ppl)": np.log(df.test_ppl) - np.log(df.train_ppl),
        "-2 * (`train_loss` - 1) ** 2 + abs(lam)": -2 * (df.train_loss - 1) ** 2 + df.lam.abs(),
        "sqrt(exp(test_loss))": np.sqrt(np.exp(df.test_loss)),
        "loss_gap": df.test_loss - df.train_loss,
        "gen_gap": df.train_acc - df.test_acc,
    }
    for expr, want in cases.items():
        out, col, _ = resolve_target(t, expr)
        np.testing.assert_allclose(out.numeric(col), want.to_numpy(), rtol=1e-13, atol=0)
        assert col not in df.columns and col in out.columns  # a copy: the input is untouched
    # derived perplexities from the losses when the table has none
    bare = as_table(lm_frame(seed, ppl=False))
    out, col, _ = resolve_target(bare, "test_ppl")
    np.testing.assert_allclose(out.numeric(col), np.exp(df.test_loss), rtol=1e-13)


@pytest.mark.parametrize(
    "expr",
    [
        "__import__('os').system('true')",
        "train_loss.__class__",
        "(lambda: 1)()",
        "train_loss[0]",
        "open('x')",
        "[train_loss]",
        "train_loss if 1 else 0",
        "'text'",
        "log(train_loss, 2)",
        "train_loss < 1",
    ],
)
def test_anything_but_arithmetic_of_columns_is_refused(expr):
    with pytest.raises(ConfigError, match="`target`.*not allowed"):
        resolve_target(as_table(lm_frame(0)), expr)


def test_unknown_names_and_bad_syntax_say_what(tmp_path):
    t = as_table(lm_frame(0))
    with pytest.raises(ConfigError, match="no column 'tset_loss'.*numeric columns: .*test_loss"):
        resolve_target(t, "tset_loss - train_loss")
    with pytest.raises(ConfigError, match="not an expression of columns"):
        resolve_target(t, "test_loss -")
    with pytest.raises(ConfigError, match="'nope' is not a column"):
        resolve_target(t, "nope")
    no_test = as_table(lm_frame(0).drop(columns=["test_loss", "test_ppl", "test_acc"]))
    with pytest.raises(ConfigError, match="loss_gap.*needs those columns.*data.test"):
        resolve_target(no_test, "loss_gap")
    path = tmp_path / "r.csv"
    lm_frame(0).to_csv(path, index=False)
    res = runner.invoke(app, ["correlate", str(path), "--target", "__import__('os')"])
    assert res.exit_code == 2 and "not allowed" in res.output
    res = runner.invoke(app, ["correlate", str(path), "--target", "test_loss - train_loss"])
    assert res.exit_code == 0, res.output
    assert "predicts test_loss - train_loss" in res.output


def test_default_target_per_loss_and_caption(tmp_path):
    lm = correlate_table(lm_frame(1))
    assert lm.target == "loss_gap" and "language models" in lm.caption
    assert "test_loss − train_loss (per scored token)" in lm.caption
    ce = lm_frame(1, ppl=False)
    ce["gen_gap"] = ce.train_acc - ce.test_acc
    rep = correlate_table(ce)
    assert rep.target == "gen_gap" and "train_acc − test_acc" in rep.caption
    # results.json's loss decides for a table beside it
    path = tmp_path / "results.csv"
    ce.to_csv(path, index=False)
    for loss, want in (
        ("causal_lm", "loss_gap"),
        ("cross_entropy", "gen_gap"),
        ("mse", "loss_gap"),
    ):
        path.with_suffix(".json").write_text(json.dumps({"config": {"loss": loss}}))
        assert correlate_table(as_table(path)).target == want
    res = runner.invoke(app, ["correlate", str(path)])
    assert res.exit_code == 0, res.output
    assert "target: loss_gap = test_loss − train_loss; the default target for loss mse" in (
        " ".join(res.output.split())
    )


def test_minimum_warning_for_classifiers_only(tmp_path):
    lm = lm_frame(2)  # train_loss 1..3 and accuracy < 0.5: far from CE ≤ 0.01
    assert not any("not at a minimum" in w for w in correlate_table(lm).warnings)
    ce = lm_frame(2, ppl=False)
    ce["gen_gap"] = ce.train_acc - ce.test_acc
    assert any("not at a minimum" in w for w in correlate_table(ce).warnings)
    path = tmp_path / "results.csv"
    ce.to_csv(path, index=False)
    path.with_suffix(".json").write_text(json.dumps({"config": {"loss": "causal_lm"}}))
    res = runner.invoke(app, ["correlate", str(path), "--target", "loss_gap"])
    assert res.exit_code == 0 and "not at a minimum" not in res.output


def test_rules_per_loss_are_the_loss_plugins():
    for name, cls in LOSSES.items():
        assert default_target([], name) == cls.gap, name
        assert CLASSIFIER_LOSSES.get(name) == cls.minimum_loss, name
        assert minimum_rule(name) == (cls.minimum_loss is not None), name


def test_a_note_shared_by_measures_is_one_line_with_a_count():
    df = lm_frame(3, n=4)
    df["m3"], df["m3_status"] = df.lam * 2, "ok"
    rep = correlate_table(df, by=["width", "wd"])
    shared = [n for n in notes(rep) if n.startswith("CMI undefined")]
    assert shared == [
        "CMI undefined: the conditioning hyperparameters determine the gap order "
        "(3 measures: " + ", ".join(mc.measure for mc in rep.measures) + ")"
    ]


@pytest.mark.parametrize("seed", range(20))
def test_cmi_warning_never_says_nan(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 9))
    g = rng.normal(size=n)
    hp = {"a": [str(i) for i in range(n)], "b": [str(int(x)) for x in rng.integers(0, 2, n)]}
    for axes in (["a"], ["a", "b"], ["b"]):
        check = check_cmi_grid(g, {k: hp[k] for k in axes}, axes, seed=seed)
        if check is None or check.reliable:
            continue
        w = check.warning()
        assert "nan" not in w.lower(), w
        if not math.isfinite(check.chance):
            assert "no chance baseline" in w


def test_correlate_frame_api_takes_expressions():
    df = api.correlate_report(lm_frame(4), target="test_acc / train_acc").to_pandas()
    assert len(df) == 2
