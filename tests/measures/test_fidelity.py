"""What the statuses and intervals claim, against dense float64 Hessians built row by row
(tests/fidelity_models.py: A, a tanh MLP with cross-entropy; B, a ReLU MLP with MSE whose Hessian
is strongly indefinite, 41% of its eigenvalues at the kink of ½log(1 + λ₊)).

* no ``ok`` on fewer than `linalg.MIN_SAMPLES` samples, Student-t intervals that cover;
* no value without an estimate (SLQ runs of fewer than 3 nodes, fewer than 2 runs: NaN, reason);
* an SLQ quadrature error that holds on B;
* the spectrum's tolerance; a capped λmax named a lower bound; ``min_kept_ritz`` after restarts;
* small problems' exact trace and the tighter near-zero floor."""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import pytest
import torch
from scipy.stats import t as student_t
from torch import nn

from flatcli.console import _value_cell
from flatcli.engine import CurvatureEngine, Problem, linalg
from flatcli.measures import MeasureContext, MeasureSpec, get_measure, list_measures, run_measure
from tests.fidelity_models import dense_hessian, reference
from tests.oracles import measure_on as run

DT = torch.float64


def le_exact(ev, gamma=1.0):
    return float(np.sum(0.5 * np.log1p(np.maximum(ev, 0) / gamma)))


def neff_exact(ev, z=1.0):
    lp = np.maximum(ev, 0)
    return float(np.sum(lp / (lp + z)))


# ------------------------------------------------------------------ 1. degrees of freedom


@pytest.mark.slow
def test_hutchpp_under_a_product_cap_covers_and_is_never_ok():
    """A, ``max_hvps: 4``: 2 residual samples (1 degree of freedom). Before: stderr without a t
    factor, status ok at 28 stderr from the truth (seed 13), ±2 stderr covered 12/20."""
    p, ev = reference("A")
    exact = float(ev.sum())
    rs = [
        run(p, "hessian_trace", seed=seed, max_hvps=4, method="hutchpp", per_layer="none")
        for seed in range(20)
    ]
    assert {r.status for r in rs} == {"budget"}  # fewer than MIN_SAMPLES residual samples
    z = [abs(r.value - exact) / r.stderr for r in rs]
    assert sum(v <= 2 for v in z) >= 18  # measured 18/20
    for r in rs:  # the interval is Student's: stderr of the mean × t_{n-1}(0.975)/1.96
        n = r.diagnostics["samples"]
        t = student_t.ppf(0.975, n - 1) / 1.959964
        assert r.stderr == pytest.approx(r.diagnostics["stderr_mean"] * t, rel=1e-6)


@functools.cache
def _dense(name: str) -> torch.Tensor:
    return dense_hessian(reference(name)[0])


@pytest.mark.parametrize("seconds,method", [(10.0, "hutchinson"), (20.0, "hutchpp")])
def test_hutchpp_under_a_short_time_cap_always_has_an_interval(seconds, method):
    """A's dense Hessian behind a clock that advances one second per product: ``max_seconds`` 10
    allows about 10 products. Before, Hutch++ spent them on its sketch (5 + 5) and returned the
    sketch part with an infinite stderr, no residual sample (16/20 runs in the review). Now its
    sketch's probes become Hutchinson samples when the cap leaves no room for residual samples
    (10 s), or it keeps its sketch when it does (20 s): a finite stderr in 20/20, covering."""
    H = _dense("A")
    exact = float(torch.trace(H))
    covered = 0
    for seed in range(20):
        now = [0.0]

        def mv(V, now=now):
            now[0] += V.shape[0]
            return V @ H

        op = linalg.as_operator(mv, H.shape[0], dtype=DT)
        budget = linalg.Budget(max_seconds=seconds, clock=lambda now=now: now[0])
        r = linalg.hutchpp(
            op, stop=linalg.ProbeStop(budget=budget), generator=torch.Generator().manual_seed(seed)
        )
        assert len(r.samples) >= 2 and math.isfinite(r.stderr), r
        assert r.method == method
        assert r.probes <= seconds + 1 and r.stopped_by_budget
        covered += abs(r.estimate - exact) <= 2 * r.stderr
    assert covered >= 18, covered  # ±2 stderr is a 95% interval: 19 of 20 expected


def test_a_fixed_count_below_the_minimum_is_not_ok():
    p, ev = reference("A")
    fixed = {"method": "hutchinson", "min_probes": 3, "max_probes": 3, "per_layer": "none"}
    r = run(p, "hessian_trace", **fixed)
    assert r.status == "not_converged" and not r.diagnostics["converged"]
    # a fixed count that passes its tolerance test is ok, like an adaptive one
    r = run(p, "hessian_trace", **{**fixed, "min_probes": 4, "max_probes": 4, "tol": 0.9})
    assert r.status == "ok" and r.diagnostics["rel_stderr"] <= 0.9


# Options that fix the count of every measure with a tolerance (``tol``) to one too small for its
# default tolerance on model A: each measure's count options set min = max.
FIXED_COUNTS = {
    "hessian_trace": [
        {"method": "hutchinson", "min_probes": 8, "max_probes": 8, "per_layer": "none"},
        {"method": "hutchinson", "min_probes": 4, "max_probes": 4, "per_layer": "json"},
        {"method": "hutchpp", "min_probes": 12, "max_probes": 12, "per_layer": "none"},
    ],
    "local_entropy": [{"method": "slq", "slq_runs": 4, "max_runs": 4, "slq_steps": 10}],
    "hessian_spectrum": [{"slq_runs": 4, "slq_steps": 10, "top_k": 1}],
    "hessian_lambda_max": [{"min_steps": 3, "max_steps": 3}],
    "hessian_top_eigenvalues": [{"min_steps": 3, "max_steps": 3, "top_k": 2}],
    # its optimizer state: two Adam steps on model A (the test writes it)
    "preconditioned_lambda_max": [{"min_steps": 3, "max_steps": 3}],
}
RITZ = ("hessian_lambda_max", "preconditioned_lambda_max")  # a lower bound when not converged


def _adam_state(p: Problem, path) -> str:
    """An Adam state dict of two steps on random gradients over p's model, saved at ``path``."""
    import copy

    model = copy.deepcopy(p.model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        for q in model.parameters():
            q.grad = torch.randn(q.shape, generator=g, dtype=q.dtype)
        opt.step()
    torch.save(opt.state_dict(), path)
    return str(path)


def _tolerance_measures() -> set[str]:
    return {
        m.name
        for m in list_measures()
        if m.options is not None and "tol" in {f.name for f in dataclasses.fields(m.options)}
    }


@pytest.mark.slow
@pytest.mark.parametrize("name,options", [(n, o) for n, opts in FIXED_COUNTS.items() for o in opts])
def test_a_fixed_count_that_misses_its_tolerance_is_never_ok(name, options, tmp_path):
    """Every measure with a tolerance, its count fixed too small (the relative error of the
    interval above ``tol``): ``not_converged`` with a finite interval, over seeds. Before,
    ``hessian_trace`` with min_probes = max_probes and ``local_entropy`` with slq_runs = max_runs
    said ok whatever their error (4 probes: 400/400 ok, true error up to 86% at tol 0.01)."""
    assert set(FIXED_COUNTS) == _tolerance_measures()  # a new measure with a tol joins the table
    p, _ = reference("A")
    tol = get_measure(name).options().tol
    if name == "preconditioned_lambda_max":
        options = {**options, "optimizer_state": _adam_state(p, tmp_path / "adam.pt")}
    for seed in range(3):
        r = run(p, name, seed=seed, **options)
        d = r.diagnostics
        if name == "hessian_top_eigenvalues":
            missed = max(d["residuals"])
        else:
            missed = d["residual"] if name in RITZ else d["rel_stderr"]
        assert missed > tol, (name, options, seed, d)  # the count is too small here
        assert r.status == "not_converged" and not d["converged"], (name, options, seed, r.status)
        if name == "hessian_lambda_max":  # a Ritz value below its tolerance is a lower bound
            assert d["bound"] == "lower bound"
        elif name not in ("hessian_top_eigenvalues", *RITZ):  # a stochastic estimate's interval
            assert math.isfinite(r.stderr) and r.stderr > 0


# ------------------------------------------------------------------ 2. no value without an estimate


def test_slq_runs_cut_before_three_nodes_count_for_nothing():
    p, _ = reference("A")
    H = CurvatureEngine(p).hessian()
    r = linalg.slq(
        H,
        runs=4,
        steps=25,
        generator=torch.Generator().manual_seed(0),
        budget=linalg.Budget(max_seconds=1e-12),
    )
    assert r.nodes == [] and r.stopped_by_budget and math.isnan(r.expect(np.abs)[0])


@pytest.mark.parametrize("name", ["hessian_spectrum", "local_entropy"])
def test_time_capped_slq_measure_without_runs_is_nan_with_reason(name):
    """Before: a one-node Gauss rule (P·f(zᵀHz/P)) reported as N_eff, 2.32 against 24.95."""
    p, _ = reference("A")
    opts = {"method": "slq"} if name == "local_entropy" else {}
    r = run(p, name, max_seconds=1e-9, **opts)
    assert math.isnan(r.value) and r.status == "budget"
    assert r.diagnostics["reason"] == "no SLQ run completed within its share"


@pytest.mark.parametrize("name", ["hessian_spectrum", "local_entropy"])
def test_one_slq_run_asked_for_is_not_converged_and_not_a_budget(name):
    """slq_runs: 1 (and max_runs: 1) without any cap: no interval, so NaN with the reason; the
    status says the options asked too little (``not_converged``), not ``budget``, which would
    make a row without a budget read as capped (and `measure` exit 4)."""
    p, _ = reference("A")
    opts = {"method": "slq", "max_runs": 1} if name == "local_entropy" else {}
    r = run(p, name, slq_runs=1, **opts)
    assert math.isnan(r.value) and r.status == "not_converged", (r.status, r.diagnostics)
    assert r.diagnostics["reason"].startswith("one SLQ run (slq_runs: 1)")
    assert math.isfinite(r.diagnostics["one_run_value"])


def test_capped_lambda_max_is_a_named_lower_bound():
    """Every capped Ritz value is ≤ λmax; the diagnostics and the table say ``lower bound``."""
    p, ev = reference("A")
    for seed in range(20):
        r = run(p, "hessian_lambda_max", seed=seed, max_hvps=2)
        assert r.status == "budget" and r.value <= ev[-1] * (1 + 1e-9)
        assert r.diagnostics["bound"] == "lower bound"
        assert _value_cell(r).endswith("(budget, lower bound)")
    r = run(p, "hessian_lambda_max")
    assert r.status == "ok" and "bound" not in r.diagnostics
    assert r.value == pytest.approx(ev[-1], rel=1e-3)
    assert r.diagnostics["min_ritz"] >= ev[0]  # without restarts: an upper bound of λmin


def test_min_ritz_after_thick_restarts_is_named_kept():
    p, ev = reference("A")
    ctx = MeasureContext(p, CurvatureEngine(p, max_basis_vectors=10), seed=0)
    r = run_measure(MeasureSpec("hessian_lambda_max", "l", {"tol": 1e-6}), ctx)
    d = r.diagnostics
    assert d["restarts"] > 0 and "min_ritz" not in d and "min_kept_ritz" in d
    assert r.value == pytest.approx(ev[-1], rel=1e-5)


# ------------------------------------------------------------------ 3. SLQ on an indefinite Hessian


@pytest.mark.slow
def test_quadrature_error_holds_on_the_kink():
    """B at 25 steps: the Gauss rule's bias is +6.8 (40 runs) on ½log(1 + λ₊); the consecutive
    rules said 2.3, the half-length rule says 24."""
    p, ev = reference("B")
    f = lambda t: 0.5 * np.log1p(np.maximum(t, 0))  # noqa: E731
    Hd = dense_hessian(p).numpy()
    w, V = np.linalg.eigh(Hd)
    fH = (V * f(w)) @ V.T
    Z = linalg.rademacher(40, p.num_params, torch.Generator().manual_seed(0), dtype=DT)
    r = linalg.slq(CurvatureEngine(p).hessian(), steps=25, starts=Z)
    per_run = [p.num_params * np.sum(wr * f(t)) for t, wr in zip(r.nodes, r.weights, strict=True)]
    bias = float(np.mean(per_run) - np.mean([z @ fH @ z for z in Z.numpy()]))
    assert bias > 3  # the case is hard: a bias, the same sign in every run
    assert r.quadrature_error(f) >= 2 * bias


@pytest.mark.slow
@pytest.mark.parametrize("name", ["local_entropy", "hessian_spectrum"])
def test_slq_intervals_cover_on_b_and_ok_is_never_far(name):
    """Per fixed model B, 20 seeds: ±2 stderr covers ≥ 17/20 and ``ok`` never at more than 6%
    true error. Before (local_entropy): 11/20 and 13/20, ``ok`` at 6-9% (seeds 5, 6, 7)."""
    p, ev = reference("B")
    exact = le_exact(ev) if name == "local_entropy" else neff_exact(ev)
    opts = {"method": "slq"} if name == "local_entropy" else {}
    cover = 0
    for seed in range(20):
        r = run(p, name, seed=seed, **opts)
        err = abs(r.value - exact)
        cover += err <= 2 * r.stderr
        assert r.status != "ok" or err <= 0.06 * exact, (seed, r.value, r.status)
    assert cover >= 17


# ------------------------------------------------------------------ 4. the spectrum's tolerance


def test_spectrum_status_follows_its_tolerance():
    """Before: status ok at any stderr (73% relative on a GPT-2). B at 25 steps: the quadrature
    error is 22% of N_eff, above tol 0.1; with tol 0.5 it is ok. The description states the
    clipping."""
    p, ev = reference("B")
    r = run(p, "hessian_spectrum")
    d = r.diagnostics
    assert r.status == "not_converged" and d["rel_stderr"] > 0.1 and not d["converged"]
    r = run(p, "hessian_spectrum", tol=0.5)
    assert r.status == "ok" and abs(r.value - neff_exact(ev)) <= 2 * r.stderr
    desc = get_measure("hessian_spectrum").description
    assert "λ₊/(λ₊ + z)" in desc and "max(λ, 0)" in desc


# ------------------------------------------------------------------ 6. small problems: exact


def _mlp(h: int, act, loss: str, seed: int = 0) -> Problem:
    """A 4-h-3 MLP on 64 rows (ReLU under MSE against 5·randn targets: an indefinite Hessian
    whose trace Hutchinson needs thousands of probes for; tanh under cross-entropy)."""
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(4, h), act(), nn.Linear(h, 3)).to(DT)
    x = torch.randn(64, 4, dtype=DT)
    y = 5 * torch.randn(64, 3, dtype=DT) if loss == "mse" else torch.randint(0, 3, (64,))
    return Problem(m, x, y, loss=loss, batch_size=64, dtype=DT)


@pytest.mark.slow
def test_auto_never_spends_more_than_p_and_its_check():
    """``method: auto`` (defaults: tol 0.01, 16 to 1,000 probes) at P from 67 to 1,899: never more
    products than P plus its check (16) or the near-zero floor (40). Before, auto was exact only
    at P ≤ 64: at P = 67 Hutchinson spent 1,040 products and ended not_converged, where the exact
    trace costs 67. A hard trace takes the exact one after the check (value to 1e-8)."""
    bound = 16 + max(16, 4 * 10)  # the check, then at most P, or the floor beside the probes
    for h, act, loss in (
        (8, nn.ReLU, "mse"),  # P = 67
        (20, nn.ReLU, "mse"),  # 163
        (150, nn.Tanh, "cross_entropy"),  # 1,203 > 1,040: before, Hutchinson without a check
        (237, nn.ReLU, "mse"),  # 1,899
    ):
        p = _mlp(h, act, loss)
        P = p.num_params
        r = run(p, "hessian_trace", per_layer="none")
        d = r.diagnostics
        assert d["n_hvp"] <= P + bound - 16, (P, d)
        assert d["check_probes"] == 16 and d["check_predicted_probes"] > (P - 16) / 2
        assert d["method"] == "exact" and r.status == "ok" and r.stderr == 0.0, (P, d)
        if P <= 200:
            exact = float(torch.trace(dense_hessian(p)))
            assert r.value == pytest.approx(exact, rel=1e-8)


def test_auto_takes_hutchinson_when_its_check_predicts_few_probes():
    """A Hessian with eigenvalues in [1, 1.1] (P = 300): 16 probes predict about one probe to
    tol 0.01, so Hutchinson runs (far below P products) and converges; the same spectrum at
    tol 1e-4 predicts thousands: exact."""
    from tests.fidelity_models import quadratic

    eigs = np.linspace(1.0, 1.1, 300)
    p = quadratic(eigs, seed=1)
    exact = 2 * float(eigs.sum())  # the loss Hessian is 2·A
    r = run(p, "hessian_trace", per_layer="none")
    d = r.diagnostics
    assert d["method"] == "hutchinson" and r.status == "ok", d
    assert d["n_hvp"] == 16 + d["probes"] <= 300 / 2  # the check, one block of probes
    assert d["check_predicted_probes"] < 5 and abs(r.value - exact) <= 2 * r.stderr
    r = run(p, "hessian_trace", per_layer="none", tol=1e-4)
    assert r.diagnostics["method"] == "exact" and r.value == pytest.approx(exact, rel=1e-10)
    assert r.diagnostics["n_hvp"] == 300 + 16


def test_auto_above_the_check_runs_hutchpp_when_its_sketch_is_small():
    """P = 2,200 > 2,080 (no check), eigenvalues 1/i² (the top of the spectrum carries the trace,
    as at trained minima): auto runs Hutch++, which meets tol 0.01 in far fewer products than
    Hutchinson alone; a fixed count, or a sketch above 256 MiB, keeps Hutchinson."""
    from flatcli.measures._trace_auto import SKETCH_BYTES, sketch_bytes, trace_method
    from flatcli.measures.hessian import TraceOptions
    from tests.fidelity_models import quadratic

    eigs = 1.0 / np.arange(1, 2201) ** 2
    p = quadratic(eigs, seed=2)
    exact = 2 * float(eigs.sum())
    r = run(p, "hessian_trace", per_layer="none")
    alone = run(p, "hessian_trace", per_layer="none", method="hutchinson")
    d = r.diagnostics
    assert d["method"] == "hutchpp" and r.status == "ok" and abs(r.value - exact) <= 2 * r.stderr
    assert 3 * d["n_hvp"] < alone.diagnostics["n_hvp"], (d["n_hvp"], alone.diagnostics["n_hvp"])
    o = TraceOptions()
    assert trace_method("auto", 2200, dataclasses.replace(o, max_probes=16)) == "hutchinson"
    big = next(P for P in range(100_000, 200_000, 100) if sketch_bytes(o, P) > SKETCH_BYTES)
    assert trace_method("auto", big - 100, o) == "hutchpp"
    assert trace_method("auto", big, o) == "hutchinson"


def test_small_trace_is_exact_by_default():
    """P = 43 ≤ 4·min_probes: the default computes the exact trace (P HVPs, stderr 0); before,
    Hutchinson spent its probes on a stochastic estimate."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)
    g = torch.Generator().manual_seed(1)
    p = Problem(
        m, torch.randn(30, 4, generator=g, dtype=DT), torch.randint(0, 3, (30,), generator=g)
    )
    exact = float(torch.trace(dense_hessian(p)))
    r = run(p, "hessian_trace")
    assert r.diagnostics["method"] == "exact" and r.diagnostics["n_hvp"] == p.num_params == 43
    assert r.value == pytest.approx(exact, rel=1e-10) and r.stderr == 0.0 and r.status == "ok"
    big = run(p, "hessian_trace", min_probes=8)  # 43 > 32: a check of 8 probes, then the cheaper
    assert big.diagnostics["check_probes"] == 8 and big.diagnostics["n_hvp"] <= 43 + 8


def _rotated(eigs, seed=0):
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(len(eigs), len(eigs), generator=g, dtype=DT))
    return (Q * torch.as_tensor(eigs, dtype=DT)) @ Q.T


def _ratio_spectrum(ratio: float, P: int = 300, seed: int = 0) -> np.ndarray:
    """P eigenvalues of magnitudes uniform on [0.05, 1], half of them negative and scaled so that
    Tr H / Tr|H| is exactly ``ratio``."""
    m = np.random.default_rng(seed).uniform(0.05, 1.0, P)
    pos, neg = m[: P // 2], m[P // 2 :]
    c = pos.sum() * (1 - ratio) / (neg.sum() * (1 + ratio))
    return np.concatenate([pos, -c * neg])


# Runs that end near_zero, of 20 seeds per true ratio Tr H / Tr|H| (P = 300, Hutchinson, at most 400
# probes), measured (the intervals page shows them with 2%, 4% and 10%):
#   tol 0.01: 0% 20, 2% 20, 3% 19, 4% 7, 5% 0, 6% 0, 8% 0, 10% 0
#   tol 0.05: 0% 20, 2% 20, 3% 19, 4% 7, 5% 0, 6% 0, 8% 0, 10% 0
# The former rule, on the two point estimates, fired at a true 6% in 1/20 runs at tol 0.01 and 7/20
# at tol 0.05. Claimed here: never at 5% and above; at least 18 of 20 at 0 and 3% (its power).
NEAR_ZERO_RATIOS = (0.0, 0.03, 0.05, 0.06, 0.08)


@pytest.mark.slow
@pytest.mark.parametrize("tol", [0.01, 0.05])
def test_near_zero_only_when_the_intervals_say_so(tol):
    """``near_zero`` needs the upper end of |Tr H|'s interval at most 5% of the lower end of
    Tr|H|'s: over 20 seeds never at a true ratio of 5% and above, nearly always at 0 and 3%."""
    counts = {}
    for ratio in NEAR_ZERO_RATIOS:
        eigs = _ratio_spectrum(ratio)
        assert eigs.sum() / np.abs(eigs).sum() == pytest.approx(ratio, abs=1e-12)
        A = _rotated(eigs, seed=1)
        op = linalg.as_operator(lambda V, A=A: V @ A, 300, dtype=DT)
        counts[ratio] = 0
        for seed in range(20):
            r = linalg.hutchinson(
                op,
                stop=linalg.ProbeStop(tol=tol, max_probes=400),
                generator=torch.Generator().manual_seed(seed),
                settings=linalg.EstimatorSettings(block_size=64),
            )
            if r.near_zero:  # what it claims: the interval below 5% of Tr|H|'s lower end
                low = r.abs_trace - 2 * r.abs_trace_stderr
                assert abs(r.estimate) + 2 * r.stderr <= low / 20
            counts[ratio] += r.near_zero
    assert all(counts[x] == 0 for x in NEAR_ZERO_RATIOS if x >= 0.05), counts
    assert counts[0.0] >= 18 and counts[0.03] >= 18, counts


def test_near_zero_floor_only_when_the_trace_is_near_zero():
    """Tr H = share·Tr|H| (P = 200, eigenvalues ±1). At 10% the floor would stop at tol·Tr|H|, an
    error up to 10% of the trace where tol is 1%: not near zero, the relative test runs to
    max_probes (not_converged, Tr|H| reported). At 2% the floor holds."""
    for share, near in ((0.10, False), (0.02, True)):
        n_pos = int(round(100 * (1 + share)))
        A = _rotated([1.0] * n_pos + [-1.0] * (200 - n_pos))
        op = linalg.as_operator(lambda V, A=A: V @ A, 200, dtype=DT)
        r = linalg.hutchinson(
            op,
            stop=linalg.ProbeStop(tol=0.01, max_probes=300),
            generator=torch.Generator().manual_seed(0),
        )
        assert r.near_zero == near and r.converged == near and r.abs_trace is not None
        assert abs(r.estimate - float(torch.trace(A))) <= 3 * r.stderr
