"""The run options as one object (`flatcli.api.RunOptions`), the landscape views as one API
(`flatcli.api.landscape(..., view)`) and `correlate`'s options passed through to `correlate_table`."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import yaml

from flatcli import api
from flatcli.errors import ConfigError
from tests.landscape.test_landscape import write_project
from tests.oracles import runner


@pytest.mark.parametrize(
    "call",
    [
        lambda: api.measure("nowhere.yaml", device="cpu"),
        lambda: api.sweep("nowhere.yaml", "out", seed=3),
        lambda: api.estimate_costs("nowhere.yaml", precision="fp64"),
        lambda: api.landscape("nowhere.yaml", "m.pt", threads=2),
        lambda: api.check_invariance("nowhere.yaml", "m.pt", seed=1),
        lambda: api.correlate_report("nowhere.csv", seed=7),
        lambda: api.correlate_frame("nowhere.csv", seed=7),
    ],
)
def test_the_old_keywords_raise_a_type_error_naming_run_options(call):
    with pytest.raises(TypeError, match=r"run=RunOptions\((device|seed|precision|threads)="):
        call()  # raised before the config or the table is read (neither exists)


def test_run_options_override_the_config_as_its_runtime_keys_do(tmp_path):
    """``run=RunOptions(seed=…, precision=…)`` gives the same slice as the config's
    ``runtime.seed``/``runtime.precision``, and another seed another slice."""
    cfg = write_project(tmp_path)
    raw = yaml.safe_load(cfg.read_text())
    raw["runtime"] = {**raw.get("runtime", {}), "seed": 5, "precision": "fp64"}
    seeded = tmp_path / "seeded.yaml"
    seeded.write_text(yaml.safe_dump(raw))
    ckpt = tmp_path / "m0.pt"
    by_run = api.landscape(cfg, ckpt, steps=3, run=api.RunOptions(seed=5, precision="fp64"))
    by_config = api.landscape(seeded, ckpt, steps=3)
    other = api.landscape(cfg, ckpt, steps=3, run=api.RunOptions(seed=6, precision="fp64"))
    assert by_run.meta["precision"] == "fp64" and by_run.train_loss.dtype == np.float64
    np.testing.assert_array_equal(by_run.train_loss, by_config.train_loss)
    assert not np.array_equal(by_run.train_loss, other.train_loss)


def test_run_options_reject_what_is_not_one():
    with pytest.raises(TypeError, match="run must be a flatcli.api.RunOptions. Got dict"):
        api.landscape("nowhere.yaml", "m.pt", run={"seed": 1})


@pytest.mark.parametrize(
    "view, checkpoints, options, message",
    [
        (
            "contour",
            "m.pt",
            {},
            "`view` must be one of slice, interpolate, pca, connect. Got 'contour'",
        ),
        ("connect", ["a.pt", "b.pt"], {"dims": 2}, "`dims` does not apply to the connect view"),
        ("slice", "m.pt", {"bend_steps": 3}, "`bend_steps` does not apply to the slice view"),
        ("interpolate", ["a.pt"], {}, "`interpolate` takes two checkpoints, A and B. Got 1"),
        ("slice", ["a.pt", "b.pt"], {}, "`slice` takes one checkpoint. Got 2"),
        (
            "connect",
            ["a.pt", "b.pt", "c.pt"],
            {},
            "`connect` takes exactly two checkpoints, A and B. Got 3",
        ),
    ],
)
def test_a_view_takes_only_its_own_options_and_checkpoints(view, checkpoints, options, message):
    with pytest.raises(ConfigError) as e:  # before the config is read (it does not exist)
        api.landscape("nowhere.yaml", checkpoints, view, **options)
    assert message in str(e.value)


def test_the_api_views_write_what_the_cli_views_write(tmp_path):
    """`landscape(..., "interpolate")` equals the CLI's ``landscape interpolate`` (the same
    grid, the same values), and the view's defaults are `InterpolateView`'s."""

    from flatcli.cli import app

    cfg = write_project(tmp_path)
    a, b = tmp_path / "m0.pt", tmp_path / "m1.pt"
    res = api.landscape(cfg, [a, b], "interpolate", steps=5, outdir=tmp_path / "api", plots=False)
    r = runner.invoke(
        app,
        [
            "landscape",
            "interpolate",
            "-c",
            str(cfg),
            str(a),
            str(b),
            "-o",
            str(tmp_path / "cli"),
            "--steps",
            "5",
            "--no-plots",
        ],
    )
    assert r.exit_code == 0, r.output
    api_csv = pd.read_csv(tmp_path / "api" / "landscape.csv")
    cli_csv = pd.read_csv(tmp_path / "cli" / "landscape.csv")
    pd.testing.assert_frame_equal(api_csv, cli_csv)
    assert res.kind == "interpolation"
    np.testing.assert_allclose(
        res.alpha, [-0.5, 0.0, 0.5, 1.0, 1.5], rtol=0, atol=1e-12
    )  # span -0.5,1.5
    meta = json.loads((tmp_path / "api" / "landscape.json").read_text())
    assert meta["checkpoint"] == str(a) and meta["to"] == str(b)


def test_correlate_passes_its_options_through_to_correlate_table():
    """`api.correlate_report` adds files and plots to `correlate_table`: the same statistics and bootstrap
    intervals for the same options, ``run.seed`` its bootstrap seed; an unknown option is
    `correlate_table`'s TypeError."""
    from flatcli.analysis.correlation import correlate_table

    rng = np.random.default_rng(0)
    df = pd.DataFrame({"m": rng.random(12), "n": rng.random(12), "gen_gap": rng.random(12)})
    opts = dict(measures="m,n", bootstrap=50, confidence=0.9, sort="spearman")
    via_api = api.correlate_report(df, run=api.RunOptions(seed=7), **opts)
    direct = correlate_table(df, seed=7, **opts)
    assert [(mc.measure, mc.spearman, mc.intervals) for mc in via_api.measures] == [
        (mc.measure, mc.spearman, mc.intervals) for mc in direct.measures
    ]
    assert [mc.intervals for mc in api.correlate_report(df, **opts).measures] == [
        mc.intervals for mc in correlate_table(df, seed=0, **opts).measures
    ]  # run.seed defaults to 0
    with pytest.raises(TypeError, match="correlate_table"):
        api.correlate_report(df, nosuch=1)
