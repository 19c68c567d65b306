"""Expressions of columns run no code: ``--where`` and ``--target`` share one whitelisted grammar
(flatcli.analysis.expressions). Known pandas/numexpr escapes and random trees with a forbidden node
are refused with exit 2 and create nothing; random allowed conditions equal a row-by-row reference."""

from __future__ import annotations

import os

import numpy as np
import pandas as pd
import pytest

import flatcli
from flatcli.analysis.expressions import MAX_DEPTH, evaluate_condition, nearest
from flatcli.analysis.table import as_table, filter_rows, resolve_column, table_columns
from flatcli.analysis.targets import resolve_target
from flatcli.cli import app
from flatcli.errors import ConfigError
from tests.oracles import runner

PAYLOADS = [  # the three of the report: each made a file through DataFrame.query
    "@pd.io.common.os.system('touch PWNED')",
    "@pd.read_pickle('evil.pkl')",
    "@Path('PWNED').touch()",
]
ESCAPES = [
    *PAYLOADS,
    "@__builtins__",
    "__import__('os').system('touch PWNED')",
    "open('PWNED', 'w')",
    "lr.__class__.__mro__",
    "lr.__class__",
    "(lambda: __import__('os'))()",
    "[c for c in ().__class__.__base__.__subclasses__()]",
    "{c: 1 for c in 'ab'}",
    "`lr`.__class__",
    "lr[0] > 1",
    "lr.values > 1",
    "lr.astype('int') > 0",
    "exp(lr).__class__",
    "log(lr, 2) > 0",
    "getattr(lr, 'x')",
    "(x := 1) > 0",
    "lr > 0 if True else False",
    "f'{lr}' == 'x'",
    "lr > (yield)",
    "*lr",
    "lr in lr",
    "lr in [width]",
    "lr in [print('x')]",
    "lr @ lr > 0",
    "lr % 2 == 0",
    "lr // 2 == 0",
    "lr << 2 > 0",
    "lr is None",
    "lr is not None",
    "...",
    "None",
    "b'x' == lr",
    "1j == lr",
    "lr == 'x' + 'y'",
    "[lr > 0]",
    "{lr > 0}",
    "(lr > 0,)",
    "lr > 0; import os",
    "import os",
    "lr\x00 > 0",
    "lr > 0\nos.system('touch PWNED')",
    "train_loss.pipe(print)",
    "width.sum() > 0",
    "lr > 0 and model.__len__()",
]


def frame(seed: int = 0, n: int = 12) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "model": [f"m{i}" for i in range(n)],
            "opt": rng.choice(["sgd", "adam", "x[/y]"], n),
            "lr": rng.choice([0.01, 0.1, 0.3], n),
            "width": rng.choice([16, 32, 64], n),
            "sharp": rng.normal(size=n),
            "train_loss": rng.uniform(0, 0.5, n),
            "ok": rng.random(n) < 0.5,
            "asam_0.05": rng.normal(size=n),
            "gen_gap": rng.uniform(0, 0.2, n),
        }
    )


def kept(where: str, df: pd.DataFrame) -> list[int]:
    """The rows ``where`` keeps, as `filter_rows` computes them (none kept is no error here)."""
    df = df.reset_index(drop=True)
    mask = evaluate_condition(where, table_columns(df, as_table(df)), "`where`")
    return [i for i in range(len(df)) if mask[i]]


@pytest.mark.parametrize("payload", PAYLOADS)
def test_the_reported_payloads_exit_2_and_create_nothing(payload, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    frame().to_csv("t.csv", index=False)
    res = runner.invoke(app, ["correlate", "t.csv", "-m", "sharp", "--where", payload])
    assert res.exit_code == 2, res.output
    assert res.output.startswith("error: --where") and res.output.count("\n") == 1, res.output
    with pytest.raises(ConfigError, match="`where`"):
        flatcli.correlate(frame(), measures="sharp", where=payload)
    assert sorted(os.listdir(tmp_path)) == ["t.csv"]


@pytest.mark.parametrize("expr", ESCAPES)
def test_escape_corpus_is_refused_naming_the_construct(expr, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        filter_rows(as_table(frame()), where=expr)
    msg = str(e.value)
    assert msg.startswith("`where`") and "\n" not in msg.replace(repr(expr), "")
    assert any(w in msg for w in ("not allowed", "not an expression", "a list", "no column")), msg
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ random trees
COLS = ["lr", "width", "sharp", "train_loss"]


def rand_arith(rng, depth: int) -> str:
    if depth <= 0 or rng.random() < 0.3:
        return str(rng.choice(COLS)) if rng.random() < 0.6 else f"{rng.integers(-3, 4)}"
    k = rng.integers(4)
    a, b = rand_arith(rng, depth - 1), rand_arith(rng, depth - 1)
    if k == 0:
        return f"({a} + {b})"
    if k == 1:
        return f"({a} - {b})"
    if k == 2:
        return f"({a} * {b})"
    return f"abs({a})"


def rand_cond(rng, depth: int) -> str:
    k = rng.integers(7) if depth > 0 else rng.integers(3)
    if k == 0:
        op = rng.choice(["<", "<=", ">", ">=", "==", "!="])
        return f"({rand_arith(rng, 2)} {op} {rand_arith(rng, 2)})"
    if k == 1:
        vals = ", ".join(f"'{v}'" for v in rng.choice(["sgd", "adam", "x[/y]", "nope"], 2))
        return f"(opt {rng.choice(['in', 'not in'])} [{vals}])"
    if k == 2:
        return f"(width in [{', '.join(str(v) for v in rng.choice([16, 32, 64, 7], 2))}])"
    if k == 3:
        return f"({rand_cond(rng, depth - 1)} and {rand_cond(rng, depth - 1)})"
    if k == 4:
        return f"({rand_cond(rng, depth - 1)} or {rand_cond(rng, depth - 1)})"
    if k == 5:
        return f"(not {rand_cond(rng, depth - 1)})"
    return f"(0.05 < lr <= {rand_arith(rng, 1)})"


def reference(expr: str, df: pd.DataFrame) -> list[int]:
    """Row-by-row Python over the generated (trusted) text, no builtins but abs."""
    out = []
    for i, row in enumerate(df.to_dict("records")):
        env = {"__builtins__": {}, "abs": abs, **row}
        if eval(expr, env):  # noqa: S307 - the test's own generated expression, the reference
            out.append(i)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_random_allowed_conditions_equal_a_row_by_row_reference(seed):
    rng = np.random.default_rng(seed)
    df = frame(seed, n=30)
    for _ in range(10):
        expr = rand_cond(rng, 3)
        assert kept(expr, df) == reference(expr, df), expr


FORBIDDEN = [
    "__import__('os').system('touch PWNED')",
    "lr.__class__",
    "(lambda: 1)()",
    "[x for x in [1]]",
    "lr[0]",
    "open('PWNED', 'w').close()",
    "print(1)",
    "(x := 2)",
    "(1 if lr else 2)",
    "lr % 2",
    "{1: 2}",
]


@pytest.mark.parametrize("seed", range(40))
def test_random_trees_with_one_forbidden_node_are_refused(seed, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(1000 + seed)
    df = frame(seed)
    for _ in range(10):
        expr = rand_cond(rng, 3)
        leaves = [c for c in COLS if c in expr]
        bad = str(rng.choice(FORBIDDEN))
        if leaves:
            expr = expr.replace(str(rng.choice(leaves)), bad, 1)
        else:
            expr = f"({expr}) and ({bad} > 0)"
        with pytest.raises(ConfigError, match="is not allowed|a list|not an expression"):
            filter_rows(as_table(df), where=expr)
    assert os.listdir(tmp_path) == []


def test_text_booleans_backquotes_and_missing_values():
    df = frame(3)
    assert kept("opt == 'x[/y]'", df) == [i for i, v in enumerate(df.opt) if v == "x[/y]"]
    assert kept("ok", df) == [i for i, v in enumerate(df.ok) if v]
    assert kept("~ok & (lr > 0.05)", df) == [
        i for i in range(len(df)) if not df.ok[i] and df.lr[i] > 0.05
    ]
    assert kept("`asam_0.05` > 0", df) == [i for i, v in enumerate(df["asam_0.05"]) if v > 0]
    nan = df.assign(sharp=[np.nan] + list(df.sharp[1:]), opt=[None] + list(df.opt[1:]))
    assert 0 not in kept("sharp > -100", nan) and 0 in kept("sharp != 1", nan)
    assert 0 not in kept("opt in ['sgd', 'adam', 'x[/y]']", nan) and 0 in kept("opt != 'a'", nan)
    with pytest.raises(ConfigError, match="cannot compare 'sgd'|cannot compare 'adam'|cannot"):
        kept("opt < 3", df.assign(opt="sgd"))
    with pytest.raises(ConfigError, match="'lr' is not true/false"):
        kept("lr", df)


@pytest.mark.parametrize(
    "expr,what",
    [
        ("(" * 900 + "lr" + ")" * 900, "not an expression"),
        ("-" * 1000 + "lr", "nested deeper than"),
        ("+".join(["lr"] * 3000), "longer than"),
        ("exp(" * 300 + "lr" + ")" * 300, "not an expression|nested deeper"),
        (" + ".join(["lr"] * (MAX_DEPTH + 5)), "nested deeper than"),
        ("lr + " + "9" * 1000, "is too large"),  # no float holds it (OverflowError, exit 1, before)
    ],
)
def test_deep_or_huge_expressions_exit_2(expr, what, tmp_path):
    frame().to_csv(tmp_path / "t.csv", index=False)
    for opt in ("--where", "--target"):
        res = runner.invoke(app, ["correlate", str(tmp_path / "t.csv"), "-m", "sharp", opt, expr])
        assert res.exit_code == 2, res.output[-300:]
        assert res.output.count("\n") == 1 and "Traceback" not in res.output
    with pytest.raises(ConfigError, match=what):
        resolve_target(as_table(frame()), expr)


def test_unknown_columns_name_the_nearest_in_one_line(tmp_path):
    extra = pd.DataFrame({f"measure_{i:03d}": np.zeros(12) for i in range(190)})
    wide = pd.concat([frame(), extra], axis=1)
    t = as_table(wide)
    with pytest.raises(ConfigError) as e:
        resolve_column(t, "widht", "--by")
    assert "did you mean width?" in str(e.value) and "measure_100" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        filter_rows(t, where="train_los < 1")
    assert "did you mean train_loss" in str(e.value) and "measure_100" not in str(e.value)
    with pytest.raises(ConfigError, match="did you mean train_loss"):
        resolve_target(t, "train_los")
    wide.to_csv(tmp_path / "w.csv", index=False)
    res = runner.invoke(app, ["correlate", str(tmp_path / "w.csv"), "-m", "sharp", "--by", "widht"])
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert len(res.output) < 300
    res = runner.invoke(app, ["correlate", str(tmp_path / "w.csv"), "-m", "shrap"])
    assert res.exit_code == 2 and res.output.count("\n") == 1 and len(res.output) < 300, res.output
    assert "did you mean sharp" in res.output
    assert nearest("zzz", [f"c{i}" for i in range(50)]) == "none close among 50 columns"
