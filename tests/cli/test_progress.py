"""Progress when stderr is not a terminal: long runs (landscapes, bootstraps) say how far they are."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from flatcli.cli import app
from flatcli.console import GridProgress
from tests.landscape.test_landscape import write_project
from tests.oracles import runner


def test_grid_progress_logs_every_few_seconds_and_at_the_end(capsys):
    t = iter([0.0, 3.0, 12.0, 15.0, 26.0, 27.0])  # the clock at creation, then at each update
    shown = GridProgress("landscape", every=10.0, clock=lambda: next(t))
    for done in (1, 4, 5, 8, 10):
        shown.update(done, 10)
    lines = capsys.readouterr().err.splitlines()
    assert (
        lines
        == [
            "landscape: 4/10 (40%), 12s elapsed, about 18s left",  # the first update ≥ 10 s after the start
            "landscape: 8/10 (80%), 26s elapsed, about 6s left",  # ≥ 10 s after the previous line
            "landscape: 10/10 (100%), 27s elapsed",  # always at the end
        ]
    )


def test_piped_landscape_and_bootstrap_report_progress(tmp_path):
    cfg = write_project(tmp_path)
    res = runner.invoke(
        app,
        [
            "landscape",
            "slice",
            "-c",
            str(cfg),
            str(tmp_path / "m0.pt"),
            "-o",
            str(tmp_path / "o"),
            "--steps",
            "3",
            "--no-plots",
        ],
    )
    assert res.exit_code == 0, res.output
    assert re.search(r"^landscape: (\d+)/\1 \(100%\), \d+s elapsed$", res.output, re.M), res.output
    rng = np.random.default_rng(0)
    pd.DataFrame({"mu": rng.random(12), "nu": rng.random(12), "gen_gap": rng.random(12)}).to_csv(
        tmp_path / "t.csv", index=False
    )
    res = runner.invoke(
        app, ["correlate", str(tmp_path / "t.csv"), "-m", "mu,nu", "--bootstrap", "100"]
    )
    assert res.exit_code == 0, res.output
    assert "correlate: measures bootstrapped: 2/2 (100%)" in res.output
