"""Smoke test of benchmarks/bench_catalogue.py on a tiny CPU problem (a benchmark: no times
asserted), and of the JSON every benchmark writes (benchmarks/_common.py)."""

import importlib.util
import json

import pytest


def _bench_catalogue():
    from benchmarks import bench_catalogue

    return bench_catalogue


def _tables(path) -> list[list[dict]]:
    """The JSON's tables as lists of {column: cell}, after checking the shared schema."""
    data = json.loads(path.read_text())
    assert data["benchmark"] == "catalogue" and data["title"] and data["command"]
    assert {"cpu", "cores", "memory_gb", "torch", "python"} <= set(data["machine"])
    assert data["commit"] and len(data["date"]) == 10
    out = []
    for t in data["tables"]:
        assert t["title"] and all(len(r) == len(t["columns"]) for r in t["rows"])
        out.append([dict(zip(t["columns"], r, strict=True)) for r in t["rows"]])
    return out


TINY = ["--device", "cpu", "--n", "8", "--batch-size", "4", "--width", "2", "--train-steps", "4"]


@pytest.mark.slow
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
            "--json",
            str(tmp_path / "catalogue.json"),
        ]
    )
    assert rc == 0
    catalogue, peers = _tables(tmp_path / "catalogue.json")
    assert [r["measure"] for r in catalogue[:-1]] == names
    assert all(r["status"] == "ok" for r in catalogue[:-1])
    lam = catalogue[2]
    assert int(lam["HVPs"]) >= 8 and lam["gradients"] == "0"
    assert "n = 8" in json.loads((tmp_path / "catalogue.json").read_text())["title"]
    tools = [r["tool"] for r in peers]
    assert "flatcli hessian_trace (auto)" in tools and "flatcli hessian_lambda_max (fp32)" in tools
    flat_lam = next(r for r in peers if r["tool"] == "flatcli hessian_lambda_max (fp32)")
    assert float(flat_lam["rel. residual (fp32 HVP)"]) < 1e-3  # tol 1e-4 in fp32, fp32 product
    if importlib.util.find_spec("pyhessian") is not None:
        ph = [r for r in peers if r["tool"].startswith("PyHessian trace")]
        assert len(ph) == 2
        assert all(r["HVPs"] == "4" and float(r["PyHessian / flatcli time"]) > 0 for r in ph)
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
            "--json",
            str(tmp_path / "catalogue.json"),
        ]
    )
    assert rc == 0
    (rows,) = _tables(tmp_path / "catalogue.json")
    assert [(r["measure"], r["status"]) for r in rows[:-1]] == [
        ("frobenius_norm", "skipped (budget 0 s spent)"),
        ("path_norm", "skipped (budget 0 s spent)"),
    ]
    assert "| **total** (0 run, 2 skipped)" in (tmp_path / "catalogue.md").read_text()
