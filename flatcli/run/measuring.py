"""Measuring one model or one checkpoint: the steps every pipeline shares.

`measure_model` measures a model on tensors; `measure_job` loads one checkpoint of
a config and measures it; `DataCache` loads each configured split once;
`load_model` builds the config's model and loads a checkpoint into it. The API
(`flatcli.api`), the sweep worker and the invariance check call these; nothing
here knows about commands, tables or output files.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import platform
import re
import traceback
from collections.abc import Sequence
from typing import Any

import torch

from .._version import __version__
from ..config import Config, parse_measures
from ..engine import Batch, CurvatureEngine, Problem, eval_mode, get_loss
from ..engine import dist as ranks
from ..engine.batch import model_output
from ..errors import ConfigError, FlatcliError, MeasurementError, ResultsWriteError, error_kind
from ..loading.data import check_finite_data, subset
from ..loading.factory import check_target
from ..loading.hf import check_positions
from ..loading.jobs import Job
from ..loading.load import (  # noqa: F401
    DataCache,
    load_init_state,
    load_model,
    manifest_train_data,
)
from ..measures import (
    Dims,
    MeasureContext,
    MeasureResult,
    MeasureSpec,
    get_measure,
    run_measure,
)
from ..measures._layers import weight_matrices
from .budgeting import learner, refused_on_some_rank, split_budget
from .kept import Reuse
from .memory import check_products, copies_model, graph_choice, refuse
from .predict import Fit
from .preflight import Checked, check_loaded
from .results import Row
from .settings import MeasureOptions, Settings
from .shares import in_turn


def as_specs(measures) -> list[MeasureSpec]:
    """Measure specs from names (a list or 'a,b'), ``{name: options}`` entries or specs."""
    if measures is None:
        return []
    if isinstance(measures, str):
        measures = [m.strip() for m in measures.split(",") if m.strip()]
    if all(isinstance(m, MeasureSpec) for m in measures):
        return list(measures)
    return parse_measures(list(measures), "measures")


def _problem(model, data, st: Settings) -> Problem:
    """The problem of ``model`` over ``data`` with the settings' loss, batch size, device, dtype,
    parameter selection and this process's ranks."""
    return Problem(
        model,
        data,
        loss=st.loss,
        batch_size=st.batch_size,
        device=st.device,
        dtype=st.dtype,
        params=st.params,
        dist=ranks.current(),
        compute_dtype=st.compute_dtype,
    )


def check_targets(model, data: Batch, loss: str, where: str, device, dtype) -> None:
    """A `ConfigError` naming ``where`` when the data's targets do not fit the model's outputs and
    the loss (labels outside the classes, a wrong output shape), from one forward pass of two rows;
    also for a split without rows, and for inputs the model cannot take (a feature count or an
    input shape other than its first layer's)."""
    if data.rows == 0:
        raise ConfigError(f"{where}: the split holds no examples")
    two = data.select(slice(0, 2)).to(device, dtype)
    args, kwargs = two.model_inputs()
    with torch.no_grad(), eval_mode(model):
        try:
            out = model_output(model(*args, **kwargs))
        except (RuntimeError, ValueError, IndexError) as e:
            if not _SHAPE_ERROR.search(str(e)):
                raise
            shapes = ", ".join(f"{k} {tuple(t.shape[1:])}" for k, t in two.items())
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(
                f"{where}: the model cannot take these inputs (per row: {shapes}): {first}"
            ) from None
    get_loss(loss).check(out, two, data, where)


# what torch says when an input's shape does not fit a layer
_SHAPE_ERROR = re.compile(
    r"shape|size mismatch|must match the size|expected input|dimension|channels", re.IGNORECASE
)


def _metrics(model, train: Batch | None, test: Batch | None, st: Settings) -> dict[str, float]:
    """train/test loss and accuracy on the full splits (units of the loss: samples, or tokens for
    ``causal_lm``), ``gen_gap = train_acc − test_acc``, ``loss_gap = test_loss − train_loss`` and,
    for a per-token loss, the perplexities ``train_ppl``/``test_ppl`` (exp of the loss per token)."""
    out: dict[str, float] = {}
    per_token = get_loss(st.loss).per_token
    for name, d in (("train", train), ("test", test)):
        if d is None:
            continue
        prob = _problem(model, d, st)
        with prob.full_precision():  # float32 forward under bf16 too: the metrics are not estimates
            out[f"{name}_loss"], out[f"{name}_acc"] = prob.evaluate()
        if per_token:
            loss = out[f"{name}_loss"]  # exp overflows past 709.78: a diverged model's inf
            out[f"{name}_ppl"] = math.exp(loss) if loss < 709.78 else math.inf
    if "test_acc" in out and not (math.isnan(out["train_acc"]) or math.isnan(out["test_acc"])):
        out["gen_gap"] = out["train_acc"] - out["test_acc"]
    if "test_loss" in out and math.isfinite(out["train_loss"]) and math.isfinite(out["test_loss"]):
        out["loss_gap"] = out["test_loss"] - out["train_loss"]
    return out


def _check_deterministic(problem: Problem) -> None:
    if not problem.batches:
        return
    b = problem.batches[0]
    with torch.no_grad():
        a = problem.batch_loss_sum(problem.params, b)
        c = problem.batch_loss_sum(problem.params, b)
    if not torch.equal(a, c) and not torch.allclose(a, c, rtol=1e-6, atol=0):
        raise MeasurementError(
            "the loss differs between two identical evaluations in eval mode "
            f"({float(a):.6g} vs {float(c):.6g}); remove randomness from forward() (dropout via F.dropout(training=True), noise)"
        )


# known failures of third-party code, and what to do about them (appended to the message)
_HINTS = (
    (
        "_scaled_dot_product_",
        "fused attention (SDPA) has no second derivative: load the model with "
        "model.kwargs.attn_implementation: eager (flatcli's default)",
    ),
)


def describe_error(e: BaseException) -> str:
    """One line for a failure: the message of a flatcli error, ``Type: message`` for anything else
    (with the fix for known third-party failures)."""
    if isinstance(e, FlatcliError):
        return str(e)
    msg = f"{type(e).__name__}: {e}"
    hint = next((h for key, h in _HINTS if key in msg), None)
    return f"{msg} ({hint})" if hint else msg


def measure_model(
    model: torch.nn.Module,
    train,
    measures: Sequence[Any] | str,
    *,
    test=None,
    init_state: dict[str, torch.Tensor] | None = None,
    settings: Settings | None = None,
    options: MeasureOptions | None = None,
    reuse: Reuse | None = None,
    **fields: Any,
) -> Row:
    """Measure one model on tensors, without a config.

    Parameters
    ----------
    model : torch.nn.Module
        The network (not modified; its train/eval mode is restored).
    train : Batch, mapping or tuple
        The training split: a `flatcli.engine.batch.Batch`, a mapping of named tensors
        (``x``/``y``, or ``input_ids``, ``attention_mask``, ``labels``...) or an ``(x, y)`` pair.
    measures : str or sequence
        Names, ``{name: options}`` entries or `MeasureSpec` objects.
    test : Batch, mapping or tuple, optional
        The test split, for the test metrics and ``gen_gap``.
    settings : Settings, optional
        A `flatcli.run.settings.Settings`; its fields may also be given as keywords (``loss``,
        ``split``, ``num_samples``, ``batch_size``, ``data_seed``, ``seed``, ``device`` (default
        ``"cpu"``), ``precision`` (``"auto"``, ``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp64"``),
        ``hvp_mode``, ``block_size``, ``params``), which override it.
    init_state : dict, optional
        The state dict at initialization (``distance_from_init``).
    options : MeasureOptions, optional
        A `flatcli.run.settings.MeasureOptions`: the row's ``checkpoint`` name and ``hparams``,
        ``debug``, and the ``progress`` and ``on_measure`` hooks (default: none of them).
    reuse : Reuse, optional
        A `flatcli.run.kept.Reuse`: earlier ``results`` not run again, ``metrics`` not computed
        again, the measures a budget is split among (``budget_among``; a sweep's unit).
    **fields
        `Settings` fields, as above.

    Returns
    -------
    Row
        One row: ``results`` (label → `MeasureResult`), ``metrics`` (train/test loss and
        accuracy, ``gen_gap``), ``status``; a failed measure is recorded, not raised.
    """
    specs = as_specs(measures)
    st = Settings.build(settings, **fields)
    o = options if options is not None else MeasureOptions()
    debug, progress, on_measure = o.debug, o.progress, o.on_measure
    earlier = reuse if reuse is not None else Reuse()
    reuse, budget_among, metrics = earlier.results, earlier.budget_among, earlier.metrics
    data = {
        "train": None if train is None else Batch.of(train, where="data.train"),
        "test": None if test is None else Batch.of(test, where="data.test"),
    }
    if data.get(st.split) is None:
        raise ConfigError(
            f"measure_data.split is {st.split!r} but no {st.split} data is configured"
        )
    row = Row(
        checkpoint=o.checkpoint, labels=[s.label for s in specs], hparams=dict(o.hparams or {})
    )
    work = _working_copy(model, st)
    with st.precision_context(), eval_mode(work):
        problem = _problem(work, subset(data[st.split], st.num_samples, st.data_seed), st)
        for split_name, d in data.items():
            if d is not None:
                check_finite_data(d, f"data.{split_name}")
                check_targets(work, d, st.loss, f"data.{split_name}", st.device, _dtype_of(work))
        row.params = st.params.describe(work, problem.names)
        engine = st.engine(
            problem,
            _graph_policy(problem, specs, lambda: problem_dims(work, data[st.split], st), st),
        )
        try:
            problem.check_finite(engine.loss())
            _check_deterministic(problem)
            if (
                st.check_memory
            ):  # before the first product: one product's activations and the vectors
                refuse(
                    check_products(
                        problem,
                        [s for s in specs if not (reuse and s.label in reuse)],
                        problem_dims(work, data[st.split], st),
                        st,
                    ),
                    problem.dist,
                )
        except FlatcliError as e:
            row.fail(str(e), error_kind(e))
            return row
        init_params = None
        if init_state is not None:
            init_params = {
                n: init_state[n].to(st.device, st.dtype) for n in problem.names if n in init_state
            }
        expected = _expected_hvps(specs, work, data[st.split], st) if progress is not None else {}
        shared: dict[
            str, Any
        ] = {}  # products the checkpoint's measures share (the Hessian diagonal)
        fit = Fit(engine, lambda: problem_dims(work, data[st.split], st))
        order, split, refused = split_budget(st, specs, fit, problem, reuse, budget_among)
        if split is not None and fit.times is not None:  # the first block under a share
            shared["seconds_per_product"] = fit.times.hvp1

        def run(spec: MeasureSpec, share: float | None) -> None:
            if reuse and spec.label in reuse:
                row.results[spec.label] = reuse[spec.label]
            elif refused_on_some_rank(row, spec, problem, refused):
                pass
            elif not _not_started(row, spec, problem, fit, share):
                show = _measure_progress(progress, spec.label, engine, expected.get(spec.label))
                args = (init_params, init_state, debug, show, share, shared)
                _run_one(row, spec, problem, engine, st, *args)

        done = learner(split, fit, order, row, shared, (problem, reuse, budget_among))
        done = _then(done, (lambda lab: on_measure(row, lab)) if on_measure else None)

        in_turn(split, order, row.results, run, done, again=not problem.dist.active)
        row.mark_budget()
        row.metrics.update(
            _metrics(work, data["train"], data["test"], st) if metrics is None else metrics
        )
    return row


def _then(first, second):
    """``first(x)`` then ``second(x)`` (``first`` alone when ``second`` is None)."""
    if second is None:
        return first

    def both(x) -> None:
        first(x)
        second(x)

    return both


def _graph_policy(problem, specs, dims, st: Settings) -> bool | None:
    """``runtime.cache_graphs`` for the engine: as set, or ``auto`` decided from the predicted peak
    (`flatcli.run.memory.graph_choice`, logged); None (the engine's own rule) when it cannot be
    predicted (a model without a double backward: its Hessian measures fail on their own)."""
    if st.cache_graphs != "auto":
        return st.graph_policy()
    try:
        keep, why = graph_choice(problem, specs, dims(), st)
    except Exception:  # a prediction never fails a run
        return None
    logging.getLogger("flatcli").info(why)
    return keep


def _expected_hvps(specs, model, data, st: Settings) -> dict[str, tuple[int, int]]:
    """Label → (least, most) HVPs its estimate declares (for the live line's time left); empty
    when the sizes cannot be had from a two-row forward pass."""
    try:
        dims = problem_dims(model, data, st)
    except Exception:  # only a progress display: never fail a run for it
        return {}
    out = {}
    for spec in specs:
        est = spec.estimate(dims) or {}
        if est.get("n_hvp", (0, 0))[1] > 0:
            out[spec.label] = est["n_hvp"]
    return out


def _measure_progress(progress, label: str, engine: CurvatureEngine, planned):
    """The engine's ``on_progress`` for one measure: ``progress(label, info)`` with the counters
    counted from the measure's start, ``seconds`` since then and ``planned_hvps`` (least, most)."""
    if progress is None:
        return None
    import time

    before = engine.counters()
    t0 = time.perf_counter()

    def report(info: dict) -> None:
        own = {k: info[k] - before.get(k, 0) for k in COUNTERS if k in info}
        progress(
            label, {**info, **own, "seconds": time.perf_counter() - t0, "planned_hvps": planned}
        )

    return report


def _not_started(
    row: Row, spec: MeasureSpec, problem: Problem, fit: Fit, share: float | None
) -> bool:
    """Whether ``spec`` cannot stop early and does not fit its cap (`flatcli.run.predict.Fit`): then
    its row gets status ``budget``, value NaN and the reason (``started: False``) instead of a run.
    Ranks agree: one rank's verdict holds for all (their collectives stay in step)."""
    try:  # a measure that will end not_applicable runs (and says so at once)
        verdict = None if spec.not_applicable(problem) else fit.reason(spec, share)
    except Exception:  # a prediction that cannot be made never stops a measure
        verdict = None
    if problem.dist.active and problem.dist.any(verdict is not None) and verdict is None:
        verdict = ("not started: another rank predicted it would not fit its budget", {})
    if verdict is None:
        return False
    why, diag = verdict
    row.results[spec.label] = MeasureResult(
        value=math.nan, status="budget", diagnostics={"reason": why, "started": False, **diag}
    )
    return True


def _run_one(
    row: Row,
    spec: MeasureSpec,
    problem: Problem,
    engine: CurvatureEngine,
    st: Settings,
    init_params,
    init_state,
    debug: bool,
    progress,
    share: float | None = None,
    shared: dict[str, Any] | None = None,
) -> None:
    """Run one measure into ``row``; a failure is recorded and the other measures go on (in one
    process). Across ranks, a failure that is not a deterministic check (the same on every rank)
    ends the run, since the other ranks may wait in a collective this one never reaches.
    ``progress(info)``: the engine's progress hook for this measure (`_measure_progress`)."""
    engine.on_progress = progress
    ctx = MeasureContext(
        problem=problem,
        engine=engine,
        seed=st.seed if spec.seed is None else spec.seed,
        init_params=init_params,
        init_state=init_state,
        max_seconds=share,
        cache=shared if shared is not None else {},
    )
    fp32 = problem.lowered and not get_measure(spec.name).low_precision
    try:
        with engine.full_precision() if fp32 else contextlib.nullcontext():
            row.results[spec.label] = run_measure(spec, ctx)
        if fp32:  # bf16 applies to the verified Hessian estimators only: loss differences are not verified
            row.results[spec.label].diagnostics["products"] = "fp32"
    except Exception as e:  # one failed measure never loses the others
        if problem.dist.active and not isinstance(e, FlatcliError):
            raise ranks.RankFailure(
                f"rank {problem.dist.rank}: {spec.label}: {describe_error(e)}"
            ) from e
        if debug and not isinstance(e, ConfigError):
            traceback.print_exc()
        row.fail(f"{spec.label}: {describe_error(e)}", error_kind(e), spec.label)


def check_finite_model(
    model: torch.nn.Module, data, settings: Settings, where: str = "the checkpoint"
) -> float:
    """The loss of ``model`` on the measurement set (``settings``' split size and seed, eval mode);
    a NaN or inf loss raises the same `MeasurementError` in every command (exit code 1), naming
    the tensors that hold NaN/inf."""
    st = settings
    with eval_mode(model):
        prob = _problem(model, subset(data, st.num_samples, st.data_seed), st)
        return prob.check_finite(CurvatureEngine(prob).loss(), where)


COUNTERS = ("n_hvp", "n_grad", "n_forward", "n_vjp")


def problem_dims(model: torch.nn.Module, data, settings: Settings) -> Dims:
    """The sizes a cost estimate needs (`flatcli.measures.Dims`), from one forward pass of two rows:
    P the selected parameters, n the scored units of the measurement set, C outputs per unit."""
    batch = subset(data, settings.num_samples, settings.data_seed)
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    dtype = first.dtype if first is not None else torch.float32
    with eval_mode(model):
        prob = Problem(  # one batch: only its sizes are read (no split into rows of two)
            model,
            batch,
            loss=settings.loss,
            batch_size=max(1, int(batch.rows)),
            device=device,
            dtype=dtype,
            params=settings.params,
        )
        two = batch.select(slice(0, 2)).to(device, dtype)
        with torch.no_grad():
            Z = prob.loss_fn.scores(prob.forward(prob.params, two), two)[0]
    chosen = set(prob.names)
    named = dict(model.named_parameters())
    mats = weight_matrices(model, chosen)
    return Dims(
        P=prob.num_params,
        n=prob.n,
        C=int(Z.shape[-1]),
        rows=int(batch.rows),
        tensors=tuple(named[n].numel() for n in prob.names),
        matrices=tuple(int(torch.Size(w.shape).numel()) for w in mats),
        matrix_tensors=tuple(prob.names.index(w.param_name) for w in mats),
        verify=settings.verifies(),
        max_basis=settings.basis_cap(prob.num_params),
        device=str(settings.device),
        dtype=settings.dtype,
    )


def estimate_products(
    specs: Sequence[MeasureSpec], dims: Dims
) -> dict[str, dict[str, tuple[int, int]] | None]:
    """Per configured measure (label), the (least, most) of each engine counter a run will count
    (None for a measure that declares no estimate). Full-set equivalents, like the counters."""
    out = {}
    for spec in specs:
        est = spec.estimate(dims)
        out[spec.label] = None if est is None else {c: est.get(c, (0, 0)) for c in COUNTERS}
    return out


def _dtype_of(model: torch.nn.Module) -> torch.dtype:
    first = next(iter(model.parameters()), None)
    return first.dtype if first is not None else torch.float32


def _working_copy(model: torch.nn.Module, st: Settings) -> torch.nn.Module:
    """``model`` itself when it is already on the device and dtype (θ's, or, with ``precision: bf16``,
    also bfloat16: the problem reads θ from it in float32 and its forward runs in bfloat16 whatever
    the module's own type), else a converted copy (the caller's model is never mutated)."""
    if not copies_model(model, st):
        return model
    return copy.deepcopy(model).to(st.device, st.dtype)


def versions() -> dict[str, str]:
    """Versions of flatcli, torch, numpy, scipy and Python (recorded in results.json)."""
    import numpy
    import scipy

    return {
        "flatcli": __version__,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "scipy": scipy.__version__,
        "python": platform.python_version(),
    }


def read_hparams_from_keys(extras: dict, keys: list[str] | None) -> dict[str, Any]:
    """Hyperparameters named ``keys`` from a checkpoint's extras (and its nested hparams dicts)."""
    if not keys:
        return {}
    pool = dict(extras)
    for nest in ("hparams", "hyperparameters", "config", "args"):
        if isinstance(extras.get(nest), dict):
            pool.update(extras[nest])
    return {k: pool[k] for k in keys if k in pool and isinstance(pool[k], (int, float, str, bool))}


def measure_job(
    cfg: Config,
    job: Job,
    specs: list[MeasureSpec],
    data: DataCache,
    settings: Settings,
    options: MeasureOptions | None = None,
    reuse: Reuse | None = None,
) -> Row:
    """Load one checkpoint and measure it. A failure (a bad file: kind ``ConfigError``, exit code 2)
    becomes an error row, so other checkpoints still complete. ``options``: as `measure_model`'s
    (its ``checkpoint`` and ``hparams`` come from the job). The checkpoint's pre-flight runs first,
    before any data is loaded (a model whose measures will not fit in the device's free memory
    fails here). ``reuse``: as `measure_model`'s, plus ``reuse.checked``, the pre-flight's result
    when the caller already ran it (the checkpoint is then not loaded again), and ``reuse.keep``, a
    `flatcli.run.kept.CheckpointCache` holding the model and metrics between calls for one
    checkpoint (a sweep worker's consecutive units of it)."""
    labels = [s.label for s in specs]
    opts = options if options is not None else MeasureOptions()
    earlier = reuse if reuse is not None else Reuse()
    debug, checked, keep, reuse = opts.debug, earlier.checked, earlier.keep, earlier.results
    try:
        todo = [s for s in specs if not (reuse and s.label in reuse)]
        if checked is None:
            loaded = load_model(cfg, job.path) if keep is None else keep.model(cfg, job)
            checked = check_loaded(cfg, job.path, job.train_data, loaded, todo, settings)
        model, extras = checked.model, checked.extras
        if settings.check_memory:  # every rank calls it: a rank that will not fit stops them all
            refuse(checked.memory_for(todo, settings), ranks.current())
        hp = dict(job.hparams)
        hp.update(read_hparams_from_keys(extras, cfg.hparams.from_keys))
        init_state = load_init_state(cfg, job, model) if keep is None else keep.init_state(cfg, job)
        train, test = _checked_data(cfg, job, model, data)
        row = measure_model(
            model,
            train,
            specs,
            test=test,
            init_state=init_state,
            settings=settings,
            options=dataclasses.replace(opts, checkpoint=job.checkpoint, hparams=hp),
            reuse=Reuse(
                results=reuse,
                metrics=None if keep is None else keep.metrics,
                budget_among=earlier.budget_among,
            ),
        )
        if keep is not None and keep.metrics is None and row.metrics:
            keep.metrics = dict(row.metrics)
        row.model = extras.get("model_info")
        return row
    except (ranks.RankFailure, ResultsWriteError):
        raise
    except Exception as e:  # a checkpoint that fails to load never loses the others
        if ranks.current().active and not isinstance(e, FlatcliError):
            raise ranks.RankFailure(
                f"rank {ranks.current().rank}: {job.checkpoint}: {describe_error(e)}"
            ) from e
        if debug and not isinstance(e, ConfigError):
            traceback.print_exc()
        row = Row(checkpoint=job.checkpoint, labels=labels, hparams=dict(job.hparams))
        row.fail(describe_error(e), error_kind(e))
        return row


def preflight(cfg: Config, job: Job, specs: Sequence[MeasureSpec], settings: Settings) -> Checked:
    """Load one checkpoint and check it before any data is loaded (`flatcli.run.preflight`): a
    ``params`` selection or ``max_length`` that does not fit raises a `ConfigError`; the memory
    verdict of ``specs`` is returned in `Checked.memory`."""
    return check_loaded(cfg, job.path, job.train_data, load_model(cfg, job.path), specs, settings)


def first_checkpoint(
    cfg: Config, job: Job | None, specs: Sequence[MeasureSpec], settings: Settings, data: DataCache
) -> Checked | None:
    """The pre-flight of a command's first checkpoint, then the data loaded once, so that a bad
    data config fails before any measure. A ``params`` selection or a ``max_length`` that does not
    fit raises (the command stops, no data loaded). A checkpoint that cannot be loaded gives None
    (its row says why). A model that will not fit in memory: the data is not loaded now (each
    checkpoint loads it when it gets there, after its own check). Pass the result to that
    checkpoint's `measure_job` so that it is not loaded twice. A ``model.target`` that does not
    resolve raises first (`flatcli.loading.factory.check_target`): one error, not one per row."""
    check_target(cfg)
    checked = None
    if job is not None:
        try:
            loaded = load_model(cfg, job.path)
        except FlatcliError:  # the checkpoint's row says why
            loaded = None
        if loaded is not None:
            checked = check_loaded(cfg, job.path, job.train_data, loaded, specs, settings)
    if checked is None or checked.fits:
        data.get("train")
        data.get("test")
    return checked


def _checked_data(cfg: Config, job: Job, model, data: DataCache):
    """The train and test splits, their tokenized widths checked against the model's positions
    (a Hugging Face model's ``n_positions``/``max_position_embeddings``; the configured
    ``max_length`` is checked before tokenizing, by `preflight`)."""
    out = []
    for split in ("train", "test"):
        batch = data.get(split, job.train_data) if split == "train" else data.get(split)
        if batch is not None and "input_ids" in batch and batch["input_ids"].dim() == 2:
            check_positions(
                model, f"data.{split} (tokenized length)", batch["input_ids"].shape[1], job.path
            )
        out.append(batch)
    return out
