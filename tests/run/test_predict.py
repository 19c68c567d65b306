"""Predicted seconds and memory (``--dry-run``, flatcli.run.prediction.predict): the arithmetic of the prediction,
the memory probe, ranges clamped to their cap, and the JSON plan."""

from __future__ import annotations

import json

import pytest
import torch

from flatcli.cli import app
from flatcli.measures import Dims, MeasureSpec
from flatcli.run.prediction.predict import ProductTimes, predict
from tests.helpers import write_project
from tests.oracles import runner


def _times(**kw) -> ProductTimes:
    base = dict(
        forward=2.0,
        grad=3.0,
        hvp1=0.5,
        hvp_block=2.0,
        block=4,
        engine_block=8,
        product_bytes=1000,
        memory="test",
        P=100,
        element=4,
    )
    return ProductTimes(**{**base, **kw})


def test_seconds_and_bytes_follow_the_declared_counts():
    """A call of k vectors costs a + b·k: from 0.5 s at k = 1 and 2.0 s at k = 4, b = 0.5, a = 0."""
    t = _times()
    assert t.hvp_seconds(8, 1) == pytest.approx(4.0) and t.hvp_seconds(8, 0) == pytest.approx(4.0)
    t = _times(hvp1=1.0, hvp_block=2.5)  # b = 0.5, a = 0.5: per vector 0.5 + 0.5/k
    assert t.hvp_seconds(8, 1) == pytest.approx(8.0) and t.hvp_seconds(8, 4) == pytest.approx(5.0)
    assert t.hvp_seconds(8, 0) == pytest.approx(4.5)  # the engine's block, 8 vectors a call
    dims = Dims(P=100, n=40, C=4)
    lam = predict(
        MeasureSpec("hessian_lambda_max", "lam", {"min_steps": 5, "max_steps": 20}), dims, t
    )
    assert lam.hvps == (5, 20) and lam.seconds == pytest.approx(
        (5.0, 20.0)
    )  # one vector a step: 1 s each
    assert (
        lam.peak_bytes == 4 * 100 * (2 + 20 + 4 + 1) + 1000
    )  # θ, gradient, 20 Krylov vectors, Lanczos's 4 of its own, one product
    sharp = predict(MeasureSpec("sharpness_average", "s", {"samples": 10}), dims, t)
    assert (
        sharp.seconds == pytest.approx((22.0, 22.0)) and sharp.peak_bytes == 4 * 100 * 2
    )  # 11 forward passes
    frob = predict(MeasureSpec("frobenius_norm", "f"), dims, t)
    assert frob.seconds == (0.0, 0.0) and frob.hvps == (0, 0)


def test_a_kept_graphs_build_is_paid_once_by_each_measure_that_takes_products():
    """With ``build`` seconds (the run keeps its gradient graphs, built at the first product), a
    measure's least and most seconds both grow by exactly ``build`` when it takes Hessian
    products, and not at all when it takes none; over several builds and measures."""
    dims = Dims(P=100, n=40, C=4)
    specs = [
        (MeasureSpec("hessian_lambda_max", "lam", {"min_steps": 5, "max_steps": 20}), True),
        (MeasureSpec("hessian_trace", "tr", {"min_probes": 8, "max_probes": 64}), True),
        (MeasureSpec("sharpness_average", "s", {"samples": 10}), False),
        (MeasureSpec("frobenius_norm", "f"), False),
    ]
    for build in (0.25, 1.0, 7.5):
        for spec, takes in specs:
            base, more = predict(spec, dims, _times()), predict(spec, dims, _times(build=build))
            for a, b in zip(base.seconds, more.seconds, strict=True):
                assert b - a == pytest.approx(build if takes else 0.0), (spec.name, build)


@pytest.mark.parametrize("seconds", [0.001, 0.05, 0.2, 0.31, 1.0, 4.0])
def test_a_timing_discards_a_first_call_and_takes_the_least_of_its_repeats(monkeypatch, seconds):
    """`timed` on a fake clock: a first call discarded (none when the caller made it), then three
    timed calls, or two once they agree and add up to `ENOUGH` seconds; the least of them."""
    import flatcli.run.prediction.timing as timing

    now, calls = [0.0], []

    def call():
        calls.append(1)
        now[0] += seconds

    monkeypatch.setattr(timing, "_clock", lambda: now[0])
    repeats = 2 if 2 * seconds >= timing.ENOUGH else 3
    for warm in (False, True):
        calls.clear()
        assert timing.timed(call, warm=warm)[0] == pytest.approx(seconds)
        assert len(calls) == (0 if warm else 1) + repeats, (seconds, warm)


def test_one_slow_call_never_stands_for_a_timing(monkeypatch):
    """A call slowed once (41 s among calls of 40 ms, the "timed: forward 41 s" dry-run), at any
    of the repeats: the timing is the fast calls' (the least of the repeats), also when the slow
    call is the first of two that would otherwise stop the repeats."""
    import flatcli.run.prediction.timing as timing

    now, calls = [0.0], []
    monkeypatch.setattr(timing, "_clock", lambda: now[0])
    for slow in range(4):
        calls.clear()

        def call(slow=slow):
            now[0] += 41.0 if len(calls) == slow else 0.04
            calls.append(1)

        assert timing.timed(call)[0] == pytest.approx(0.04), slow


def test_a_range_never_starts_above_its_cap():
    """``max_steps: 8`` below the certified floor printed '15–8 HVPs'; the least is the cap."""
    from flatcli.engine.linalg import certified_min_steps

    dims = Dims(P=84_000, n=10)
    assert certified_min_steps(84_000) > 8
    est = MeasureSpec("hessian_lambda_max", "l", {"max_steps": 8}).estimate(dims)
    assert est["n_hvp"] == (8, 8)


PROBE = """
import gc, json, sys
import torch
from flatcli.run.prediction.predict import measure_peak

nbytes = 64 * 2**20


def alloc():
    x = torch.ones(nbytes // 4)
    x += 1  # touch every page
    return float(x[0])


class Cycle:
    pass


def alloc_after_a_collection():
    gc.collect()  # the collection a long process may run in the middle of the call
    return alloc()


def junk():
    j = Cycle()
    j.me, j.data = j, torch.ones(2 * nbytes // 4) + 1


seen = {"again": [], "garbage": []}
for _ in range(2):
    seen["again"].append(measure_peak(alloc, torch.device("cpu")))
for _ in range(3):
    junk()
    seen["garbage"].append(measure_peak(alloc_after_a_collection, torch.device("cpu")))
print(json.dumps(seen))
"""


def _probe_in_a_fresh_process() -> dict:
    """The probe's readings in a fresh flatcli process: a test process holds other tests'
    threads and freed memory, whose changes to the resident set the CPU probe cannot tell from
    the call's own."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_memory_probe_sees_each_call_again_and_through_garbage():
    """The CPU probe resets the peak between calls: a second equal 64 MiB allocation is seen
    again (the process-lifetime ru_maxrss would show nothing the second time). And cyclic
    garbage holding 128 MiB, collected during the call (as an automatic collection may be),
    does not hide the call's own peak: the probe collects first."""
    nbytes = 64 * 2**20
    seen = _probe_in_a_fresh_process()
    for case, readings in seen.items():
        for got, how in readings:
            assert 0.9 * nbytes <= got <= 1.5 * nbytes, (case, got, how)


def test_dry_run_json_lists_every_checkpoint_and_measure(tmp_path):
    cfg = write_project(
        tmp_path / "p",
        measures=[
            {"hessian_lambda_max": {"max_steps": 8}},
            {"hessian_trace": {"min_probes": 8, "max_probes": 8}},
            "frobenius_norm",
        ],
    )
    res = runner.invoke(app, ["measure", "-c", str(cfg), "--dry-run", "--format", "json"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)
    assert [(e["checkpoint"], e["measure"]) for e in plan] == [
        (c, m)
        for c in ("m0.pt", "m1.pt")
        for m in ("hessian_lambda_max", "hessian_trace", "frobenius_norm")
    ]
    keys = {
        "checkpoint",
        "measure",
        "hvps_low",
        "hvps_high",
        "seconds_low",
        "seconds_high",
        "seconds_interval",
        "peak_bytes",
        "status",
        "memory",
        "stops_early",
    }
    assert all(set(e) == keys and e["status"] == "ok" for e in plan)
    for e in plan:  # the timings' interval holds the range of the declared counts
        low, high = e["seconds_interval"]
        assert 0 <= low <= e["seconds_low"] <= e["seconds_high"] <= high, e
    lam, trace, frob = plan[:3]
    assert (lam["stops_early"], trace["stops_early"], frob["stops_early"]) == (True, True, False)
    assert (lam["hvps_low"], lam["hvps_high"]) == (8, 8) and (
        trace["hvps_low"],
        trace["hvps_high"],
    ) == (8, 8 + 40)  # a fixed count, and the near-zero floor's SLQ when the trace cancels
    assert 0 < trace["seconds_low"] < trace["seconds_high"] and frob["seconds_high"] == 0
    P = 16 * 8 + 8 + 8 * 4 + 4
    resident = frob["peak_bytes"] - 4 * P * 2  # the process before the products: torch, data
    assert resident > 50 * 2**20 and lam["peak_bytes"] - resident > 4 * P * (2 + 8)
    text = runner.invoke(app, ["measure", "-c", str(cfg), "--dry-run"]).output
    assert (
        "hessian_lambda_max: 8 HVPs; predicted " in text
        and "measured: forward " in text
        and ", peak " in text
    )


def test_applicable_checks_predict_the_runs_not_applicable_reasons():
    """``--dry-run`` prints not_applicable with the reason the run will give, for path_norm on
    named inputs and for BatchNorm folding when the parameter selection names the folded
    BatchNorm parameters; an applicable configuration predicts a run (None)."""
    from flatcli.api import measure_model
    from flatcli.config import parse_measures
    from flatcli.engine import ParamSelection, Problem
    from tests.helpers import TinyBN, tiny_data
    from tests.token_models import TokenClassifier, padded_tokens

    torch.manual_seed(3)
    lm = TokenClassifier().double().eval()
    ids, mask = padded_tokens(6, 5, 9, seed=3)
    named = {"input_ids": ids, "attention_mask": mask, "labels": torch.arange(6) % 3}
    bn = TinyBN().double().eval()
    x, y = tiny_data(n=12)
    cases = [
        (lm, named, None, "path_norm", True),
        (bn, (x, y), {"include": ["bn.*"]}, "fisher_rao_norm", True),
        (bn, (x, y), {"include": ["bn.*"]}, "pacbayes_flatness", True),
        (bn, (x, y), {"include": ["fc1.*", "fc2.*"]}, "fisher_rao_norm", False),
    ]
    for model, data, params, name, skipped in cases:
        spec = parse_measures([name])[0]
        sel = ParamSelection.of(params) if params else None
        batch = data if isinstance(data, dict) else {"x": data[0], "y": data[1]}
        predicted = spec.not_applicable(
            Problem(model, batch, batch_size=6, dtype=torch.float64, params=sel)
        )
        assert (predicted is not None) == skipped, (name, params, predicted)
        res = measure_model(
            model, data, [name], precision="fp64", batch_size=6, params=params
        ).results[name]
        if predicted is None:
            assert res.status == "ok", (name, params, res.diagnostics)
        else:
            assert res.status == "not_applicable" and res.diagnostics["reason"] == predicted, (
                name,
                params,
            )


def test_the_dry_runs_clock_waits_for_queued_cuda_work(monkeypatch):
    """A CUDA product returns before its kernels finish: each reading of the dry-run's clock
    first synchronizes the device when CUDA is in use (mocked: no GPU needed), and not otherwise."""
    import flatcli.run.prediction.timing as timing

    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: events.append("sync"))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: events.append("read") or 0.0)
    for used in (True, False):
        events.clear()
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda used=used: used)
        timing.timed(lambda: None)
        reads = events.count("read")
        assert reads >= 2 and events == (["sync", "read"] * reads if used else ["read"] * reads)


def test_the_graphs_build_scales_as_the_product_and_is_at_most_two_gradients():
    """`_build` over many draws: what the largest micro-batch's first product paid above a warm
    one, scaled as its product scales to the whole set, and never above two whole-set
    gradients."""
    from flatcli.run.prediction.predict import _build

    g = torch.Generator().manual_seed(3)
    for _ in range(50):
        b, h_at, hvp, grad = (torch.rand(4, generator=g, dtype=torch.float64) + 0.01).tolist()
        assert _build(b, h_at, hvp, grad) == pytest.approx(min(b * hvp / h_at, 2 * grad))
