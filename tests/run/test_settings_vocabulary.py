"""One settings object and one precision vocabulary on every path: validated once (in API terms),
the same words in YAML, the CLI flag, Python and the engine."""

import json

import pytest
import torch

from flatcli.cli import app
from flatcli.engine import CurvatureEngine, Problem
from flatcli.engine.precision import PRECISIONS, Precision
from flatcli.errors import ConfigError
from flatcli.run.settings import Settings
from tests.helpers import write_project
from tests.oracles import runner


def test_settings_validate_in_api_terms():
    with pytest.raises(
        ConfigError,
        match=r"^precision must be one of auto, fp32, tf32, bf16, fp64. Got 'half' instead\.$",
    ):
        Settings(precision="half")
    with pytest.raises(
        ConfigError, match=r"^precision: fp16 is not offered: float16's range .* use bf16"
    ):
        Settings(precision="fp16")
    with pytest.raises(
        ConfigError,
        match=r"^loss must be one of cross_entropy, mse, causal_lm. Got 'nll' instead\.$",
    ):
        Settings(loss="nll")
    with pytest.raises(ConfigError, match=r"^batch_size must be an int ≥ 1. Got 0 instead\.$"):
        Settings(batch_size=0)
    assert Settings(params={"include": ["fc.*"]}).params.include == ("fc.*",)


def test_the_engine_speaks_the_settings_vocabulary():
    model = torch.nn.Linear(3, 2)
    p = Problem(model, torch.randn(4, 3), torch.tensor([0, 1, 0, 1]))
    for (
        name
    ) in PRECISIONS:  # the engine takes the configured word itself and resolves it the same way
        eng = CurvatureEngine(p, precision=name)
        assert (
            eng.precision
            == Precision.of(name, p.device)
            == Settings(precision=name).resolved_precision
        )
    on_cpu = {n: Precision.of(n, "cpu").effective for n in PRECISIONS}
    assert on_cpu == {
        "auto": "fp32",
        "fp32": "fp32",
        "tf32": "fp32",
        "bf16": "bf16",
        "fp64": "fp64",
    }
    assert (
        p.compute_dtype == p.dtype
    )  # the last engine (fp64) set the forward back to θ's type after bf16
    with pytest.raises(ValueError, match="precision must be one of"):
        CurvatureEngine(p, precision="half")


def test_precision_flag_on_measure_and_landscape(tmp_path):
    project = write_project(tmp_path / "proj")
    res = runner.invoke(
        app,
        [
            "measure",
            "-c",
            str(project),
            "-o",
            str(tmp_path / "o"),
            "--precision",
            "fp64",
            "-m",
            "frobenius_norm",
        ],
    )
    assert res.exit_code == 0, res.output
    meta = json.loads((tmp_path / "o" / "results.json").read_text())
    assert meta["config"]["runtime"]["precision"] == "fp64"
    bad = runner.invoke(app, ["measure", "-c", str(project), "--precision", "fp16"])
    assert (
        bad.exit_code == 2
        and "--precision must be one of auto, fp32, tf32, bf16, fp64. Got 'fp16' instead."
        in bad.output
    )
    view = runner.invoke(
        app,
        [
            "landscape",
            "slice",
            "-c",
            str(project),
            str(project.parent / "m0.pt"),
            "-o",
            str(tmp_path / "l"),
            "--steps",
            "3",
            "--no-plots",
            "--precision",
            "fp64",
        ],
    )
    assert view.exit_code == 0, view.output
    assert json.loads((tmp_path / "l" / "landscape.json").read_text())["precision"] == "fp64"
