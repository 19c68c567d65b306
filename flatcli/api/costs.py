"""`estimate_costs`: what a run will cost (``--dry-run``): products per measure, predicted seconds and
peak memory, or not_applicable with its reason."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import Config
from ..errors import ExitCode, FlatcliError
from ..loading.factory import model_dtype
from ..loading.load import DataCache, load_model
from ..run.measuring import COUNTERS, estimate_products, problem_dims
from ..run.memory import check_model, check_products
from ..run.predict import Prediction, predict, time_products
from ..run.settings import RunOptions, Settings
from ._setup import _jobs_and_specs, load_run, takes_run


@dataclass
class CostEstimate:
    """What a run of the configured measures will cost: per checkpoint and measure label, the
    (least, most) of each engine counter (``n_hvp``, ``n_grad``, ``n_forward``, ``n_vjp``; full-set
    equivalents, ranges for adaptive estimators), and the sizes it was computed from; ``errors``
    holds (checkpoint, message) for every checkpoint that could not be loaded (no costs for it)."""

    checkpoints: list[str]
    labels: list[str]
    costs: list[
        dict[str, dict[str, tuple[int, int]] | None]
    ]  # per loaded checkpoint: label -> counters
    dims: list[Any]  # per loaded checkpoint
    loaded: list[str] = field(default_factory=list)  # the checkpoints ``costs`` and ``dims`` are of
    errors: list[tuple[str, str]] = field(default_factory=list)
    params: dict[str, Any] | None = None  # the parameter selection on the first loaded model
    predictions: list[dict[str, Any]] = field(
        default_factory=list
    )  # per loaded checkpoint: label -> Prediction
    times: list[Any] = field(
        default_factory=list
    )  # per loaded checkpoint: its group's ProductTimes (None: not timed)
    memory: list[list[Any]] = field(
        default_factory=list
    )  # per loaded checkpoint: its MemoryVerdicts (flatcli.run.memory)

    def to_json(self) -> list[dict[str, Any]]:
        """``--dry-run --format json``: one entry per loaded checkpoint × measure (`flatcli.run.predict.Prediction`),
        with ``memory``: the checkpoint's memory verdicts (`flatcli.run.memory.MemoryVerdict.to_json`:
        ``fits``, ``need_bytes``, ``free_bytes``, ``suggestions``, ``verdict``; empty when
        ``runtime.check_memory`` is false)."""
        mem = self.memory or [[] for _ in self.loaded]
        return [
            {**pred.to_json(ckpt, lab), "memory": [v.to_json() for v in verdicts]}
            for ckpt, per, verdicts in zip(self.loaded, self.predictions, mem, strict=True)
            for lab, pred in per.items()
        ]

    dtypes: list[str] = field(default_factory=list)  # per loaded checkpoint: the type it loads in
    dtype_setting: str = "auto"  # model.dtype
    precision: str = ""  # runtime.precision, resolved for the device (e.g. "bf16", "fp32")

    @property
    def untimed(self) -> list[str]:
        """The checkpoints whose products could not be timed (they will not fit in memory)."""
        return [
            c
            for c, per in zip(self.loaded, self.predictions, strict=False)
            if any(p.status == "will_not_fit" for p in per.values())
        ]

    @property
    def exit_code(self) -> int:
        """2 when a checkpoint could not be loaded (bad input); 1 when one could not be timed (it
        will not fit: the run would fail it); else 0."""
        if self.errors:
            return ExitCode.USAGE
        return ExitCode.FAILED if self.untimed else ExitCode.OK

    def totals(self) -> dict[str, tuple[int, int]]:
        """(least, most) of each counter summed over every loaded checkpoint and measure."""
        tot = {c: [0, 0] for c in COUNTERS}
        for per in self.costs:
            for est in per.values():
                for c, (lo, hi) in (est or {}).items():
                    tot[c][0] += lo
                    tot[c][1] += hi
        return {c: (lo, hi) for c, (lo, hi) in tot.items()}

    def lines(self) -> list[str]:
        """The estimate in words: per group of checkpoints of one size, one line per measure; then a
        line per checkpoint that could not be loaded, and the totals."""
        groups: dict[tuple[int, int], list[int]] = {}
        for k, d in enumerate(self.dims):
            groups.setdefault((d.P, d.n), []).append(k)
        out = [_describe_params(self.params)] if self.params else []
        if self.dtypes:
            out.append(_describe_dtypes(self.dtypes, self.dtype_setting, self.precision))
        for (P, _), ks in groups.items():
            which = "" if len(groups) == 1 else f" for {_names([self.loaded[k] for k in ks])}"
            out.append(
                f"estimated products per checkpoint{which} (P = {P:,} parameters, {_describe_n(self.dims[ks[0]])}; "
                "gradients and passes over the whole measurement set):"
            )
            if self.times and self.times[ks[0]] is not None:
                out.append(f"  measured: {_describe_times(self.times[ks[0]])}")
            out += [
                f"  memory ({v.stage}): {v.line()}"
                for v in (self.memory[ks[0]] if self.memory else [])
            ]
            out += [
                f"  {lab}: {_describe_prediction(self.costs[ks[0]].get(lab), self.predictions[ks[0]].get(lab) if self.predictions else None)}"
                for lab in self.labels
            ]
        out += [f"checkpoint {c}: cannot be loaded: {e}" for c, e in self.errors]
        loaded = len(self.loaded)
        secs = [sum(p.seconds[i] for per in self.predictions for p in per.values()) for i in (0, 1)]
        spans = [
            sum((p.interval or p.seconds)[i] for per in self.predictions for p in per.values())
            for i in (0, 1)
        ]
        out.append(
            f"total over {loaded} checkpoint(s)"
            + (f" ({len(self.errors)} could not be loaded)" if self.errors else "")
            + ": "
            + _describe_cost(self.totals(), empty="parameters only")
            + (_describe_seconds(secs, self.untimed, loaded, spans) if self.predictions else "")
        )
        return out


def _describe_seconds(secs, untimed: list[str], loaded: int, spans=None) -> str:
    """``; about 3–5 s predicted (interval 2.5–6 s)``, or what could not be timed instead of a sum
    that leaves it out."""
    if not untimed:
        within = f" (interval {_range(spans, _secs)})" if spans and spans != secs else ""
        return f"; about {_range(secs, _secs)} predicted{within}"
    why = f"cannot time {_names(untimed)} (will not fit in memory)"
    if len(untimed) == loaded:
        return f"; {why}"
    return f"; about {_range(secs, _secs)} for the others; {why}"


def _describe_n(d) -> str:
    """``n = 40 samples``, or ``n = 64 sequences (728 tokens)`` when the loss scores many units
    (tokens) per row: the count the user set (``measure_data.num_samples``) first."""
    if d.rows and d.rows != d.n:
        return f"n = {d.rows:,} sequences ({d.n:,} scored tokens)"
    return f"n = {d.n:,} samples"


def _secs(x: float) -> str:
    return f"{x:.2g} s" if x < 10 else f"{x:,.0f} s"


def _bytes(x: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if x < 1024 or unit == "GiB":
            return f"{x:.3g} {unit}" if unit != "B" else f"{int(x)} B"
        x /= 1024
    return f"{x:.3g} GiB"


def _range(pair, show) -> str:
    """``1.2 s`` or ``1.2–3.4 s`` (the unit once)."""
    lo, hi = show(pair[0]), show(pair[1])
    if lo == hi:
        return lo
    a, unit = lo.rsplit(" ", 1)
    b, unit2 = hi.rsplit(" ", 1)
    return f"{a}–{b} {unit}" if unit == unit2 else f"{lo}–{hi}"


def _timing(t, name: str, seconds: float) -> str:
    """``0.41 s (0.35–0.47)``: a timed call fitted to the set, with its interval."""
    lo, hi = t.intervals.get(name, (seconds, seconds))
    return f"{_secs(seconds)} ({_range((lo, hi), _secs).replace(' s', '')})"


def _describe_times(t) -> str:
    """The timed products of a size group, in words: measured, fitted to the whole set, each with
    its interval (`flatcli.run.timing`)."""
    build = f", building the kept graphs {_secs(t.build)}" if t.build > 0 else ""
    return (
        f"forward {_timing(t, 'forward', t.forward)}, gradient {_timing(t, 'grad', t.grad)}, "
        f"HVP {_timing(t, 'hvp', t.hvp1)} (1 vector), "
        f"{_secs(t.hvp_block)} ({t.block} vectors){build}; one product's memory "
        f"{_bytes(t.product_bytes)} ({t.memory})"
    )


def _describe_prediction(est, pred) -> str:
    """One measure's line: its products, then the predicted seconds and peak memory, or
    ``not_applicable`` with the reason instead of a cost; "cannot stop early" for a measure a cap
    does not stop (under a budget it is started only when its prediction fits)."""
    if pred is not None and pred.status == "not_applicable":
        return f"not_applicable: {pred.reason}"
    text = _describe_cost(est)
    if pred is not None and pred.status == "will_not_fit":
        return text + "; not timed (the checkpoint will not fit in memory)"
    if pred is not None:
        text += f"; predicted {_range(pred.seconds, _secs)}"
        if pred.interval is not None and tuple(pred.interval) != tuple(pred.seconds):
            text += f" (interval {_range(pred.interval, _secs)})"
        text += f", peak {_bytes(pred.peak_bytes)}"
        text += "" if pred.stops_early or pred.seconds[1] == 0 else "; cannot stop early"
    return text


_PRODUCTS = {
    "bf16": "forward and products in bfloat16, vectors and sums in float32, verified in float32",
    "tf32": "TF32 products",
    "fp32": "float32",
    "fp64": "float64",
}


def _describe_dtypes(dtypes: list[str], setting: str, precision: str) -> str:
    """``model dtype: bfloat16 (model.dtype: auto); products: bf16 (forward and products in ...)``."""
    kinds = ", ".join(dict.fromkeys(dtypes))
    return f"model dtype: {kinds} (model.dtype: {setting}); products: {precision}" + (
        f" ({_PRODUCTS[precision]})" if precision in _PRODUCTS else ""
    )


def _describe_params(sel: dict[str, Any]) -> str:
    """``params: include head.* → 1 tensor, 28 parameters: head.weight`` (every trainable one when
    no patterns are given)."""
    pats = [f"include {', '.join(sel['include'])}"] if sel["include"] else []
    pats += [f"exclude {', '.join(sel['exclude'])}"] if sel["exclude"] else []
    head = f"params: {'; '.join(pats)} → " if pats else "params: every trainable parameter → "
    return (
        head + f"{sel['tensors']} tensor(s), {sel['count']:,} parameters: {_names(sel['names'], 6)}"
    )


def _names(names: list[str], most: int = 3) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _describe_cost(est: dict[str, tuple[int, int]] | None, empty: str = "parameters only") -> str:
    """``12 HVPs, 3–5 gradients``: the counters with work, each a count or a range."""
    if est is None:
        return "no estimate declared"
    names = {
        "n_hvp": "HVPs",
        "n_grad": "gradients",
        "n_forward": "forward passes",
        "n_vjp": "VJP passes",
    }
    parts = [
        f"{lo}" + ("" if lo == hi else f"–{hi}") + f" {names[c]}"
        for c in COUNTERS
        for lo, hi in [est.get(c, (0, 0))]
        if hi > 0
    ]
    return ", ".join(parts) or empty


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
    HVPs of one vector and of one block, one product's memory; `flatcli.run.predict.time_products`).
    With ``runtime.check_memory`` each checkpoint also gets the run's memory verdicts
    (`flatcli.run.memory`); a checkpoint that will not fit is not timed and its measures get status
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
    st = Settings.from_config(cfg)
    data = DataCache(cfg)
    est = CostEstimate(
        [j.checkpoint for j in jobs],
        [s.label for s in specs],
        [],
        [],
        dtype_setting=cfg.model.dtype,
        precision=st.effective_precision,
    )
    groups: dict[
        tuple[int, int], Any
    ] = {}  # (P, n) -> (ProductTimes, Problem) of its first checkpoint
    for job in jobs:
        try:
            model, _ = load_model(cfg, job.path)
        except FlatcliError as e:
            est.errors.append((job.checkpoint, str(e)))
            continue
        dims = problem_dims(
            model, data.get(st.split, job.train_data if st.split == "train" else None), st
        )
        if est.params is None:
            est.params = st.params.describe(model, st.params.select(model))
        est.dims.append(dims)
        est.costs.append(estimate_products(specs, dims))
        est.loaded.append(job.checkpoint)
        est.dtypes.append(model_dtype(model))
        verdicts = [check_model(model, specs, st)] if st.check_memory else []
        if timed:
            key = (dims.P, dims.n, all(v.fits for v in verdicts))
            if key not in groups:
                groups[key] = _timed_group(
                    model,
                    data.get(st.split, job.train_data if st.split == "train" else None),
                    st,
                    specs,
                    dims,
                    verdicts,
                )
            times, problem, more = groups[key]
            verdicts += more
            est.times.append(times)
            est.predictions.append(
                {
                    s.label: Prediction(status="will_not_fit", reason=verdicts[-1].line())
                    if times is None
                    else predict(s, dims, times, problem)
                    for s in specs
                }
            )
        est.memory.append(verdicts)
    return est


def _timed_group(model, data, st: Settings, specs, dims, verdicts) -> tuple[Any, Any, list[Any]]:
    """(ProductTimes or None, Problem or None, the products' memory verdicts) of one size group:
    nothing is timed when the model's verdict says it will not fit, or the products' (checked on
    the problem before any product) does."""
    if not all(v.fits for v in verdicts):
        return None, None, []
    more: list[Any] = []

    def check(problem) -> bool:
        if st.check_memory:
            more.append(check_products(problem, specs, dims, st))
        return all(v.fits for v in more)

    with st.precision_context():
        times, problem = time_products(model, data, st, check)
    return times, problem, more
