"""Results that survive (issue 26): results written after every measure, Ctrl-C keeps what finished
(exit 130, the rest ``interrupted``), ``--resume`` reuses finished measures; one log line per
finished measure on a pipe, and the live line's products and time left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from flatcli.cli import app
from tests.helpers import write_project
from tests.oracles import runner

SLOW_TRACE = {
    "hessian_trace": {
        "method": "hutchinson",
        "tol": 1e-12,
        "min_probes": 8,
        "max_probes": 1_000_000,
    }
}  # runs until stopped


def _frobenius(path: Path) -> float:
    """Σ ‖W‖_F² over the MLP's weight matrices, from the checkpoint file itself."""
    sd = torch.load(path, weights_only=True)
    return float(sum((v.double() ** 2).sum() for k, v in sd.items() if k.endswith("weight")))


def _interrupt_after_first_measure(cfg: Path, out: Path) -> tuple[int, str]:
    """Run ``flatcli measure`` in a subprocess, send SIGINT once its log says the first measure
    finished; (exit code, stderr)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    # SIGINT at its default in the child: a process that starts with SIGINT ignored (as children
    # of a test worker where some library left it ignored do) never gets a KeyboardInterrupt,
    # which is Unix's rule for background jobs, not a flatcli behaviour to test here
    p = subprocess.Popen(
        [sys.executable, "-m", "flatcli", "measure", "-c", str(cfg), "-o", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    seen = []
    try:
        for line in p.stderr:
            seen.append(line)
            if " · frobenius_norm · " in line:
                p.send_signal(signal.SIGINT)
                break
        _, rest = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, "".join(seen) + rest


@pytest.mark.slow
def test_sigint_keeps_the_finished_measure_and_resume_does_not_recompute_it(tmp_path):
    cfg = write_project(
        tmp_path / "p",
        measures=["frobenius_norm", SLOW_TRACE, {"hessian_lambda_max": {"tol": 1e-3}}],
    )
    out = tmp_path / "o"
    code, err = _interrupt_after_first_measure(cfg, out)
    assert code == 130, err
    assert "interrupted: 1 finished measure(s) kept in" in err
    t = pd.read_csv(out / "results.csv")
    assert list(t["checkpoint"]) == ["m0.pt", "m1.pt"] and list(t["status"]) == ["interrupted"] * 2
    assert t.loc[0, "frobenius_norm_status"] == "ok"
    assert t.loc[0, "frobenius_norm"] == pytest.approx(_frobenius(cfg.parent / "m0.pt"), rel=1e-6)
    assert list(t["hessian_trace_status"]) == ["interrupted"] * 2
    assert list(t["hessian_lambda_max_status"]) == ["interrupted"] * 2
    assert t.loc[1, "frobenius_norm_status"] == "interrupted" and t["hessian_trace"].isna().all()
    seconds = t.loc[0, "frobenius_norm_seconds"]

    # --resume with a trace that now ends: the finished measure is reused (its seconds unchanged)
    doc = yaml.safe_load(cfg.read_text())
    doc["measures"][1] = {"hessian_trace": {"min_probes": 8, "max_probes": 8, "tol": 0.5}}
    cfg.write_text(yaml.safe_dump(doc))
    res = runner.invoke(app, ["measure", "-c", str(cfg), "-o", str(out), "--resume"])
    assert res.exit_code == 0, res.output
    assert "m0.pt · frobenius_norm · " in res.output and res.output.count("(reused)") == 1
    t2 = pd.read_csv(out / "results.csv")
    assert (
        t2.loc[0, "frobenius_norm_seconds"] == seconds
        and t2.loc[0, "frobenius_norm"] == t.loc[0, "frobenius_norm"]
    )
    assert list(t2["status"]) == ["ok", "ok"] and list(t2["hessian_trace_status"]) == ["ok", "ok"]
    assert json.loads((out / "results.json").read_text())["complete"] is True


def test_results_after_every_measure_and_resume_recomputes_what_changed(tmp_path):
    """results.csv holds every finished measure as soon as it finishes. The --resume key is the checkpoint's bytes, the resolved measure options and the config: a changed
    file or an ``interrupted``/``error`` entry is computed again."""
    from flatcli import api
    from flatcli.demo.models import MLP

    cfg = write_project(tmp_path / "p", measures=["frobenius_norm"])
    out = tmp_path / "o"
    seen = []  # results.csv as a kill -9 would leave it after each finished measure
    api.measure(
        cfg,
        outdir=out,
        reporting=api.Reporting(
            on_measure=lambda row, lab, r: seen.append(pd.read_csv(out / "results.csv"))
        ),
    )
    assert [list(t["frobenius_norm_status"]) for t in seen] == [["ok", "interrupted"], ["ok", "ok"]]
    assert seen[0].loc[0, "frobenius_norm"] == pytest.approx(
        _frobenius(cfg.parent / "m0.pt"), rel=1e-6
    )
    old = json.loads((out / "results.json").read_text())
    torch.manual_seed(7)
    torch.save(MLP(16, 8, 1, 4).state_dict(), cfg.parent / "m1.pt")  # m1 changes, m0 does not
    reused = []
    api.measure(
        cfg,
        outdir=out,
        resume=True,
        reporting=api.Reporting(on_measure=lambda row, lab, r: reused.append((row.checkpoint, r))),
    )
    assert reused == [("m0.pt", True), ("m1.pt", False)]
    new = pd.read_csv(out / "results.csv")
    assert new.loc[1, "frobenius_norm"] == pytest.approx(_frobenius(cfg.parent / "m1.pt"), rel=1e-6)
    # an entry marked interrupted (or error) is not finished: computed again
    (key,) = old["rows"][0]["keys"].values()
    for status in ("interrupted", "error"):
        old["rows"][0]["measures"]["frobenius_norm"]["status"] = status
        (out / "results.json").write_text(json.dumps(old))
        assert key not in api.previous_results(out)
    old["rows"][0]["measures"]["frobenius_norm"]["status"] = "ok"
    (out / "results.json").write_text(json.dumps(old))
    assert (
        api.previous_results(out)[key].value
        == old["rows"][0]["measures"]["frobenius_norm"]["value"]
    )


def test_one_log_line_per_finished_measure_on_a_pipe(tmp_path):
    cfg = write_project(tmp_path / "p")
    ckpt = str(cfg.parent / "m0.pt")
    res = runner.invoke(app, ["measure", "-c", str(cfg), ckpt, "-o", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    t = pd.read_csv(tmp_path / "o" / "results.csv").iloc[0]
    lines = [ln for ln in res.output.splitlines() if ln.startswith(f"{ckpt} · ")]
    assert [ln.split(" · ")[1] for ln in lines] == [
        "hessian_lambda_max",
        "hessian_trace",
        "frobenius_norm",
    ]
    trace = lines[1].split(" · ")
    assert (
        trace[2] == f"{t['hessian_trace_seconds']:.2f}s"
        and trace[3] == f"{int(t['hessian_trace_n_hvp'])} HVPs"
    )
    assert (
        trace[4] == f"{t['hessian_trace']:.4g} ± {t['hessian_trace_stderr']:.2g}"
        and trace[5] == "ok"
    )
    lam = lines[0].split(" · ")
    assert (
        lam[3] == f"{int(t['hessian_lambda_max_n_hvp'])} HVPs"
        and lam[4] == f"{t['hessian_lambda_max']:.4g}"
    )
    assert lines[2].split(" · ")[3:] == [
        f"{t['frobenius_norm']:.4g}",
        "ok",
    ]  # no products: none named


def test_live_line_counts_each_measures_own_products_and_the_time_left(tmp_path):
    from flatcli import api
    from flatcli.console import describe_progress

    cfg = write_project(tmp_path / "p")
    seen = []
    report = api.measure(
        cfg,
        [str(cfg.parent / "m0.pt")],
        measures="hessian_trace,hessian_lambda_max",
        reporting=api.Reporting(on_progress=lambda label, info: seen.append((label, dict(info)))),
    )
    res = report.rows[0].results
    for lab in ("hessian_trace", "hessian_lambda_max"):
        counts = [i["n_hvp"] for la, i in seen if la == lab]
        assert (
            counts and max(counts) <= res[lab].diagnostics["n_hvp"]
        )  # not the engine's running total
        assert all(i["planned_hvps"] == (8, 48) for la, i in seen if la == "hessian_trace")
    line = describe_progress(
        "hessian_trace",
        {"n_hvp": 10, "planned_hvps": (10, 40), "seconds": 5.0, "value": 2.0, "stderr": 0.1},
    )
    assert (
        line == "hessian_trace · 10/40 HVPs · ≈ 2 ± 0.1 · ≤ 15s left"
    )  # 30 HVPs left at 0.5 s each
