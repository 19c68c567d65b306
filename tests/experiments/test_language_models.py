"""The worked language-model study of docs/howto/language-models.md, run as the page shows it:
its block (between the markers) in bash, on a corpus this test writes. Checks the loss gap and
perplexities against each model's own loss on each split, the default-free ranking against
loss_gap without the minimum warning, the plots, and quiet logs."""

from __future__ import annotations

import csv
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "howto" / "language-models.md"
MEASURES = 7


def write_corpus(path: Path, lines: int = 600) -> None:
    """Pseudo-English text (about 27 KB), the same every run."""
    rng = random.Random(0)
    words = (
        "the a of and to in is was for on that with as by at from this be it are or an which "
        "have not has had they their were but one all can more license software copy work "
        "source code program terms conditions rights notice permission holder author"
    ).split()
    text = [
        " ".join(rng.choice(words) for _ in range(rng.randint(5, 12))).capitalize() + "."
        for _ in range(lines)
    ]
    path.write_text("\n".join(text) + "\n")


def own_loss(folder: Path, text_file: Path, length: int = 32) -> float:
    """The model's own loss per scored token on a split, as its own forward computes it
    (``labels=input_ids``): windows of ``length`` characters over the whole file, the last shorter."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor(tok(text_file.read_text())["input_ids"])
    total, count = 0.0, 0
    with torch.no_grad():
        for w in ids.split(length):
            if len(w) < 2:
                continue
            total += float(model(input_ids=w[None], labels=w[None]).loss) * (len(w) - 1)
            count += len(w) - 1
    return total / count


@pytest.mark.slow
def test_language_model_study_runs_as_documented(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    m = re.search(
        r"<!-- lm-study:start -->\n```bash\n(.*?)```\n<!-- lm-study:end -->", PAGE.read_text(), re.S
    )
    assert m, f"the study block (between its markers) is missing from {PAGE}"
    write_corpus(tmp_path / "corpus.txt")
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    env.pop("FLATCLI_DEBUG", None)
    script = (
        f'flatcli() {{ "{sys.executable}" -m flatcli "$@"; }}\n'
        f'python() {{ "{sys.executable}" "$@"; }}\nset -e\n' + m.group(1)
    )
    res = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    # quiet logs: no third-party bars, no "nan" in a warning, no minimum rule for language models
    assert "Loading weights" not in res.stderr
    warnings = [ln for ln in res.stderr.splitlines() if ln.startswith("warning:")]
    assert not [w for w in warnings if "nan" in w.lower()], warnings
    assert "not at a minimum" not in res.stderr + res.stdout
    assert "target: loss_gap = test_loss − train_loss (per scored token)" in res.stdout

    out = tmp_path / "runs" / "study"
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows)
    for r in rows:
        folder = tmp_path / r["checkpoint"]
        train, test = float(r["train_loss"]), float(r["test_loss"])
        assert train == pytest.approx(own_loss(folder, tmp_path / "train.txt"), abs=1e-6)
        assert test == pytest.approx(own_loss(folder, tmp_path / "test.txt"), abs=1e-6)
        assert float(r["loss_gap"]) == pytest.approx(test - train, abs=1e-12)
        assert float(r["train_ppl"]) == pytest.approx(math.exp(train), rel=1e-12)
        assert float(r["test_ppl"]) == pytest.approx(math.exp(test), rel=1e-12)
    with open(out / "corr" / "correlations.csv") as f:
        ranked = list(csv.DictReader(f))
    assert len(ranked) == MEASURES
    assert sum(r["kendall_tau_b"] != "" for r in ranked) >= MEASURES - 1  # ranked on 4 models
    plots = list((out / "corr" / "plots").glob("*.png"))
    assert len(plots) >= MEASURES
