"""flatcli.engine.linalg.sem: the one standard error of a mean (issue 28), against scipy.stats.sem."""

import math

import numpy as np
import pytest
import scipy.stats
import torch

from flatcli.engine.linalg.sem import mean_stderr, mean_stderr_of_sums


@pytest.mark.parametrize("kind", ["list", "numpy", "torch"])
def test_mean_stderr_is_the_mean_and_scipy_sem(kind):
    rng = np.random.default_rng(0)
    x = rng.normal(3.0, 2.0, size=(7, 5))
    conv = {"list": lambda a: a.tolist(), "numpy": lambda a: a, "torch": torch.tensor}[kind]
    m, se = mean_stderr(conv(x[:, 0]))
    assert m == pytest.approx(x[:, 0].mean(), rel=1e-14) and se == pytest.approx(
        scipy.stats.sem(x[:, 0]), rel=1e-12
    )
    if kind != "list":
        M, SE = mean_stderr(conv(x), axis=0)
        np.testing.assert_allclose(np.asarray(SE), scipy.stats.sem(x, axis=0), rtol=1e-12)
        M1, SE1 = mean_stderr(conv(x), axis=1)
        np.testing.assert_allclose(np.asarray(M1), x.mean(1), rtol=1e-14)
        np.testing.assert_allclose(np.asarray(SE1), scipy.stats.sem(x, axis=1), rtol=1e-12)


@pytest.mark.parametrize("kind", ["list", "numpy", "torch"])
def test_one_sample_has_an_infinite_stderr_and_none_a_nan_mean(kind):
    conv = {
        "list": list,
        "numpy": np.array,
        "torch": lambda v: torch.tensor(v, dtype=torch.float64),
    }[kind]
    m, se = mean_stderr(conv([2.5]))
    assert float(m) == 2.5 and math.isinf(float(se))
    m0, se0 = mean_stderr(conv(np.zeros(0).tolist()) if kind == "list" else conv(np.zeros(0)))
    assert math.isnan(float(m0)) and math.isinf(float(se0))


def test_running_sums_give_the_same_numbers():
    rng = np.random.default_rng(1)
    x = torch.tensor(rng.normal(size=(9, 4)))
    m, se = mean_stderr_of_sums(x.sum(0), (x**2).sum(0), 9)
    M, SE = mean_stderr(x)
    torch.testing.assert_close(m, M, rtol=1e-12, atol=0)
    torch.testing.assert_close(se, SE, rtol=1e-10, atol=0)
    m1, se1 = mean_stderr_of_sums(x[0], x[0] ** 2, 1)
    assert torch.equal(m1, x[0]) and torch.isinf(se1).all()
