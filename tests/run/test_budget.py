"""Budgets (issue 26, points 1 and 5): capped estimators return the estimate of the work they did,
measures map that to status ``budget``; relative tolerances on quantities near 0 stop at their
absolute floor with status ``near_zero``. References are dense float64 matrices and Hessians built
row by row with double backward."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest
import torch
from torch import nn

from flatcli import api
from flatcli.cli import app
from flatcli.config import from_dict, parse_measures, parse_seconds
from flatcli.engine import linalg
from flatcli.engine.linalg import Budget
from flatcli.errors import ConfigError
from flatcli.run.prediction import shares as shares_module
from flatcli.run.prediction.shares import BudgetSplit, continuations, stopped_by_share
from tests.helpers import TinyBN, tiny_data, tiny_mlp, write_project
from tests.oracles import call, model_hessian, runner

DT = torch.float64


def sym(P: int, seed: int, eigs=None) -> torch.Tensor:
    """A dense symmetric matrix with eigenvalues ``eigs`` (default: 1..P spread) in a random basis."""
    g = torch.Generator().manual_seed(seed)
    Q = torch.linalg.qr(torch.randn(P, P, generator=g, dtype=DT)).Q
    e = torch.as_tensor(eigs if eigs is not None else np.linspace(0.1, 5.0, P), dtype=DT)
    return (Q * e) @ Q.T


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ capped estimators


def test_capped_hutchinson_returns_the_estimate_and_stderr_of_its_probes():
    A = sym(40, 0)
    b = Budget(max_products=40)
    r = linalg.hutchinson(
        linalg.as_operator(lambda V: V @ A, 40, dtype=DT),
        stop=linalg.ProbeStop(tol=1e-9, min_probes=16, budget=b),
        generator=gen(3),
        settings=linalg.EstimatorSettings(block_size=16),
    )
    assert r.stopped_by_budget and not r.converged and r.probes == 40 and b.spent == 40
    Z = linalg.rademacher(40, 40, gen(3), dtype=DT)  # the same probes, drawn at once
    q = ((Z @ A) * Z).sum(1)
    assert r.estimate == pytest.approx(float(q.mean()), rel=1e-12)
    assert r.stderr_mean == pytest.approx(float(q.std()) / math.sqrt(40), rel=1e-10)
    assert r.stderr == pytest.approx(r.stderr_mean * linalg.t_factor(40), rel=1e-12)
    assert abs(r.estimate - float(torch.trace(A))) < 5 * r.stderr


def test_capped_hutchpp_stays_within_its_products():
    A = sym(60, 1)
    r = linalg.hutchpp(
        linalg.as_operator(lambda V: V @ A, 60, dtype=DT),
        generator=gen(4),
        stop=linalg.ProbeStop(tol=1e-9, min_probes=16, budget=Budget(max_products=30)),
    )
    assert r.stopped_by_budget and not r.converged and r.probes <= 30
    assert math.isfinite(r.estimate) and math.isfinite(r.stderr)
    assert abs(r.estimate - float(torch.trace(A))) < 6 * r.stderr


def test_capped_lanczos_returns_the_ritz_values_of_its_krylov_space():
    A = sym(60, 2)
    v0 = torch.randn(60, generator=gen(5), dtype=DT)
    r = linalg.lanczos(
        linalg.as_operator(lambda V: V @ A, 60, dtype=DT),
        v0=v0,
        stop=linalg.KrylovStop(tol=1e-12, max_steps=50, budget=Budget(max_products=6)),
    )
    assert r.steps == 6 and r.stopped_by_budget and not r.converged
    K = torch.stack([torch.linalg.matrix_power(A, j) @ v0 for j in range(6)], 1)
    Q = torch.linalg.qr(K).Q  # the 6-dimensional Krylov space, in float64
    ref = np.sort(torch.linalg.eigvalsh(Q.T @ A @ Q).numpy())[::-1]
    np.testing.assert_allclose(r.eigenvalues, ref, rtol=1e-8, atol=1e-10)


def test_capped_slq_keeps_whole_runs_and_shares_the_budget():
    A = sym(30, 3)
    b = Budget(max_products=12)
    s = linalg.slq(
        linalg.as_operator(lambda V: V @ A, 30, dtype=DT),
        runs=10,
        steps=5,
        generator=gen(6),
        budget=b,
    )
    assert len(s.nodes) == 2 and s.n_hvp == 10 and s.stopped_by_budget and b.spent == 10
    full = linalg.slq(
        linalg.as_operator(lambda V: V @ A, 30, dtype=DT), runs=10, steps=5, generator=gen(6)
    )
    np.testing.assert_allclose(np.concatenate(s.nodes), np.concatenate(full.nodes[:2]), rtol=1e-12)
    r = linalg.lanczos(
        linalg.as_operator(lambda V: V @ A, 30, dtype=DT),
        generator=gen(7),
        stop=linalg.KrylovStop(max_steps=20, budget=b),
    )
    assert r.steps == 2 and r.stopped_by_budget  # what the SLQ left of the shared cap


def test_an_exhausted_budget_still_gives_a_value():
    A = sym(30, 4)
    b = Budget(max_seconds=0.0)
    r = linalg.hutchinson(
        linalg.as_operator(lambda V: V @ A, 30, dtype=DT),
        generator=gen(1),
        stop=linalg.ProbeStop(budget=b),
    )
    assert r.probes == 2 and r.stopped_by_budget and math.isfinite(r.stderr)
    assert (
        linalg.lanczos(
            linalg.as_operator(lambda V: V @ A, 30, dtype=DT),
            generator=gen(1),
            stop=linalg.KrylovStop(budget=b),
        ).steps
        == 1
    )
    s = linalg.slq(
        linalg.as_operator(lambda V: V @ A, 30, dtype=DT),
        runs=4,
        steps=3,
        generator=gen(1),
        budget=b,
    )
    # the time was up after the first step: runs of one Gauss node are no estimate, none is kept
    assert len(s.nodes) == 0 and s.stopped_by_budget


# ------------------------------------------------------------------ measures under caps


def _measure(measures, model=None, loss="cross_entropy", data=None, **kw):
    model = model if model is not None else tiny_mlp(seed=1)
    x, y = data if data is not None else tiny_data(n=30)
    return api.measure_model(
        model, (x, y), measures, loss=loss, batch_size=8, precision="fp64", **kw
    )


def test_max_hvps_caps_the_trace_at_the_value_of_that_many_probes():
    row = _measure(
        [
            {
                "hessian_trace": {
                    "method": "hutchinson",
                    "tol": 1e-6,
                    "max_hvps": 48,
                    "label": "capped",
                }
            },
            {
                "hessian_trace": {
                    "method": "hutchinson",
                    "min_probes": 48,
                    "max_probes": 48,
                    "label": "fixed",
                }
            },
        ]
    )
    capped, fixed = row.results["capped"], row.results["fixed"]
    assert (
        capped.status == "budget"
        and capped.diagnostics["probes"] == 48
        and capped.diagnostics["n_hvp"] == 48
    )
    assert (
        capped.value == fixed.value
        and capped.stderr == fixed.stderr
        and 0 < capped.stderr < math.inf
    )


def test_every_iterative_measure_maps_its_cap_to_status_budget():
    row = _measure(
        [
            {"hessian_lambda_max": {"max_hvps": 3, "tol": 1e-9}},
            {"hessian_spectrum": {"max_hvps": 20, "top_k": 2, "slq_runs": 4, "slq_steps": 5}},
            {"local_entropy": {"method": "slq", "max_hvps": 30, "slq_steps": 5, "tol": 1e-6}},
            {"hessian_trace": {"method": "hutchpp", "max_hvps": 20, "tol": 1e-6}},
            "frobenius_norm",
        ]
    )
    st = {k: (r.status, r.diagnostics.get("n_hvp")) for k, r in row.results.items()}
    assert st["hessian_lambda_max"] == ("budget", 3)
    assert st["hessian_spectrum"][0] == "budget" and st["hessian_spectrum"][1] <= 20
    assert st["local_entropy"] == ("budget", 30)  # 6 runs of 5 steps: the rounds end at the cap
    assert st["hessian_trace"][0] == "budget" and st["hessian_trace"][1] <= 20
    assert st["frobenius_norm"] == ("ok", 0)
    assert all(math.isfinite(r.value) for r in row.results.values())


def test_a_spent_checkpoint_budget_stops_iterative_measures_and_flags_the_others():
    row = _measure(
        [
            "hessian_lambda_max",
            {"hessian_trace": {"method": "hutchinson"}},
            "frobenius_norm",
            "first_order_flatness",
            {"sharpness_worst": {"restarts": 3}},
            "keskar_sharpness",
        ],
        budget=1e-9,
    )
    res = row.results
    full = _measure(["first_order_flatness", {"sharpness_worst": {"restarts": 3}}]).results
    for lab in ("first_order_flatness", "sharpness_worst", "keskar_sharpness"):  # ascents end early
        assert res[lab].status == "budget", lab
    assert (
        res["sharpness_worst"].diagnostics["n_grad"] < full["sharpness_worst"].diagnostics["n_grad"]
    )
    assert (
        res["first_order_flatness"].diagnostics["n_hvp"]
        == 2
        < full["first_order_flatness"].diagnostics["n_hvp"]
    )
    assert (
        0 < res["first_order_flatness"].value <= full["first_order_flatness"].value
    )  # the best point so far
    assert (
        res["hessian_lambda_max"].status == "budget"
        and res["hessian_lambda_max"].diagnostics["steps"] == 1
    )
    assert (
        res["hessian_trace"].status == "budget" and res["hessian_trace"].diagnostics["probes"] == 2
    )
    assert (
        res["frobenius_norm"].status == "ok"
        and res["frobenius_norm"].diagnostics["over_budget"] is True
    )
    assert all(
        math.isfinite(r.value) and r.diagnostics["budget_seconds"] <= 1e-9 for r in res.values()
    )


def test_a_measure_that_cannot_stop_early_starts_only_when_its_prediction_fits():
    """The exact trace (one unit-vector HVP per parameter) cannot stop early: under a cap its least
    predicted seconds or HVPs must fit, else it is not started (status ``budget``, NaN, the
    reason); a measure that stops early starts whatever its cap."""
    P = sum(p.numel() for p in tiny_mlp(seed=1).parameters())
    row = _measure(
        [
            {"hessian_trace": {"method": "exact", "max_seconds": 1e-6, "label": "tight"}},
            {"hessian_trace": {"method": "exact", "max_seconds": 1e6, "label": "roomy"}},
            {"hessian_trace": {"method": "exact", "max_hvps": P - 1, "label": "few"}},
            {"hessian_trace": {"method": "hutchinson", "max_seconds": 1e-6, "label": "stops"}},
            {"frobenius_norm": {"max_seconds": 1e-9, "label": "free"}},
        ]
    )
    res = row.results
    alone = _measure([{"hessian_trace": {"method": "exact"}}]).results["hessian_trace"]
    for lab in ("tight", "few"):
        assert res[lab].status == "budget" and math.isnan(res[lab].value), lab
        assert res[lab].diagnostics["started"] is False and "n_hvp" not in res[lab].diagnostics, lab
    assert (
        res["tight"].diagnostics["predicted_seconds"][0] > 1e-6
        and "cannot stop early" in res["tight"].diagnostics["reason"]
    )
    assert (
        res["few"].diagnostics["predicted_hvps"] == [P, P]
        and f"max_hvps = {P - 1}" in res["few"].diagnostics["reason"]
    )
    assert (
        res["roomy"].status == "ok"
        and res["roomy"].value == alone.value
        and res["roomy"].diagnostics["n_hvp"] == P
    )
    assert res["stops"].status == "budget" and math.isfinite(
        res["stops"].value
    )  # started, stopped at its cap
    assert res["free"].status == "ok"  # no products to predict: it always starts
    folded = _measure(
        [{"fisher_rao_norm": {"max_seconds": 1e-9}}],
        model=TinyBN().double(),
        params={"include": ["bn.*"]},
    )
    assert (
        folded.results["fisher_rao_norm"].status == "not_applicable"
    )  # its own reason, not the cap's


def test_shares_follow_predicted_seconds_and_leave_the_rest_to_later_measures():
    t = [0.0]
    plan = BudgetSplit(30.0, [1.0, 2.0, 0.0, 3.0], clock=lambda: t[0])
    assert plan.share(0) == pytest.approx(25.0)  # enough: all but what the others need (5 s)
    t[0] = 26.0  # it used 26 s: 4 s left hold the 2 s measure's least, not also the 3 s one's
    assert plan.share(1) == pytest.approx(4.0)
    t[0] = 27.0  # a measure predicted not_applicable (0 s) gets no part of a short budget
    assert plan.share(2) == 0.0 and plan.share(3) == pytest.approx(3.0)  # the last: all left
    t[0] = 0.0
    short = BudgetSplit(6.0, [4.0, 1.0, 3.0], clock=lambda: t[0], minima=[1.0, 1.0, 1.0])
    # 6 s for 8 s predicted: each its minimum (3 s), the 3 s above split by the work beyond it
    assert short.refused == {} and short.share(0) == pytest.approx(1.0 + 3.0 * 3 / 5)
    t[0] = 40.0
    assert plan.share(3) == 0.0
    specs = parse_measures(["hessian_lambda_max", "hessian_trace", "frobenius_norm"])
    secs = {"hessian_lambda_max": 2.0, "hessian_trace": 6.0, "frobenius_norm": 0.0}
    fixed = BudgetSplit.of(100.0, specs[1:2], lambda ss: [secs[s.name] for s in ss], among=specs)
    assert fixed.share(0) == pytest.approx(75.0)


def _simulate(total, predicted, actual, stops, order_seed=None):
    """Run measures one after the other under a `BudgetSplit` on a fake clock, as the pipeline does:
    one that stops early spends min(its cost, its share) (stopped when its share is smaller); one
    that cannot is started only when its predicted seconds fit its share (`flatcli.run.prediction.predict.Fit`).
    Returns (spent, stopped or skipped indices)."""
    t = [0.0]
    plan = BudgetSplit(total, predicted, clock=lambda: t[0])
    cut = []
    for i, (p, a, early) in enumerate(zip(predicted, actual, stops, strict=True)):
        share = plan.share(i)
        if early:
            t[0] += min(a, share)
            cut += [i] if a > share else []
        elif p <= share:
            t[0] += a
        else:
            cut.append(i)
    return t[0], cut


@pytest.mark.parametrize("seed", range(300))
def test_a_budget_at_least_the_cost_stops_nothing(seed):
    """Property over random measure sets: with a budget at least the unbudgeted cost and each
    prediction at most the measure's cost (2×: at most twice), no measure is stopped or
    skipped. A single prediction far above the least (local_entropy's 10,000-product cap) can
    no longer take the time of the others."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 9))
    actual = rng.lognormal(0, 2, n)
    stops = rng.random(n) < 0.6
    cost = float(actual.sum())
    predicted = actual * rng.uniform(0, 1, n)
    assert _simulate(cost * (1 + 1e-9), predicted, actual, stops)[1] == []
    predicted2 = actual * rng.uniform(0, 2, n)
    assert _simulate(2 * cost, predicted2, actual, stops)[1] == []


def _work_clock(monkeypatch):
    """time.perf_counter replaced by the work of every engine made since (HVP 1, gradient and VJP
    0.5, forward 0.2, × 10 ms), plus 1 µs per reading: budgets become deterministic."""
    from flatcli.engine import CurvatureEngine

    engines, reads, init = [], [0], CurvatureEngine.__init__

    def register(self, *a, **k):
        init(self, *a, **k)
        engines.append(self)

    def clock():
        reads[0] += 1
        counts = [e.counters() for e in engines]
        work = sum(
            c["n_hvp"] + 0.5 * (c["n_grad"] + c["n_vjp"]) + 0.2 * c["n_forward"] for c in counts
        )
        return 0.01 * work + 1e-6 * reads[0]

    monkeypatch.setattr(CurvatureEngine, "__init__", register)
    monkeypatch.setattr(time, "perf_counter", clock)


BUDGET_SETS = [
    ["hessian_lambda_max", "hessian_trace", "frobenius_norm"],
    ["local_entropy", "hessian_lambda_max", "first_order_flatness", "hessian_trace"],
    ["hessian_spectrum", "fisher_rao_norm", "sharpness_worst", "keskar_sharpness"],
    [{"hessian_trace": {"method": "exact"}}, "hessian_lambda_max", "normalized_sharpness"],
    ["sharpness_worst", "local_entropy", "hessian_spectrum", "hessian_lambda_max"],
]


def _same(a, b) -> bool:
    return a.status == b.status and (
        a.value == b.value or (math.isnan(a.value) and math.isnan(b.value))
    )


@pytest.mark.slow
@pytest.mark.parametrize("measures", BUDGET_SETS, ids=range(len(BUDGET_SETS)))
def test_twice_the_cost_changes_nothing_and_half_of_it_is_spent(measures, monkeypatch):
    """On a tiny MLP, with time counted in products (`_work_clock`): a budget twice the
    unbudgeted cost gives every measure its unbudgeted status and value; a budget of half the cost
    is spent 60–125% (what a measure stopped by its share did not get while others left time
    unused, it gets once they have run: `flatcli.run.prediction.shares.continuations`)."""
    _work_clock(monkeypatch)
    model, data = tiny_mlp(d=6, h=12, seed=1), tiny_data(n=40)

    def run(budget=None):
        return _measure(measures, model=model, data=data, budget=budget).results

    free = run()
    cost = sum(r.seconds for r in free.values())
    assert cost > 0.5  # at least 50 products: the budget has something to share
    twice = run(2 * cost)
    assert all(_same(twice[k], free[k]) for k in free), {k: twice[k].status for k in free}
    half = run(cost / 2)
    spent = sum(r.seconds for r in half.values())
    assert 0.6 <= spent / (cost / 2) <= 1.25, (spent, cost, {k: half[k].status for k in half})


def test_a_measure_stopped_by_its_share_goes_on_with_the_time_left():
    from flatcli.measures import MeasureResult

    specs = parse_measures(
        [
            "hessian_lambda_max",
            {"hessian_trace": {"max_hvps": 5, "label": "own_cap"}},
            "hessian_trace",
        ]
    )
    res = {
        "hessian_lambda_max": MeasureResult(1.0, seconds=1.0, status="budget"),
        "own_cap": MeasureResult(1.0, seconds=1.0, status="budget"),  # stopped by its max_hvps
        "hessian_trace": MeasureResult(1.0, seconds=3.0, status="budget"),
    }
    assert stopped_by_share(specs[0], res["hessian_lambda_max"])
    assert not stopped_by_share(specs[1], res["own_cap"])
    t = [2.0]
    plan = BudgetSplit(10.0, [1.0, 1.0, 3.0], clock=lambda: 0.0)
    plan.clock = lambda: t[0]

    def go():
        got = []
        for i, share in continuations(plan, specs, res):
            got.append((i, pytest.approx(share)))
            t[0] += 1.0  # the second run of measure i takes 1 s
        return got

    assert go() == [(0, 2.0), (2, 7.0)]  # 8 s left: 8 × 1/4, then the 7 s left
    t[0] = 5.0  # 5 s left: 1.25 s is less than twice λmax's 1 s, 5 s less than twice 3 s
    assert go() == []


# ------------------------------------------------------------------ configuration


def test_budget_values_and_their_errors():
    assert [parse_seconds(v) for v in (90, "90", "90s", "10m", "1h", " 1.5H ")] == [
        90,
        90,
        90,
        600,
        3600,
        5400,
    ]
    for bad in ("10d", "", "-5s", 0, "fast", True, float("inf")):
        with pytest.raises(
            ConfigError, match="runtime.budget must be a positive number of seconds"
        ):
            parse_seconds(bad)
    cfg = from_dict({"runtime": {"budget": "2m"}})
    assert cfg.runtime.budget == 120.0 and from_dict({}).hash() == from_dict({"runtime": {}}).hash()
    with pytest.raises(ConfigError, match="config key 'runtime.budget'"):
        from_dict({"runtime": {"budget": "soon"}})
    spec = parse_measures([{"hessian_trace": {"max_seconds": "1m", "max_hvps": 64, "tol": 0.1}}])[0]
    assert (spec.max_seconds, spec.max_hvps, spec.options) == (60.0, 64, {"tol": 0.1})
    with pytest.raises(
        ConfigError, match=r"measures\[0\].hessian_trace.max_hvps' must be an int ≥ 1"
    ):
        parse_measures([{"hessian_trace": {"max_hvps": 0}}])
    with pytest.raises(ConfigError, match="max_seconds' must be a positive number"):
        parse_measures([{"frobenius_norm": {"max_seconds": "x"}}])


def test_cli_budget_flag(tmp_path):
    cfg = write_project(tmp_path / "p", measures=["hessian_trace", "frobenius_norm"], n_ckpt=1)
    res = runner.invoke(app, ["measure", "-c", str(cfg), "--budget", "soon"])
    assert res.exit_code == 2 and "--budget must be a positive number of seconds" in res.output
    res = runner.invoke(
        app,
        [
            "measure",
            "-c",
            str(cfg),
            "-o",
            str(tmp_path / "o"),
            "--budget",
            "1h",
            "--format",
            "json",
        ],
    )
    assert res.exit_code == 0, res.output
    import json

    rows = json.loads((tmp_path / "o" / "results.json").read_text())["rows"]
    assert rows[0]["measures"]["hessian_trace"]["diagnostics"]["budget_seconds"] <= 3600


# ------------------------------------------------------------------ near zero


def _zero_linear(d=6, h=5, o=3):
    model = nn.Sequential(nn.Linear(d, h, bias=False), nn.Linear(h, o, bias=False)).to(DT)
    for p in model.parameters():
        nn.init.zeros_(p)
    g = gen(0)
    return (
        model,
        torch.randn(20, d, generator=g, dtype=DT),
        torch.randn(20, o, generator=g, dtype=DT),
    )


def _dense_hessian(model, x, y) -> torch.Tensor:
    """The Hessian of the mean per-sample squared error (dense, float64)."""
    return model_hessian(model, lambda ps: ((call(model, ps, x) - y) ** 2).sum(1).mean())


@pytest.mark.parametrize("method", ["hutchinson", "hutchpp"])
def test_a_zero_trace_stops_at_its_floor_with_status_near_zero(method):
    """Two zero-initialized bias-free linear layers under MSE: Tr H = 0 exactly (H only couples the
    layers), so tol 0.02 relative cannot be met; the floor tol·Tr|H| is."""
    model, x, y = _zero_linear()
    H = _dense_hessian(model, x, y)
    assert float(torch.trace(H)) == 0.0 and float(H.abs().max()) > 0.1
    abs_trace = float(torch.linalg.eigvalsh(H).abs().sum())
    row = _measure(
        [{"hessian_trace": {"method": method, "tol": 0.02}}], model=model, loss="mse", data=(x, y)
    )
    r = row.results["hessian_trace"]
    assert r.status == "near_zero" and r.diagnostics["probes"] < 400
    assert 0.5 * abs_trace < r.diagnostics["abs_trace"] < 1.5 * abs_trace
    assert r.stderr <= 0.02 * max(r.diagnostics["abs_trace"], abs(r.value))
    assert abs(r.value) < 4 * r.stderr  # the exact trace, 0, within the error bar


def test_the_floor_reads_tr_abs_h_from_the_spectrums_slq_runs():
    """After hessian_spectrum in one checkpoint's run, the trace's floor takes Tr|H| from the SLQ
    runs it kept (no products of its own), equal to the SLQ estimate of Σ|λ| from the spectrum's
    runs (its nodes and weights in its diagnostics); alone it computes its own 4 × 10-step SLQ."""
    model, x, y = _zero_linear()
    abs_trace = float(torch.linalg.eigvalsh(_dense_hessian(model, x, y)).abs().sum())
    trace = {"hessian_trace": {"method": "hutchinson", "tol": 0.02}}
    both = _measure(
        [{"hessian_spectrum": {"slq_runs": 4, "slq_steps": 12}}, trace],
        model=model,
        loss="mse",
        data=(x, y),
    ).results
    alone = _measure([trace], model=model, loss="mse", data=(x, y)).results["hessian_trace"]
    r, spec = both["hessian_trace"], both["hessian_spectrum"].diagnostics
    P = sum(p.numel() for p in model.parameters())
    kept = np.mean(
        [
            P * np.sum(np.asarray(w) * np.abs(t))
            for t, w in zip(spec["slq_nodes"], spec["slq_weights"], strict=True)
        ]
    )
    assert r.status == alone.status == "near_zero"
    assert (
        r.diagnostics["abs_trace"]
        == pytest.approx(kept, rel=1e-12)
        != alone.diagnostics["abs_trace"]
    )
    assert 0.7 * abs_trace < r.diagnostics["abs_trace"] < 1.3 * abs_trace


def test_a_positive_definite_trace_never_uses_the_floor():
    A = sym(50, 5, eigs=np.geomspace(1e-3, 10.0, 50))
    r = linalg.hutchinson(
        linalg.as_operator(lambda V: V @ A, 50, dtype=DT),
        generator=gen(2),
        stop=linalg.ProbeStop(tol=0.01, max_probes=4000),
    )
    assert r.converged and not r.near_zero and r.stderr <= 0.01 * abs(r.estimate)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["hutchinson", "hutchpp"])
def test_a_trace_small_at_the_spectrums_scale_stops_at_its_floor(method):
    """Tr A = 10 of Tr|A| ≈ 410 (eigenvalues ±[0.5, 1.5], the positive ones 5% larger; the floor
    holds up to 5% of Tr|A|): 1% of 10 needs about 80,000 probes, so the relative test is out of reach within max_probes although the
    trace is many standard errors from 0. The estimator takes the floor tol·Tr|A| (status
    near_zero) after a few dozen probes and its estimate covers the exact trace."""
    P = 400
    eigs = np.concatenate([1.05 * np.linspace(0.5, 1.5, P // 2), -np.linspace(0.5, 1.5, P // 2)])
    A = sym(P, 7, eigs=eigs)
    exact, mag = float(eigs.sum()), float(np.abs(eigs).sum())
    est = linalg.hutchpp if method == "hutchpp" else linalg.hutchinson
    r = est(
        linalg.as_operator(lambda V: V @ A, P, dtype=DT),
        generator=gen(5),
        stop=linalg.ProbeStop(tol=0.01),
    )
    assert r.near_zero and r.converged and r.probes < (300 if method == "hutchinson" else 600), (
        r
    )  # cap: 1,000
    assert abs(r.abs_trace - mag) < 0.2 * mag and r.stderr <= 0.01 * r.abs_trace
    assert (
        abs(r.estimate - exact) < 4 * r.stderr and abs(r.estimate) > 2 * r.stderr
    )  # not indistinguishable from 0
    # mild cancellation (Tr|A| = 1.5 Tr A): not near 0, so the relative test stays (out of reach
    # within the cap) although the floor tol·Tr|A| would be met within it (tried: it stops near_zero)
    mild = np.concatenate([np.linspace(0.5, 1.5, 300), -np.linspace(0.5, 1.5, 60)])
    q = est(
        linalg.as_operator(lambda V: V @ sym(360, 8, eigs=mild), 360, dtype=DT),
        generator=gen(5),
        stop=linalg.ProbeStop(tol=0.002, max_probes=1000),
    )
    assert (
        not q.near_zero
        and not q.converged
        and q.probes >= 1000
        and q.stderr > 0.002 * abs(q.estimate)
    )


def test_a_fixed_probe_count_near_zero_spends_no_products_on_the_floor():
    """min_probes = max_probes (a fixed count, as benchmarks/bench_large.py's 4 or 16 probes): a trace
    within 2σ of 0 at its last probe has no probe left to save, so Tr|A| is not computed (it cost
    40 more products, 10× a 4-probe trace, before this was fixed) and the result is not_converged."""
    P = 400
    eigs = np.concatenate(
        [np.linspace(0.5, 1.5, P // 2), -np.linspace(0.5, 1.5, P // 2)]
    )  # Tr A = 0
    A = sym(P, 7, eigs=eigs)
    r = linalg.hutchinson(
        linalg.as_operator(lambda V: V @ A, P, dtype=DT),
        generator=gen(5),
        stop=linalg.ProbeStop(tol=0.01, min_probes=8, max_probes=8),
    )
    assert abs(r.estimate) < 2 * r.stderr  # near 0: the case that used to compute Tr|A|
    assert r.probes == 8 and r.abs_trace is None and not r.near_zero and not r.converged, r


def test_lanczos_stops_at_the_absolute_floor_when_the_top_eigenvalue_is_zero():
    """λmax = 0 under eigenvalues in [−1, −0.5], products in float32 (as on a network): the residual
    stalls near 1e-9 while |θ| ~ 1e-8, so ‖Hx − θx‖ ≤ 1e-3·|θ| is out of reach (all 100 steps,
    not converged, without the floor); the floor tol²·max|θ| = 1e-6 is met."""
    A = sym(300, 6, eigs=np.concatenate([[0.0], -np.linspace(0.5, 1.0, 299)])).float()
    r = linalg.lanczos(
        linalg.as_operator(lambda V: V @ A, 300, dtype=torch.float32),
        generator=gen(3),
        stop=linalg.KrylovStop(tol=1e-3, max_steps=100),
    )
    assert r.converged and r.near_zero and r.steps < 50
    assert abs(r.eigenvalues[0]) < 1e-6  # known to tol²·‖H‖ absolutely
    big = linalg.lanczos(
        linalg.as_operator(lambda V: V @ A + 2 * V, 300, dtype=torch.float32),
        generator=gen(3),
        stop=linalg.KrylovStop(tol=1e-3, max_steps=100),
    )
    assert big.converged and not big.near_zero  # λmax = 2: the relative test, unchanged


def test_a_sweep_gives_each_unit_its_fixed_share_and_records_its_caps(tmp_path):
    from flatcli.config import load_config
    from flatcli.keys import caps
    from flatcli.sweep.store import measure_hash

    cfg = write_project(
        tmp_path / "p",
        measures=[{"hessian_trace": {"min_probes": 8, "max_probes": 8}}, "frobenius_norm"],
        n_ckpt=1,
    )
    rep = api.sweep(cfg, tmp_path / "s", run=api.RunOptions(budget="1m"), log=lambda m: None)
    assert rep.computed == 2
    import json

    units = [json.loads(p.read_text()) for p in (tmp_path / "s" / "units").glob("*.json")]
    shares = {u["label"]: u["result"]["diagnostics"]["budget_seconds"] for u in units}
    assert (
        sum(shares.values()) == pytest.approx(60.0)
        and shares["hessian_trace"] > shares["frobenius_norm"] > 0
    )
    plain, capped = load_config(cfg), load_config(cfg, {"runtime.budget": 60})
    spec = plain.measure_specs()[0]
    # a cap that does not stop a measure leaves its value: not in the key; the caps go beside it
    # (a result a cap stopped is reused only under the same caps: tests/run/test_keys.py)
    assert measure_hash(plain.to_dict(), spec) == measure_hash(capped.to_dict(), spec)
    assert caps(plain.to_dict(), spec) is None and caps(capped.to_dict(), spec) == {"budget": 60.0}
    assert {u["key"]["caps"]["budget"] for u in units} == {60.0}


def test_a_measure_whose_minimum_does_not_fit_is_refused_at_the_start(monkeypatch, caplog):
    """λmax beside an exact trace predicted at P HVPs (time counted in products: `_work_clock`):
    0.6 s hold λmax's first products but not the trace's P, so the trace is refused before the
    first measure (logged at once; status ``budget``, not started, the reason naming its
    minimum), λmax gets the whole budget and its unbudgeted value, and the row's status is
    ``budget``."""
    _work_clock(monkeypatch)
    model, data = tiny_mlp(d=6, h=12, seed=1), tiny_data(n=40)
    lam = {"hessian_lambda_max": {"tol": 1e-6, "max_steps": 40}}
    measures = [lam, {"hessian_trace": {"method": "exact"}}]
    free = _measure([lam], model=model, data=data).results["hessian_lambda_max"]
    with caplog.at_level("WARNING", logger="flatcli"):
        row = _measure(measures, model=model, data=data, budget=0.6)
    res = row.results
    trace = res["hessian_trace"].diagnostics
    assert trace["started"] is False and "to return a value" in trace["reason"]
    assert any("hessian_trace not started" in m for m in caplog.messages)
    assert _same(res["hessian_lambda_max"], free)
    assert res["hessian_lambda_max"].diagnostics["n_hvp"] == free.diagnostics["n_hvp"]
    assert row.status == "budget" and "hessian_trace" in row.error


@pytest.mark.parametrize("seed", range(200))
def test_every_measure_kept_at_the_start_gets_at_least_its_minimum(seed):
    """Property over random budgets, least seconds and minima (minimum ≤ least): the measures
    refused at the start are exactly those the cheapest-first selection leaves out (none of them
    fits beside those kept); when every measure spends its whole share (the worst case for
    those after it), every measure not refused gets at least its minimum; and a measure that
    stops early is never refused."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 9))
    costs = rng.lognormal(0, 1.5, n)
    minima = costs * rng.uniform(0.05, 1.0, n) * (rng.random(n) < 0.8)
    total = float(costs.sum() * rng.uniform(0.05, 1.5))
    t = [0.0]
    plan = BudgetSplit(total, costs, clock=lambda: t[0], minima=minima)
    kept = [i for i in range(n) if i not in plan.refused]
    assert sum(minima[kept]) <= total * (1 + 1e-9)
    for j in plan.refused:
        assert sum(minima[kept]) + minima[j] > total, (j, plan.refused)
    for i in range(n):
        share = plan.share(i)
        if i in plan.refused:
            assert share == 0.0
            continue
        assert share >= minima[i] * (1 - 1e-9), (i, share, minima[i])
        t[0] += share
    early = rng.random(n) < 0.5  # a measure that stops early is never refused: it has a value
    assert not set(BudgetSplit(total, costs, minima=minima, early=early).refused) & set(
        np.flatnonzero(early).tolist()
    )


CHEAP_AND_DEAR = [
    "hessian_lambda_max",
    {"hessian_trace": {"tol": 0.05, "max_probes": 100}},
    "frobenius_norm",
    "inverse_margin",
    {"sharpness_average": {"rho": 0.01, "samples": 5}},
    {"pacbayes_flatness": {"samples": 3}},
    "fisher_rao_norm",
]


def _families():
    """(name, model, data, loss) of three model families: an MLP, a small CNN with BatchNorm,
    a tiny GPT-2 language model."""
    from tests.helpers import conv_bn_setup
    from tests.run.test_memory_counts import tiny_gpt2

    cnn, x, y = conv_bn_setup(n=32)
    gpt, batch = tiny_gpt2(8, 1, rows=8, length=8)
    return [
        ("mlp", tiny_mlp(d=6, h=12, seed=1), tiny_data(n=40), "cross_entropy"),
        ("cnn+bn", cnn, (x, y), "cross_entropy"),
        ("gpt2", gpt.double(), batch, "causal_lm"),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("family", range(3))
def test_half_a_budget_leaves_every_measure_a_value_or_says_why_at_the_start(family, monkeypatch):
    """Over model families, cheap measures (one forward pass to a few) beside adaptive ones,
    time counted in products (`_work_clock`): half and an eighth of the unbudgeted cost leave
    every measure with a value, or refused at the start with the reason (its minimum does not
    fit), the row ``budget`` exactly then; twice the cost changes no status and no value."""
    _work_clock(monkeypatch)
    name, model, data, loss = _families()[family]

    def run(budget=None):
        if loss == "causal_lm":
            return api.measure_model(
                model, data, CHEAP_AND_DEAR, loss=loss, batch_size=4, precision="fp64",
                budget=budget,
            )  # fmt: skip
        return _measure(CHEAP_AND_DEAR, model=model, data=data, budget=budget)

    free = run().results
    cost = sum(r.seconds for r in free.values())
    twice = run(2 * cost).results
    assert all(_same(twice[k], free[k]) for k in free), {k: twice[k].status for k in free}
    for fraction in (2, 8):  # half the cost; an eighth, below what the measures least need
        half = run(cost / fraction)
        empty = []
        for label, r in half.results.items():
            assert r.status != "error", (name, label, r)
            if r.status != "budget" or math.isfinite(r.value):  # a value, or a status of one
                continue
            assert r.diagnostics["started"] is False, (name, label, r)
            assert "to return a value" in r.diagnostics["reason"], (name, label, r.diagnostics)
            empty.append(label)
        assert half.status == ("budget" if empty else "ok"), (name, half.status, empty)


def test_measure_exits_4_when_a_budget_leaves_a_measure_without_a_value(tmp_path):
    """``measure --budget``: a budget too small for an exact trace's minimum leaves it without a
    value (row status ``budget``, exit code 4); a budget that merely caps an adaptive measure
    (its first unit: a value) exits 0 with row status ``ok``."""
    cfg = write_project(tmp_path / "p", measures=[{"hessian_trace": {"method": "exact"}}])
    res = runner.invoke(
        app, ["measure", "-c", str(cfg), "--budget", "0.000001", "-o", str(tmp_path / "a")]
    )
    assert res.exit_code == 4, res.output
    rows = json.loads((tmp_path / "a" / "results.json").read_text())["rows"]
    assert {r["status"] for r in rows} == {"budget"}
    cfg2 = write_project(tmp_path / "q", measures=[{"hessian_trace": {"method": "hutchinson"}}])
    res = runner.invoke(
        app, ["measure", "-c", str(cfg2), "--budget", "0.000001", "-o", str(tmp_path / "b")]
    )
    assert res.exit_code == 0, res.output
    rows = json.loads((tmp_path / "b" / "results.json").read_text())["rows"]
    assert {r["status"] for r in rows} == {"ok"}
    assert {r["measures"]["hessian_trace"]["status"] for r in rows} == {"budget"}


def test_a_plan_learns_the_measured_seconds_per_product(monkeypatch):
    """Time counted in products (`_work_clock`: an HVP 10 ms) while the plan's timed product says
    1 ms: once the exact trace (P products, run first: it cannot stop early) has run, the later
    measures' least seconds are predicted again at the measured speed and what is left is split
    again, so they equal (within 5%) those of a plan timed right, where the first plan was 10×
    short; the first block of a later measure expects the measured speed."""
    from flatcli.run.prediction import predict as predict_module

    _work_clock(monkeypatch)
    model, data = tiny_mlp(d=6, h=12, seed=1), tiny_data(n=40)
    measures = [
        {"hessian_trace": {"method": "exact", "label": "exact"}},
        "hessian_lambda_max",
        {"hessian_trace": {"method": "hutchinson", "min_probes": 8, "label": "hutch"}},
    ]
    splits = []
    split_of = shares_module.BudgetSplit.of

    def record(*a, **k):
        splits.append(split_of(*a, **k))
        return splits[-1]

    monkeypatch.setattr(shares_module.BudgetSplit, "of", staticmethod(record))
    _measure(measures, model=model, data=data, budget=100.0)
    right = list(splits[-1].costs)
    quick = predict_module.quick_times

    def fast(engine):  # the timed product 10× too fast
        t = quick(engine)
        t.hvp1, t.hvp_block = t.hvp1 / 10, t.hvp_block / 10
        return t

    monkeypatch.setattr(predict_module, "quick_times", fast)
    splits.clear()
    _measure(measures, model=model, data=data, budget=100.0)
    learned = splits[-1]
    first = learned.costs[0]
    assert first == pytest.approx(right[0] / 10, rel=0.05)  # the exact trace, planned too fast
    for j in (1, 2):  # λmax and Hutchinson: planned again at the measured speed
        assert learned.costs[j] == pytest.approx(right[j], rel=0.05), (j, learned.costs, right)


def test_a_measures_minimum_is_its_first_unit_or_its_least_work():
    """`Fit.minimum` on set times, over engine blocks of 1, 4 and 8: a measure that cannot stop
    early needs its least seconds; λmax (one vector a step) its first two products; a Hutchinson
    trace (probes in engine blocks) its first block, at least two probes, less than its least; a
    norm without timed work 0."""
    from flatcli.measures import Dims
    from flatcli.run.prediction.predict import Fit, ProductTimes

    for block in (1, 4, 8):
        fit = Fit(None, lambda: Dims(P=100, n=40, C=4))
        fit._times = ProductTimes(
            forward=0.01, grad=0.02, hvp1=0.1, hvp_block=0.1 * block, block=max(block, 2),
            engine_block=block, product_bytes=0, memory="", P=100, element=4,
        )  # fmt: skip
        lam, trace, avg, frob = parse_measures(
            [
                {"hessian_lambda_max": {"min_steps": 20}},
                {"hessian_trace": {"method": "hutchinson", "min_probes": 16}},
                {"sharpness_average": {"samples": 5}},
                "frobenius_norm",
            ]
        )
        t = fit.times
        assert fit.minimum(avg) == pytest.approx(fit.seconds(avg))
        assert fit.minimum(lam) == pytest.approx(t.hvp_seconds(2, 1))  # one vector a step
        first = t.hvp_seconds(max(2, block), 0)  # the trace's probes come in engine blocks
        assert first == pytest.approx(fit.minimum(trace)) and first < fit.seconds(trace), block
        assert fit.minimum(frob) == 0.0
