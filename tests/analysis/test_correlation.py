"""Correlation statistics against scipy, brute-force references and hand-computed cases."""

from __future__ import annotations

import csv
import itertools
import json
import math
from collections import Counter

import numpy as np
import pytest
from scipy import stats

from flatcli import api
from flatcli.analysis.correlation import correlate_table
from flatcli.analysis.statistics import conditional_mi, granulated_kendall, jiang_tau
from flatcli.analysis.table import load_results
from flatcli.cli import app
from flatcli.errors import ConfigError
from tests.oracles import runner


def write_results(path, rows, labels=None):
    """A results.csv like `flatcli measure`'s: measure values, diagnostics, metrics, hp_* columns."""
    cols = list(rows[0])
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    if labels is not None:
        path.with_suffix(".json").write_text(
            json.dumps({"rows": [{"measures": {lab: {} for lab in labels}}]})
        )
    return path


def grid_rows(m_fn, g_fn, axes=(("a", (0, 1, 2)), ("b", (0, 1)), ("c", (0, 1)))):
    names = [a for a, _ in axes]
    rows = []
    for k, vals in enumerate(itertools.product(*[v for _, v in axes])):
        hp = dict(zip(names, vals, strict=True))
        rows.append(
            {
                "checkpoint": f"m{k}.pt",
                "status": "ok",
                "error": "",
                "mu": repr(float(m_fn(k, hp))),
                "mu_status": "ok",
                "mu_stderr": "0.5",
                "mu_seconds": "1.0",
                "gen_gap": repr(float(g_fn(k, hp))),
                **{f"hp_{a}": v for a, v in hp.items()},
            }
        )
    return rows


# ------------------------------------------------------------------ Jiang's τ, scipy statistics
def test_jiang_tau_equals_kendall_without_ties_and_counts_pairs_with_ties():
    rng = np.random.default_rng(0)
    m, g = rng.normal(size=9), rng.normal(size=9)
    assert jiang_tau(m, g) == pytest.approx(stats.kendalltau(m, g).statistic, abs=1e-12)
    # with ties: (concordant − discordant) / (n choose 2), no tie correction
    m2 = np.array([1, 1, 2, 3, 3, 3, 4.0])
    g2 = np.array([0, 1, 1, 2, 0, 2, 5.0])
    c = d = 0
    for i, j in itertools.combinations(range(7), 2):
        s = np.sign(m2[i] - m2[j]) * np.sign(g2[i] - g2[j])
        c += s > 0
        d += s < 0
    assert jiang_tau(m2, g2) == pytest.approx((c - d) / 21, abs=1e-15)
    assert jiang_tau(m2, g2) != pytest.approx(
        stats.kendalltau(m2, g2).statistic
    )  # τ-b differs with ties
    assert math.isnan(jiang_tau(np.array([1.0]), np.array([2.0])))


def test_table_statistics_match_scipy(tmp_path):
    rng = np.random.default_rng(1)
    mv, gv = rng.normal(size=12), rng.normal(size=12)
    mv[3] = mv[5]  # a tie, so τ-b ≠ Jiang's τ
    rows = grid_rows(lambda k, hp: mv[k], lambda k, hp: gv[k])
    rep = correlate_table(load_results(write_results(tmp_path / "results.csv", rows)))
    (mc,) = rep.measures
    assert mc.n == 12
    assert mc.pearson == pytest.approx(stats.pearsonr(mv, gv).statistic, abs=1e-12)
    assert mc.spearman == pytest.approx(stats.spearmanr(mv, gv).statistic, abs=1e-12)
    assert mc.kendall_tau_b == pytest.approx(
        stats.kendalltau(mv, gv, variant="b").statistic, abs=1e-12
    )
    assert mc.jiang_tau == pytest.approx(jiang_tau(mv, gv), abs=1e-15)
    assert rep.axes == ["a", "b", "c"]


# ------------------------------------------------------------------ granulated Ψ by hand
def test_granulated_psi_on_a_3x2_grid_by_hand():
    # (a, b):     (0,0) (1,0) (2,0) (0,1) (1,1) (2,1)
    m = np.array([1.0, 2.0, 3.0, 1.0, 3.0, 2.0])
    g = np.array([0.1, 0.3, 0.2, 0.5, 0.6, 0.7])
    hp = {"a": ["0", "1", "2", "0", "1", "2"], "b": ["0", "0", "0", "1", "1", "1"]}
    # ψ_a: groups by b. b=0: pairs (0,1) ++, (0,2) ++, (1,2) m↑ g↓ → (1+1−1)/3 = 1/3.
    #                   b=1: (0,1) ++, (0,2) ++, (1,2) m↓ g↑ → 1/3.       ψ_a = 1/3.
    # ψ_b: groups by a, one pair each. a=0: m tie → 0; a=1: ++ → +1; a=2: m↓ g↑ → −1. ψ_b = 0.
    # Ψ = (1/3 + 0) / 2 = 1/6.
    psi, axes = granulated_kendall(m, g, hp, ["a", "b"])
    assert axes["a"].psi == pytest.approx(1 / 3, abs=1e-15)
    assert axes["b"].psi == pytest.approx(0.0, abs=1e-15)
    assert psi == pytest.approx(1 / 6, abs=1e-15)
    assert (axes["a"].groups, axes["a"].n, axes["b"].groups, axes["b"].n) == (2, 6, 3, 6)


def test_granulated_psi_incomplete_grid_skips_singleton_groups():
    # 2×2 grid without (a=1, b=1): group b=1 for axis a and group a=1 for axis b have one model
    m, g = np.array([1.0, 2.0, 3.0]), np.array([0.1, 0.2, 0.05])
    hp = {"a": ["0", "1", "0"], "b": ["0", "0", "1"]}
    psi, axes = granulated_kendall(m, g, hp, ["a", "b"])
    assert (
        axes["a"].psi == 1.0 and axes["a"].groups == 1 and axes["a"].skipped == 1
    )  # (0,0)→(1,0): ++
    assert (
        axes["b"].psi == -1.0 and axes["b"].groups == 1 and axes["b"].skipped == 1
    )  # (0,0)→(0,1): m↑ g↓
    assert psi == 0.0


# ------------------------------------------------------------------ CMI
def _cmi_reference(m, g, hp, axes):
    """Brute force: Python loops over ordered pairs, dict counts, natural log."""
    n = len(m)
    conds = list(itertools.combinations(axes, 2)) if len(axes) >= 2 else [tuple(axes)]
    best = math.inf
    for cond in conds:
        cells: dict[tuple, Counter] = {}
        total = 0
        for i in range(n):
            for j in range(n):
                if i == j or g[i] == g[j]:
                    continue
                u = tuple((hp[a][i], hp[a][j]) for a in cond)
                cells.setdefault(u, Counter())[(np.sign(m[i] - m[j]), np.sign(g[i] - g[j]))] += 1
                total += 1
        mi = h = 0.0
        for cnt in cells.values():
            nu = sum(cnt.values())
            for (a, b), c in cnt.items():
                pa = sum(v for (x, _), v in cnt.items() if x == a)
                pb = sum(v for (_, y), v in cnt.items() if y == b)
                mi += c / total * math.log(c * nu / (pa * pb))
            for b in (-1.0, 1.0):
                pb = sum(v for (_, y), v in cnt.items() if y == b)
                if pb:
                    h -= pb / total * math.log(pb / nu)
        if h > 1e-15:
            best = min(best, mi / h)
    return best


def _grid3():
    vals = list(itertools.product([0, 1, 2], [0, 1], [0, 1]))
    hp = {ax: [str(v[k]) for v in vals] for k, ax in enumerate("abc")}
    return vals, hp


def test_cmi_known_answers():
    vals, hp = _grid3()
    rng = np.random.default_rng(3)
    g = rng.normal(size=len(vals))
    axes = ["a", "b", "c"]
    # the measure is the gap: V_μ = V_g in every cell, I = H → 1
    assert conditional_mi(g, g, hp, axes).value == pytest.approx(1.0, abs=1e-12)
    # a constant measure carries no information → 0
    assert conditional_mi(np.ones_like(g), g, hp, axes).value == pytest.approx(0.0, abs=1e-15)
    # a measure that only reads off hyperparameter a: V_μ is fixed in every cell of (a, b) → 0
    m = np.array([float(v[0]) for v in vals])
    res = conditional_mi(m, g, hp, axes)
    assert res.value == pytest.approx(0.0, abs=1e-12)
    assert "a" in res.condition.split(" × ")
    assert res.pairs == len(vals) * (len(vals) - 1)


def test_cmi_matches_brute_force():
    vals, hp = _grid3()
    rng = np.random.default_rng(4)
    g = rng.integers(0, 4, size=len(vals)).astype(float)  # ties in the gap are dropped
    m = g + rng.normal(scale=1.5, size=len(vals))
    m[2] = m[7]  # a measure tie is kept as V_μ = 0
    axes = ["a", "b", "c"]
    res = conditional_mi(m, g, hp, axes)
    assert res.value == pytest.approx(_cmi_reference(m, g, hp, axes), abs=1e-12)
    assert 0 < res.value < 1
    assert res.pairs == sum(1 for i in range(12) for j in range(12) if i != j and g[i] != g[j])


def test_cmi_cells_are_the_same_partition_with_one_integer_key_or_unique_rows():
    """The cells U_S of the pairs: one mixed-radix int64 key per pair, or (when the axes have too
    many values for one key) numpy's unique rows: both group the pairs exactly as their values do."""
    from flatcli.analysis.statistics import _cell_ids

    rng = np.random.default_rng(0)
    small = {"a": rng.integers(0, 3, 14), "b": rng.integers(0, 4, 14)}
    huge = {k: v * 2**40 for k, v in small.items()}  # the same grid, codes too large for one key
    i, j = np.nonzero(~np.eye(14, dtype=bool))

    def groups(cell):
        return sorted(sorted(np.flatnonzero(cell == c).tolist()) for c in np.unique(cell))

    truth = groups(
        np.unique(
            [
                f"{small['a'][p]},{small['a'][q]},{small['b'][p]},{small['b'][q]}"
                for p, q in zip(i, j, strict=True)
            ],
            return_inverse=True,
        )[1]
    )
    for codes in (small, huge):
        cell = _cell_ids(i, j, codes, ("a", "b"))
        assert cell.min() == 0 and cell.max() == len(np.unique(cell)) - 1  # numbered 0..cells−1
        assert groups(cell) == truth
    assert groups(_cell_ids(i, j, small, ())) == [list(range(len(i)))]


# ------------------------------------------------------------------ robustness and reporting
def test_only_measure_columns_count_and_notes_not_crashes(tmp_path):
    rows = grid_rows(lambda k, hp: k % 5, lambda k, hp: (k * 7) % 11)
    for r in rows:
        r["flat"] = "3.0"  # a constant measure
        r["flat_status"] = "ok"
        r["gappy"] = "" if r["checkpoint"] in ("m1.pt", "m4.pt") else r["mu"]  # missing values
        r["gappy_status"] = "error" if r["checkpoint"] == "m1.pt" else "ok"
        r["train_acc"] = "1.0"
    rows = [
        r for r in rows if not (r["hp_a"] == 2 and r["hp_b"] == 1 and r["hp_c"] == 1)
    ]  # incomplete grid
    path = write_results(tmp_path / "results.csv", rows)
    rep = correlate_table(load_results(path))
    names = {mc.measure for mc in rep.measures}
    assert names == {"mu", "flat", "gappy"}  # not mu_stderr, mu_seconds, train_acc, gen_gap, hp_*
    assert rep.measures_source.startswith("inferred")
    by = {mc.measure: mc for mc in rep.measures}
    assert by["gappy"].n == len(rows) - 2
    assert (
        math.isnan(by["flat"].kendall_tau_b) and "constant over the checkpoints" in by["flat"].notes
    )
    assert by["flat"].jiang_tau == 0.0
    assert any("incomplete grid" in n and "11 of 12" in n for n in rep.notes)
    assert rep.grid is not None and not rep.grid.complete and rep.grid.missing == ["a=2, b=1, c=1"]
    # results.json's labels win over inference
    write_results(path, rows, labels=["mu", "gappy"])
    assert [mc.measure for mc in correlate_table(load_results(path)).measures] != []
    assert {mc.measure for mc in correlate_table(load_results(path)).measures} == {"mu", "gappy"}


def test_default_axes_skip_constant_and_unique_columns(tmp_path):
    rows = grid_rows(lambda k, hp: k, lambda k, hp: -k)
    for i, r in enumerate(rows):
        r["hp_steps"] = 100 + i
        r["hp_dataset"] = "digits"
    rep = correlate_table(load_results(write_results(tmp_path / "results.csv", rows)))
    assert rep.axes == ["a", "b", "c"]
    assert any("steps" in n for n in rep.notes) and any("dataset" in n for n in rep.notes)
    (mc,) = rep.measures
    assert mc.kendall_tau_b == pytest.approx(-1.0) and mc.psi == pytest.approx(-1.0)
    rep2 = correlate_table(load_results(tmp_path / "results.csv"), by="a,hp_b")
    assert rep2.axes == ["a", "b"] and set(rep2.measures[0].psi_axes) == {"a", "b"}
    with pytest.raises(ConfigError, match="`by` 'lr'"):
        correlate_table(load_results(tmp_path / "results.csv"), by="lr")
    with pytest.raises(ConfigError, match="`target` 'test_gap'"):
        correlate_table(load_results(tmp_path / "results.csv"), target="test_gap")


def test_ranking_and_csv(tmp_path):
    rng = np.random.default_rng(5)
    gv = rng.normal(size=12)
    rows = grid_rows(lambda k, hp: gv[k], lambda k, hp: gv[k])
    for k, r in enumerate(rows):
        r["anti"], r["anti_status"] = repr(-gv[k]), "ok"
        r["noise"], r["noise_status"] = repr(rng.normal()), "ok"
    path = write_results(tmp_path / "results.csv", rows)
    rep = api.correlate_report(path, outdir=tmp_path / "corr", sort="kendall_tau_b")
    assert [mc.measure for mc in rep.measures][0] == "mu" and rep.measures[-1].measure == "anti"
    with open(tmp_path / "corr" / "correlations.csv") as f:
        got = list(csv.DictReader(f))
    assert [r["measure"] for r in got] == [mc.measure for mc in rep.measures]
    assert float(got[0]["kendall_tau_b"]) == pytest.approx(1.0, abs=1e-12)
    assert float(got[0]["cmi"]) == pytest.approx(1.0, abs=1e-12)
    assert {"psi_a", "psi_a_groups", "psi_a_n", "cmi_pairs", "cmi_condition"} <= set(got[0])


def test_cli_correlate_with_plots(tmp_path):
    pytest.importorskip("matplotlib")
    rng = np.random.default_rng(6)
    rows = grid_rows(lambda k, hp: rng.normal(), lambda k, hp: rng.normal())
    path = write_results(tmp_path / "results.csv", rows)
    res = runner.invoke(
        app, ["correlate", str(path), "--by", "a,b", "-o", str(tmp_path / "c"), "--plots"]
    )
    assert res.exit_code == 0, res.output
    assert "Kendall τ-b" in res.output and "ψ a" in res.output
    plots = {p.name for p in (tmp_path / "c" / "plots").iterdir()}
    assert {"scatter_mu.png", "scatter_all.png", "psi_heatmap.png"} <= plots
    res = runner.invoke(app, ["correlate", str(path), "--by", "nope"])
    assert res.exit_code == 2 and "--by 'nope'" in res.output


def test_correlate_plots_without_an_output_folder_is_a_usage_error(tmp_path, monkeypatch):
    """--plots writes into -o OUTDIR, as its help says; without -o nothing lands in the working folder."""
    rows = grid_rows(lambda k, hp: float(k), lambda k, hp: float(k % 5))
    path = write_results(tmp_path / "results.csv", rows)
    monkeypatch.chdir(tmp_path)
    before = set(tmp_path.iterdir())
    res = runner.invoke(app, ["correlate", path.name, "--by", "a,b", "--plots"])
    assert res.exit_code == 2 and "--plots needs an output directory (--outdir)" in res.output
    assert set(tmp_path.iterdir()) == before


# ------------------------------------------------------------------ small grids, ties, bootstrap size
def grid_frame(seeds: int, seed: int = 1):
    """3 lr × 3 width × ``seeds`` seeds; a gap driven by lr and width, a measure that tracks it."""
    import pandas as pd

    rng = np.random.default_rng(seed)
    rows = []
    for lr, w, s in itertools.product([0.01, 0.1, 0.3], [64, 128, 256], range(seeds)):
        gap = 0.05 + 0.1 * lr + 1e-4 * w + rng.normal(scale=0.01)
        rows.append(
            {
                "lr": lr,
                "width": w,
                "seed": s,
                "gen_gap": gap,
                "sharp": 10 * gap + rng.normal(scale=0.03),
            }
        )
    return pd.DataFrame(rows)


def brute_pairs_per_cell(df, axes):
    """Fewest untied ordered pairs per occupied cell (U_i, U_j) over every pair of axes, by loops."""
    g = df["gen_gap"].to_numpy()
    best = math.inf
    for a, b in itertools.combinations(axes, 2):
        pairs = [(i, j) for i in range(len(g)) for j in range(len(g)) if i != j and g[i] != g[j]]
        cells = {(df[a][i], df[b][i], df[a][j], df[b][j]) for i, j in pairs}
        best = min(best, len(pairs) / len(cells))
    return best


def test_cmi_warns_on_a_small_grid_and_gives_the_chance_level():
    """18 models (the new user's case): too few pairs per cell; the warning says what CMI needs and
    what a random measure scores there, which an independent 100-draw estimate confirms."""
    small = grid_frame(seeds=2)
    rep = correlate_table(small, measures="sharp", by="lr,width,seed")
    chk = rep.cmi_check
    assert chk.pairs_per_cell == pytest.approx(
        brute_pairs_per_cell(small, ["lr", "width", "seed"]), rel=1e-12
    )
    assert not chk.reliable and any(
        "CMI is not reliable on this grid" in w and "needs ≳ 10" in w for w in rep.warnings
    )
    hp = {a: [str(v) for v in small[a]] for a in ("lr", "width", "seed")}
    rng = np.random.default_rng(99)
    draws = np.array(
        [
            conditional_mi(rng.random(18), small["gen_gap"].to_numpy(), hp, list(hp)).value
            for _ in range(100)
        ]
    )
    assert abs(chk.chance - draws.mean()) <= 4 * draws.std() / math.sqrt(
        20
    )  # the mean of its 20 draws
    assert chk.chance > 0.05  # on this grid noise scores well above 0: the reason for the warning
    large = correlate_table(grid_frame(seeds=8), measures="sharp", by="lr,width")
    assert large.cmi_check.reliable and not large.warnings


def test_ties_in_the_ranking_statistic_are_broken_by_kendall_tau_then_by_name():
    """Two measures with Ψ = 1: one orders every checkpoint like the gap (τ-b = 1), the other only
    within the Ψ groups. The first ranks first whatever the column order; equal ones go by name."""
    import pandas as pd

    rows = [
        {"a": a, "b": b, "gen_gap": a + 10 * b} for a, b in itertools.product(range(2), range(3))
    ]
    df = pd.DataFrame(rows)
    df["within_groups"] = 100 * df["a"] + df["b"]  # ψ_a = ψ_b = 1, but orders a before b
    df["exact"] = df["gen_gap"]
    df["copy_of_exact"] = df["gen_gap"]
    rep = correlate_table(df, measures="within_groups,exact,copy_of_exact", by="a,b")
    assert [mc.psi for mc in rep.measures] == [1.0, 1.0, 1.0]
    assert (
        rep.measures[2].kendall_tau_b
        < rep.measures[0].kendall_tau_b
        == pytest.approx(1.0, abs=1e-12)
    )
    assert [mc.measure for mc in rep.measures] == ["copy_of_exact", "exact", "within_groups"]


def test_bootstrap_needs_enough_resamples_for_its_interval(tmp_path):
    df = grid_frame(seeds=2)
    path = tmp_path / "t.csv"
    df.to_csv(path, index=False)
    res = runner.invoke(app, ["correlate", str(path), "-m", "sharp", "--bootstrap", "1"])
    assert (
        res.exit_code == 2
        and "--bootstrap 1: a 95% percentile interval needs at least 100 resamples" in res.output
    )
    with pytest.raises(ConfigError, match="needs at least 500 resamples"):
        correlate_table(df, measures="sharp", bootstrap=100, confidence=0.99)
    mc = correlate_table(df, measures="sharp", bootstrap=100).measures[0]
    assert mc.intervals["kendall_tau_b"].lo <= mc.kendall_tau_b <= mc.intervals["kendall_tau_b"].hi
