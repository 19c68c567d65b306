"""results.csv's text (`flatcli.run.results.to_csv`) is written by the csv module, byte for byte as
pandas' ``to_csv`` of the same object table writes it (the former writer, the oracle here), over
many random rows: floats (NaN, ±inf, −0.0, tiny and huge, numpy scalars), ints, bools, None, and
text with commas, quotes and newlines; and writing it imports no pandas."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from flatcli.measures import MeasureResult
from flatcli.run import results as R

TEXTS = ["", "a", "a,b", 'say "hi"', "two\nlines", " pad ", "ünï", "x\r\ny", "'", ",", '"']


def _value(rng: random.Random):
    kind = rng.randrange(9)
    if kind == 0:
        return rng.choice([math.nan, math.inf, -math.inf, -0.0, 0.0, 1e-300, 1e300, 5e-324])
    if kind == 1:
        return rng.uniform(-1e6, 1e6) * 10 ** rng.randint(-20, 20)
    if kind == 2:
        return rng.randint(-(10**12), 10**12)
    if kind == 3:
        return rng.choice([True, False])
    if kind == 4:
        return None
    if kind == 5:
        return rng.choice(TEXTS)
    if kind == 6:
        return np.float32(rng.uniform(-10, 10))
    if kind == 7:
        return np.float64(rng.choice([math.nan, rng.random()]))
    return rng.random()


def _rows(rng: random.Random) -> list[R.Row]:
    labels = [f"m{i}" for i in range(rng.randint(1, 3))]
    rows = []
    for i in range(rng.randint(1, 4)):
        hp = {f"h{j}": _value(rng) for j in range(rng.randint(0, 3))}
        row = R.Row(checkpoint=rng.choice([f"c{i}.pt", 'we,ird "c".pt']), labels=labels, hparams=hp)
        for lab in labels:
            if rng.random() < 0.8:
                diag = {f"d{j}": _value(rng) for j in range(rng.randint(0, 4))}
                se = rng.choice([None, _value(rng)])
                stderr = se if isinstance(se, float) or se is None else None
                row.results[lab] = MeasureResult(
                    value=_value(rng), stderr=stderr, diagnostics=diag, seconds=rng.random()
                )
        if rng.random() < 0.5:
            row.metrics.update(train_loss=_value(rng), train_acc=rng.random())
        rows.append(row)
    return rows


def _pandas_csv(rows: list[R.Row]) -> str:
    cols = R.columns(rows)
    if not cols:
        return "\n"
    table = pd.DataFrame([r.flat() for r in rows], columns=cols, dtype=object)
    return table.to_csv(index=False, lineterminator="\n")


@pytest.mark.parametrize("seed", range(300))
def test_the_text_is_pandas_text(seed):
    rows = _rows(random.Random(seed))
    assert R.to_csv(rows) == _pandas_csv(rows)


def test_no_rows_and_an_empty_row():
    assert R.to_csv([]) == _pandas_csv([]) == "\n"
    row = R.Row(checkpoint="", labels=["m"], hparams={})
    assert R.to_csv([row]) == _pandas_csv([row])


def test_writing_results_imports_no_pandas(tmp_path):
    code = (
        "import sys\nfrom flatcli.run import results as R\nfrom flatcli.measures import MeasureResult\n"
        "row = R.Row(checkpoint='m.pt', labels=['a'], hparams={'lr': 0.1})\n"
        "row.results['a'] = MeasureResult(value=1.5)\n"
        f"R.write_results({str(tmp_path)!r}, [row], {{}})\n"
        "print('pandas' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
    assert (tmp_path / "results.csv").read_text().splitlines()[1].startswith("m.pt,ok,,1.5,")
