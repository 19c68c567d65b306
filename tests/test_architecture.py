"""The layering rules of docs/architecture.md, checked on the source tree.

* No module outside ``flatcli/measures/`` names a measure (registry hooks carry the rules).
* Nothing below the CLI imports ``flatcli.cli`` (entry-point ``__main__`` modules excepted).
* The engine knows nothing of measures.
* No import cycles between flatcli modules (imports inside functions count too).
"""

from __future__ import annotations

import ast
from pathlib import Path

from flatcli.measures import list_measures

PKG = Path(__file__).resolve().parent.parent / "flatcli"


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.with_suffix("").relative_to(PKG.parent).parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """flatcli modules imported anywhere in module ``name`` (function-level imports included)."""
    path = MODULES[name]
    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    tree = ast.parse(path.read_text())
    typing_only = {  # `if TYPE_CHECKING:` imports exist for annotations only: no runtime edge
        id(n) for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                stem = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(stem + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in MODULES and t != name}
    return found


def _string_constants(path: Path) -> set[str]:
    """String literals of a module, docstrings excluded."""
    tree = ast.parse(path.read_text())
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docs.add(id(body[0].value))
    return {
        n.value for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
    }


def test_no_module_outside_measures_names_a_measure():
    names = {m.name for m in list_measures()}
    offenders = {}
    for mod, path in MODULES.items():
        if mod == "flatcli.measures" or mod.startswith("flatcli.measures."):
            continue
        hit = names & _string_constants(path)
        if hit:
            offenders[mod] = sorted(hit)
    assert not offenders, f"measure names outside flatcli/measures/: {offenders}"


def test_nothing_below_the_cli_imports_it():
    entry = {"flatcli.cli", "flatcli.__main__", "flatcli.sweep.__main__"}
    bad = [m for m in MODULES if m not in entry and "flatcli.cli" in _imports(m)]
    assert not bad, f"modules importing flatcli.cli: {bad}"


def test_engine_knows_nothing_of_measures():
    bad = {m: sorted(i for i in _imports(m) if not i.startswith("flatcli.engine") and i != "flatcli.errors")
           for m in MODULES if m.startswith("flatcli.engine")}
    assert not any(bad.values()), bad


def test_no_import_cycles():
    edges = {m: _imports(m) for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"
