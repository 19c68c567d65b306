"""Imports of flatcli modules inside functions (docs/architecture.md, "Imports at the top"): at
most `MOST`, each giving its reason on its line (``# lazy: <reason>``: an optional dependency, the
start-up time of ``import flatcli`` and of the CLI, or an import cycle). Everything else is
imported at the top of its module. The CLI's start-up, which these lazy imports keep small, is
checked too: ``flatcli --help`` and ``--version`` load neither torch nor pandas."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "flatcli"
MOST = 30


def _of_flatcli(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] == "flatcli"
    if isinstance(node, ast.Import):
        return any(a.name.split(".")[0] == "flatcli" for a in node.names)
    return False


def _in_functions(node: ast.AST, in_function: bool = False):
    """The import statements of flatcli modules inside functions under ``node``."""
    for child in ast.iter_child_nodes(node):
        inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
        if inside and _of_flatcli(child):
            yield child
        yield from _in_functions(child, inside)


def function_imports(root: Path) -> list[tuple[str, int, bool]]:
    """(file, line, whether it gives a ``# lazy:`` reason) of every import of a flatcli module
    inside a function (methods and nested functions included) under ``root``."""
    out = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in _in_functions(ast.parse("\n".join(lines))):
            src = lines[node.lineno - 1 : node.end_lineno]
            reason = any(s.partition("# lazy:")[2].strip() for s in src)
            out.append((path.relative_to(root.parent).as_posix(), node.lineno, reason))
    return out


def test_function_level_imports_are_few_and_give_their_reason():
    found = function_imports(PKG)
    assert len(found) <= MOST, (
        f"{len(found)} function-level imports of flatcli modules (most {MOST})"
    )
    silent = [f"{f}:{n}" for f, n, reason in found if not reason]
    assert not silent, f"imports inside functions without a '# lazy: <reason>' comment: {silent}"


def test_the_count_finds_every_function_level_import(tmp_path):
    pkg = tmp_path / "flatcli"
    pkg.mkdir()
    (pkg / "mod.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import top\n"
        "if TYPE_CHECKING:\n"
        "    from .x import Y\n"
        "def f():\n"
        "    import os\n"
        "    from . import a  # lazy: start-up\n"
        "    from .b import (  # lazy:\n"
        "        c,\n"
        "    )\n"
        "class K:\n"
        "    def m(self):\n"
        "        def inner():\n"
        "            import flatcli.api\n"
        "        from flatcli.run import (\n"
        "            results,\n"
        "        )  # lazy: cycle\n"
    )
    assert function_imports(pkg) == [
        ("flatcli/mod.py", 7, True),
        ("flatcli/mod.py", 8, False),  # a reason must say something
        ("flatcli/mod.py", 14, False),
        ("flatcli/mod.py", 15, True),
    ]


@pytest.mark.parametrize("args", [["--help"], ["--version"]])
def test_the_cli_starts_without_torch_or_pandas(args):
    code = (
        "import sys\n"
        "from flatcli.cli import app\n"
        f"try:\n    app(args={args!r})\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'pandas', 'scipy') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "[]"
