"""One name, one meaning (docs/architecture.md): no two modules under ``flatcli/`` in different
packages share a name, and no module is named like a package, so that ``from ..x.plan import``
never leaves a reader guessing which "plan" it is."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "flatcli"

# stem -> the only paths (relative to the repository) allowed to share it, and why
ALLOWED = {
    "__init__": None,  # every package has one
    "__main__": None,  # ``python -m flatcli.<package>``
    # model targets users write in their configs and checkpoints' manifests
    # (``flatcli.demo.models:MLP``, ``flatcli.experiments.models:LeNet``): renaming either breaks them
    "models": {"flatcli/demo/models.py", "flatcli/experiments/models.py"},
}


def collisions(root: Path) -> dict[str, list[str]]:
    """Stems held by more than one module or package under ``root`` (paths relative to its
    parent, packages with a trailing ``/``), less the allowed ones."""
    holders: dict[str, list[str]] = defaultdict(list)
    for p in sorted(root.rglob("*.py")):
        holders[p.stem].append(p.relative_to(root.parent).as_posix())
        if p.name == "__init__.py" and p.parent != root:
            holders[p.parent.name].append(p.parent.relative_to(root.parent).as_posix() + "/")
    out = {}
    for stem, paths in holders.items():
        if len(paths) < 2 or (stem in ALLOWED and ALLOWED[stem] is None):
            continue
        if set(paths) <= (ALLOWED.get(stem) or set()):
            continue
        out[stem] = paths
    return out


def test_no_two_modules_share_a_name():
    assert collisions(PKG) == {}, (
        "rename one of each (docs/architecture.md, 'One name, one meaning')"
    )


# near-names: stems equal but for a leading underscore or a plural ``s`` (``run/checkpoint.py`` beside
# ``loading/checkpoints.py``), each pair left with its reason; the list only shrinks
NEAR_ALLOWED = {
    "measure": {"flatcli/api/measure.py", "flatcli/measures/"},  # the entry point `api.measure`
    "sweep": {"flatcli/api/sweeps.py", "flatcli/sweep/"},  # the API's sweep, collect, correlate
    "store": {"flatcli/engine/linalg/_store.py", "flatcli/sweep/store.py"},  # a private basis store
    "plot": {"flatcli/landscape/plots.py", "flatcli/tracking/plot.py"},  # `flatcli plot-track`
}


def near_names(root: Path) -> dict[str, list[str]]:
    """Modules and packages under ``root`` whose stems differ only by a leading underscore or a
    trailing ``s`` (``checkpoint``/``checkpoints``, ``result``/``results``), less `NEAR_ALLOWED`
    and the exact collisions `collisions` reports."""
    holders: dict[str, set[str]] = defaultdict(set)
    for p in sorted(root.rglob("*.py")):
        if p.name == "__init__.py" and p.parent != root:
            holders[p.parent.name.removesuffix("s")].add(
                p.parent.relative_to(root.parent).as_posix() + "/"
            )
        elif p.stem not in ("__init__", "__main__"):
            holders[p.stem.lstrip("_").removesuffix("s")].add(p.relative_to(root.parent).as_posix())
    return {
        key: sorted(paths)
        for key, paths in holders.items()
        if len(paths) > 1
        and len({Path(q.rstrip("/")).stem for q in paths}) > 1
        and paths != NEAR_ALLOWED.get(key)
    }


def test_no_two_modules_differ_only_by_a_plural():
    assert near_names(PKG) == {}, (
        "rename one of each (docs/architecture.md, 'One name, one meaning')"
    )
    stale = {k for k, v in NEAR_ALLOWED.items() if not v <= {q for q in _all_paths(PKG)}}
    assert not stale, f"no longer there, remove from NEAR_ALLOWED: {sorted(stale)}"


def _all_paths(root: Path) -> set[str]:
    out = set()
    for p in root.rglob("*.py"):
        out.add(p.relative_to(root.parent).as_posix())
        if p.name == "__init__.py":
            out.add(p.parent.relative_to(root.parent).as_posix() + "/")
    return out


def test_the_check_finds_near_names(tmp_path):
    """``run/checkpoint.py`` beside ``loading/checkpoints.py`` and ``landscape/result.py`` beside
    ``run/results.py`` are found; the renamed ones are not."""
    root = tmp_path / "flatcli"
    for f in ["__init__.py", "run/__init__.py", "run/checkpoint.py", "run/results.py",
              "loading/__init__.py", "loading/checkpoints.py", "landscape/__init__.py",
              "landscape/result.py"]:  # fmt: skip
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).write_text("")
    assert near_names(root) == {
        "checkpoint": ["flatcli/loading/checkpoints.py", "flatcli/run/checkpoint.py"],
        "result": ["flatcli/landscape/result.py", "flatcli/run/results.py"],
    }
    (root / "run/checkpoint.py").rename(root / "run/measuring.py")
    (root / "landscape/result.py").rename(root / "landscape/loss_grid.py")
    assert near_names(root) == {}


def test_the_check_finds_shared_names(tmp_path):
    """A module twice in two packages, a module named like a package and a third ``models`` are
    found; the allowed pair and a name used once are not."""
    root = tmp_path / "flatcli"
    files = [
        "__init__.py",
        "api/__init__.py",
        "api/views.py",
        "cli/__init__.py",
        "cli/views.py",
        "cli/run.py",
        "run/__init__.py",
        "run/predict.py",
        "demo/__init__.py",
        "demo/models.py",
        "experiments/__init__.py",
        "experiments/models.py",
    ]
    for f in files:
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).write_text("")
    assert collisions(root) == {
        "views": ["flatcli/api/views.py", "flatcli/cli/views.py"],
        "run": ["flatcli/cli/run.py", "flatcli/run/"],
    }
    (root / "loading").mkdir()
    (root / "loading" / "models.py").write_text("")
    assert collisions(root)["models"] == [
        "flatcli/demo/models.py",
        "flatcli/experiments/models.py",
        "flatcli/loading/models.py",
    ]


# engine modules named for what they hold: stem -> the classes defined there
ENGINE_HOLDS = {
    "routes": {"Route", "RouteFailed", "MemoryPolicy"},
    "products": {"ProductContext"},
    "counters": {"Counters"},
    "curvatures": {"Curvature", "Hessian", "GGN", "FiniteDifferenceHessian"},
    "operators": {"CurvatureOperator"},
}


def _classes(path: Path) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)}


def test_the_engine_modules_say_what_they_hold():
    """The product route lives in routes.py, what products share in products.py, the counters in
    counters.py; none of them elsewhere, and no module named for a loop it does not hold or for
    a shared "state"."""
    engine = PKG / "engine"
    held = {p.stem: _classes(p) for p in engine.rglob("*.py")}
    for stem, names in ENGINE_HOLDS.items():
        assert names <= held.get(stem, set()), (stem, names - held.get(stem, set()))
        others = {s for s, cls in held.items() if s != stem and cls & names}
        assert not others, f"{sorted(names)} also defined in {sorted(others)}"
    assert not {s for s in held if s == "state" or s.endswith("_state")}, sorted(held)
    for p in PKG.rglob("loop.py"):
        loops = [
            n for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.For | ast.While)
        ]
        assert loops, f"{p.relative_to(PKG.parent)} holds no loop"
