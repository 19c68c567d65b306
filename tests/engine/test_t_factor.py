"""Student's t factor of the estimators' standard errors (`flatcli.engine.linalg.t_factor`): the
exact quantile (closed forms at 1 and 2 degrees of freedom, scipy.stats.t over many), taken from
scipy.special so that a measure process never imports scipy.stats (~0.6 s of start-up)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
from scipy import stats

from flatcli.engine.linalg import t_factor

Z975 = 1.959963984540054


def test_closed_forms_at_one_and_two_degrees_of_freedom():
    assert t_factor(2) == pytest.approx(math.tan(math.pi * 0.475) / Z975, rel=1e-12)  # Cauchy
    p = 0.975
    assert t_factor(3) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)) / Z975, rel=1e-12)
    assert t_factor(1) == math.inf and t_factor(0) == math.inf


@pytest.mark.parametrize("samples", [*range(2, 40), 64, 100, 257, 1000, 5000, 10**6])
def test_equals_scipy_stats_t(samples):
    want = stats.t.ppf(0.975, samples - 1) / Z975
    assert t_factor(samples) == pytest.approx(want, rel=1e-12)


def test_does_not_import_scipy_stats():
    code = (
        "import sys\nfrom flatcli.engine.linalg import t_factor\nt_factor(8)\n"
        "print('scipy.stats' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
