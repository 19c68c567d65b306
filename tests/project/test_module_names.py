"""One name, one meaning (docs/architecture.md): no two modules under ``flatcli/`` in different
packages share a name, and no module is named like a package, so that ``from ..x.plan import``
never leaves a reader guessing which "plan" it is."""

from __future__ import annotations

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
