"""The test suite's own rules: one module builds the exact references, every test folder keeps
fast tests, and the default command runs everything."""

import ast
from pathlib import Path

import tomllib

ROOT = Path(__file__).parents[2]
TESTS = ROOT / "tests"
ORACLES = TESTS / "oracles.py"

# Double backward that is the subject of a test, not a reference: (file, function) → why.
NOT_REFERENCES = {
    ("tests/engine/test_curvatures.py", "_matmat_batch"): "the toy curvature of the docs' recipe",
}

LOOPS = (ast.For, ast.While, ast.ListComp, ast.GeneratorExp, ast.SetComp, ast.DictComp)


def _grad_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """Local names bound to torch.autograd.grad and to a Hessian function of torch."""
    grads, hessians = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
            for a in node.names:
                if a.name == "grad" and node.module == "torch.autograd":
                    grads.add(a.asname or a.name)
                if a.name == "hessian":
                    hessians.add(a.asname or a.name)
    return grads, hessians


def _is_call_to(node: ast.Call, attrs: tuple[str, ...], names: set[str]) -> bool:
    f = node.func
    if isinstance(f, ast.Name):
        return f.id in names
    return isinstance(f, ast.Attribute) and ast.unparse(f).endswith(attrs)


def _keyword_true(node: ast.Call, name: str) -> bool:
    return any(
        k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is True
        for k in node.keywords
    )


def dense_references(path: Path) -> list[str]:
    """The places in ``path`` that build a Hessian reference: a call of ``torch.func.hessian``
    (or ``torch.autograd.functional.hessian``), or a function that takes a gradient with
    ``create_graph=True`` and differentiates it again in a loop or with ``is_grads_batched``
    (double backward row by row, or product by product)."""
    tree = ast.parse(path.read_text())
    grads, hessians = _grad_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _is_call_to(
            node, ("func.hessian", "functional.hessian"), hessians
        ):
            found.append(f"{ast.unparse(node.func)} (line {node.lineno})")
    funcs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    for fn in funcs:
        calls = [
            n
            for n in ast.walk(fn)
            if isinstance(n, ast.Call) and _is_call_to(n, ("autograd.grad",), grads)
        ]
        if not any(_keyword_true(c, "create_graph") for c in calls):
            continue
        looped = {id(c) for lp in ast.walk(fn) if isinstance(lp, LOOPS) for c in ast.walk(lp)}
        again = [
            c
            for c in calls
            if not _keyword_true(c, "create_graph")
            and (id(c) in looped or _keyword_true(c, "is_grads_batched"))
        ]
        if again:
            found.append(
                f"{fn.name} (line {fn.lineno}): double backward of a create_graph gradient, row by row or batched"
            )
    return found


def test_only_the_oracle_module_builds_a_dense_hessian_reference():
    """Exact references come from tests/oracles.py: no other test module calls torch.func.hessian
    or differentiates a create_graph gradient again, row by row or product by product."""
    own = dense_references(ORACLES)
    assert any(s.startswith("dense_hessian ") for s in own), own  # the detector sees the oracle
    assert any(s.startswith("hessian_products ") for s in own), own
    bad, allowed = [], set()
    for path in sorted(TESTS.rglob("*.py")):
        if path == ORACLES:
            continue
        rel = path.relative_to(ROOT).as_posix()
        for where in dense_references(path):
            key = (rel, where.split(" ")[0])
            if key in NOT_REFERENCES:
                allowed.add(key)
            else:
                bad.append(f"{rel}: {where}")
    assert not bad, "use tests/oracles.py (dense_hessian, problem_hessian, ...):\n" + "\n".join(bad)
    assert allowed == set(NOT_REFERENCES), set(NOT_REFERENCES) - allowed  # no stale exemption


def _marks(decorators) -> set[str]:
    out = set()
    for d in decorators:
        target = d.func if isinstance(d, ast.Call) else d
        text = ast.unparse(target)
        if text.startswith("pytest.mark."):
            out.add(text.removeprefix("pytest.mark."))
    return out


def _module_marks(tree: ast.Module) -> set[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            values = (
                node.value.elts if isinstance(node.value, ast.List | ast.Tuple) else [node.value]
            )
            return _marks(values)
    return set()


def fast_tests(path: Path) -> list[str]:
    """The test functions of a module that are not marked slow (by decorator, class or module)."""
    tree = ast.parse(path.read_text())
    if "slow" in _module_marks(tree):
        return []
    out = []
    for node in tree.body:
        scopes = [(node, set())]
        if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            scopes = [(n, _marks(node.decorator_list)) for n in node.body]
        for fn, inherited in scopes:
            if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test"):
                if "slow" not in inherited | _marks(fn.decorator_list):
                    out.append(fn.name)
    return out


def test_every_test_folder_keeps_tests_that_are_not_slow():
    """``-m "not slow"`` still covers every package: each tests/<pkg>/ has a test not marked slow."""
    folders = [p for p in sorted(TESTS.iterdir()) if p.is_dir() and any(p.glob("test_*.py"))]
    assert len(folders) >= 10, folders
    empty = [p.name for p in folders if not any(fast_tests(f) for f in p.glob("test_*.py"))]
    assert not empty, f"no test outside the slow selection in tests/{empty}"


def test_the_fast_selection_counts_marks_as_pytest_does(tmp_path):
    """The folder check's reading of marks: decorator, class and module marks make a test slow."""
    f = tmp_path / "test_x.py"
    f.write_text(
        "import pytest\n"
        "@pytest.mark.slow\ndef test_a(): pass\n"
        "@pytest.mark.parametrize('k', [1])\n@pytest.mark.slow\ndef test_b(k): pass\n"
        "@pytest.mark.slow\nclass TestC:\n    def test_c(self): pass\n"
        "def test_fast(): pass\n"
    )
    assert fast_tests(f) == ["test_fast"]
    f.write_text("import pytest\npytestmark = [pytest.mark.slow]\ndef test_fast(): pass\n")
    assert fast_tests(f) == []


def test_the_default_command_runs_the_slow_tests_too():
    """``python -m pytest -q`` (README, CI) deselects nothing: the addopts select no marker."""
    opts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "-m" not in opts["addopts"].split() and "slow" not in opts["addopts"]
    assert any(m.startswith("slow:") for m in opts["markers"])
