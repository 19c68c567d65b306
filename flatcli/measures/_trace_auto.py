"""``hessian_trace``'s ``method: auto``: the estimator chosen by predicted products.

`trace_method` chooses before any product (exact for small P, Hutchinson for large P, else a
check); `auto_check` runs the check, ``min_probes`` Hutchinson probes of their own seed, and
`auto_after_check` chooses from their spread (`flatcli.engine.linalg.probes_to_tolerance`):
never more than P products plus the check (or the near-zero floor's)."""

from __future__ import annotations

import dataclasses

from ..engine import linalg

EXACT_FACTOR = 4  # auto: the exact trace, no check, when P ≤ EXACT_FACTOR · min_probes
CHECK_MARGIN = 2  # auto: Hutchinson after its check only when it predicts ≤ 1/2 of what exact costs
CHECK_SEED = 5  # generator offset of auto's check probes (the trace's own probes keep offset 0)
CHECK_LIMIT = 2  # auto: no check (Hutchinson) when P > CHECK_LIMIT × the stochastic trace's most
SKETCH_BYTES = (
    256 * 2**20
)  # auto: Hutch++ above the check when its largest sketch takes at most this


def sketch_bytes(o, P: int) -> int:
    """Bytes of Hutch++'s largest sketch: a third of ``max_probes`` float64 P-vectors."""
    return min(P, o.max_probes // 3) * P * 8


def stochastic_worst(o, P: int) -> int:
    """The most products a stochastic trace may spend (`flatcli.engine.linalg.hutchinson_cost`):
    ``max_probes`` and the near-zero floor's SLQ."""
    stop = linalg.ProbeStop(min_probes=o.min_probes, max_probes=o.max_probes)
    return linalg.hutchinson_cost(P, stop).hvp[1]


def trace_method(method: str, P: int, o) -> str:
    """The estimator ``method`` names before any product: ``auto`` is ``exact`` when P ≤
    `EXACT_FACTOR` · ``min_probes`` (a check of ``min_probes`` products would cost a quarter of the
    exact trace or more), ``hutchinson`` when P is more than `CHECK_LIMIT` times the most products
    of a stochastic trace (`stochastic_worst`: 2,080 at the defaults), else ``check``:
    ``min_probes`` Hutchinson probes predict the probes to the tolerance, and the cheaper of the
    two runs (`auto_after_check`). Above the check's range, ``hutchpp`` when the count adapts
    (``min_probes < max_probes``) and its largest sketch (`sketch_bytes`) takes at most
    `SKETCH_BYTES` (256 MiB: P up to about 100k at the defaults): its sketch grows only while
    the residual's spread says it pays, so it spends a few more products than Hutchinson on a
    flat spectrum and far fewer where the top of the spectrum carries the trace (a trained
    digits MLP, P = 4,810: 106 products and ok where Hutchinson spent 1,040 and missed ``tol``)."""
    if method != "auto":
        return method
    if P <= EXACT_FACTOR * o.min_probes:
        return "exact"
    if P <= CHECK_LIMIT * stochastic_worst(o, P):
        return "check"
    small = sketch_bytes(o, P) <= SKETCH_BYTES
    return "hutchpp" if small and o.min_probes < o.max_probes else "hutchinson"


def auto_after_check(samples, P: int, o, exact_fits: bool = True) -> tuple[str, int]:
    """``auto``'s choice after its check: (method, max_probes). Hutchinson when the probes it is
    predicted to need to reach ``tol`` at the check's spread (`flatcli.engine.linalg.probes_to_tolerance`)
    are at most 1/`CHECK_MARGIN` of the fewer of ``max_probes`` and the P − m products the exact
    trace would cost beyond the check's m (the margin covers the spread estimated from m samples),
    its probes capped at P − m so that the whole never spends more than P plus the check (and the
    near-zero floor); else the exact trace (P products), unless a cap leaves fewer than P
    (``exact_fits`` False: the exact trace cannot stop early, Hutchinson stops with its interval)."""
    m = len(samples)
    need = linalg.probes_to_tolerance(samples, o.tol)
    room = P - m
    if need <= min(room, o.max_probes) / CHECK_MARGIN or not exact_fits:
        return "hutchinson", max(min(o.max_probes, room), o.min_probes)
    return "exact", P


def auto_check(ctx, opts):
    """``auto``'s check: ``min_probes`` Hutchinson probes of its own (seed offset `CHECK_SEED`, no
    near-zero floor), then `auto_after_check`'s choice; the options to run and the diagnostics
    ``check_probes`` and ``check_predicted_probes``."""
    P = ctx.problem.num_params
    c = linalg.hutchinson(
        ctx.engine.hessian(),
        stop=linalg.ProbeStop(opts.tol, opts.min_probes, opts.min_probes, ctx.budget),
        generator=ctx.generator(CHECK_SEED),
        settings=ctx.engine.estimator_settings,
    )
    # a cap's products or seconds left (at the check's speed) for the P products of the exact trace
    fits = ctx.budget.allow(P) >= P
    method, most = auto_after_check(c.samples, P, opts, fits)
    diag = {
        "check_probes": c.probes,
        "check_predicted_probes": linalg.probes_to_tolerance(c.samples, opts.tol),
    }
    return dataclasses.replace(opts, method=method, max_probes=most), diag


def trace_auto_cost(o, d) -> linalg.Cost:
    """What ``auto`` with its check declares: the check (``min_probes`` probes, no near-zero
    floor), then Hutchinson capped at P − ``min_probes`` probes (`auto_after_check`) or the exact
    trace: at most P plus the larger of the check and the near-zero floor."""
    first = min(o.min_probes, o.max_probes)
    check = linalg.ProbeStop(min_probes=first, max_probes=first)
    after = linalg.ProbeStop(min_probes=first, max_probes=d.P - first)
    hutchinson = linalg.hutchinson_cost(d.P, after, device=d.device, dtype=d.dtype)
    chosen = hutchinson.either(linalg.exact_diagonal_cost(d.P))
    return linalg.hutchinson_cost(d.P, check, floor=False).then(chosen)
