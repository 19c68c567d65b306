"""Messages are text: user-controlled strings (paths, checkpoint and measure names, errors) print
exactly, never as rich markup; control characters are shown escaped, never sent to the terminal."""

from __future__ import annotations

import shutil

import numpy as np
import pandas as pd
import pytest
import torch

from flatcli.console import as_text
from tests.helpers import cli_output, write_project
from tests.oracles import cli as run

NAMES = ["[bold]m", "a[/x]b", "x]y[z", "back\\slash", "end\\", "[red]r[/red]", "[/]", "[link=x]"]
CONTROL = ["bell\x07", "esc\x1b[31mred", "nul\x00x", "del\x7fx", "c1\x9bx"]


def shown(name: str) -> str:
    """What a name looks like once printed: itself, control characters as \\xNN."""
    return "".join(f"\\x{ord(c):02x}" if ord(c) < 32 or 0x7F <= ord(c) <= 0x9F else c for c in name)


@pytest.mark.parametrize("name", NAMES + CONTROL)
def test_as_text_renders_to_the_exact_name(name):
    from rich.console import Console

    con = Console(record=True, width=500, color_system=None)
    con.print(f"[red]error:[/red] {as_text(name)} here", highlight=False)
    assert con.export_text().rstrip("\n") == f"error: {shown(name)} here"


@pytest.mark.parametrize("name", NAMES + [c for c in CONTROL if "\x00" not in c])
def test_error_paths_print_the_exact_name(name, tmp_path):
    missing = tmp_path / f"{name}.yaml"
    res = run("config", "show", "-c", missing)
    assert res.exit_code == 2, cli_output(res)
    text = res.output
    assert text == f"error: config file not found: {shown(str(missing))}\n", text
    assert "\x1b" not in text and "Traceback" not in text


@pytest.mark.parametrize("name", NAMES)
def test_measure_and_correlate_tables_print_the_exact_names(name, tmp_path):
    if "/" not in name:  # a file name: the checkpoint's row in measure's table
        cfg = write_project(tmp_path / "p", measures=["frobenius_norm"])
        ckpt = cfg.parent / f"{name}.pt"
        shutil.copy(cfg.parent / "m0.pt", ckpt)
        res = run("measure", "-c", cfg, str(ckpt), "-o", tmp_path / "o", "--wide")
        text = cli_output(res)
        assert res.exit_code == 0, text
        rows = [line for line in res.output.splitlines() if line.startswith("│")]
        assert any(f"{name}.pt" in line for line in rows), text
    rng = np.random.default_rng(0)
    df = pd.DataFrame(
        {
            "checkpoint": [f"{name}{i}" for i in range(8)],
            name: rng.normal(size=8),
            "gen_gap": rng.normal(size=8),
        }
    )
    df.to_csv(tmp_path / "t.csv", index=False)
    res = run("correlate", tmp_path / "t.csv", "-m", name, "--wide")
    text = cli_output(res)
    assert res.exit_code == 0, text
    rows = [line for line in res.output.splitlines() if line.startswith("│")]
    assert any(name in line for line in rows), text
    res = run("correlate", tmp_path / "t.csv", "-m", name, "--target", f"`{name}` +")
    assert res.exit_code == 2 and "Traceback" not in cli_output(res), cli_output(res)
    assert res.output.count("\n") == 1


def test_an_exception_with_markup_in_its_message_prints_it(tmp_path, monkeypatch):
    """An unexpected error (exit 1) whose message holds ``[/x]``: printed, not a crash."""
    from flatcli import api

    def boom(*a, **k):
        raise RuntimeError("bad [/x] and [bold]thing")

    monkeypatch.setattr(api, "load", boom)
    res = run("config", "show", "-c", write_project(tmp_path / "p"))
    assert res.exit_code == 1
    assert "RuntimeError: bad [/x] and [bold]thing" in cli_output(res)
    assert torch is not None
