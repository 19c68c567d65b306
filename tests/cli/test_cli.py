import csv
import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from flatcli.cli import app
from tests.helpers import cli_output, write_project
from tests.oracles import cli as run
from tests.oracles import runner


def out(res) -> str:
    return cli_output(res)


@pytest.fixture
def project(tmp_path):
    return write_project(tmp_path / "proj")


def test_measure_end_to_end_writes_csv_and_json(project, tmp_path):
    res = run("measure", "-c", project, "-o", tmp_path / "o")
    assert res.exit_code == 0, out(res)
    rows = list(csv.DictReader(open(tmp_path / "o" / "results.csv")))
    assert [r["checkpoint"] for r in rows] == ["m0.pt", "m1.pt"]
    cols = list(rows[0])
    assert cols[:6] == [
        "checkpoint",
        "status",
        "error",
        "hessian_lambda_max",
        "hessian_trace",
        "frobenius_norm",
    ]
    for c in [
        "hessian_trace_stderr",
        "hessian_lambda_max_min_ritz",
        "hessian_lambda_max_residual",
        "hessian_lambda_max_converged",
        "train_loss",
        "train_acc",
        "test_loss",
        "test_acc",
        "gen_gap",
    ]:
        assert c in cols, c
    assert cols.index("gen_gap") > cols.index("frobenius_norm_seconds")
    r = rows[0]
    assert abs(float(r["gen_gap"]) - (float(r["train_acc"]) - float(r["test_acc"]))) < 1e-12
    meta = json.load(open(tmp_path / "o" / "results.json"))
    assert meta["config_hash"] and meta["versions"]["torch"] and meta["device"] == "cpu"
    assert meta["rows"][1]["measures"]["hessian_trace"]["diagnostics"]["probes"] == 8


def test_table_format_prints_only_the_table(project, tmp_path):
    res = run("measure", "-c", project, "-m", "frobenius_norm", "-o", tmp_path / "o")
    assert res.exit_code == 0, out(res)
    assert (
        "frobenius_norm" in res.stdout
        and '"checkpoint"' not in res.stdout
        and "checkpoint,status" not in res.stdout
    )


def test_measure_cli_checkpoints_and_measure_selection(project, tmp_path):
    res = run(
        "measure",
        project.parent / "m1.pt",
        "-c",
        project,
        "-m",
        "frobenius_norm",
        "-o",
        tmp_path / "o",
        "--format",
        "csv",
    )
    assert res.exit_code == 0, out(res)
    lines = res.stdout.strip().splitlines()
    assert lines[0].startswith("checkpoint,status,error,frobenius_norm,") and len(lines) == 2
    res = run(
        "measure", "-c", project, "-m", "frobenius_norm", "-o", tmp_path / "o2", "--format", "json"
    )
    assert res.exit_code == 0
    assert len(json.loads(res.stdout)) == 2


def test_plain_progress_line_per_checkpoint(project, tmp_path):
    res = run("measure", "-c", project, "-m", "frobenius_norm", "-o", tmp_path / "o")
    text = out(res)
    assert "[1/2] m0.pt ok" in text and "[2/2] m1.pt ok" in text


def _edit(project, **changes):
    cfg = yaml.safe_load(project.read_text())
    cfg.update(changes)
    project.write_text(yaml.safe_dump(cfg))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (
            lambda c: c.update(measure_data={"batch_sise": 2}),
            "Unknown config key 'measure_data.batch_sise'. Did you mean 'measure_data.batch_size'?",
        ),
        (
            lambda c: c.update(measure_data={"batch_size": "x"}),
            "config key 'measure_data.batch_size' must be an int ≥ 1. Got 'x'",
        ),
        (
            lambda c: c.update(checkpoints=["nothere.pt"]),
            "config key 'checkpoints': checkpoint not found",
        ),
        (
            lambda c: c.update(measures=[{"hessian_trace": {"tol": 2}}]),
            "The 'tol' parameter of hessian_trace must be a float in (0, 1). Got 2 instead.",
        ),
        (
            lambda c: c["model"].update(target="flatcli.demo.models:Nope"),
            "model.target: 'flatcli.demo.models' has no attribute 'Nope'",
        ),
        (
            lambda c: c["data"]["train"].update(source="tensors", path="nofile.pt"),
            "data.train.path: file not found",
        ),
    ],
)
def test_config_errors_exit_2_one_line(project, tmp_path, mutate, message):
    cfg = yaml.safe_load(project.read_text())
    mutate(cfg)
    project.write_text(yaml.safe_dump(cfg))
    res = run("measure", "-c", project, "-o", tmp_path / "o")
    assert res.exit_code == 2, out(res)
    text = out(res)
    assert message in text
    assert "Traceback" not in text


def test_missing_config_file(tmp_path):
    res = run("measure", "-c", tmp_path / "none.yaml")
    assert res.exit_code == 2 and "config file not found" in out(res)


def test_state_dict_mismatch_exit_2_others_complete(project, tmp_path):
    from flatcli.demo.models import MLP

    torch.save(MLP(16, 9, 1, 4).state_dict(), project.parent / "m1.pt")  # wrong width
    res = run("measure", "-c", project, "-m", "frobenius_norm", "-o", tmp_path / "o")
    assert res.exit_code == 2, out(res)
    assert "m1.pt does not match the model" in out(res) and "shape mismatches" in out(res)
    rows = list(csv.DictReader(open(tmp_path / "o" / "results.csv")))
    assert rows[0]["status"] == "ok" and rows[1]["status"] == "error"


def test_label_outside_outputs_exit_2(project, tmp_path):
    cfg = yaml.safe_load(project.read_text())
    cfg["model"]["kwargs"]["num_classes"] = 2
    project.write_text(yaml.safe_dump(cfg))
    for i in range(2):
        from flatcli.demo.models import MLP

        torch.save(MLP(16, 8, 1, 2).state_dict(), project.parent / f"m{i}.pt")
    res = run("measure", "-c", project, "-m", "frobenius_norm", "-o", tmp_path / "o")
    assert res.exit_code == 2 and "is outside the model's 2 outputs" in out(res)


def test_failed_measurement_row_exit_1_others_complete(project, tmp_path):
    from flatcli.demo.models import MLP

    bad = MLP(16, 8, 1, 4)
    with torch.no_grad():
        bad.classifier.weight.fill_(float("inf"))
    torch.save(bad.state_dict(), project.parent / "m0.pt")
    res = run("measure", "-c", project, "-o", tmp_path / "o")
    assert res.exit_code == 1, out(res)
    rows = list(csv.DictReader(open(tmp_path / "o" / "results.csv")))
    assert rows[0]["status"] == "error" and "not finite" in rows[0]["error"]
    assert rows[1]["status"] == "ok" and float(rows[1]["hessian_trace"]) != 0


def test_unsafe_pickle_refused_then_allowed(project, tmp_path):
    from flatcli.demo.models import MLP

    torch.save(MLP(16, 8, 1, 4), project.parent / "m0.pt")
    res = run("measure", "-c", project, "-m", "frobenius_norm", "-o", tmp_path / "o")
    assert (
        res.exit_code == 2
        and "--allow-unsafe-pickle" in out(res)
        and "flatcli.demo.models.MLP" in out(res)
    )
    res = run(
        "measure",
        "-c",
        project,
        "-m",
        "frobenius_norm",
        "-o",
        tmp_path / "o",
        "--allow-unsafe-pickle",
    )
    assert res.exit_code == 0, out(res)


def test_debug_shows_traceback_and_keeps_the_exit_code(tmp_path):
    args = ["measure", "-c", str(tmp_path / "none.yaml")]
    plain, debug = run(*args), run(*args, "--debug")
    assert (
        plain.exit_code == debug.exit_code == 2
    )  # a config error is a config error with --debug too
    assert "Traceback (most recent call last)" not in out(plain) and "none.yaml" in out(plain)
    assert "Traceback (most recent call last)" in out(debug) and "ConfigError" in out(debug)
    assert "none.yaml" in out(debug).splitlines()[-1]  # the one-line message still ends the output


def test_measures_lists_names_and_options():
    res = run("measures")
    assert res.exit_code == 0
    for name in ("hessian_lambda_max", "hessian_trace", "frobenius_norm", "max_probes"):
        assert name in res.stdout


def test_config_show_provenance(project):
    res = runner.invoke(app, ["config", "show", "-c", str(project)], env={"FLATCLI_SEED": "4"})
    assert res.exit_code == 0, out(res)
    assert "runtime.seed: env FLATCLI_SEED" in res.stdout and "loss: default" in res.stdout
    assert "seed: 4" in res.stdout


def test_cli_paths_keep_manifest_metadata(tmp_path):
    proj = write_project(tmp_path / "p", measures=["frobenius_norm"])
    import shutil

    shutil.copy(proj.parent / "m0.pt", proj.parent / "init0.pt")
    (proj.parent / "man.csv").write_text(
        "path,init_checkpoint,lr\nm0.pt,init0.pt,0.1\nm1.pt,,0.2\n"
    )
    cfg = yaml.safe_load(proj.read_text())
    cfg["checkpoints"] = {"manifest": "man.csv"}
    proj.write_text(yaml.safe_dump(cfg))
    res = run(
        "measure",
        proj.parent / "m0.pt",
        "-c",
        proj,
        "-m",
        "frobenius_norm,distance_from_init",
        "-o",
        tmp_path / "o",
    )
    assert res.exit_code == 0, out(res)
    row = next(csv.DictReader(open(tmp_path / "o" / "results.csv")))
    assert row["hp_lr"] == "0.1" and float(row["distance_from_init"]) == 0.0


@pytest.mark.slow
def test_measure_plots_the_spectrum_density(project, tmp_path):
    pytest.importorskip("matplotlib")
    d = yaml.safe_load(project.read_text())
    d["measures"] = [
        {"hessian_spectrum": {"top_k": 2, "slq_runs": 2, "slq_steps": 10, "label": "esd"}}
    ]
    project.write_text(yaml.safe_dump(d))
    res = run("measure", "-c", project, "-o", tmp_path / "o", "--plots", "--format", "csv")
    assert res.exit_code == 0, out(res)
    assert res.stdout.startswith("checkpoint,status,error,esd,")  # the chosen format still prints
    pngs = sorted(p.name for p in (tmp_path / "o" / "plots").glob("*.png"))
    assert pngs == ["000_m0_esd.png", "001_m1_esd.png"]
    assert (tmp_path / "o" / "plots" / pngs[0]).read_bytes()[:4] == b"\x89PNG"
    from flatcli import api
    from flatcli.errors import ConfigError

    del d["output"]  # nowhere to write: refused before measuring
    (project.parent / "noout.yaml").write_text(yaml.safe_dump(d))
    with pytest.raises(ConfigError, match="`plots` needs an output directory"):
        api.measure(project.parent / "noout.yaml", plots=True)


def test_version_and_unknown_measure_pattern():
    from flatcli._version import __date__, __version__

    res = run("--version")
    assert res.exit_code == 0 and res.output.strip() == f"flatcli {__version__} ({__date__})"
    res = run("measures", "hesian_trace")  # a typo: exit 2 with the close match, not an empty table
    assert res.exit_code == 2 and "Did you mean 'hessian_trace'?" in out(res)
    res = run("measures", "nosuch")
    assert res.exit_code == 2 and "no measure matches 'nosuch'" in out(res)
    res = run("measures", "hessian_*")
    assert res.exit_code == 0 and "hessian_trace" in res.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["measure", "--nosuch"], "No such option: --nosuch"),
        (
            ["measure", "-c", "x.yaml", "--format", "xml"],
            "--format must be one of table, csv, json. Got 'xml' instead.",
        ),
        (
            ["sweep", "-c", "x.yaml", "-o", "o", "--workers", "0"],
            "--workers must be an int ≥ 1. Got 0 instead.",
        ),
        (["landscape", "slice", "-c", "x.yaml", "-o", "o"], "Missing argument 'checkpoint'"),
        (["landscape", "pca", "-c", "x.yaml", "-o", "o"], "Missing argument 'checkpoints'"),
        (["landscape", "contour", "-c", "x.yaml"], "No such command 'contour'"),
        (["landscape", "-c", "x.yaml", "m0.pt"], "No such option: -c"),
    ],
)
def test_usage_errors_are_one_line_with_exit_code_2(args, message):
    res = run(*args)
    text = res.output.strip()  # stdout and stderr together
    assert res.exit_code == 2, text
    assert message in text and len(text.splitlines()) == 1, text
    assert text.startswith("error:") and "--help" in text


@pytest.mark.parametrize("command", ["measure", "sweep", "collect", "correlate"])
def test_an_unusable_output_directory_fails_before_any_work(
    project, tmp_path, command, monkeypatch
):
    import flatcli.run.measuring as pipeline

    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    calls = []
    monkeypatch.setattr(pipeline, "measure_model", lambda *a, **k: calls.append(1))
    args = {
        "measure": ["measure", "-c", project, "-o", afile / "sub"],
        "sweep": ["sweep", "-c", project, "-o", afile / "sub"],
        "collect": ["collect", tmp_path, "-o", afile / "sub"],
        "correlate": ["correlate", tmp_path / "r.csv", "-o", afile / "sub"],
    }[command]
    res = run(*args)
    text = res.output.strip()
    assert res.exit_code == 2, text
    assert "afile is a file" in text and len(text.splitlines()) == 1, text
    assert not calls  # nothing was measured before the error


def test_results_survive_an_output_folder_that_vanishes(project, tmp_path, monkeypatch):
    import flatcli.run.results as results

    real = results.write_results
    target = tmp_path / "o"

    def flaky(outdir, rows, meta):
        if Path(outdir) == target:
            raise PermissionError(13, "Permission denied")
        return real(outdir, rows, meta)

    monkeypatch.setattr(results, "write_results", flaky)
    res = run("measure", "-c", project, "-m", "frobenius_norm", "-o", target)
    assert res.exit_code == 1
    fallback = re.search(r"results written to (\S+) instead", res.output).group(1)
    rows = list(csv.DictReader(open(Path(fallback) / "results.csv")))
    assert [r["checkpoint"] for r in rows] == ["m0.pt", "m1.pt"] and rows[0]["frobenius_norm"]


def test_a_nan_checkpoint_gets_one_message_and_exit_code_in_every_command(project, tmp_path):
    good = project.parent / "m0.pt"
    state = torch.load(good, weights_only=True)
    name = next(k for k in state if k.endswith("weight"))
    state[name][0, 0] = float("nan")
    nan = project.parent / "nan.pt"
    torch.save(state, nan)
    third = project.parent / "m1.pt"
    commands = {
        "measure": ["measure", nan, "-c", project, "-m", "frobenius_norm", "-o", tmp_path / "m"],
        "check-invariance": ["check-invariance", "-c", project, nan],
        "landscape slice": [
            "landscape",
            "slice",
            "-c",
            project,
            nan,
            "-o",
            tmp_path / "l",
            "--steps",
            "3",
            "--no-plots",
        ],
        "landscape interpolate": [
            "landscape",
            "interpolate",
            "-c",
            project,
            good,
            nan,
            "-o",
            tmp_path / "t",
            "--steps",
            "3",
            "--no-plots",
        ],
        "landscape pca": [
            "landscape",
            "pca",
            "-c",
            project,
            good,
            third,
            nan,
            "-o",
            tmp_path / "p",
            "--steps",
            "3",
            "--no-plots",
        ],
        "landscape connect": [
            "landscape",
            "connect",
            "-c",
            project,
            good,
            nan,
            "-o",
            tmp_path / "c",
            "--steps",
            "3",
            "--no-plots",
        ],
    }
    for what, args in commands.items():
        res = run(*args)
        assert res.exit_code == 1, (what, res.output)
        assert "is not finite" in res.output and f"NaN/inf in {name}" in res.output, (
            what,
            res.output,
        )
    cfg = yaml.safe_load(project.read_text())
    cfg["checkpoints"] = ["m0.pt", "nan.pt"]
    both = project.parent / "both.yaml"
    both.write_text(yaml.safe_dump(cfg))
    assert run("sweep", "-c", both, "-o", tmp_path / "s", "-m", "frobenius_norm").exit_code == 1
    res = run("collect", tmp_path / "s")
    assert res.exit_code == 1
    rows = list(csv.DictReader(open(tmp_path / "s" / "results.csv")))
    assert rows[0]["status"] == "ok" and rows[1]["status"] == "error"
    assert "is not finite" in rows[1]["error"] and f"NaN/inf in {name}" in rows[1]["error"]


def test_tables_are_full_width_when_stdout_is_not_a_terminal(tmp_path):
    long_label = "hessian_trace_with_a_rather_long_label_for_the_column"
    proj = write_project(
        tmp_path / "a_project_folder_with_a_long_name_to_wrap",
        measures=[
            {"hessian_trace": {"min_probes": 4, "max_probes": 4, "label": long_label}},
            "frobenius_norm",
            "spectral_norm",
            "path_norm",
        ],
    )
    ckpt = proj.parent / "m0.pt"
    res = run("measure", ckpt, "-c", proj, "-o", tmp_path / "o")
    assert res.exit_code == 0, res.output
    assert long_label in res.output and "…" not in res.output  # never truncated
    assert any(str(ckpt) in line for line in res.output.splitlines())  # the path on one line
    res = run("measures")
    assert res.exit_code == 0 and "…" not in res.output


def test_progress_inside_measures_and_one_line_per_stage_in_logs(project, tmp_path):
    from flatcli import api
    from flatcli.console import describe_progress

    seen = []
    api.measure(
        project,
        [str(project.parent / "m0.pt")],
        measures="hessian_trace,hessian_lambda_max",
        reporting=api.Reporting(on_progress=lambda label, info: seen.append((label, dict(info)))),
    )
    labels = {lab for lab, _ in seen}
    assert labels == {"hessian_trace", "hessian_lambda_max"}
    trace = [i for lab, i in seen if lab == "hessian_trace" and "stderr" in i]
    assert (
        trace and trace[-1]["probes"] == 8 and trace[-1]["n_hvp"] >= 8
    )  # probes done, stderr so far
    lam = [i for lab, i in seen if lab == "hessian_lambda_max" and "residual" in i]
    assert [i["steps"] for i in lam] == sorted(i["steps"] for i in lam)
    line = describe_progress("hessian_trace", trace[-1])
    assert line.startswith("hessian_trace · ") and "HVPs" in line and "±" in line
    res = run("check-invariance", "-c", project, project.parent / "m0.pt", "-m", "frobenius_norm")
    assert (
        "[1/2] measuring the original network" in res.output
        and "[2/2] measuring the rescaled" in res.output
    )


def test_dry_run_prints_the_planned_products_and_measures_nothing(project, tmp_path, monkeypatch):
    import flatcli.run.measuring as pipeline

    monkeypatch.setattr(
        pipeline, "measure_model", lambda *a, **k: pytest.fail("measured in a dry run")
    )
    res = run("measure", "-c", project, "--dry-run", "-o", tmp_path / "o")
    assert res.exit_code == 0, res.output
    # a fixed count of 8 probes, and the near-zero floor's 40 when the trace cancels
    assert "hessian_lambda_max: " in res.output and "hessian_trace: 8–48 HVPs" in res.output
    assert (
        "frobenius_norm: parameters only" in res.output
        and "total over 2 checkpoint(s)" in res.output
    )
    assert not (tmp_path / "o").exists()
    res = run("sweep", "-c", project, "-o", tmp_path / "s", "--dry-run")
    assert res.exit_code == 0 and "hessian_trace: 8–48 HVPs" in res.output


def test_dry_run_sizes_each_checkpoint_and_names_every_bad_one(tmp_path):
    """Checkpoints of two widths get their own parameter counts; every checkpoint that cannot be
    loaded gets its own line (the dry run goes on past the first) and the exit code is 2."""
    from flatcli.demo.models import MLP

    proj = write_project(
        tmp_path / "p", measures=[{"hessian_trace": {"min_probes": 8, "max_probes": 8}}]
    )
    torch.manual_seed(0)
    torch.save(
        {"state_dict": MLP(16, 32, 1, 4).state_dict(), "model_kwargs": {"width": 32}},
        proj.parent / "wide.pt",
    )
    torch.save(
        MLP(16, 32, 1, 4).state_dict(), proj.parent / "no_kwargs.pt"
    )  # width 32 into the width-8 model
    (proj.parent / "junk.pt").write_bytes(b"\x00junk" * 50)
    names = ["m0.pt", "junk.pt", "wide.pt", "no_kwargs.pt", "m1.pt"]
    res = run("measure", *[proj.parent / n for n in names], "-c", proj, "--dry-run")
    assert res.exit_code == 2, res.output
    text = out(res)
    for width in (8, 32):
        P = sum(p.numel() for p in MLP(16, width, 1, 4).parameters())
        assert f"(P = {P:,} parameters" in text
    assert re.search(r"checkpoint \S*junk.pt: cannot be loaded: .*not a readable checkpoint", text)
    assert re.search(r"checkpoint \S*no_kwargs.pt: cannot be loaded: .*shape mismatches", text)
    assert "total over 3 checkpoint(s) (2 could not be loaded): 24–144 HVPs" in text


def test_checkpoint_column_holds_glob_matches_as_the_glob_is_written(tmp_path, monkeypatch):
    """A relative glob in the config matches relative to the config's folder and its matches stay
    relative (the README's "the path as given"); an absolute glob gives absolute paths."""
    proj = write_project(tmp_path / "p", measures=["frobenius_norm"], n_ckpt=2)
    (proj.parent / "runs" / "a").mkdir(parents=True)
    (proj.parent / "runs" / "b").mkdir()
    (proj.parent / "m0.pt").rename(proj.parent / "runs" / "a" / "best.pt")
    (proj.parent / "m1.pt").rename(proj.parent / "runs" / "b" / "best.pt")
    cfg = yaml.safe_load(proj.read_text())
    cfg["checkpoints"] = ["runs/*/best.pt"]
    proj.write_text(yaml.safe_dump(cfg))
    monkeypatch.chdir(tmp_path)  # elsewhere than the config's folder
    res = run("measure", "-c", proj, "-o", tmp_path / "o", "--format", "csv")
    assert res.exit_code == 0, out(res)
    assert [r["checkpoint"] for r in csv.DictReader(open(tmp_path / "o" / "results.csv"))] == [
        "runs/a/best.pt",
        "runs/b/best.pt",
    ]
    cfg["checkpoints"] = [str(proj.parent / "runs" / "*" / "best.pt")]
    proj.write_text(yaml.safe_dump(cfg))
    res = run("measure", "-c", proj, "-o", tmp_path / "o2")
    assert res.exit_code == 0, out(res)
    assert [r["checkpoint"] for r in csv.DictReader(open(tmp_path / "o2" / "results.csv"))] == [
        str(proj.parent / "runs" / d / "best.pt") for d in "ab"
    ]


def test_a_directory_given_as_a_checkpoint_is_named_as_one(project, tmp_path):
    (tmp_path / "run").mkdir()
    torch.save({}, tmp_path / "run" / "final.pt")
    res = run("measure", tmp_path / "run", "-c", project)
    assert res.exit_code == 2
    assert "run is a directory, not a checkpoint file; it holds final.pt: pass one of them" in out(
        res
    )
    assert "file not found" not in out(res)


@pytest.mark.parametrize(
    "module, argv, expected",
    [
        ("flatcli.sweep", ["out", "--shard", "0/2"], ["sweep-worker", "out", "--shard", "0/2"]),
        (
            "flatcli.experiments",
            ["random_labels", "--quick"],
            ["experiments", "run", "random_labels", "--quick"],
        ),
        ("flatcli.experiments", ["list"], ["experiments", "list"]),
        ("flatcli", ["--version"], ["--version"]),
    ],
)
def test_python_m_aliases_reach_the_cli_through_the_one_entry_point(
    monkeypatch, module, argv, expected
):
    """``python -m flatcli.sweep`` and ``python -m flatcli.experiments`` call `flatcli.__main__.run`
    (the one module outside flatcli/cli/ that imports the CLI), which runs the console script's
    `flatcli.cli.main` on the aliased arguments."""
    import runpy
    import sys

    import flatcli.cli

    seen = []
    monkeypatch.setattr(flatcli.cli, "main", lambda args=None: seen.append(args))
    monkeypatch.setattr(sys, "argv", ["python", *argv])
    if module == "flatcli":  # run as __main__, not the imported module the aliases use
        monkeypatch.delitem(sys.modules, "flatcli.__main__", raising=False)
    runpy.run_module(module, run_name="__main__", alter_sys=False)
    assert seen == [expected if module != "flatcli" else None]
