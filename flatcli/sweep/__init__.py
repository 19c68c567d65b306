"""Sweeps: plan units of work (checkpoint × measure), run workers locally, by shard or on SLURM, collect rows.

See `flatcli.sweep.plan` (units, plan.json), `flatcli.sweep.worker` (the worker loop),
`flatcli.sweep.runner` (pools, shards, submitit), `flatcli.sweep.collect` (one table back) and
`flatcli.sweep.store` (unit keys, atomic row files, locks).
"""

from .collect import CollectReport, collect
from .plan import Plan, load_plan
from .runner import SweepReport, run_sweep
from .store import Store, parse_shard, shard_of
from .worker import run_worker

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
