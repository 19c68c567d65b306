"""Sweeps: plan units of work (checkpoint × measure), run workers locally, by shard or on SLURM, collect rows.

See `flatcli.sweep.plan` (units, plan.json), `flatcli.sweep.worker` (the worker loop),
`flatcli.sweep.runner` (pools, shards, submitit), `flatcli.sweep.collect` (one table back) and
`flatcli.sweep.store` (unit keys, atomic row files; the lock files are `flatcli.locks`). What
`flatcli.api` uses of the sweep is imported from here (its ``__all__``), never from the modules.
"""

from .collect import CollectReport, collect, old_output_warning, output_csv
from .plan import Plan, load_plan
from .runner import SweepInterrupted, SweepOptions, SweepReport, run_sweep
from .store import PLAN_FILE, UNITS_DIR, Store, parse_shard, result_from, shard_of
from .worker import default_log, run_worker

__all__ = [
    "PLAN_FILE",
    "UNITS_DIR",
    "CollectReport",
    "Plan",
    "Store",
    "SweepInterrupted",
    "SweepOptions",
    "SweepReport",
    "collect",
    "default_log",
    "load_plan",
    "old_output_warning",
    "output_csv",
    "parse_shard",
    "result_from",
    "run_sweep",
    "run_worker",
    "shard_of",
]
