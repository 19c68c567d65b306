"""`flatcli.tracking.Tracker`: a tracked run trains exactly as an untracked one, rows follow the
schedule and the output folder resumes; the budget schedule keeps its overhead."""

from __future__ import annotations

import json
import random

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn
from torch.func import functional_call

import flatcli
import flatcli.measures as reg
from flatcli.errors import ConfigError
from flatcli.measures import MeasureResult
from flatcli.tracking import Schedule, Tracker, TrackOptions
from tests.oracles import model_hessian


class Net(nn.Module):
    """Dropout (draws from torch's generator in train mode) and BatchNorm (running statistics)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.drop, self.fc2 = (
            nn.Linear(4, 8),
            nn.BatchNorm1d(8),
            nn.Dropout(0.3),
            nn.Linear(8, 3),
        )

    def forward(self, x):
        return self.fc2(self.drop(torch.tanh(self.bn(self.fc1(x)))))


class GlobalDraws(reg.Measure):
    """A measure that draws from every global stream (a careless plug-in)."""

    name = "global_draws"
    description = "test"

    def compute(self, ctx, opts):
        draw = float(torch.rand(())) + float(np.random.rand()) + random.random()
        return MeasureResult(value=draw)


@pytest.fixture
def greedy_measure(monkeypatch):
    reg._load_all()
    info = reg.MeasureInfo.of(GlobalDraws)
    monkeypatch.setitem(reg._REGISTRY, "global_draws", info)
    return "global_draws"


def _train(seed: int, make_opt, tracked: dict | None, steps: int = 7):
    """A short mini-batch run; returns the final state and what the loop draws next."""
    torch.manual_seed(seed), np.random.seed(seed), random.seed(seed)
    model = Net()
    x, y = torch.randn(48, 4), torch.randint(0, 3, (48,))
    opt = make_opt(model.parameters())
    tracker = Tracker(model, (x[:16], y[:16]), **tracked) if tracked is not None else None
    grads = []
    for s in range(steps):
        idx = torch.from_numpy(np.random.permutation(48)[:12])
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
        if tracker is not None:
            tracker.step(s, optimizer=opt)
        grads.append([p.grad.clone() for p in model.parameters()])
        assert model.training and model.drop.training  # the loop's mode is kept
    nxt = (torch.rand(3), np.random.rand(3), random.random())
    return model.state_dict(), opt.state_dict(), grads, nxt, tracker


OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, centered=True),
}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("optim", list(OPTIMIZERS))
def test_a_tracked_run_trains_bit_identically(seed, optim, greedy_measure):
    measures = ["hessian_lambda_max", "gradient_norm", greedy_measure]
    if optim != "sgd_momentum":
        measures.append("preconditioned_lambda_max")
    tracked = dict(loss="cross_entropy", measures=measures, every=2)
    a = _train(seed, OPTIMIZERS[optim], None)
    b = _train(seed, OPTIMIZERS[optim], tracked)
    assert len(b[4].rows) == 4 and all(r["status"] == "ok" for r in b[4].rows), b[4].rows
    for k, v in a[0].items():  # weights and BatchNorm's running statistics
        assert torch.equal(v, b[0][k]), k
    sa, sb = a[1]["state"], b[1]["state"]
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
    for ga, gb in zip(a[2], b[2], strict=True):
        assert all(torch.equal(p, q) for p, q in zip(ga, gb, strict=True))
    assert torch.equal(a[3][0], b[3][0]) and np.array_equal(a[3][1], b[3][1])
    assert a[3][2] == b[3][2]


def test_the_top_level_names():
    assert flatcli.Tracker is Tracker and flatcli.TrackOptions is TrackOptions


def test_rows_measure_the_eval_mode_model_exactly():
    """λmax of a tracked row equals the dense float64 eigenvalue of the eval-mode model's Hessian on
    the tracking set, gradient_norm its gradient's norm (dropout off, BatchNorm's running stats)."""
    torch.manual_seed(3)
    model = Net().double()
    x, y = torch.randn(20, 4, dtype=torch.float64), torch.randint(0, 3, (20,))
    model(x)  # running statistics away from their initial values
    tracker = Tracker(
        model,
        (x, y),
        measures=[
            {"hessian_lambda_max": {"tol": 1e-8}},
            "gradient_norm",
            {"hessian_trace": {"method": "exact"}},
        ],
        options=TrackOptions(precision="fp64", batch_size=7),
    )
    row = tracker.step(0)
    assert tracker.step(0) is None  # a step is evaluated once (gradient accumulation repeats it)
    model.eval()
    params = dict(model.named_parameters())

    def loss_of(ps):
        return nn.functional.cross_entropy(functional_call(model, ps, (x,)), y)

    H = model_hessian(model, loss_of)
    g = torch.autograd.grad(loss_of(params), list(params.values()))
    gnorm = float(torch.cat([t.reshape(-1) for t in g]).norm())
    assert row["hessian_lambda_max"] == pytest.approx(float(torch.linalg.eigvalsh(H)[-1]), rel=1e-7)
    assert row["gradient_norm"] == pytest.approx(gnorm, rel=1e-10)
    assert row["hessian_trace"] == pytest.approx(float(torch.trace(H)), rel=1e-10)
    assert row["tracking_loss"] == pytest.approx(float(loss_of(params).detach()), rel=1e-12)


@pytest.mark.parametrize("every", [1, 3, 4])
def test_every_n_steps_and_resume(tmp_path, every):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    x, y = torch.randn(10, 3), torch.randn(10, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = tmp_path / "track"
    t1 = Tracker(model, (x, y), "mse", ["gradient_norm"], every=every, out=out)
    for s in range(12):
        t1.step(s, optimizer=opt)
    steps = [s for s in range(12) if s % every == 0]
    assert [r["step"] for r in t1.rows] == steps
    assert all(r["lr"] == 0.05 for r in t1.rows)
    # training resumes from a checkpoint at step 6: the rows from step 6 on are the new run's
    t2 = Tracker(model, (x, y), "mse", ["gradient_norm"], every=every, out=out)
    for s in range(6, 9):
        t2.step(s, optimizer=opt)
    want = [s for s in steps if s < 6] + [s for s in range(6, 9) if s % every == 0]
    doc = json.loads((out / "track.json").read_text())
    assert [r["row"]["step"] for r in doc["rows"]] == want
    table = pd.read_csv(out / "track.csv")
    assert table["step"].tolist() == want
    assert table["gradient_norm"].tolist() == [r["row"]["gradient_norm"] for r in doc["rows"]]
    assert not list(out.glob(".*tmp"))  # atomic writes leave no temp file


def test_a_file_that_is_not_a_track_is_named(tmp_path):
    (tmp_path / "track.json").write_text('{"rows": [{"row": {"step": "x"}}]}')
    model = nn.Linear(2, 1)
    with pytest.raises(ConfigError, match="track.json is not a tracker's output"):
        Tracker(model, (torch.randn(4, 2), torch.randn(4, 1)), "mse", out=tmp_path)


def test_bad_engine_settings_fail_when_built():
    data = (torch.randn(4, 2), torch.randn(4, 1))
    with pytest.raises(ValueError, match="precision"):
        Tracker(nn.Linear(2, 1), data, "mse", options=TrackOptions(precision="fp8"))
    with pytest.raises(ConfigError, match="label"):
        Tracker(nn.Linear(2, 3), (torch.randn(4, 2), torch.tensor([0, 1, 2, 5])), "cross_entropy")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"every": 0}, "`every` must be an int ≥ 1"),
        ({"budget": 1.5}, "`budget` must be a fraction"),
        ({"measures": ["hessian_lambda_mx"]}, "Did you mean 'hessian_lambda_max'"),
        ({"measures": [{"hessian_lambda_max": {"tol": 2}}]}, "'tol' parameter"),
        ({"options": {"cold_every": 0}}, "`cold_every` must be an int ≥ 1"),
    ],
)
def test_bad_settings_are_one_line_errors(kwargs, match):
    if "options" in kwargs:
        with pytest.raises(ConfigError, match=match):
            TrackOptions(**kwargs["options"])
        return
    with pytest.raises(ConfigError, match=match):
        Tracker(nn.Linear(2, 1), (torch.randn(4, 2), torch.randn(4, 1)), "mse", **kwargs)


def test_a_failing_measure_is_recorded_and_training_goes_on():
    model = nn.Linear(2, 1)
    tracker = Tracker(model, (torch.randn(4, 2), torch.randn(4, 1)), "mse", ["gradient_norm"])
    with torch.no_grad():
        model.weight.fill_(float("nan"))
    row = tracker.step(0)
    assert row["status"] == "error" and row["gradient_norm_status"] == "error"
    assert (
        "the loss at step 0 is not finite" in row["error"] and "NaN/inf in weight" in row["error"]
    )


@pytest.mark.parametrize("budget", [0.05, 0.1, 0.3])
@pytest.mark.parametrize("costs", [(1.0, 2.0), (0.2, 5.0), (3.0, 1.0)])
def test_the_budget_keeps_the_overhead_within_half_an_evaluation(budget, costs):
    """On a simulated clock (a training step of ``t`` s, an evaluation of ``c`` s), the tracker's
    time stays within c/2 + b·t of b times the training time at every step."""
    t, c = costs
    sched, now = Schedule(budget=budget), 0.0
    worst, settled = 0.0, False
    for step in range(4000):
        now += t  # training
        sched.tick(now)
        due = sched.due(step)
        now += c if due else 0.0
        sched.charge(c if due else 0.0, due, now)
        settled = settled or sched.spent <= budget * sched.trained  # the first evaluation paid
        if settled:
            worst = max(worst, abs(sched.spent - budget * sched.trained))
    assert worst <= c / 2 + budget * t + 1e-9
    assert sched.overhead == pytest.approx(budget, abs=(c / 2 + budget * t) / sched.trained + 1e-9)


def test_a_capped_evaluation_is_a_lower_bound_with_status_budget():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    data = (torch.randn(32, 4), torch.randn(32, 1))
    capped = Tracker(model, data, "mse", [{"hessian_lambda_max": {"max_hvps": 2}}]).step(0)
    assert capped["hessian_lambda_max_status"] == "budget"
    assert capped["hessian_lambda_max_n_hvp"] == 2
    assert capped["hessian_lambda_max_bound"] == "lower bound"
    timed = Tracker(
        model, data, "mse", ["hessian_lambda_max"], options=TrackOptions(max_seconds=1e-9)
    ).step(0)
    assert timed["hessian_lambda_max_status"] == "budget"
    full = Tracker(model, data, "mse", [{"hessian_lambda_max": {"tol": 1e-10}}]).step(0)
    assert capped["hessian_lambda_max"] <= full["hessian_lambda_max"] * (1 + 1e-12)
