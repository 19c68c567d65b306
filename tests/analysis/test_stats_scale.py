"""Jiang's τ and the CMI score on large tables: the O(n log n) τ and the block-wise CMI pair counts
equal the pairwise definitions exactly, and the CMI never holds all n² pairs at once."""

import itertools
import math
import tracemalloc

import numpy as np
import pytest

from flatcli.analysis import statistics as st


def brute_jiang(m, g) -> float:
    """Eq. 2 of Jiang et al. 2020 with Python integers: Σ_{i≠j} sign(Δm) sign(Δg) / (n(n−1))."""
    n = len(m)
    sgn = lambda x: (x > 0) - (x < 0)  # noqa: E731
    s = sum(sgn(m[i] - m[j]) * sgn(g[i] - g[j]) for i, j in itertools.permutations(range(n), 2))
    return s / (n * (n - 1))


@pytest.mark.parametrize("seed", range(40))
def test_jiang_tau_without_pairs_equals_the_definition(seed, monkeypatch):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 90))
    ties = int(rng.integers(1, 8))
    m = rng.integers(0, ties * 3, n).astype(float) if seed % 2 else rng.normal(size=n)
    g = rng.integers(0, ties, n).astype(float) if seed % 3 else rng.normal(size=n)
    if seed % 7 == 0:
        m[:] = 1.5  # a constant column
    want = brute_jiang(m.tolist(), g.tolist())
    assert st.jiang_tau(m, g) == want  # the pairwise path (n ≤ JIANG_PAIRWISE_MAX)
    monkeypatch.setattr(st, "JIANG_PAIRWISE_MAX", 1)
    assert st.jiang_tau(m, g) == want  # from scipy's τ-b and the tie counts


@pytest.mark.parametrize("seed", range(40))
def test_block_wise_cmi_counts_equal_the_pairwise_ones(seed):
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(2, 50))
    axes = [f"a{k}" for k in range(int(rng.integers(0, 4)))]
    hp = {a: [str(v) for v in rng.integers(0, int(rng.integers(1, 5)), n)] for a in axes}
    m = rng.integers(0, 4, n).astype(float) if seed % 2 else rng.normal(size=n)
    g = rng.integers(0, 3, n).astype(float) if seed % 3 else rng.normal(size=n)
    codes = st._axis_codes(hp, axes)
    conds = st._conditions(axes)
    want = st._pairwise_joints(m, g, codes, conds)
    for chunk in (1, 7, 10**6):  # one row, a few rows, everything at once per block
        st_chunk, st._PAIR_CHUNK = st._PAIR_CHUNK, chunk
        try:
            got = st._chunked_joints(m, g, codes, conds)
        finally:
            st._PAIR_CHUNK = st_chunk
        assert got.keys() == want.keys()
        for c in conds:
            np.testing.assert_array_equal(got[c], want[c])


def test_cmi_of_thousands_of_checkpoints_holds_no_n_squared_arrays():
    rng = np.random.default_rng(0)
    n = 4000  # 16 million ordered pairs: their index arrays alone would take 256 MB
    hp = {
        "lr": [str(v) for v in np.repeat(np.arange(8), n // 8)],
        "wd": [str(v) for v in np.tile(np.arange(5), n // 5)],
    }
    m = rng.normal(size=n)
    g = m + rng.normal(size=n)
    tracemalloc.start()
    try:
        c = st.conditional_mi(m, g, hp, ["lr", "wd"])
        check = st.check_cmi_grid(g, hp, ["lr", "wd"])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert c.pairs == n * (n - 1) and math.isfinite(c.value) and check.reliable
    assert peak < 120e6, f"peak {peak / 1e6:.0f} MB"
