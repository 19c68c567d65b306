"""`estimate_costs`: what a run will cost (``--dry-run``): products per measure, predicted seconds and
peak memory, or not_applicable with its reason (computed by `flatcli.run.prediction.dry_run`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..config import Config
from ..run.prediction.dry_run import CostEstimate, estimate_jobs
from ..run.settings import RunOptions
from ._setup import _jobs_and_specs, load_run, takes_run

__all__ = ["CostEstimate", "estimate_costs"]


@takes_run
def estimate_costs(
    config: Config | str | Path | dict,
    checkpoints: Sequence[str] | None = None,
    *,
    measures: Sequence[str] | str | None = None,
    run: RunOptions | None = None,
    timed: bool = True,
) -> CostEstimate:
    """The products, seconds and memory `measure` or `sweep` would spend (``--dry-run``).

    Loads every checkpoint's model but measures nothing. The products come from the measures'
    declared cost formulas and each checkpoint's model size; with ``timed``, one checkpoint of
    each size group has its products timed on the measurement set (a forward pass, a gradient,
    HVPs of one vector and of one block, one product's memory; `flatcli.run.prediction.predict.time_products`).
    With ``runtime.check_memory`` each checkpoint also gets the run's memory verdicts
    (`flatcli.run.prediction.memory`); a checkpoint that will not fit is not timed and its measures get status
    ``will_not_fit``.

    Parameters
    ----------
    config : Config, str, Path or dict
        The config (see `measure`).
    checkpoints : sequence of str, optional
        Checkpoints instead of the config's.
    measures : str or sequence of str, optional
        Labels or measure names, as in `measure`.
    run : RunOptions, optional
        Overrides of the config's ``runtime.*`` keys (device, precision, seed, threads,
        allow_unsafe_pickle, budget), what the CLI's shared flags build.
        Its device and precision are those the products are planned and timed at.
    timed : bool
        Time the products to predict seconds and peak memory (a few seconds per size group).

    Returns
    -------
    CostEstimate
        Per checkpoint and measure, the least and most products, the predictions
        (``predictions``), the memory verdicts (``memory``) and the checkpoints that could not
        be loaded (``errors``).
    """
    cfg = load_run(config, run)
    jobs, specs = _jobs_and_specs(cfg, checkpoints, measures)
    return estimate_jobs(cfg, jobs, specs, timed=timed)
