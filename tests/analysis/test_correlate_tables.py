"""correlate on any table: foreign CSVs, -m/--by on any column, filters, the convergence warning,
bootstrap intervals and the plot encodings."""

from __future__ import annotations

import itertools
import math
import re

import numpy as np
import pandas as pd
import pytest
from scipy import stats

import flatcli
from flatcli import api
from flatcli.analysis.correlation import correlate_table
from flatcli.analysis.statistics import bootstrap_intervals, granulated_kendall, jiang_tau
from flatcli.analysis.table import as_table
from flatcli.cli import app
from tests.oracles import runner


def sweep_table(seed: int = 0) -> pd.DataFrame:
    """A 24-model sweep as another tool would save it: `model` names, lr × width × seed, a
    `sharp` measure that tracks the gap on converged models, a noisy `trace`, and half the
    models stopped above train loss 0.01 (their `sharp` is unrelated to the gap)."""
    rng = np.random.default_rng(seed)
    rows = []
    for k, (lr, width, s) in enumerate(
        itertools.product([0.01, 0.1, 0.3], [64, 128, 256, 512], [0, 1])
    ):
        gap = 0.05 + 0.1 * lr + 1e-4 * width + rng.normal(scale=0.01)
        converged = k % 2 == 0
        sharp = 10 * gap + rng.normal(scale=0.05) if converged else rng.normal(scale=1.0)
        rows.append(
            {
                "model": f"mlp{k}",
                "lr": lr,
                "width": width,
                "seed": s,
                "sharp": sharp,
                "sharp_stderr": 0.05,
                "trace": rng.normal(),
                "train_loss": 0.004 if converged else 0.3,
                "train_acc": 1.0 if converged else 0.93,
                "gen_gap": gap,
            }
        )
    return pd.DataFrame(rows)


@pytest.fixture
def foreign(tmp_path):
    path = tmp_path / "my_table.csv"
    sweep_table().to_csv(path, index=False)
    return path


def by_measure(rep):
    return {mc.measure: mc for mc in rep.measures}


# ------------------------------------------------------------------ any table
def test_foreign_csv_with_m_and_by_on_plain_columns(foreign):
    res = runner.invoke(app, ["correlate", str(foreign), "-m", "sharp,trace", "--by", "lr,width"])
    assert res.exit_code == 0, res.output
    assert "ψ lr" in res.output and "ψ width" in res.output and "measures from -m" in res.output
    rep = api.correlate_report(foreign, measures="sharp,trace", by="lr,width")
    assert rep.axes == ["lr", "width"] and rep.axis_columns == {"lr": "lr", "width": "width"}
    df = sweep_table()
    for name, mc in by_measure(rep).items():
        m, g = df[name].to_numpy(), df["gen_gap"].to_numpy()
        assert mc.n == 24
        assert mc.kendall_tau_b == pytest.approx(stats.kendalltau(m, g).statistic, abs=1e-12)
        assert mc.spearman == pytest.approx(stats.spearmanr(m, g).statistic, abs=1e-12)
        assert mc.jiang_tau == pytest.approx(jiang_tau(m, g), abs=1e-15)
        hp = {"lr": [repr(v) for v in df["lr"]], "width": [str(v) for v in df["width"]]}
        psi, axes = granulated_kendall(m, g, hp, ["lr", "width"])
        assert mc.psi == pytest.approx(psi, abs=1e-15) and mc.psi_axes["lr"].groups == 4


def test_foreign_csv_without_m_takes_the_numeric_columns_and_says_so(tmp_path):
    df = sweep_table()
    path = tmp_path / "t.csv"
    df.to_csv(path)  # with pandas' index column ("Unnamed: 0")
    rep = api.correlate_report(path, by="lr,width")
    assert [mc.measure for mc in rep.measures] != []
    assert set(by_measure(rep)) == {
        "seed",
        "sharp",
        "trace",
    }  # not the target, metrics, axes, stderr, index
    assert rep.measures_source == "numeric columns"
    assert any("took every numeric column" in n and "seed, sharp, trace" in n for n in rep.notes)
    # hp_ columns are flatcli's axes: found by their name, never taken as measures
    df2 = df.rename(columns={"lr": "hp_lr"})
    rep2 = flatcli.correlate(df2, by=["lr", "width"]).attrs["report"]
    assert rep2.axis_columns == {"lr": "hp_lr", "width": "width"} and "hp_lr" not in by_measure(
        rep2
    )


def test_foreign_csv_errors_are_one_line_exit_2(foreign, tmp_path):
    cases = [
        (["-m", "nope"], "-m 'nope': no column nope"),
        (["-m", "model"], "-m 'model': column model"),
        (["--by", "depth"], "--by 'depth': no column depth or hp_depth"),
        (["--target", "test_gap"], "--target 'test_gap'"),
    ]
    for args, msg in cases:
        res = runner.invoke(app, ["correlate", str(foreign), *args])
        assert res.exit_code == 2 and msg in res.output, (args, res.output)
        assert res.output.strip().count("\n") == 0, res.output
    pd.DataFrame({"model": ["a", "b"], "gen_gap": [0.1, 0.2]}).to_csv(
        tmp_path / "none.csv", index=False
    )
    res = runner.invoke(app, ["correlate", str(tmp_path / "none.csv")])
    assert res.exit_code == 2 and "holds no measure columns: name them with -m" in res.output


# ------------------------------------------------------------------ filters and the warning
def test_max_train_loss_reports_the_dropped_rows_and_correlates_the_rest(foreign):
    res = runner.invoke(
        app,
        ["correlate", str(foreign), "-m", "sharp", "--by", "lr,width", "--max-train-loss", "0.01"],
    )
    assert res.exit_code == 0, res.output
    dropped = ", ".join(f"mlp{k}" for k in range(1, 24, 2))
    assert f"--max-train-loss 0.01 dropped 12 of 24 rows: {dropped}" in res.output
    assert "12 checkpoints (of 24, after the filters)" in res.output
    assert "not at a minimum" not in res.output  # every remaining row is at a minimum
    rep = api.correlate_report(foreign, measures=["sharp"], by="lr,width", max_train_loss=0.01)
    assert (
        rep.dropped == [f"mlp{k}" for k in range(1, 24, 2)]
        and rep.n_rows == 12
        and rep.n_input == 24
    )
    df = sweep_table()
    ref = correlate_table(df[df.train_loss <= 0.01], measures=["sharp"], by="lr,width")
    got, want = rep.measures[0], ref.measures[0]
    assert (got.n, got.kendall_tau_b, got.psi, got.cmi) == (
        want.n,
        want.kendall_tau_b,
        want.psi,
        want.cmi,
    )
    over_all = api.correlate_report(foreign, measures=["sharp"], by="lr,width").measures[0]
    assert (
        got.kendall_tau_b > 0.6 and over_all.kendall_tau_b < got.kendall_tau_b - 0.3
    )  # the ranking changes


def test_where_filters_with_a_query_and_names_rows_by_index(foreign):
    rep = api.correlate_report(
        foreign, measures="sharp,trace", by="width", where="lr < 0.3 and train_acc >= 0.99"
    )
    assert rep.n_rows == 8 and rep.filters[0].option == "--where 'lr < 0.3 and train_acc >= 0.99'"
    assert any(
        n.startswith("--where 'lr < 0.3 and train_acc >= 0.99' dropped 16 of 24 rows: mlp1, mlp3")
        for n in rep.notes
    )
    df = sweep_table().set_index(
        "model"
    )  # a DataFrame without a checkpoint column: the index names rows
    rep2 = flatcli.correlate(df, measures="sharp", where="seed == 1").attrs["report"]
    assert rep2.dropped == [f"mlp{k}" for k in range(24) if (k % 2) == 0]


def test_filter_errors_are_one_line_config_errors(foreign, tmp_path):
    for args, msg in [
        (["--where", "lr <"], "--where 'lr <': not an expression of columns"),
        (["--where", "depth > 2"], "--where 'depth > 2': no column 'depth' (columns of"),
        (["--where", "lr > 5"], "the filters left no rows of"),
    ]:
        res = runner.invoke(app, ["correlate", str(foreign), "-m", "sharp", *args])
        assert res.exit_code == 2 and msg in res.output, (args, res.output)
        assert res.output.strip().count("\n") == 0, res.output
    sweep_table().drop(columns=["train_loss"]).to_csv(tmp_path / "noloss.csv", index=False)
    res = runner.invoke(
        app, ["correlate", str(tmp_path / "noloss.csv"), "-m", "sharp", "--max-train-loss", "0.01"]
    )
    assert res.exit_code == 2 and "--max-train-loss needs a train_loss column" in res.output


def test_warning_when_rows_not_at_a_minimum_are_correlated(foreign, tmp_path):
    res = runner.invoke(app, ["correlate", str(foreign), "-m", "sharp", "--by", "lr,width"])
    assert res.exit_code == 0, res.output
    assert (
        "warning: 12 of 24 rows being correlated are not at a minimum (train_loss > 0.01 or train_acc < 0.99)"
        in res.output
    )
    assert (
        "mlp1, mlp3, mlp5" in res.output and "--max-train-loss 0.01 leaves them out" in res.output
    )
    # only train_acc: the fix offered is a --where
    df = sweep_table().drop(columns=["train_loss"])
    rep = flatcli.correlate(df, measures="sharp").attrs["report"]
    assert (
        len(rep.warnings) == 1
        and "train_acc < 0.99" in rep.warnings[0]
        and "--where 'train_acc >= 0.99'" in rep.warnings[0]
    )
    # rows without a value for the measure are not being correlated
    df = sweep_table()
    df.loc[df.train_loss > 0.01, "sharp"] = np.nan
    assert flatcli.correlate(df, measures="sharp").attrs["report"].warnings == []


# ------------------------------------------------------------------ bootstrap intervals
def test_bootstrap_intervals_contain_the_estimate_and_are_reproducible(foreign, tmp_path):
    kw = dict(measures="sharp,trace", by="lr,width", max_train_loss=0.01, bootstrap=400)
    a = api.correlate_report(foreign, run=api.RunOptions(seed=7), outdir=tmp_path / "a", **kw)
    b = api.correlate_report(foreign, run=api.RunOptions(seed=7), **kw)
    c = api.correlate_report(foreign, run=api.RunOptions(seed=8), **kw)
    for mc in a.measures:
        for stat in ("pearson", "spearman", "kendall_tau_b"):
            iv = mc.intervals[stat]
            assert -1 <= iv.lo <= mc.get(stat) <= iv.hi <= 1, (mc.measure, stat, iv)
    assert [mc.intervals for mc in a.measures] == [mc.intervals for mc in b.measures]
    assert [mc.intervals for mc in a.measures] != [mc.intervals for mc in c.measures]
    # the interval is scipy's percentile interval over the same seeded resamples
    df = sweep_table()
    df = df[df.train_loss <= 0.01]
    ref = stats.bootstrap(
        (df.sharp.to_numpy(), df.gen_gap.to_numpy()),
        lambda x, y: stats.kendalltau(x, y).statistic,
        paired=True,
        vectorized=False,
        n_resamples=400,
        method="percentile",
        rng=np.random.default_rng(7),
    )
    iv = by_measure(a)["sharp"].intervals["kendall_tau_b"]
    # flatcli computes every resample's τ-b at once (its own row statistics): the same resamples,
    # the same interval up to the rounding of the last bit
    assert iv.lo == pytest.approx(ref.confidence_interval.low, rel=1e-12)
    assert iv.hi == pytest.approx(ref.confidence_interval.high, rel=1e-12)
    written = pd.read_csv(tmp_path / "a" / "correlations.csv")
    assert {"kendall_tau_b_lo", "kendall_tau_b_hi", "pearson_lo", "spearman_hi"} <= set(
        written.columns
    )
    assert written.loc[0, "kendall_tau_b_lo"] == a.measures[0].intervals["kendall_tau_b"].lo
    res = runner.invoke(
        app, ["correlate", str(foreign), "-m", "sharp", "--bootstrap", "200", "--seed", "3"]
    )
    assert res.exit_code == 0 and "95% bootstrap intervals" in res.output, res.output
    assert re.search(r"\+0\.\d{3} \[[+-]\d\.\d\d, [+-]\d\.\d\d\]", res.output), res.output
    plain = api.correlate_report(foreign, measures="sharp").to_pandas()
    assert not [
        c for c in plain.columns if c.endswith(("_lo", "_hi"))
    ]  # intervals only when asked for


def test_bootstrap_on_a_tiny_sample_skips_undefined_resamples():
    m, g = np.array([1.0, 2.0, 3.0, 4.0]), np.array([0.1, 0.3, 0.2, 0.4])
    ivs, undefined = bootstrap_intervals(m, g, 300, seed=0)
    assert undefined > 0  # some resamples repeat one checkpoint: every statistic undefined there
    for iv in ivs.values():
        assert math.isfinite(iv.lo) and math.isfinite(iv.hi) and -1 <= iv.lo <= iv.hi <= 1
    rep = correlate_table(pd.DataFrame({"mu": m, "gen_gap": g}), bootstrap=300)
    assert any("resamples had a constant column" in n for n in rep.measures[0].notes)


def test_psi_standard_error_over_groups():
    hp = {"a": ["0", "1", "2", "0", "1", "2"], "b": ["0", "0", "0", "1", "1", "1"]}
    m = np.array([1.0, 2.0, 3.0, 1.0, 3.0, 2.0])
    g = np.array([0.1, 0.3, 0.2, 0.5, 0.6, 0.7])
    _, axes = granulated_kendall(m, g, hp, ["a", "b"])
    assert axes["a"].sem == pytest.approx(0.0, abs=1e-15)  # both groups: τ = 1/3
    assert axes["b"].sem == pytest.approx(stats.sem([0.0, 1.0, -1.0]), abs=1e-15)
    rep = correlate_table(
        as_table(pd.DataFrame({"mu": m, "gen_gap": g, "hp_a": hp["a"], "hp_b": hp["b"]}))
    )
    assert rep.to_pandas().loc[0, "psi_b_sem"] == pytest.approx(1 / math.sqrt(3), abs=1e-15)


# ------------------------------------------------------------------ plots
def test_plots_colour_by_one_axis_mark_by_another_with_error_bars(foreign, tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.container import ErrorbarContainer

    from flatcli.analysis import correlation_plots as plots

    res = runner.invoke(
        app,
        [
            "correlate",
            str(foreign),
            "-m",
            "sharp,trace",
            "--by",
            "lr,width",
            "-o",
            str(tmp_path / "c"),
            "--plots",
            "--color-by",
            "width",
            "--marker-by",
            "lr",
        ],
    )
    assert res.exit_code == 0, res.output
    names = {p.name for p in (tmp_path / "c" / "plots").iterdir()}
    assert {"scatter_sharp.png", "scatter_trace.png", "scatter_all.png", "psi_heatmap.png"} <= names
    rep = api.correlate_report(foreign, measures="sharp,trace", by="lr,width")
    fig = plots._figure()
    ax = fig.subplots()
    mc = by_measure(rep)["sharp"]
    plots._scatter(ax, rep.table, rep, mc, ("width", "width"), ("lr", "lr"))
    bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert (
        len(bars) == 1 and len(bars[0].lines[2][0].get_segments()) == 24
    )  # x error bars from sharp_stderr
    assert len(ax.collections) - 1 == 12  # one scatter per (width, lr) present: 4 × 3
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == [
        "width=64",
        "width=128",
        "width=256",
        "width=512",
        "lr=0.01",
        "lr=0.1",
        "lr=0.3",
    ]
    assert ax.get_title().startswith("sharp: τ=") and "Ψ=" in ax.get_title()
    ax2 = fig.subplots()
    plots._scatter(ax2, rep.table, rep, by_measure(rep)["trace"], None, None)
    assert not [
        c for c in ax2.containers if isinstance(c, ErrorbarContainer)
    ]  # no trace_stderr column
    res = runner.invoke(
        app,
        [
            "correlate",
            str(foreign),
            "-m",
            "sharp",
            "-o",
            str(tmp_path / "d"),
            "--plots",
            "--marker-by",
            "depth",
        ],
    )
    assert res.exit_code == 2 and "--marker-by 'depth'" in res.output
