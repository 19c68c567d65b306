"""Every status word flatcli writes, with its meaning: a measure's (``<label>_status`` in
results.csv, ``status`` of a result in results.json) and a row's (``status`` of a checkpoint).

The documentation's status tables are generated from these dicts (docs/guide/statuses.md), and a
test finds every status word the code writes and checks it is declared here.
"""

from __future__ import annotations

# the status of one measure of one checkpoint
MEASURE_STATUSES: dict[str, str] = {
    "ok": "converged to its tolerance: the tolerance test passed, whatever the options (a fixed "
    "count too)",
    "not_converged": "a tolerance not met within the iteration cap or by a fixed count; the value "
    "is the estimate so far, with its stderr",
    "budget": "stopped by a cap (`max_seconds`, `max_hvps`, `runtime.budget`): the estimate so "
    "far, with its stderr",
    "near_zero": "a relative tolerance on a quantity near 0 met at its absolute floor, where the "
    "intervals say it is near 0 (a trace: the upper end of the trace's interval at most 5% of the lower end of the "
    "absolute trace's)",
    "precision_warning": "the TF32/bf16 products' bias exceeds the estimate's stderr",
    "saturated": "an optimizer or search hit its box (e.g. the PAC-Bayes σ at `sigma_max`)",
    "vacuous": "a generalization bound at or above the loss's range: true but says nothing "
    "(the value is still the bound)",
    "non_positive_margin": "the output margin's 10th percentile γ is ≤ 0 (more than a tenth of "
    "the measurement set misclassified or on the boundary): the value is infinite, γ is in the "
    "diagnostic `margin`",
    "not_a_bound": "(`representativeness: true`) the generalization bound the value is part of "
    "came out negative, so it bounds nothing; the value itself is unaffected",
    "non_finite": "the value is NaN or infinite",
    "not_applicable": "the measure does not fit the model, loss or parameter selection; value NaN "
    "and a one-line reason (`<label>_reason`). Not a failure",
    "will_not_fit": "(`--dry-run`) the checkpoint will not fit in free memory",
    "interrupted": "(in results written during a run) not computed yet when the run stopped",
    "error": "the measurement failed; results.json has the exception class in `error_kind`",
}

# statuses of a value: a row whose measures all have one of these is `ok` (exit code 0)
VALUE_STATUSES: frozenset[str] = frozenset(
    {
        "ok",
        "not_converged",
        "budget",
        "near_zero",
        "precision_warning",
        "saturated",
        "vacuous",
        "non_positive_margin",
        "not_a_bound",
        "non_finite",
        "not_applicable",
    }
)

# the status of a row (one checkpoint)
ROW_STATUSES: dict[str, str] = {
    "ok": "every measure of the row has a value, or a status of a value",
    "budget": "a budget or a cap (`--budget`, a measure's `max_seconds` or `max_hvps`) left a "
    "measure of the row without a value (its status `budget`, value NaN, `<label>_started` false "
    "and the reason); `error` lists those measures. Nothing failed; `measure` exits 4",
    "error": "a measure or the checkpoint failed; `error` holds the first message and "
    "`error_kind` the exception class",
    "interrupted": "`measure` stopped before these measures ran (Ctrl-C, `kill -9`, or a results "
    "write that failed). Their values are empty and `--resume` computes them",
    "incomplete": "`collect`: units of this checkpoint are not finished yet; `error` lists the "
    "missing measures",
}
