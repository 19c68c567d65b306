"""benchmarks/ (tracked comparisons writing JSON) and tools/ (docs tooling): imported as installed
packages, never through sys.path or flatcli's private names; every result file in
docs/benchmarks/data follows the one schema the documentation renders."""

import ast
import datetime
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "docs" / "benchmarks" / "data"
MACHINE = {"cpu", "cores", "memory_gb", "torch", "python"}


def _sources():
    return sorted([*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "tools").glob("*.py")])


def _private_flatcli_imports(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "flatcli":
            parts = node.module.split(".") + [a.name for a in node.names]
            out += [f"from {node.module} import {a.name}" for a in node.names if _private(parts)]
        elif isinstance(node, ast.Import):
            out += [
                a.name
                for a in node.names
                if a.name.startswith("flatcli.") and _private(a.name.split("."))
            ]
    return out


def _private(parts: list[str]) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in parts)


def _touches_sys_path(tree: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Attribute)
        and n.attr == "path"
        and isinstance(n.value, ast.Name)
        and n.value.id == "sys"
        for n in ast.walk(tree)
    ) or any(
        "sys.path" in n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    )


@pytest.mark.slow
def test_scripts_are_split_into_benchmarks_and_tools():
    assert not (ROOT / "scripts").exists()
    assert (ROOT / "benchmarks" / "_common.py").is_file() and (ROOT / "tools").is_dir()
    bad = {}
    for path in _sources():
        tree = ast.parse(path.read_text())
        found = _private_flatcli_imports(tree) + (["sys.path"] if _touches_sys_path(tree) else [])
        if found:
            bad[str(path.relative_to(ROOT))] = found
    assert not bad, bad


def _check_schema(data: dict, where: str) -> None:
    keys = {"benchmark", "title", "command", "machine", "commit", "date", "tables"}
    assert keys <= set(data) <= keys | {"history"}, where
    assert all(isinstance(data[k], str) and data[k] for k in ("benchmark", "title", "commit")), (
        where
    )
    assert isinstance(data["command"], str), where
    datetime.date.fromisoformat(data["date"])
    assert MACHINE <= set(data["machine"]) <= MACHINE | {"gpu"}, where
    assert data["tables"], where
    for t in data["tables"]:
        assert set(t) <= {"title", "columns", "rows", "note"} and t["title"], where
        assert all(isinstance(c, str) for c in t["columns"]), where
        assert all(isinstance(r, list) and len(r) == len(t["columns"]) for r in t["rows"]), where
        assert isinstance(t.get("note", ""), str), where


def test_benchmark_data_follow_the_schema():
    files = sorted(DATA.glob("*.json"))
    assert len(files) >= 20
    for f in files:
        _check_schema(json.loads(f.read_text()), f.name)


# a path of one machine: a home, a scratch or temporary folder, a checkout's absolute path
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:home|Users|tmp|work|scratch|mnt|opt|root|var)/")


def test_benchmark_data_carry_no_machine_paths():
    """A data file says `CHECKOUT` or a relative path, never the folder of the machine it ran on."""
    assert MACHINE_PATH.search("python x.py --a /tmp/he27b/lib")  # the pattern catches one
    assert not MACHINE_PATH.search("python -m benchmarks.x --out out/cat CHECKOUT/flatcli")
    found = {
        f.name: MACHINE_PATH.findall(f.read_text())
        for f in sorted(DATA.glob("*.json"))
        if MACHINE_PATH.search(f.read_text())
    }
    assert not found, found


def test_the_writer_writes_the_schema(tmp_path):
    from benchmarks._common import records_table, table, write_json

    tables = [
        table("a", ["x", "y"], [[1, 2.5], ["n", float("nan")]], "a note"),
        records_table("b", [{"size": "2M", "s": 1.0}, {"size": "10M", "peak": 3}]),
    ]
    path = write_json("demo", "Demo", tables, tmp_path / "demo.json", command="python -m x")
    data = json.loads(path.read_text())
    _check_schema(data, "demo")
    assert data["benchmark"] == "demo" and data["command"] == "python -m x"
    assert data["tables"][0]["rows"] == [[1, 2.5], ["n", "nan"]]
    assert data["tables"][1]["columns"] == ["size", "s", "peak"]
    assert data["tables"][1]["rows"] == [["2M", 1.0, ""], ["10M", "", 3]]
    assert data["date"] == datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    assert data["machine"]["cores"] >= 1


@pytest.mark.parametrize("name", [p.stem for p in sorted((ROOT / "benchmarks").glob("bench_*.py"))])
def test_every_benchmark_imports_and_takes_json(name):
    """Each benchmark imports as a package module (``python -m benchmarks.NAME``) and writes its
    result through the shared writer (``--json``)."""
    import importlib

    mod = importlib.import_module(f"benchmarks.{name}")
    assert "json_arg" in vars(mod) and "write_json" in vars(mod), name
