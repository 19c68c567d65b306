"""Bootstrap intervals of Pearson, Spearman and Kendall τ-b: scipy's statistic called once per
resample (flatcli before) against all resamples at once (`flatcli.analysis.correlation`'s row
statistics), side by side, on the same seeded resamples.

Data: n checkpoints with a measure correlated with the gap (τ about 0.5) and ties in the
measure (a tenth of the values repeated), as in a sweep table. Prints, per n, the seconds of
each path (best of ``--repeat``), their ratio and the largest difference of the interval ends.

    python scripts/bench_bootstrap.py                       # n = 48 and 200, 1,000 resamples
    python scripts/bench_bootstrap.py --n 30,400 --resamples 2000
"""

from __future__ import annotations

import argparse
import platform
import time
import warnings

import numpy as np
import scipy
from scipy import stats

from flatcli.analysis.statistics import _scipy_stats, bootstrap_intervals


def per_resample(m, g, resamples, seed):
    """The former path: scipy.stats.bootstrap with one scipy call per resample and statistic."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = stats.bootstrap(
            (m, g),
            _scipy_stats,
            paired=True,
            vectorized=False,
            n_resamples=resamples,
            confidence_level=0.95,
            method="percentile",
            rng=np.random.default_rng(seed),
        )
    return np.asarray(res.confidence_interval.low), np.asarray(res.confidence_interval.high)


def best(fn, repeat):
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--n", default="48,200", help="checkpoints, comma-separated")
    ap.add_argument("--resamples", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args(argv)
    print(
        f"# {platform.processor() or platform.machine()}, numpy {np.__version__}, scipy {scipy.__version__}; "
        f"{a.resamples} resamples, best of {a.repeat}"
    )
    print("| n | scipy per resample (s) | all at once (s) | ratio | max |Δ interval end| |")
    print("|---|---|---|---|---|")
    for n in (int(v) for v in a.n.split(",")):
        rng = np.random.default_rng(n)
        g = rng.normal(size=n)
        m = g + rng.normal(size=n)
        m[: n // 10] = m[n // 10 : 2 * (n // 10)]  # ties
        t_old, (lo_old, hi_old) = best(
            lambda m=m, g=g: per_resample(m, g, a.resamples, 0), a.repeat
        )
        t_new, (iv, _) = best(
            lambda m=m, g=g: bootstrap_intervals(m, g, a.resamples, seed=0), a.repeat
        )
        lo_new = np.array([v.lo for v in iv.values()])
        hi_new = np.array([v.hi for v in iv.values()])
        diff = float(max(np.abs(lo_new - lo_old).max(), np.abs(hi_new - hi_old).max()))
        print(f"| {n} | {t_old:.3f} | {t_new:.4f} | {t_new / t_old:.3f} | {diff:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
