"""Warm starts of the Krylov measures across a tracker's evaluations (`flatcli.tracking`).

Consecutive steps of training change the Hessian little, so Lanczos started from the previous
evaluation's Ritz vectors meets the residual test in a few products where a random start needs
the certified floor and more. ``MeasureContext.warm`` carries the vectors from one evaluation to
the next; it is None in every ``measure`` run, where nothing here changes anything.
"""

from __future__ import annotations

import torch

WARM_MIN_STEPS = 3  # fewest Lanczos steps from a warm start (the residual test decides the rest)


def warm_start(ctx, min_steps: int | None) -> tuple[torch.Tensor | None, int | None]:
    """(start block, fewest steps) of a Lanczos run: the previous evaluation's Ritz vectors
    (``ctx.warm["vectors"]``, set by `keep_ritz_vectors`) when a tracker carries them, with
    ``min_steps`` lowered to `WARM_MIN_STEPS` unless the measure's option sets it; else a seeded
    random start with the certified floor (``min_steps`` None).

    The certified floor (`flatcli.engine.linalg.certified_min_steps`) is a statement about a
    *random* start; a warm start replaces it by continuity with the previous evaluation, which
    was itself certified or warm (the tracker starts cold every ``cold_every`` evaluations). The
    residual test is unchanged: a warm start changes the cost, never the tolerance."""
    vectors = (ctx.warm or {}).get("vectors")
    if vectors is None or vectors.shape[-1] != ctx.problem.num_params:
        return None, min_steps
    return vectors, (WARM_MIN_STEPS if min_steps is None else min_steps)


def keep_ritz_vectors(ctx, r) -> None:
    """Keep a Lanczos run's Ritz vectors for the next evaluation's warm start (``ctx.warm``)."""
    if ctx.warm is not None and r.ritz_vectors is not None:
        ctx.warm["vectors"] = r.ritz_vectors.detach().clone()
