"""The README's measures table is the one generated from the registry (no drift)."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_readme_measures_table_is_current():
    spec = importlib.util.spec_from_file_location("gen", ROOT / "tools" / "gen_measures_table.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.block() in (ROOT / "README.md").read_text(), (
        "run: python tools/gen_measures_table.py --write"
    )


def test_readme_commands_match_ci():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_line = 'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[test]" && python -m pytest -q'
    assert test_line in readme and test_line in ci


@pytest.mark.slow
def test_text_data_example_runs(tmp_path):
    """The README's "Text data and tokenizers" block, extracted between its markers and run with bash in an
    empty folder: it builds a tokenizer with `tokenizers`, saves it, writes the config and measures. Two
    fresh processes importing transformers: ~25 s of CPU (2-core VM, torch 2.14.1)."""
    import os
    import re
    import subprocess
    import sys

    pytest.importorskip("transformers")
    readme = (ROOT / "README.md").read_text()
    m = re.search(
        r"<!-- readme-text-example:start -->\n```bash\n(.*?)```\n<!-- readme-text-example:end -->",
        readme,
        re.S,
    )
    assert m, "the README's text example (between its markers) is missing"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
    }
    script = (
        f'flatcli() {{ "{sys.executable}" -m flatcli "$@"; }}\npython() {{ "{sys.executable}" "$@"; }}\nset -e\n'
        + m.group(1)
    )
    res = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    out = tmp_path / "lm_demo" / "out"
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert len(rows) == 1 and rows[0]["status"] == "ok", rows
    assert set(rows[0]["measures"]) == {"hessian_lambda_max", "fisher_rao_norm"}
