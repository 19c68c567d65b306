"""The README's measures table is the one generated from the registry (no drift)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_measures_table_is_current():
    spec = importlib.util.spec_from_file_location("gen", ROOT / "scripts" / "gen_measures_table.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.block() in (ROOT / "README.md").read_text(), "run: python scripts/gen_measures_table.py --write"


def test_readme_commands_match_ci():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_line = 'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[test]" && python -m pytest -q'
    assert test_line in readme and test_line in ci
