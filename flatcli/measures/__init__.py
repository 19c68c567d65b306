"""The measure registry: the list of `Measure` classes.

A measure is a subclass of `Measure` with a stable snake_case ``name``, its options as a
frozen dataclass (see `flatcli.measures._options`), its tags and its rules as methods, and
``compute(ctx: MeasureContext, opts) -> MeasureResult``. Every value is oriented so that
*larger means sharper* (a larger predicted generalization gap).

The family modules are imported lazily by `_load_all` so that importing flatcli stays cheap;
the registry holds every `Measure` class each module defines.
"""

from __future__ import annotations

import abc
import dataclasses
import fnmatch
import importlib
import math
import re
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..engine.linalg.budget import Budget
from ..engine.linalg.declarations import Cost
from ..engine.losses import NotApplicable
from ..errors import ConfigError
from ._options import Check, parse_options

if TYPE_CHECKING:  # annotations only: importing the engine here would load it with the registry
    from ..engine import CurvatureEngine, Problem

__all__ = [
    "Cost",
    "Dims",
    "MeasureResult",
    "MeasureContext",
    "MeasureCache",
    "MeasureSpec",
    "Measure",
    "MeasureInfo",
    "measure_classes",
    "get_measure",
    "list_measures",
    "run_measure",
    "NotApplicable",
]

# One module per measure family; the registry holds the `Measure` classes each defines.
_FAMILY_MODULES = [
    "flatcli.measures.hessian",
    "flatcli.measures.norms",
    "flatcli.measures.normalized_sharpness",
    "flatcli.measures.ns_bound",
    "flatcli.measures.relative_flatness",
    "flatcli.measures.feature_robustness",
    "flatcli.measures.sharpness",
    "flatcli.measures.pacbayes",
    "flatcli.measures.fisher_rao",
    "flatcli.measures.local_entropy",
    "flatcli.measures.weightwatcher",
    "flatcli.measures.during_training",
]


@dataclass(frozen=True)
class MeasureResult:
    """What a measure returns.

    Attributes
    ----------
    value : float
        The measure, oriented so that larger means sharper.
    stderr : float or None
        Standard error of a stochastic estimate (None when exact).
    diagnostics : dict
        Iterations, residuals, convergence flags, per-layer values, the products spent.
    seconds : float
        Wall time of the measure.
    status : str
        ``"ok"``, or a short word: ``"not_converged"``, ``"saturated"``, ``"not_applicable"``
        (the measure does not apply to this model, loss or parameter selection; the reason is in
        ``diagnostics["reason"]``), ``"budget"`` (its cap, ``max_seconds``, ``max_hvps`` or its
        share of ``runtime.budget``, stopped it: the value is the estimate so far, with its
        stderr), ``"near_zero"`` (a relative tolerance on a quantity near 0 was met at its
        absolute floor).
    """

    value: float
    stderr: float | None = None
    diagnostics: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    status: str = "ok"


@dataclass
class MeasureCache:
    """Work one checkpoint's measures share (same θ, same data), one typed part per kind of work.

    Attributes
    ----------
    seconds_per_product : float or None
        A timed Hessian-vector product: the first block of a measure under a budget share
        expects it (`flatcli.engine.linalg.Budget.allow`).
    hessian_diagonal : dict
        Hessian diagonals by estimator, options, seed, problem and tensors
        (`flatcli.measures._hessian_diag.estimate_diagonal`).
    ggn_diagonal : dict
        The exact Gauss-Newton diagonal by problem and engine.
    diagonal_parts : dict
        The ``auto`` diagonal's checked tensors by problem, engine, seed and options.
    slq_runs : dict
        SLQ runs of the Hessian by problem, engine, seed, steps and precision
        (`flatcli.measures._slq_shared.SharedSLQ`).
    """

    seconds_per_product: float | None = None
    hessian_diagonal: dict[Hashable, Any] = field(default_factory=dict)
    ggn_diagonal: dict[Hashable, torch.Tensor] = field(default_factory=dict)
    diagonal_parts: dict[Hashable, dict[str, Any]] = field(default_factory=dict)
    slq_runs: dict[Hashable, Any] = field(default_factory=dict)


@dataclass
class MeasureContext:
    """Everything a measure may use. Measures never mutate ``model``.

    Attributes
    ----------
    problem : flatcli.engine.Problem
        The measurement set's problem (functional parameters, eval mode).
    engine : flatcli.engine.CurvatureEngine
        The curvature engine over ``problem``.
    seed : int
        The seed of this measure (its own ``seed`` option or ``runtime.seed``).
    init_params, init_state : dict of str to torch.Tensor or None
        Parameters (and the whole state dict, buffers included) at initialization.
    max_seconds : float or None
        This measure's share of the checkpoint's ``runtime.budget``.
    budget : flatcli.engine.linalg.Budget
        Set by `run_measure`: pass it to the estimators.
    cache : MeasureCache
        The work shared by one checkpoint's measures (same θ, same data).
    warm : dict or None
        State one measure carries from one evaluation to the next at nearby θ (the tracker of a
        training run, `flatcli.tracking.Tracker`): a warm-startable measure reads its start vectors
        here and writes its Ritz vectors back; None (every ``measure`` run) means a cold start.
    optimizer : torch.optim.Optimizer or dict or None
        The training optimizer (or its state dict) at θ, for measures of the optimizer's geometry
        (``preconditioned_lambda_max``); None outside a tracked training run.
    """

    problem: Problem
    engine: CurvatureEngine | None
    seed: int = 0
    init_params: dict[str, torch.Tensor] | None = None
    init_state: dict[str, torch.Tensor] | None = None
    max_seconds: float | None = None  # this measure's share of the checkpoint's runtime.budget
    budget: Budget = field(
        default_factory=Budget
    )  # set by `run_measure`: pass it to the estimators
    cache: MeasureCache = field(default_factory=MeasureCache)  # one checkpoint's shared work
    warm: dict[str, Any] | None = None  # carried across a tracker's evaluations (start vectors)
    optimizer: Any = None  # the training optimizer or its state dict (a tracker's step)

    @property
    def model(self) -> torch.nn.Module:
        """The network being measured (never mutated)."""
        return self.problem.model

    def generator(self, offset: int = 0) -> torch.Generator:
        """A CPU generator seeded from the measure's seed (draws are moved to the device)."""
        g = torch.Generator()
        g.manual_seed(int(self.seed) * 1_000_003 + offset)
        return g


@dataclass(frozen=True)
class Dims:
    """Sizes a cost estimate depends on: P parameters, n scored units in the measurement set
    (samples; tokens for ``causal_lm``) in ``rows`` rows (sequences), C model outputs, the
    parameter tensors' and weight matrices' sizes, whether results are verified in fp32 (see
    `flatcli.engine.precision.Precision.verify`), and the device and θ's type of the run."""

    P: int
    n: int
    C: int = 1
    tensors: tuple[int, ...] = ()  # sizes of the trainable parameter tensors
    matrices: tuple[int, ...] = ()  # sizes of the weight matrices (Linear and Conv weights)
    verify: bool = False  # precision auto with TF32 products: fp32 checks add products
    rows: int = 0  # rows of the measurement set (0: as many as n)
    max_basis: int | None = (
        None  # most Lanczos basis vectors (runtime.max_basis_vectors, resolved; None: unbounded)
    )
    matrix_tensors: tuple[int, ...] = ()  # each weight matrix's index in ``tensors``
    device: str = "cpu"  # where the run's vectors live (the device's room for SLQ runs in lockstep)
    dtype: torch.dtype = torch.float32  # θ's type: the vectors' element


Claim = Callable[[Any], "bool | str"]
DeclareCost = Callable[[Any, Dims], Cost]
Shared = Callable[[Any, Dims], "dict[Hashable, dict[str, int]]"]
Note = Callable[[MeasureResult, MeasureResult, Any], "str | None"]
Artifacts = Callable[[MeasureResult, Path, str], "list[Path]"]

_HOOKS = ("declare_cost", "applicable", "shared", "invariance_note", "artifacts")


@dataclass(frozen=True)
class _NoOptions:
    pass


class Measure(abc.ABC):
    """A measure: one subclass per measure, in a module of `flatcli.measures`.

    The class states what the measure is (its name, options and references), its capability
    tags, and its rules as methods; the pipeline, ``--dry-run``, budgets, ``check-invariance``
    and the docs only read them (through the registry's `MeasureInfo` view). ``compute`` is the
    measure itself, oriented so that larger means sharper::

        class FrobeniusNorm(Measure):
            \"\"\"Σ_l ‖W_l‖_F² over the weight matrices.\"\"\"

            name = "frobenius_norm"
            description = "Sum over weight matrices of the squared Frobenius norm."
            reference = "Jiang et al. 2020 (§C, eq. 40)"

            def declare_cost(self, opts, dims):
                return Cost()  # no products

            def compute(self, ctx, opts):
                return MeasureResult(value=...)

    Attributes
    ----------
    name : str
        The stable snake_case name (``flatcli measures`` lists it; configs use it).
    options : type
        The frozen options dataclass, every field made with `flatcli.validation.opt` (checked
        when the class is defined).
    description, reference : str
        One line each: what it is (larger = sharper), the papers with equation numbers.
    stochastic : bool
        Whether the value depends on a seed.
    needs_init : bool
        Whether it needs ``init_checkpoint``.
    low_precision : bool
        Whether its products may run in bfloat16 under ``runtime.precision: bf16`` (its results
        verified or refined in float32); every other measure runs with a float32 forward there.
    stops_early : bool or method
        Whether the measure stops at its cap with the estimate so far (status ``budget``): its
        iterative estimator checks `flatcli.engine.linalg.Budget` between blocks. A method
        ``stops_early(opts) -> bool`` when it depends on the options. A measure that cannot stop
        early is started under a cap only when its predicted seconds fit.
    invariant : bool or method
        Whether it claims invariance to function-preserving node-wise rescalings; a method
        ``invariant(opts) -> True | reason`` when it depends on the options.
    invariance_options : dict
        Options ``flatcli check-invariance`` turns on unless the user set them.
    revision : int
        Raise it when the measure's values change (a fix, a new default, another estimator): it
        is part of every result's key (`flatcli.keys`), so stored results of this measure are
        recomputed and those of the others are kept.
    """

    name: ClassVar[str]
    options: ClassVar[type] = _NoOptions
    description: ClassVar[str]
    reference: ClassVar[str] = ""
    stochastic: ClassVar[bool] = False
    needs_init: ClassVar[bool] = False
    low_precision: ClassVar[bool] = False
    stops_early: ClassVar[bool | Callable[[Any], bool]] = False
    invariant: ClassVar[bool | Claim] = False
    invariance_options: ClassVar[dict[str, Any]] = {}
    revision: ClassVar[int] = 1

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _check_declaration(cls)

    @abc.abstractmethod
    def compute(self, ctx: MeasureContext, opts: Any) -> MeasureResult:
        """The measure on ``ctx`` with the parsed options ``opts`` (every subclass defines it: a
        class without it is refused when it is defined)."""

    def declare_cost(self, opts: Any, dims: Dims) -> Cost | None:
        """The work a run will do (`flatcli.engine.linalg.Cost`: products, passes, vectors,
        vector operations, each as (least, most)), composed from the declarations of the
        estimators it runs (`flatcli.engine.linalg.lanczos_cost`, ``hutchinson_cost``, ...): what
        ``--dry-run``, budgets and the memory prediction read. None: not declared."""
        return None

    def applicable(self, opts: Any, problem: Problem) -> str | None:
        """A cheap check, on the measurement set's `flatcli.engine.Problem` before any product, of
        what would make the measure end ``not_applicable`` (the loss, the layers): the reason, or
        None (``--dry-run`` prints the reason instead of a cost)."""
        return None

    def shared(self, opts: Any, dims: Dims) -> dict[Hashable, dict[str, int]]:
        """The parts of its least work (the counters each spends, as in ``declare_cost``) that
        another measure of the checkpoint may have done already and that it then reuses (a
        Hessian diagonal's tensors): a budget's split weighs each part once."""
        return {}

    def invariance_note(
        self, original: MeasureResult, rescaled: MeasureResult, opts: Any
    ) -> str | None:
        """A remark printed with ``flatcli check-invariance`` (e.g. that an optimizer hit its
        box), or None."""
        return None

    def artifacts(self, result: MeasureResult, stem: Path, title: str) -> list[Path]:
        """Files (plots) drawn from a result by ``flatcli measure --plots``."""
        return []


_SNAKE = re.compile(r"[a-z][a-z0-9_]*")


def _check_declaration(cls: type) -> None:
    """A measure class states a snake_case name, a description and frozen options whose every
    field carries a check of the validation vocabulary (a subclass without ``name`` is a base)."""
    if "name" not in vars(cls):
        return
    where = f"{cls.__module__}.{cls.__qualname__}"
    if not isinstance(cls.name, str) or not _SNAKE.fullmatch(cls.name):
        raise TypeError(f"{where}: the name must be a snake_case string. Got {cls.name!r} instead.")
    if not isinstance(getattr(cls, "description", None), str) or not cls.description:
        raise TypeError(f"{where}: states no description")
    opts = cls.options
    if not dataclasses.is_dataclass(opts) or not opts.__dataclass_params__.frozen:
        raise TypeError(f"{where}: the options must be a frozen dataclass. Got {opts!r} instead.")
    loose = [
        f.name for f in dataclasses.fields(opts) if not isinstance(f.metadata.get("check"), Check)
    ]
    if loose:
        raise TypeError(f"{where}: options {loose} are not declared with opt(default, check, help)")
    if cls.compute is Measure.compute:
        raise TypeError(f"{where}: has no compute()")


@dataclass(frozen=True)
class MeasureInfo:
    """The registry's view of one `Measure` class: everything the CLI, the docs and the checks
    need about one measure, read from the class (its source of truth).

    The hooks (``invariant``, ``declare_cost``, ``applicable``, ``stops_early``, ``artifacts``,
    ``invariance_note``, ``shared``) are how a measure owns its rules; the pipeline,
    ``--dry-run`` and ``check-invariance`` only call them. A hook the class does not define is
    None here; the tags ``invariant`` and ``stops_early`` are a bool or the class's method.

    Attributes
    ----------
    measure : Measure
        The measure (an instance of its class).
    name : str
        The registered name.
    fn : callable
        ``fn(ctx: MeasureContext, opts) -> MeasureResult``: the class's ``compute``.
    options : type
        The frozen options dataclass.
    description, reference : str
        One line each: what it is, the papers.
    stochastic, needs_init, low_precision : bool
        The class's tags (see `Measure`).
    invariant : bool or callable
        Whether the measure claims invariance to function-preserving node-wise rescalings, as a
        bool or as a function of the parsed options returning ``True`` or the reason (a string)
        why it does not hold with these options.
    invariance_options : dict
        Options `flatcli check-invariance` turns on unless the user set them.
    invariance_note, artifacts, declare_cost, applicable, shared : callable or None
        The class's methods of those names (see `Measure`), None when it does not define them.
    stops_early : bool or callable
        Whether the measure stops at its cap with the estimate so far; a bool or a function of
        the parsed options.
    revision : int
        The revision of the measure's values (part of every result's key).
    """

    measure: Measure
    name: str
    fn: Callable
    options: type
    description: str
    reference: str = ""
    stochastic: bool = False
    invariant: bool | Claim = False
    needs_init: bool = False
    invariance_options: dict[str, Any] = field(default_factory=dict)
    invariance_note: Note | None = None
    artifacts: Artifacts | None = None
    declare_cost: DeclareCost | None = None
    applicable: Callable[[Any, Any], str | None] | None = None
    stops_early: bool | Callable[[Any], bool] = False
    low_precision: bool = False
    revision: int = 1
    shared: Shared | None = None

    @classmethod
    def of(cls, measure: type[Measure]) -> MeasureInfo:
        """The view of a measure class."""
        m = measure()
        hooks = {
            h: None if getattr(measure, h) is getattr(Measure, h) else getattr(m, h) for h in _HOOKS
        }
        return cls(
            measure=m,
            name=measure.name,
            fn=m.compute,
            options=measure.options,
            description=measure.description,
            reference=measure.reference,
            stochastic=measure.stochastic,
            invariant=m.invariant,
            needs_init=measure.needs_init,
            invariance_options=dict(measure.invariance_options),
            stops_early=m.stops_early,
            low_precision=measure.low_precision,
            revision=measure.revision,
            **hooks,
        )

    def default_cost(self, dims: Dims) -> Cost | None:
        """The cost it declares with its default options on a problem of ``dims`` (None: none)."""
        if self.declare_cost is None:
            return None
        return self.declare_cost(parse_options(self.options, {}, self.name), dims)

    @property
    def may_claim_invariance(self) -> bool:
        """Whether the measure claims invariance with some options."""
        return self.invariant is not False

    def claims_invariance(self, opts: Any) -> tuple[bool, str]:
        """(claimed, reason) for the parsed options ``opts``; reason is empty when claimed."""
        if self.invariant is True or self.invariant is False:
            return bool(self.invariant), "" if self.invariant else "claims no invariance"
        verdict = self.invariant(opts)
        if verdict is True:
            return True, ""
        return False, str(verdict or "not invariant with these options")


_REGISTRY: dict[str, MeasureInfo] = {}
_loaded = False


def measure_classes(module: ModuleType) -> list[type[Measure]]:
    """The `Measure` classes a module defines (not those it imports), in their order."""
    return [
        c
        for c in vars(module).values()
        if isinstance(c, type)
        and issubclass(c, Measure)
        and c.__module__ == module.__name__
        and "name" in vars(c)
    ]


def _load_all() -> None:
    """Import every family module once and enter each of its `Measure` classes."""
    global _loaded
    if _loaded:
        return
    for mod in _FAMILY_MODULES:
        for cls in measure_classes(importlib.import_module(mod)):
            old = _REGISTRY.get(cls.name)
            if old is not None and type(old.measure) is not cls:
                raise ValueError(f"measure {cls.name!r} defined twice")
            _REGISTRY[cls.name] = MeasureInfo.of(cls)
    _loaded = True


def list_measures(pattern: str = "*") -> list[MeasureInfo]:
    """Every registered measure whose name matches a pattern, sorted by name.

    Parameters
    ----------
    pattern : str
        Shell wildcards (``"hessian_*"``).

    Returns
    -------
    list of MeasureInfo
        The registry entries.

    Examples
    --------
    >>> from flatcli.measures import list_measures
    >>> [m.name for m in list_measures("hessian_*")]
    ['hessian_lambda_max', 'hessian_spectrum', 'hessian_top_eigenvalues', 'hessian_trace']
    """
    _load_all()
    return [_REGISTRY[k] for k in sorted(_REGISTRY) if fnmatch.fnmatch(k, pattern)]


def get_measure(name: str) -> MeasureInfo:
    """The registry entry of one measure.

    Parameters
    ----------
    name : str
        The measure's registered name.

    Returns
    -------
    MeasureInfo
        Its entry.

    Raises
    ------
    flatcli.errors.ConfigError
        For an unknown name, suggesting the closest one.

    Examples
    --------
    >>> from flatcli.measures import get_measure
    >>> get_measure("hessian_trace").stochastic
    True
    """
    _load_all()
    if name not in _REGISTRY:
        import difflib

        hint = difflib.get_close_matches(name, list(_REGISTRY), n=1)
        msg = f"Unknown measure '{name}'."
        msg += f" Did you mean '{hint[0]}'?" if hint else " Run 'flatcli measures' for the list."
        raise ConfigError(msg)
    return _REGISTRY[name]


@dataclass(frozen=True)
class MeasureSpec:
    """One configured measure: registry name, column label, raw options, own seed and own caps
    (the common options ``max_seconds`` and ``max_hvps``, see `run_measure`)."""

    name: str
    label: str
    options: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    max_seconds: float | None = None
    max_hvps: int | None = None

    def budget(self, share: float | None = None, per_product: float | None = None) -> Budget:
        """A fresh `Budget` (its clock starts now) for this spec.

        Parameters
        ----------
        share : float, optional
            This measure's part of ``runtime.budget``, in seconds.
        per_product : float, optional
            The seconds one product is expected to take (`Budget.allow`).

        Returns
        -------
        Budget
            ``max_hvps`` products, and the smaller of ``max_seconds`` and ``share`` in seconds.
        """
        secs = [v for v in (self.max_seconds, share) if v is not None]
        return Budget(
            max_seconds=min(secs) if secs else None,
            max_products=self.max_hvps,
            per_product=per_product,
        )

    def parsed(self):
        """The validated options dataclass of this spec."""
        info = get_measure(self.name)
        return parse_options(info.options, self.options, self.name)

    def claims_invariance(self) -> tuple[bool, str]:
        """(claimed, reason): whether this configured measure claims rescaling invariance."""
        return get_measure(self.name).claims_invariance(self.parsed())

    def estimate(self, dims: Dims) -> dict[str, tuple[int, int]] | None:
        """The products a run of this spec will count.

        Parameters
        ----------
        dims : Dims
            The sizes the estimate depends on.

        Returns
        -------
        dict of str to (int, int), or None
            (least, most) of each counter, or None when the measure declares no estimate.
        """
        cost = self.cost(dims)
        if cost is None:
            return None
        # a range never starts above its cap (a floor of steps above max_steps runs max_steps)
        return {k: (min(v), v[1]) for k, v in cost.estimate().items()}

    def cost(self, dims: Dims) -> Cost | None:
        """The work a run of this spec declares (`MeasureInfo.declare_cost`; None when none)."""
        info = get_measure(self.name)
        return None if info.declare_cost is None else info.declare_cost(self.parsed(), dims)

    def shared_work(self, dims: Dims) -> dict:
        """The parts of its least work another measure of the checkpoint may have done already
        (`MeasureInfo.shared`; empty when it declares none)."""
        info = get_measure(self.name)
        return {} if info.shared is None else dict(info.shared(self.parsed(), dims))

    def stops_early(self) -> bool:
        """Whether this configured measure stops at its cap with its estimate so far
        (`MeasureInfo.stops_early`)."""
        flag = get_measure(self.name).stops_early
        return bool(flag(self.parsed()) if callable(flag) else flag)

    def not_applicable(self, problem) -> str | None:
        """Why this spec will end ``not_applicable`` on a problem (its registry ``applicable`` check).

        Parameters
        ----------
        problem : flatcli.engine.Problem
            The measurement set's problem.

        Returns
        -------
        str or None
            The reason, or None when it will run (or cannot tell before running).
        """
        info = get_measure(self.name)
        return None if info.applicable is None else info.applicable(self.parsed(), problem)


# The measure `flatcli check-invariance` always adds as the non-invariant reference.
INVARIANCE_REFERENCE = "hessian_trace"


def run_measure(spec: MeasureSpec, ctx: MeasureContext) -> MeasureResult:
    """Validate a measure's options, run it, time it and attach its cost.

    A measure that does not apply to this model, loss or parameter selection (`NotApplicable`)
    gives status ``not_applicable``, value NaN and the reason in ``diagnostics["reason"]``: not a
    failure. ``ctx.budget`` is set to `MeasureSpec.budget` of ``ctx.max_seconds``; the
    iterative estimators (Lanczos, Hutchinson, Hutch++, SLQ) stop when it is spent and the
    measure reports status ``budget`` with its estimate so far. Measures without an iterative
    estimator cannot stop early: `flatcli.run.measuring` starts them under a cap only when their
    predicted seconds fit; when they pass a time cap the diagnostics say so (``over_budget``,
    with ``budget_seconds``).

    Parameters
    ----------
    spec : MeasureSpec
        The configured measure.
    ctx : MeasureContext
        The problem, engine, seed and shared cache of this checkpoint.

    Returns
    -------
    MeasureResult
        With ``seconds`` and the engine's product counters (``n_hvp``, ``n_grad``, ...) in its
        diagnostics.
    """
    info = get_measure(spec.name)
    opts = parse_options(info.options, spec.options, spec.name)
    engine = ctx.engine
    before = engine.counters() if engine is not None else {}
    ctx.budget = spec.budget(ctx.max_seconds, ctx.cache.seconds_per_product)
    dist = getattr(ctx.problem, "dist", None)
    if dist is not None and dist.active:  # every rank stops at the same block
        ctx.budget.agree = dist.any
        ctx.budget.agree_count = lambda n: int(dist.sum_float(n)[0] // dist.world)
    t0 = time.perf_counter()
    try:
        res = info.fn(ctx, opts)
    except NotApplicable as e:
        res = MeasureResult(value=math.nan, diagnostics={"reason": str(e)}, status="not_applicable")
    seconds = time.perf_counter() - t0
    diag = dict(res.diagnostics)
    cap = ctx.budget.max_seconds
    if cap is not None:
        diag["budget_seconds"] = cap
        if seconds > cap and res.status != "budget":
            diag["over_budget"] = True
    if engine is not None:
        after = engine.counters()
        for k, v in after.items():
            diag.setdefault(k, v - before.get(k, 0))
    return dataclasses.replace(res, seconds=seconds, diagnostics=diag, value=float(res.value))
