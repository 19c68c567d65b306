"""Smoke test of scripts/bench_catalogue.py on a tiny CPU problem (a benchmark: no times asserted)."""

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench_catalogue():
    spec = importlib.util.spec_from_file_location(
        "bench_catalogue", ROOT / "scripts" / "bench_catalogue.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


TINY = ["--device", "cpu", "--n", "8", "--batch-size", "4", "--width", "2", "--train-steps", "4"]


def test_catalogue_and_peers_write_their_rows(tmp_path):
    bc = _bench_catalogue()
    names = ["frobenius_norm", "distance_from_init", "hessian_lambda_max"]
    rc = bc.main(
        [
            *TINY,
            "--measures",
            ",".join(names),
            "--probes",
            "4",
            "--skip-process",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    data = json.loads((tmp_path / "catalogue.json").read_text())
    assert [r["measure"] for r in data["catalogue"]] == names
    assert all(r["status"] == "ok" for r in data["catalogue"])
    lam = data["catalogue"][2]
    assert lam["n_hvp"] >= 8 and lam["n_grad"] == 0
    assert data["meta"]["n"] == 8 and data["meta"]["batch_size"] == 4
    tools = [r["tool"] for r in data["peers"]]
    assert "flatcli hessian_trace (auto)" in tools and "flatcli hessian_lambda_max (fp32)" in tools
    flat_lam = next(r for r in data["peers"] if r["tool"] == "flatcli hessian_lambda_max (fp32)")
    assert flat_lam["residual"] < 1e-3  # tol 1e-4 in fp32, checked with an fp32 product
    if importlib.util.find_spec("pyhessian") is not None:
        ph = [r for r in data["peers"] if r["tool"].startswith("PyHessian trace")]
        assert len(ph) == 2 and all(r["n_hvp"] == 4 and r["ratio"] > 0 for r in ph)
    md = (tmp_path / "catalogue.md").read_text()
    assert "| **total** (3 run, 0 skipped)" in md and "threads" in md


def test_budget_skips_measures_and_lists_them(tmp_path):
    bc = _bench_catalogue()
    rc = bc.main(
        [
            *TINY,
            "--measures",
            "frobenius_norm,path_norm",
            "--budget-s",
            "0",
            "--skip-peers",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    rows = json.loads((tmp_path / "catalogue.json").read_text())["catalogue"]
    assert [(r["measure"], r["status"]) for r in rows] == [
        ("frobenius_norm", "skipped (budget 0 s spent)"),
        ("path_norm", "skipped (budget 0 s spent)"),
    ]
    assert "| **total** (0 run, 2 skipped)" in (tmp_path / "catalogue.md").read_text()
