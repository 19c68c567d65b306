"""Measures compose the costs their estimators declare; none restates an estimator's stopping rule.

A measure's cost is `flatcli.engine.linalg.Cost` composed from the declarations beside the
estimators (`lanczos_cost`, `hutchinson_cost`, ...), which read the stopping rules' own objects.
A measure module that reads those objects itself (the certified Lanczos steps, the basis floor,
the near-zero floor's runs, the working vectors) holds a second copy of the rule."""

import ast
import inspect
from pathlib import Path

ROOT = Path(__file__).parents[2]
MEASURES = ROOT / "flatcli" / "measures"

# The helpers and constants behind the estimators' stopping rules and sizes (flatcli/engine/linalg).
STOPPING_RULES = {
    "certified_min_steps",
    "basis_floor",
    "basis_limit",
    "restart_keep",
    "host_fit",
    "LANCZOS_WORK_VECTORS",
    "NEAR_ZERO_RUNS",
    "NEAR_ZERO_STEPS",
    "near_zero_vectors",
    "slq_group_size",
    "HOST_ROOM",
    "default_capacity",
    "device_capacity",
}


def restated(path: Path) -> list[str]:
    """Where ``path`` names a stopping-rule helper or constant (an import, a name, an attribute);
    docstrings and comments do not count."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom | ast.Import):
            names = [a.name.rsplit(".", 1)[-1] for a in node.names]
        elif isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        found += [f"{path.name}:{node.lineno} {n}" for n in names if n in STOPPING_RULES]
    return found


def test_no_measure_module_restates_an_estimator_stopping_rule():
    modules = sorted(MEASURES.glob("*.py"))
    assert len(modules) > 20
    found = [hit for path in modules for hit in restated(path)]
    assert not found, (
        "compose the estimators' declared costs (flatcli.engine.linalg.lanczos_cost, "
        f"hutchinson_cost, ...) instead of reading their stopping rules: {found}"
    )


def test_the_scan_sees_every_way_of_naming_a_rule(tmp_path):
    src = tmp_path / "m.py"
    for line in (
        "from ..engine.linalg import certified_min_steps",
        "x = linalg.basis_floor(1, 1, 1, None)",
        "y = linalg.trace.NEAR_ZERO_RUNS",
        "import flatcli.engine.linalg.lanczos.host_fit",
    ):
        src.write_text(line + "\n")
        assert restated(src), line
    src.write_text('"""certified_min_steps in prose"""\n# basis_floor in a comment\n')
    assert not restated(src)


def test_the_measure_reference_prints_each_declaration():
    from flatcli.measures import Dims, list_measures
    from tests.project.test_docs import docs

    for info in list_measures():
        assert not hasattr(info, "cost"), "a prose cost beside the declaration"
        page = docs.measure_page(info)
        section = page.split("\nCost\n----\n", 1)[1].split("Stops early", 1)[0]
        assert inspect.getdoc(info.declare_cost) in section, info.name
        for P in docs.COST_SIZES:
            dims = Dims(P=P, n=10_000, C=10, tensors=(P,), matrices=(P,), matrix_tensors=(0,))
            assert f"- P = {P:,}: {info.default_cost(dims).summary()}" in section, (info.name, P)


def test_flatcli_measures_prints_each_declaration():
    from flatcli.measures import Dims, get_measure
    from tests.oracles import cli_and_output

    dims = Dims(P=100_000, n=10_000, C=10, tensors=(100_000,), matrices=(100_000,))
    for name in ("hessian_lambda_max", "sharpness_average", "frobenius_norm"):
        res, out = cli_and_output("measures", name)
        assert res.exit_code == 0, out
        cells = " ".join(line.strip("│ ").strip() for line in out.splitlines())
        want = get_measure(name).default_cost(dims).summary()
        assert f"cost (defaults, P = 100,000): {want}" in " ".join(cells.split()), (name, out)
