"""``runtime.recompute`` and ``runtime.max_device_vectors`` (issue 27): config schema, `flatcli config
show`, errors, and the settings reaching the estimators through `flatcli measure`."""

import json

import numpy as np
import pytest

from flatcli.cli import app
from flatcli.config import from_dict
from flatcli.engine.linalg._store import BasisStore
from flatcli.errors import ConfigError
from flatcli.run.settings import Settings
from tests.helpers import write_project
from tests.oracles import runner


def test_defaults_are_auto_and_leave_the_hash_alone():
    cfg = from_dict({})
    assert (cfg.runtime.recompute, cfg.runtime.max_device_vectors) == ("auto", "auto")
    assert (
        "recompute" not in cfg.to_dict()["runtime"]
    )  # a config that does not use them hashes as before
    assert cfg.to_dict(defaults=True)["runtime"]["max_device_vectors"] == "auto"
    set_ = from_dict({"runtime": {"recompute": True, "max_device_vectors": 4}})
    assert set_.hash() != cfg.hash()
    st = Settings.from_config(set_)
    assert (st.recompute, st.max_device_vectors) == ("true", 4)


@pytest.mark.parametrize(
    "key,value,msg",
    [
        ("recompute", "sometimes", "'runtime.recompute' must be true, false or auto"),
        ("max_device_vectors", 0, "'runtime.max_device_vectors' must be an int ≥ 1, auto or null"),
        ("max_device_vectors", "many", "'runtime.max_device_vectors' must be"),
    ],
)
def test_bad_values_name_the_key(key, value, msg):
    with pytest.raises(ConfigError, match=msg):
        from_dict({"runtime": {key: value}})


def test_config_show_lists_the_memory_settings(tmp_path):
    cfg = write_project(tmp_path)
    res = runner.invoke(app, ["config", "show", "-c", str(cfg)])
    assert res.exit_code == 0, res.output
    assert "recompute: auto" in res.stdout and "max_device_vectors: auto" in res.stdout


@pytest.mark.slow
def test_measures_with_offloaded_bases_equal_the_default_run(tmp_path, monkeypatch):
    """λmax (Lanczos), the spectrum (block Lanczos + SLQ) and a Hutch++ trace through the CLI with
    ``max_device_vectors: 2`` equal the run with every basis on the device (float64, to rounding)."""
    measures = [
        {"hessian_lambda_max": {"tol": 1e-8}},
        {"hessian_spectrum": {"top_k": 2, "slq_runs": 2, "slq_steps": 12}},
        {"hessian_trace": {"method": "hutchpp", "min_probes": 12, "max_probes": 30}},
    ]
    made = []
    init = BasisStore.__init__

    def recording(self, *a, **k):
        init(self, *a, **k)
        made.append(self)

    monkeypatch.setattr(BasisStore, "__init__", recording)
    rows, offloaded = {}, {}
    for name, rt in (("dev", {}), ("host", {"max_device_vectors": 2, "recompute": True})):
        cfg = write_project(
            tmp_path / name,
            n_ckpt=1,
            measures=measures,
            extra={"runtime": {"device": "cpu", "seed": 0, "precision": "fp64", **rt}},
        )
        res = runner.invoke(app, ["measure", "-c", str(cfg), "-o", str(tmp_path / name / "o")])
        assert res.exit_code == 0, res.output
        rows[name] = json.loads((tmp_path / name / "o" / "results.json").read_text())["rows"][0][
            "measures"
        ]
        offloaded[name] = [s.peak_resident for s in made if s.offloaded]
        made.clear()
    assert (
        offloaded["dev"] == [] and len(offloaded["host"]) >= 4
    )  # λmax, spectrum, SLQ runs, Hutch++ sketch
    assert max(offloaded["host"]) == 2
    for m in ("hessian_lambda_max", "hessian_trace"):
        assert rows["host"][m]["value"] == pytest.approx(rows["dev"][m]["value"], rel=1e-9)
    sd, sh = rows["dev"]["hessian_spectrum"], rows["host"]["hessian_spectrum"]
    assert sh["value"] == pytest.approx(
        sd["value"], rel=1e-9
    )  # effective dimension, from the SLQ nodes
    dd, dh = sd["diagnostics"], sh["diagnostics"]
    np.testing.assert_allclose(dh["top_eigenvalues"], dd["top_eigenvalues"], rtol=1e-9)
