"""ruff with the project's rules (pyproject.toml: pycodestyle, pyflakes, imports, bugbear, pyupgrade,
complexity C90/PLR0912/PLR0915 and docstrings D) passes on the package, the scripts and the tests."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_passes():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    res = subprocess.run(
        [ruff, "check", "flatcli", "scripts", "tests"], cwd=ROOT, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout + res.stderr
