"""One error grammar, scikit-learn's, for every validated value: "<subject> must be <constraint>.
Got <value> instead." Checked over every rule (settings, training recipe), every config key with a
rule, every measure's options, every view's options, and the source (no message in the old
"...; got ..." form); a ``model.target`` typo is one error with a did-you-mean."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flatcli import api
from flatcli.config import from_dict
from flatcli.errors import ConfigError
from flatcli.measures import get_measure, list_measures
from flatcli.validation import SETTINGS, TRAINING, option_fields, parse_options, validate

# a value no check accepts (each candidate is refused by some), tried in turn
CANDIDATES = (["not", "a", "value"], "not-a-value", -7, object())
TEMPLATE = r"^{subject} must be (?P<what>.+)\. Got (?P<got>.+) instead\.$"


def refused(call) -> list[str]:
    """The messages of the candidates ``call(value)`` refuses."""
    out = []
    for bad in CANDIDATES:
        try:
            call(bad)
        except ConfigError as e:
            out.append(str(e))
    return out


def follows(msg: str, subject: str) -> bool:
    return re.match(TEMPLATE.format(subject=re.escape(subject)), msg, re.S) is not None


@pytest.mark.parametrize(
    "rules,name", [(SETTINGS, n) for n in SETTINGS] + [(TRAINING, n) for n in TRAINING]
)
def test_every_rule_refuses_in_the_one_grammar(rules, name):
    msgs = refused(lambda v: validate(name, v, f"subject {name}", rules=rules))
    assert msgs, f"no candidate refused by {name}"
    for m in msgs:
        assert follows(m, f"subject {name}"), m


def _config_keys() -> list[tuple[str, str]]:
    """(section, key) of every config key checked by a rule."""
    import dataclasses

    from flatcli.config import Config
    from flatcli.config import yaml_key as ykey

    out = []
    for sec in dataclasses.fields(Config):
        typ = sec.default_factory if sec.default_factory is not dataclasses.MISSING else None
        if typ is None or not dataclasses.is_dataclass(typ):
            continue
        out += [(sec.name, ykey(f)) for f in dataclasses.fields(typ) if f.metadata.get("setting")]
    top = [f.name for f in dataclasses.fields(Config) if f.metadata.get("setting")]
    return out + [("", k) for k in top]


def _base() -> dict:
    syn = {"source": "synthetic", "num_samples": 8, "input_shape": [3], "num_classes": 2}
    return {"model": {"target": "flatcli.demo.models:MLP"}, "data": {"train": syn}}


@pytest.mark.parametrize("section,key", _config_keys())
def test_every_config_key_with_a_rule_refuses_in_the_one_grammar(section, key):
    def load(v):
        raw = _base()
        if section:
            raw.setdefault(section, {})[key] = v
        else:
            raw[key] = v
        from_dict(raw, base_dir=".", env={})

    msgs = refused(load)
    assert msgs
    full = f"{section}.{key}" if section else key
    for m in msgs:
        assert follows(m, f"config key '{full}'"), m


@pytest.mark.parametrize("name", sorted(m.name for m in list_measures()))
def test_every_measure_option_refuses_in_the_one_grammar(name):
    cls = get_measure(name).options
    fields = option_fields(cls) if cls is not None else []
    for f in fields:
        msgs = refused(lambda v, f=f: parse_options(cls, {f.name: v}, name))
        assert msgs, f"{name}.{f.name}"
        for m in msgs:
            assert follows(m, f"The '{f.name}' parameter of {name}"), m


@pytest.mark.parametrize(
    "cls", [api.SliceView, api.InterpolateView, api.PCAView, api.ConnectView], ids=str
)
def test_every_view_option_refuses_in_the_one_grammar(cls):
    fields = option_fields(cls)
    assert fields
    for f in fields:
        msgs = refused(lambda v, f=f: cls(**{f.name: v}))
        assert msgs, f.name
        for m in msgs:
            assert follows(m, f"`{f.name}`"), m


def test_no_message_in_the_source_uses_the_old_grammar():
    """Messages written by hand read as `validation.message` writes them: no "...; got {x}"."""
    root = Path(__file__).resolve().parents[2] / "flatcli"
    old = re.compile(r"[;,] got \{")
    bad = [
        f"{p.relative_to(root.parent)}:{i}"
        for p in sorted(root.rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if old.search(line)
    ]
    assert not bad, bad


# ------------------------------------------------------------------ model.target
def test_a_target_typo_suggests_the_class(tmp_path):
    from flatcli.loading.factory import resolve_target

    with pytest.raises(
        ConfigError, match=r"has no attribute 'MPL'; did you mean 'flatcli.demo.models:MLP'\?"
    ):
        resolve_target("flatcli.demo.models:MPL")
    with pytest.raises(ConfigError, match=r"did you mean 'flatcli.demo.models:MLP'\?"):
        resolve_target("flatcli.demo.modles:MLP")
    (tmp_path / "nets.py").write_text("import torch\nclass SmallCNN(torch.nn.Module):\n    pass\n")
    with pytest.raises(ConfigError, match=r"did you mean 'nets.py:SmallCNN'\?"):
        resolve_target("nets.py:SmallCnn", tmp_path)


def test_a_bad_target_is_one_error_before_any_checkpoint(tmp_path):
    """12 checkpoints and a typo in model.target: one ConfigError (exit code 2), not 12 error rows."""
    import torch

    from flatcli.demo.models import MLP

    ck = tmp_path / "ck"
    ck.mkdir()
    for i in range(3):
        torch.save(MLP(3, 4, 1, 2).state_dict(), ck / f"m{i}.pt")
    raw = _base() | {
        "checkpoints": ["ck/*.pt"],
        "measures": ["frobenius_norm"],
        "runtime": {"device": "cpu"},
    }
    raw["model"] = {"target": "flatcli.demo.models:MPL", "kwargs": {"in_features": 3}}
    cfg = from_dict(raw, base_dir=str(tmp_path), env={})
    with pytest.raises(ConfigError, match="did you mean") as e:  # not a report of 3 error rows
        api.measure(cfg, outdir=tmp_path / "m")
    assert e.value.exit_code == 2 and not (tmp_path / "m" / "results.csv").exists()
    with pytest.raises(ConfigError, match="did you mean"):
        api.sweep(cfg, tmp_path / "s", log=lambda m: None)


def test_the_cli_says_a_bad_target_once(tmp_path):
    import torch
    import yaml

    from flatcli.cli import app
    from flatcli.demo.models import MLP
    from tests.oracles import runner

    (tmp_path / "ck").mkdir()
    for i in range(3):
        torch.save(MLP(3, 4, 1, 2).state_dict(), tmp_path / "ck" / f"m{i}.pt")
    raw = _base() | {"checkpoints": ["ck/*.pt"], "measures": ["frobenius_norm"]}
    raw["model"] = {"target": "flatcli.demo.models:mlp", "kwargs": {"in_features": 3}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    res = runner.invoke(app, ["measure", "-c", str(tmp_path / "c.yaml"), "--device", "cpu"])
    assert res.exit_code == 2, res.output
    assert res.output.count("has no attribute") == 1, res.output
    assert "did you mean 'flatcli.demo.models:MLP'?" in res.output


# ------------------------------------------------------------------ command-line options
def _commands():
    """(command path, click command) of every command and sub-command of the CLI."""
    import typer

    from flatcli.cli import app

    out = []

    def walk(cmd, path):
        subs = getattr(cmd, "commands", None)
        if subs:
            for name, sub in subs.items():
                walk(sub, [*path, name])
        else:
            out.append((" ".join(path), cmd))

    walk(typer.main.get_command(app), [])
    return out


def test_every_refused_option_value_reads_in_the_one_grammar():
    """Each option of each command, given a value its type refuses (text for a number or a
    choice, -5 below a minimum): the message is "--flag must be ... Got ... instead." (not typer's
    "Invalid value for '--flag': Input should be ..."), and the command line says it with exit 2."""
    from flatcli.cli._app import option_message

    seen = 0
    for path, cmd in _commands():
        for p in cmd.params:
            if p.param_type_name != "option" or getattr(p, "is_flag", False):
                continue
            flag = max((o for o in p.opts if o.startswith("--")), key=len)
            for bad in ("not-a-value", "-5"):
                try:
                    cmd.make_context(path, [flag, bad], resilient_parsing=False)
                except Exception as e:  # noqa: BLE001 - the parse's error, whatever it is
                    said = option_message(e)
                    if "Invalid value" in str(getattr(e, "format_message", lambda: "")()):
                        assert said is not None, (path, flag, bad, e.format_message())
                        assert follows(said, flag), said
                        seen += 1
    assert seen >= 20, seen  # the numeric and choice options of the commands


def test_the_command_line_says_a_refused_option_in_the_one_grammar():
    from flatcli.cli import app
    from tests.oracles import runner

    res = runner.invoke(app, ["sweep", "-c", "c.yaml", "-o", "out", "--workers", "0"])
    assert res.exit_code == 2
    assert (
        "error: --workers must be an int ≥ 1. Got 0 instead. (see 'flatcli sweep --help')"
        in res.output
    )
    res = runner.invoke(app, ["sweep", "-c", "c.yaml", "-o", "out", "--executor", "pbs"])
    assert "--executor must be one of local, slurm, local-array. Got 'pbs' instead." in res.output
