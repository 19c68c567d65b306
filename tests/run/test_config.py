import pytest

from flatcli.config import from_dict, load_config
from flatcli.errors import ConfigError


def test_unknown_key_suggests_closest():
    with pytest.raises(
        ConfigError,
        match=r"Unknown config key 'measure_data.batch_sise'. Did you mean 'measure_data.batch_size'\?",
    ):
        from_dict({"measure_data": {"batch_sise": 3}})


def test_unknown_top_level_key():
    with pytest.raises(
        ConfigError, match=r"Unknown config key 'mesures'. Did you mean 'measures'\?"
    ):
        from_dict({"mesures": []})


def test_wrong_type_names_key():
    with pytest.raises(ConfigError, match=r"config key 'hparams.from_path' must be str. Got int 3"):
        from_dict({"hparams": {"from_path": 3}})
    # a key with a rule (flatcli.validation.SETTINGS) says the rule, type and range in one wording
    with pytest.raises(
        ConfigError,
        match=r"^config key 'measure_data.batch_size' must be an int ≥ 1. Got 'big' instead\.$",
    ):
        from_dict({"measure_data": {"batch_size": "big"}})


def test_measure_option_message_is_sklearn_style():
    with pytest.raises(
        ConfigError,
        match=r"The 'tol' parameter of hessian_trace must be a float in \(0, 1\)\. Got 0 instead\.",
    ):
        from_dict({"measures": [{"hessian_trace": {"tol": 0}}]})


def test_unknown_measure_and_option():
    with pytest.raises(
        ConfigError, match=r"Unknown measure 'hessian_trac'. Did you mean 'hessian_trace'\?"
    ):
        from_dict({"measures": ["hessian_trac"]})
    with pytest.raises(
        ConfigError,
        match=r"Unknown option 'max_step' for measure hessian_lambda_max. Did you mean 'max_steps'\?",
    ):
        from_dict({"measures": [{"hessian_lambda_max": {"max_step": 3}}]})


def test_duplicate_labels_rejected_and_labels_allow_repeats():
    with pytest.raises(ConfigError, match="more than once"):
        from_dict({"measures": ["hessian_trace", {"hessian_trace": {"tol": 0.1}}]})
    cfg = from_dict(
        {"measures": ["hessian_trace", {"hessian_trace": {"tol": 0.1, "label": "tr_loose"}}]}
    )
    assert [s.label for s in cfg.measure_specs()] == ["hessian_trace", "tr_loose"]
    assert cfg.measure_specs()[1].options == {"tol": 0.1}


def test_yaml_reads_scientific_strings():
    cfg = from_dict({"measures": [{"hessian_lambda_max": {"tol": "1e-4"}}]})
    assert cfg.measure_specs()[0].parsed().tol == 1e-4


def test_precedence_cli_over_env_over_yaml(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("runtime: {device: cpu, seed: 3}\n")
    cfg = load_config(p)
    assert cfg.runtime.seed == 3 and cfg.provenance["runtime.seed"] == "yaml"
    cfg = from_dict({"runtime": {"seed": 3}}, env={"FLATCLI_SEED": "5"})
    assert cfg.runtime.seed == 5 and cfg.provenance["runtime.seed"] == "env FLATCLI_SEED"
    cfg = from_dict(
        {"runtime": {"seed": 3}}, env={"FLATCLI_SEED": "5"}, overrides={"runtime.seed": 7}
    )
    assert cfg.runtime.seed == 7 and cfg.provenance["runtime.seed"] == "cli"
    assert cfg.provenance["loss"] == "default"


def test_invalid_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    p = tmp_path / "bad.yaml"
    p.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match=r"is not valid YAML \(line"):
        load_config(p)


def test_python_tags_are_refused_not_run(tmp_path, monkeypatch):
    """The config loader (libyaml's safe loader when present) builds plain data only: a tag that
    would call a function under yaml.unsafe_load is a YAML error naming its line."""
    calls = []
    monkeypatch.setattr("os.getcwd", lambda: calls.append(1) or "/")
    p = tmp_path / "evil.yaml"
    p.write_text("model:\n  target: !!python/object/apply:os.getcwd []\n")
    with pytest.raises(ConfigError, match=r"is not valid YAML \(line 2, column 11\)"):
        load_config(p)
    assert calls == []


def test_bad_enums():
    with pytest.raises(ConfigError, match="data.train.source' must be one of"):
        from_dict({"data": {"train": {"source": "tensor"}}})
    with pytest.raises(ConfigError, match="'loss' must be"):
        from_dict({"loss": "hinge"})
    with pytest.raises(ConfigError, match="runtime.device"):
        from_dict({"runtime": {"device": "tpu"}})


def test_hash_ignores_output_but_not_measures():
    a = from_dict({"measures": ["hessian_trace"], "output": {"dir": "a"}})
    b = from_dict({"measures": ["hessian_trace"], "output": {"dir": "b"}})
    c = from_dict({"measures": [{"hessian_trace": {"tol": 0.1}}]})
    assert a.hash() == b.hash() != c.hash()
