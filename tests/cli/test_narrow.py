"""Tables and help on an 80-column terminal: columns leave whole instead of collapsing, --wide and
pipes get everything."""

from __future__ import annotations

import csv
import itertools
import re

import numpy as np
import pytest
from rich.console import Console

from flatcli import cli
from flatcli.cli import app
from tests.helpers import write_project
from tests.oracles import runner

LONG = [
    "normalized_sharpness_with_a_long_label",
    "relative_flatness",
    "hessian_lambda_max",
    "pacbayes_flatness",
    "sharpness_average",
    "fisher_rao_norm",
]


@pytest.fixture
def terminal80(monkeypatch):
    """stdout is an 80-column terminal (what `flatcli.console.fit_width` and --help see)."""
    term = Console(force_terminal=True, width=80, color_system=None)
    for mod in (cli._app, cli.compute, cli.explore):  # every module of the command line that prints
        monkeypatch.setattr(mod, "console", term)


def grid_table(path):
    """24 models on a 2 × 3 × 4 grid, six measures with long names, a gap they predict to varying
    degrees (seeded noise)."""
    rng = np.random.default_rng(0)
    rows = []
    for i, (wd, lr, width) in enumerate(
        itertools.product([0, 1e-4], [0.01, 0.05, 0.1], [16, 32, 64, 128])
    ):
        gap = 0.1 * (wd == 0) + lr + width / 1000 + 0.01 * rng.standard_normal()
        row = {
            "checkpoint": f"runs/m{i}.pt",
            "hp_wd": wd,
            "hp_lr": lr,
            "hp_width": width,
            "gen_gap": gap,
        }
        for k, name in enumerate(LONG):
            row[name] = gap + (k / 10) * rng.standard_normal()
        rows.append(row)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def headers(out):
    """The column names of a rich table's header, each reassembled from its wrapped lines."""
    rows = [[c.strip() for c in ln.split("┃")[1:-1]] for ln in out if ln.startswith("┃")]
    return ["".join(parts) for parts in zip(*rows, strict=True)]


def lines(text):
    return [ln for ln in text.splitlines() if ln.strip()]


def test_correlate_fits_80_columns_without_cutting_numbers(tmp_path, terminal80):
    table = grid_table(tmp_path / "t.csv")
    res = runner.invoke(
        app,
        [
            "correlate",
            str(table),
            "-m",
            ",".join(LONG),
            "--by",
            "wd,lr,width",
            "-o",
            str(tmp_path / "c"),
        ],
    )
    assert res.exit_code == 0, res.output
    box = [ln for ln in lines(res.stdout) if ln[0] in "┏┃┡│└"]
    assert box and max(len(ln) for ln in box) <= 80
    header = " ".join(ln for ln in box if ln.startswith("┃"))
    assert (
        " # " in header and " n " in header and "Ψ" in header
    )  # rank, n and the ranking statistic stay
    assert "…" not in res.stdout
    with open(tmp_path / "c" / "correlations.csv") as f:
        ranked = list(csv.DictReader(f))
    body = "\n".join(ln for ln in box if ln.startswith("│"))
    for r in ranked:  # every shown number whole, on its measure's row
        assert f"{float(r['kendall_tau_b']):+.3f}" in body and f"{float(r['psi']):+.3f}" in body
    assert re.search(r"not shown at 80 columns: .*CMI.*--wide", " ".join(res.stdout.split()))
    wide = runner.invoke(
        app, ["correlate", str(table), "-m", ",".join(LONG), "--by", "wd,lr,width", "--wide"]
    )
    assert "CMI" in wide.stdout and "ψ width" in wide.stdout and "not shown" not in wide.stdout


def test_piped_correlate_and_measure_keep_every_column(tmp_path):
    table = grid_table(tmp_path / "t.csv")
    res = runner.invoke(app, ["correlate", str(table), "-m", ",".join(LONG), "--by", "wd,lr,width"])
    assert res.exit_code == 0 and "not shown" not in res.stdout
    for col in ("Jiang τ", "Spearman", "Pearson", "ψ wd", "ψ lr", "ψ width", "CMI", LONG[0]):
        assert col in res.stdout  # one line per row, nothing wrapped or cut


def test_measure_fits_80_columns(tmp_path, terminal80, monkeypatch):
    measures = [
        "hessian_lambda_max",
        {"hessian_trace": {"min_probes": 4, "max_probes": 4, "tol": 0.5}},  # ok: 4 probes meet it
        "frobenius_norm",
        "spectral_norm",
        "path_norm",
    ]
    cfg = write_project(
        tmp_path / "runs" / "an_experiment_with_a_long_name" / "width_8", measures=measures
    )
    monkeypatch.chdir(tmp_path)
    ckpts = [f"runs/an_experiment_with_a_long_name/width_8/m{i}.pt" for i in (0, 1)]
    res = runner.invoke(app, ["measure", *ckpts, "-c", str(cfg), "-o", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    out = lines(res.stdout)
    assert max(len(ln) for ln in out if ln[0] in "┏┃┡│└") <= 80 and "…" not in res.stdout
    assert sum(("m0.pt" in ln) for ln in out) == 1 and sum(("m1.pt" in ln) for ln in out) == 1
    text = " ".join(" ".join(out).split())
    assert "checkpoints in runs/an_experiment_with_a_long_name/width_8/" in text
    shown = headers(out)  # whole names, wrapped at "_" over several header lines
    assert shown[:5] == [
        "checkpoint",
        "status",
        "hessian_lambda_max",
        "hessian_trace",
        "frobenius_norm",
    ]
    assert "gen_gap" in shown and "spectral_norm" not in shown and "not shown at 80 columns" in text
    wide = runner.invoke(
        app, ["measure", *ckpts, "-c", str(cfg), "-o", str(tmp_path / "o"), "--wide"]
    )
    assert ckpts[0] in wide.stdout and "test_acc" in wide.stdout and "not shown" not in wide.stdout


@pytest.mark.parametrize(
    "command", ["sweep", "landscape slice", "landscape connect", "measure", "correlate"]
)
def test_help_on_80_columns_shows_every_option_whole(command, terminal80):
    res = runner.invoke(app, [*command.split(), "--help"])
    assert res.exit_code == 0
    assert max(len(ln) for ln in res.stdout.splitlines()) <= 80
    import typer.main

    cmd = typer.main.get_command(app)
    for name in command.split():
        cmd = cmd.commands[name]
    params = cmd.params
    for p in params:
        for opt in p.opts + p.secondary_opts:
            if opt.startswith("--") and not getattr(p, "hidden", False):
                assert re.search(rf"{re.escape(opt)}(?![\w-])", res.stdout), opt


def test_demo_help_says_it_ranks_by_psi():
    res = runner.invoke(app, ["demo", "--help"])
    text = " ".join(res.stdout.split())
    assert (
        res.exit_code == 0
        and "granulated Kendall Ψ" in text
        and "rank measures by Kendall τ" not in text
    )
