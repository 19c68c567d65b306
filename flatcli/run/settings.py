"""How to measure, resolved once: the `Settings` every pipeline passes down whole, and the
`RunOptions` a call gives to change the config's run settings.

The path of a run's settings: a `Config` (YAML + environment, see `flatcli.config`) takes a
call's `RunOptions` (device, precision, seed, threads, allow_unsafe_pickle, budget: what the
CLI's shared flags set and every config-taking entry point of `flatcli.api` accepts as
``run=``) as overrides of its ``runtime.*`` keys; `Settings.from_config` then resolves the
config into `Settings`. So `RunOptions` is what `Settings` is built from (through the config),
not a third copy: it holds only the unresolved, optional per-call values (None: keep the
config's). The Python entry points that take a model and tensors (`flatcli.api.measure_model`,
`flatcli.invariance.check_invariance_model`) have no config: they accept `Settings` fields as
keywords and build one with `Settings.build`. Nothing below the API unpacks a config into long
argument lists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..config import overrides
from ..engine import CurvatureEngine
from ..engine.linalg.lanczos import host_fit
from ..engine.params import ParamSelection
from ..engine.precision import BF16_FD_REFUSED, PRECISIONS, Precision, has_tensor_cores
from ..errors import ConfigError
from ..validation import Bool, Function, Kind, Optional, Str, check_fields, opt, validate

__all__ = [
    "PRECISIONS",
    "MeasureOptions",
    "RunOptions",
    "Settings",
    "has_tensor_cores",
    "resolve_device",
]


@dataclass(frozen=True)
class RunOptions:
    """How one call runs, over the config: the options every entry point of `flatcli.api` that
    takes a config shares (``run=RunOptions(...)``), and the CLI builds once from its shared flags
    (``--device``, ``--precision``, ``--seed``, ``--threads``, ``--allow-unsafe-pickle``,
    ``--budget``).

    Each field overrides its ``runtime.*`` config key, as the flag does; None (and False for
    ``allow_unsafe_pickle``) keeps the config's value. The config validates the values (a bad
    one is a `flatcli.errors.ConfigError` naming the key) when the entry point loads it; the
    resolved form is `Settings` (`Settings.from_config`). A field an entry point does not use is
    ignored (the landscape views have no ``budget``; `flatcli.api.correlate_report`, which has no config,
    uses only ``seed``, the seed of its bootstrap, default 0).

    The entry points take no separate ``device``/``precision``/``seed``/``threads``/
    ``allow_unsafe_pickle``/``budget`` keywords: passing one raises a TypeError that names
    ``run=RunOptions(...)`` (one object rather than a block of keywords repeated in every
    signature; see `flatcli.api._setup.takes_run`).

    Parameters
    ----------
    device : str, optional
        ``"auto"``, ``"cpu"`` or ``"cuda:N"`` (``runtime.device``).
    precision : str, optional
        ``"auto"``, ``"fp32"``, ``"tf32"``, ``"bf16"`` or ``"fp64"`` (``runtime.precision``).
    seed : int, optional
        Seed of every stochastic measure and view without its own (``runtime.seed``).
    threads : int or "auto", optional
        Intra-op CPU threads per process (``runtime.threads``).
    allow_unsafe_pickle : bool
        Load full pickled checkpoints (``runtime.allow_unsafe_pickle``: trusted files only).
    budget : float or str, optional
        Seconds (or ``"10m"``) for one checkpoint's measures together (``runtime.budget``).

    Examples
    --------
    >>> from flatcli import RunOptions
    >>> RunOptions(device="cpu", seed=3).changes()
    {'runtime.device': 'cpu', 'runtime.seed': 3}
    """

    device: str | None = None
    precision: str | None = None
    seed: int | None = None
    threads: int | str | None = None
    allow_unsafe_pickle: bool | None = None
    budget: float | str | None = None

    def changes(self) -> dict[str, Any]:
        """The config overrides (``{"runtime.device": "cpu", ...}``) of the fields given."""
        return overrides(**dataclasses.asdict(self))

    @classmethod
    def of(cls, run: RunOptions | None) -> RunOptions:
        """``run``, or the defaults (nothing overridden) for None; a TypeError for anything else."""
        if run is None:
            return cls()
        if not isinstance(run, cls):
            raise TypeError(
                f"run must be a flatcli.api.RunOptions. Got {type(run).__name__} instead."
            )
        return run


_HOOK = Optional(Function())


@dataclass(frozen=True)
class MeasureOptions:
    """How one `flatcli.api.measure_model` call names its row and reports (``options=``), validated
    at construction (a bad value is a `ConfigError` naming the field). The defaults are those of a
    call without options.

    Parameters
    ----------
    checkpoint : str
        The name the row carries (default ``"<model>"``).
    hparams : mapping, optional
        The row's ``hp_*`` columns.
    debug : bool
        Re-raise a failed measurement instead of recording it.
    progress : callable, optional
        ``progress(label, info)`` while a measure runs: its counters so far, ``seconds``,
        ``planned_hvps`` and the estimator's ``probes``/``steps``, ``value``, ``stderr``.
    on_measure : callable, optional
        ``on_measure(row, label)`` after each measure finishes (the row so far).

    Examples
    --------
    >>> MeasureOptions(checkpoint="epoch_3.pt", hparams={"lr": 0.1}).checkpoint
    'epoch_3.pt'
    """

    checkpoint: str = opt("<model>", Str(), "the row's name")
    hparams: Mapping[str, Any] | None = opt(
        None, Optional(Kind(Mapping, words="a mapping")), "the row's hp_* columns"
    )
    debug: bool = opt(False, Bool(), "re-raise a failed measurement")
    progress: Callable[[str, dict], None] | None = opt(None, _HOOK, "progress(label, info)")
    on_measure: Callable[[Any, str], None] | None = opt(None, _HOOK, "on_measure(row, label)")

    def __post_init__(self):
        check_fields(self)


def resolve_device(name: str | torch.device | None, where: str = "device") -> torch.device:
    """'auto' → cuda if available else cpu; a name is checked with the rule ``device`` of
    `flatcli.validation` (auto, cpu, cuda, cuda:N) and cuda:N against the visible devices; errors
    name ``where`` (the API parameter, or the config key). A `torch.device` passes through."""
    if isinstance(name, torch.device):
        return name
    name = validate("device", name or "auto", where)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(
                f"{where} is {name!r} but no CUDA device is visible; use `device` cpu"
            )
        dev = torch.device(name)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(
                f"{where} {name!r}: only {torch.cuda.device_count()} CUDA device(s) visible"
            )
        return dev
    return torch.device(name)


@dataclass(frozen=True)
class Settings:
    """The resolved measurement settings, passed whole to every path (measure, sweep, landscape,
    PCA, connect, invariance, experiments). Validated here, once, in API terms.

    Parameters
    ----------
    device : where to compute (a `torch.device`; build with `resolve_device`).
    precision : "auto" (default: TF32 products on a CUDA device with tensor cores, every
        converged quantity verified with fp32 products at the end; fp32 elsewhere), "fp32",
        "tf32" (TF32 matrix products on CUDA, no verification), "bf16" (the model's forward and
        products in bfloat16, vectors and reductions in float32, converged quantities verified in
        fp32) or "fp64" (`flatcli.engine.precision`).
    seed : seed of every stochastic measure without its own ``seed``.
    loss : "cross_entropy", "mse" or "causal_lm" (`flatcli.engine.losses`).
    split, num_samples, batch_size, data_seed : the measurement set (``measure_data``).
    hvp_mode, block_size : engine settings (``runtime.hvp_mode``, ``runtime.block_size``).
    recompute : "auto", "true" or "false" (``runtime.recompute``; booleans accepted): Hessian products
        keeping one block's activations at a time (`flatcli.engine.segments`, or checkpointing,
        `flatcli.engine.recompute`, on models that are not chains of blocks).
    max_device_vectors : most basis vectors the Krylov estimators keep on the device
        (``runtime.max_device_vectors``: an int, "auto" or None; `flatcli.engine.linalg._store`).
    max_basis_vectors : most Lanczos basis vectors kept at all, device and host
        (``runtime.max_basis_vectors``: an int, "auto" or None; beyond it Lanczos thick-restarts,
        `flatcli.engine.linalg.lanczos`).
    params : the parameter selection every measure perturbs and differentiates
        (`flatcli.engine.params.ParamSelection`; default everything).
    budget : seconds for one checkpoint's measures together (``runtime.budget``, ``--budget``;
        None: no cap), shared among them by predicted cost (`flatcli.run.shares`).
    cache_graphs : "auto", "true" or "false" (``runtime.cache_graphs``; booleans accepted): keep
        each batch's gradient graph across the Hessian products at one θ; ``auto`` keeps them when
        the predicted peak with them fits in half the free memory (`flatcli.run.memory.graph_choice`).
    check_memory : whether a run's predicted peak memory is checked against the device's free
        memory before the data and before the first product (``runtime.check_memory``,
        `flatcli.run.memory`); a run that will not fit fails its checkpoint with suggestions.
    """

    device: torch.device = torch.device("cpu")
    precision: str = "auto"
    seed: int = 0
    loss: str = "cross_entropy"
    split: str = "train"
    num_samples: int | str = "all"
    batch_size: int = 256
    data_seed: int = 0
    hvp_mode: str = "auto"
    block_size: int | None = None
    params: ParamSelection = ParamSelection()
    recompute: str = "auto"
    max_device_vectors: int | str | None = "auto"
    max_basis_vectors: int | str | None = "auto"
    budget: float | None = None
    cache_graphs: str = "auto"
    check_memory: bool = True

    def __post_init__(self):
        """Every field but ``device`` (a `torch.device`, see `resolve_device`) and ``params`` is checked
        with its rule in `flatcli.validation.SETTINGS`, the one the config sections use; errors name
        the field (the API parameter)."""
        for name in _CHECKED:
            object.__setattr__(self, name, validate(name, getattr(self, name)))
        if self.precision == "bf16" and self.hvp_mode == "finite_difference":
            raise ConfigError(BF16_FD_REFUSED)
        for name in ("recompute", "cache_graphs"):
            if isinstance(getattr(self, name), bool):
                object.__setattr__(self, name, "true" if getattr(self, name) else "false")
        if not isinstance(self.params, ParamSelection):
            object.__setattr__(self, "params", ParamSelection.of(self.params))

    @property
    def resolved_precision(self) -> Precision:
        """The precision resolved for the device (`flatcli.engine.precision.Precision`)."""
        return Precision.of(self.precision, self.device)

    @property
    def dtype(self) -> torch.dtype:
        """The floating type of parameters and products (float64 for ``fp64``)."""
        return self.resolved_precision.dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        """The floating type the model's forward and the products run in (bfloat16 for ``bf16``)."""
        return self.resolved_precision.compute_dtype

    @property
    def effective_precision(self) -> str:
        """The precision products run at (``auto`` is ``tf32`` on a tensor-core GPU, else ``fp32``)."""
        return self.resolved_precision.effective

    @classmethod
    def from_config(cls, cfg, device: str | torch.device | None = None) -> Settings:
        """Settings of a `flatcli.config.Config` (``device`` overrides ``runtime.device``)."""
        md, rt = cfg.measure_data, cfg.runtime
        return cls(
            device=resolve_device(device)
            if device is not None
            else resolve_device(rt.device, "runtime.device"),
            precision=rt.precision,
            seed=rt.seed,
            loss=cfg.loss,
            split=md.split,
            num_samples=md.num_samples,
            batch_size=md.batch_size,
            data_seed=md.seed,
            hvp_mode=rt.hvp_mode,
            block_size=rt.block_size,
            params=ParamSelection.of(cfg.params),
            recompute=rt.recompute,
            max_device_vectors=rt.max_device_vectors,
            max_basis_vectors=rt.max_basis_vectors,
            budget=rt.budget,
            cache_graphs=rt.cache_graphs,
            check_memory=rt.check_memory,
        )

    @classmethod
    def build(cls, settings: Settings | None = None, **fields: Any) -> Settings:
        """``settings`` (default: the defaults) with the given fields replaced; None values ignored."""
        base = settings if settings is not None else cls()
        given = {k: v for k, v in fields.items() if v is not None}
        unknown = set(given) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"unknown settings: {', '.join(sorted(unknown))}")
        if "device" in given:
            given["device"] = resolve_device(given["device"])
        return dataclasses.replace(base, **given)

    def replace(self, **fields: Any) -> Settings:
        """A copy with some fields changed."""
        return Settings.build(self, **fields)

    def precision_context(self):
        """TF32 matrix products on for an effective ``tf32``, off otherwise; the previous flags are restored."""
        return self.resolved_precision.context()

    def basis_cap(self, P: int) -> int | None:
        """``runtime.max_basis_vectors`` for cost estimates (`flatcli.measures.Dims.max_basis`): an
        int as given, None (unbounded), ``auto``: the P-vectors that fit in half the free host memory
        (`flatcli.engine.linalg.lanczos.host_fit`, before the floor of `basis_floor`)."""
        return (
            host_fit(P, self.dtype) if self.max_basis_vectors == "auto" else self.max_basis_vectors
        )

    def engine(self, problem, cache_graphs: bool | None = None):
        """The `flatcli.engine.CurvatureEngine` over ``problem`` with these settings' products
        (mode, block, precision, recompute, caps) and ``cache_graphs`` (None: the engine's own
        rule): one place, so that the dry-run times the engine the run builds."""
        return CurvatureEngine(
            problem,
            hvp_mode=self.hvp_mode,
            block_size=self.block_size,
            precision=self.precision,
            recompute=self.recompute,
            max_device_vectors=self.max_device_vectors,
            max_basis_vectors=self.max_basis_vectors,
            cache_graphs=cache_graphs,
        )

    def graph_policy(self) -> bool | None:
        """``runtime.cache_graphs`` as `flatcli.engine.CurvatureEngine`'s ``cache_graphs``: True, False,
        or None for ``auto`` (the engine's own rule, until `flatcli.run.memory.graph_choice` decides)."""
        return {"true": True, "false": False}.get(self.cache_graphs)

    def verifies(self) -> bool:
        """Whether converged quantities are re-checked with fp32 products (``auto`` running TF32)."""
        return self.resolved_precision.verify

    def describe_device(self) -> str:
        """The device in words, e.g. ``cuda:0 (NVIDIA H100)``."""
        dev = self.device
        return str(dev) + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else "")


_CHECKED = (
    "precision",
    "seed",
    "loss",
    "split",
    "num_samples",
    "batch_size",
    "data_seed",
    "hvp_mode",
    "block_size",
    "recompute",
    "max_device_vectors",
    "max_basis_vectors",
    "budget",
    "cache_graphs",
    "check_memory",
)
