"""flatcli correlate --compare A,B: the paired bootstrap of the difference of two measures' correlations with the
gap, against scipy on every resample, Zou's (2007) published example, and synthetic tables where one measure is
clearly better and where two are tied."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

import flatcli
from flatcli.analysis.compare import (
    STATISTICS,
    compare_measures,
    kendall_rows,
    paired_bootstrap,
    pearson_rows,
    spearman_rows,
    zou_interval,
)
from flatcli.cli import app
from flatcli.errors import ConfigError
from tests.oracles import runner


def _table(n=40, noise_a=0.3, noise_b=2.0, seed=0):
    rng = np.random.default_rng(seed)
    g = rng.normal(size=n)
    return pd.DataFrame(
        {
            "gen_gap": g,
            "A": g + noise_a * rng.normal(size=n),
            "B": g + noise_b * rng.normal(size=n),
            "C": g + noise_b * rng.normal(size=n),
        }
    )


@pytest.mark.parametrize(
    "n", [12, 200]
)  # all rows at once from sign matrices; scipy per row above 150 columns
def test_row_statistics_match_scipy_with_ties(n):
    rng = np.random.default_rng(1)
    X = rng.integers(0, 5, size=(30, n)).astype(float)  # many ties, as in bootstrap resamples
    Y = rng.normal(size=(30, n)).round(1)
    X[7] = 2.0  # a constant row among the others
    tau, rho, r = kendall_rows(X, Y), spearman_rows(X, Y), pearson_rows(X, Y)
    assert np.isnan(tau[7]) and np.isnan(rho[7]) and np.isnan(r[7])
    for k in set(range(30)) - {7}:
        assert tau[k] == pytest.approx(
            stats.kendalltau(X[k], Y[k], variant="b").statistic, rel=1e-12
        )
        assert rho[k] == pytest.approx(stats.spearmanr(X[k], Y[k]).statistic, rel=1e-12)
        assert r[k] == pytest.approx(stats.pearsonr(X[k], Y[k]).statistic, rel=1e-12)


def test_each_resample_is_the_scipy_difference_on_the_same_rows():
    df = _table(n=15)
    a, b, g = (df[c].to_numpy() for c in ("A", "B", "gen_gap"))
    diffs = paired_bootstrap(a, b, g, 50, seed=3)
    idx = np.random.default_rng(3).integers(0, 15, size=(50, 15))
    for k in (0, 17, 49):
        i = idx[k]
        ref = stats.kendalltau(a[i], g[i]).statistic - stats.kendalltau(b[i], g[i]).statistic
        assert diffs["kendall_tau_b"][k] == pytest.approx(ref, rel=1e-12)
        ref = stats.spearmanr(a[i], g[i]).statistic - stats.spearmanr(b[i], g[i]).statistic
        assert diffs["spearman"][k] == pytest.approx(ref, rel=1e-12)


def test_zou_2007_published_example():
    # Zou (2007), overlapping dependent correlations: r = 0.396 and 0.179, r_AB = 0.088, n = 66 → [−0.093, 0.517].
    lo, hi = zou_interval(0.396, 0.179, 0.088, 66)
    assert round(lo, 3) == -0.093 and round(hi, 3) == 0.517


def test_clearly_better_measure_ranks_above_and_the_interval_excludes_zero():
    df = _table()
    out = flatcli.compare(df, "A", "B", bootstrap=1000, seed=0)
    assert list(out["statistic"]) == list(STATISTICS) and (out["n"] == 40).all()
    assert (out["lo"] > 0).all() and (out["verdict"] == "A ranks above B").all()
    t = out.set_index("statistic")
    assert t.loc["kendall_tau_b", "a"] == pytest.approx(
        stats.kendalltau(df.A, df.gen_gap).statistic, rel=1e-12
    )
    assert t.loc["pearson", "difference"] == pytest.approx(
        stats.pearsonr(df.A, df.gen_gap).statistic - stats.pearsonr(df.B, df.gen_gap).statistic,
        rel=1e-12,
    )
    assert t.loc["pearson", "zou_lo"] > 0 and math.isnan(t.loc["spearman", "zou_lo"])
    assert (out["p_value"] < 0.05).all()
    # reversed order: the same evidence, the other way round
    rev = flatcli.compare(df, "B", "A", bootstrap=1000, seed=0)
    assert (rev["hi"] < 0).all() and (rev["verdict"] == "A ranks above B").all()
    assert np.allclose(rev["difference"], -out["difference"])


def test_equally_good_measures_are_tied():
    df = _table(noise_a=2.0, noise_b=2.0, seed=4)
    out = compare_measures(df, "B", "C", bootstrap=1000, seed=0)
    assert ((out["lo"] < 0) & (out["hi"] > 0)).all() and (out["verdict"] == "tied").all()
    assert (out["p_value"] > 0.05).all()


def test_seeded_and_paired_rows_only():
    df = _table()
    df.loc[3, "A"] = np.nan  # a missing value drops the row for both measures
    x = compare_measures(df, "A", "B", bootstrap=200, seed=7)
    assert (x["n"] == 39).all()
    pd.testing.assert_frame_equal(x, compare_measures(df, "A", "B", bootstrap=200, seed=7))
    assert not x.equals(compare_measures(df, "A", "B", bootstrap=200, seed=8))


def test_bad_requests_are_config_errors():
    df = _table()
    with pytest.raises(ConfigError, match="two different measures"):
        compare_measures(df, "A", "A")
    with pytest.raises(ConfigError, match="no column D"):
        compare_measures(df, "A", "D")
    with pytest.raises(ConfigError, match="needs ≥ 3 checkpoints"):
        compare_measures(df.head(2), "A", "B")
    with pytest.raises(ConfigError, match="B is constant over the 40 usable rows"):
        compare_measures(df.assign(B=1.0), "A", "B")


def test_cli_compare(tmp_path):
    path = tmp_path / "results.csv"
    _table().to_csv(path, index=False)
    res = runner.invoke(
        app, ["correlate", str(path), "-m", "A,B,C", "--compare", "A,B", "-o", str(tmp_path)]
    )
    assert res.exit_code == 0, res.output
    assert "paired comparison with gen_gap (A vs B):" in res.output
    assert res.output.count("A ranks above B") == 3 and "Zou (2007)" in res.output
    assert (tmp_path / "comparison.csv").exists()
    res = runner.invoke(app, ["correlate", str(path), "--compare", "B,C"])
    assert res.exit_code == 0 and res.output.count(": tied") == 3
    res = runner.invoke(app, ["correlate", str(path), "--compare", "A"])
    assert res.exit_code == 2 and "must be two measures as A,B" in res.output
