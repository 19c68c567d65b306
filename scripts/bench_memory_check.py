"""Seconds of the memory check's two stages (`flatcli.memory.check_model`, `check_products`) against
one Hessian-vector product, side by side in one process, on a config's first checkpoint::

    python scripts/demo_memory_check.py /tmp/fit7m 320 6 5
    python scripts/bench_memory_check.py /tmp/fit7m/config.yaml

Prints the seconds and both verdicts (docs/performance.md, "Will it fit?").
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    """Time check_model, check_products and the second of two one-vector HVPs (one thread)."""
    import torch

    from flatcli.config import load_config
    from flatcli.engine import CurvatureEngine, eval_mode
    from flatcli.jobs import resolve_jobs
    from flatcli.loading.data import subset
    from flatcli.memory import check_model, check_products
    from flatcli.pipeline import DataCache, _problem, _working_copy, load_model, problem_dims
    from flatcli.settings import Settings

    torch.set_num_threads(1)
    cfg = load_config(sys.argv[1])
    st = Settings.from_config(cfg)
    model, _ = load_model(cfg, resolve_jobs(cfg)[0].path)
    specs = cfg.measure_specs()
    t = time.perf_counter()
    before = check_model(model, specs, st)
    a = time.perf_counter() - t
    data = DataCache(cfg).get(st.split)
    work = _working_copy(model, st)
    with st.precision_context(), eval_mode(work):
        prob = _problem(work, subset(data, st.num_samples, st.data_seed), st)
        dims = problem_dims(work, data, st)
        t = time.perf_counter()
        products = check_products(prob, specs, dims, st)
        b = time.perf_counter() - t
        eng = CurvatureEngine(prob)
        v = torch.randn(prob.num_params, dtype=st.dtype)
        eng.hessian()(v)
        t = time.perf_counter()
        eng.hessian()(v)
        c = time.perf_counter() - t
    print(f"check_model {a:.3f} s; check_products {b:.3f} s; one HVP (second) {c:.3f} s")
    print(before.line())
    print(products.line())


if __name__ == "__main__":
    main()
