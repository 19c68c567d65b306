"""flatcli plot-track: measures against the step, with 2/η for gradient descent's sharpness and
the preconditioned threshold the measure records."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flatcli.errors import ConfigError
from flatcli.tracking import Tracker
from flatcli.tracking.plot import track_figure
from tests.oracles import cli_and_output


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("track")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1))
    x, y = torch.randn(16, 3), torch.randn(16, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    measures = ["hessian_lambda_max", "preconditioned_lambda_max", "gradient_norm"]
    tracker = Tracker(model, (x, y), "mse", measures, every=2, out=out)
    for s in range(9):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
        tracker.step(s, optimizer=opt)
    return out, tracker.rows


def _lines(ax) -> dict[str, list]:
    return {ln.get_label(): list(ln.get_ydata()) for ln in ax.get_lines()}


def test_the_thresholds_are_drawn_from_the_rows(run):
    out, rows = run
    fig = track_figure(out)
    lam, pre, grad = (_lines(ax) for ax in fig.axes)
    assert lam["2/η"] == pytest.approx([2 / r["lr"] for r in rows])
    assert lam["hessian_lambda_max"] == pytest.approx([r["hessian_lambda_max"] for r in rows])
    thr = [(2 + 2 * 0.9) / (0.1 * r["lr"]) for r in rows]
    assert pre["(2+2β₁)/((1−β₁)η)"] == pytest.approx(thr)
    assert "2/η" not in pre and "2/η" not in grad


def test_the_command_writes_a_png_and_names_bad_input(run, tmp_path):
    out, _ = run
    res, text = cli_and_output("plot-track", str(out), "-m", "hessian_lambda_max")
    assert res.exit_code == 0 and (out / "track.png").stat().st_size > 1000, text
    res, text = cli_and_output("plot-track", str(out), "-m", "hessian_trace")
    assert res.exit_code == 2 and "'hessian_trace' is not in this run" in text
    res, text = cli_and_output("plot-track", str(tmp_path / "nothing"))
    assert res.exit_code == 2 and "no tracker output at" in text and "Traceback" not in text
    (tmp_path / "track.json").write_text("{}")
    with pytest.raises(ConfigError, match="is not a tracker's output"):
        track_figure(tmp_path)
