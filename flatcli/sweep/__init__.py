"""Sweeps: plan units of work (checkpoint × measure), run workers locally, by shard or on SLURM, collect rows.

See `flatcli.sweep.store` (unit keys, atomic row files, locks) and `flatcli.sweep.runner`
(plan, worker loop, pools, submitit, collect).
"""

from .runner import CollectReport, Plan, SweepReport, collect, load_plan, run_sweep, run_worker
from .store import Store, parse_shard, shard_of

__all__ = [
    "CollectReport",
    "Plan",
    "Store",
    "SweepReport",
    "collect",
    "load_plan",
    "parse_shard",
    "run_sweep",
    "run_worker",
    "shard_of",
]
