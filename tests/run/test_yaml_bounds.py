"""Config parsing is bounded: a YAML alias bomb and a key given twice are one-line errors naming
the key (exit 2, within a second), on both the libyaml and the pure-Python loader; merge keys,
ordinary aliases and plain configs still load."""

from __future__ import annotations

import time

import numpy as np
import pytest
import yaml

from flatcli import yaml_loader as cfgmod
from flatcli.cli import app
from flatcli.config import load_config, safe_yaml
from flatcli.errors import ConfigError
from flatcli.yaml_loader import MAX_ALIAS_VALUES, BoundedLoader
from tests.oracles import runner


def bomb(where: str = "kwargs", levels: int = 9) -> str:
    """A billion-laughs bomb (9 levels of 9 aliases: 9⁹ strings) under ``model.<where>``."""
    lines = ["model:", "  target: torch.nn:Linear", f"  {where}:"]
    lines.append('    a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]')
    prev = "a"
    for c in "bcdefghijklm"[: levels - 1]:
        lines.append(f"    {c}: &{c} [" + ",".join([f"*{prev}"] * 9) + "]")
        prev = c
    return "\n".join(lines) + "\n"


LOADERS = [BoundedLoader, cfgmod._FastBoundedLoader]


@pytest.mark.parametrize("loader", LOADERS)
def test_alias_bomb_is_refused_naming_the_key(loader):
    text = bomb()
    assert len(text.encode()) < 700  # a few hundred bytes expanding to 9⁹ values
    t0 = time.perf_counter()
    with pytest.raises(yaml.YAMLError, match=r"aliases expand model\.kwargs\.e to more than"):
        yaml.load(text, Loader=loader)  # noqa: S506 - a safe loader
    assert time.perf_counter() - t0 < 1.0


def test_alias_bomb_exits_2_in_one_line_within_a_second(tmp_path):
    for where in ("kwargs", "data_kwargs"):
        p = tmp_path / f"{where}.yaml"
        p.write_text(bomb(where))
        t0 = time.perf_counter()
        with pytest.raises(ConfigError, match=rf"{p}.*line \d+.*model\.{where}\.e"):
            load_config(p)
        assert time.perf_counter() - t0 < 1.0
    res = runner.invoke(app, ["config", "show", "-c", str(tmp_path / "kwargs.yaml")])
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert "aliases expand model.kwargs.e" in res.output


@pytest.mark.parametrize("seed", range(20))
def test_alias_expansion_under_the_bound_loads_and_over_it_is_refused(seed):
    """Random fan-outs: a document whose aliases add at most the bound loads (equal to the plain
    loader's data), one over it is refused."""
    rng = np.random.default_rng(seed)
    fan, levels = int(rng.integers(2, 12)), int(rng.integers(2, 7))
    lines = ["x:", "  a: &a [" + ",".join(["1"] * fan) + "]"]
    prev = "a"
    for i in range(1, levels):
        name = f"n{i}"
        lines.append(f"  {name}: &{name} [" + ",".join([f"*{prev}"] * fan) + "]")
        prev = name
    text = "\n".join(lines) + "\n"
    plain = yaml.safe_load(text)
    # values added by aliases: expanded nodes (brute force) minus distinct ones
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    added = _brute_expanded(node) - cfgmod._distinct(node)
    if added <= MAX_ALIAS_VALUES:
        assert safe_yaml(text) == plain
    else:
        with pytest.raises(yaml.YAMLError, match="aliases expand x.n"):
            safe_yaml(text)


def _brute_expanded(node) -> int:
    """Nodes of the tree with every alias copied out (recursion: small documents only)."""
    kids = cfgmod._children(node)
    return 1 + sum(_brute_expanded(k) for k in kids)


@pytest.mark.parametrize("seed", range(10))
def test_the_expansion_count_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    lines, names = [], []
    for i in range(int(rng.integers(2, 8))):
        items = [str(v) for v in rng.integers(0, 9, int(rng.integers(1, 4)))]
        items += [f"*{n}" for n in rng.choice(names, min(len(names), 3))] if names else []
        lines.append(f"k{i}: &k{i} [{', '.join(items)}]")
        names.append(f"k{i}")
    node = yaml.compose("\n".join(lines), Loader=yaml.SafeLoader)
    assert cfgmod._expanded(node, {}) == _brute_expanded(node)


@pytest.mark.parametrize("loader", LOADERS)
def test_duplicate_keys_are_refused_naming_key_and_line(loader):
    text = "model:\n  target: t\nmeasures:\n  - a\nmeasures:\n  - b\n"
    with pytest.raises(yaml.YAMLError, match="duplicate key 'measures'") as e:
        yaml.load(text, Loader=loader)  # noqa: S506 - a safe loader
    assert e.value.problem_mark.line == 4
    nested = "model:\n  kwargs: {a: 1, b: 2, a: 3}\n"
    with pytest.raises(yaml.YAMLError, match="duplicate key 'a'"):
        yaml.load(nested, Loader=loader)  # noqa: S506 - a safe loader
    # a merge key may be overridden (YAML's rule), and distinct keys 1 and '1' stay distinct
    merged = "base: &b {x: 1, y: 2}\nother:\n  <<: *b\n  x: 3\nn: {1: a, '1': b}\n"
    assert yaml.load(merged, Loader=loader) == yaml.safe_load(merged)  # noqa: S506


def test_duplicate_measures_key_exits_2(tmp_path):
    p = tmp_path / "dup.yaml"
    p.write_text(
        "model:\n  target: torch.nn:Linear\n  kwargs: {in_features: 2, out_features: 2}\n"
        "measures:\n  - hessian_trace\nmeasures:\n  - weight_norm\n"
    )
    t0 = time.perf_counter()
    with pytest.raises(
        ConfigError,
        match=r"dup.yaml is not valid YAML \(line 6, column 1\): duplicate key 'measures'",
    ):
        load_config(p)
    assert time.perf_counter() - t0 < 1.0
    res = runner.invoke(app, ["config", "show", "-c", str(p)])
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output


def test_recursive_alias_non_utf8_and_deep_files_are_one_line(tmp_path):
    cases = {
        "rec.yaml": b"a: &a [1, *a]\n",
        "latin.yaml": b"model:\n  target: caf\xe9\n",
        "deep.yaml": b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n",
    }
    for name, data in cases.items():
        p = tmp_path / name
        p.write_bytes(data)
        with pytest.raises(ConfigError, match=rf"config file {p} ") as e:
            load_config(p)
        assert "\n" not in str(e.value)


def test_plain_configs_still_load_the_same():
    text = "model:\n  target: m:f\n  kwargs: &k {a: 1, b: [1, 2]}\nother: *k\nx: 1e-3\n"
    assert safe_yaml(text) == yaml.safe_load(text)
