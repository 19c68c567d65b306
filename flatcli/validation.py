"""One validation vocabulary: constraints (`Check`) and every shared setting's rule, declared once.

A `Check` says whether a value is acceptable (`Check.ok`, after `Check.coerce`) and what it must
be in words (`Check.describe`). `SETTINGS` (the measurement settings: ``runtime.*``,
``measure_data.*``, ``loss``; `flatcli.run.settings.Settings`' fields) and `TRAINING` (the training
recipe: an experiment spec's ``training`` keys, `flatcli.training.Recipe`) map each name to its
`Rule`: the check and a help line. Every place that takes such a value — the config sections
(`flatcli.config`), `Settings`, the experiment spec, the `Recipe`, the engine's constructor —
calls `validate` with the rule's name and its own subject (the config key, the API parameter), so
a bad value reads the same everywhere but for the subject::

    config key 'measure_data.batch_size' must be an int ≥ 1. Got 0 instead.   (YAML)
    batch_size must be an int ≥ 1. Got 0 instead.                            (Python, `Settings`)
    The 'tol' parameter of hessian_trace must be a float in (0, 1). Got 0 instead.  (a measure)
    ns_regularization.yaml: studies.mnist1d.training: batch_size must be an int ≥ 1. Got 0 instead.

Messages never name a command-line flag: the CLI alone maps keys to flags (`flatcli.cli.cli_message`).
The allowed-values tuples (`PRECISIONS`, `LOSS_NAMES`, `HVP_MODES`, ...) live here only; the engine
and the config import them (tests/project/test_architecture.py checks no other module spells one out).

One grammar, scikit-learn's, for every refused value (`message`): "<subject> must be <constraint>.
Got <value> instead." The measures' options use the same checks (`opt`, `parse_options`,
re-exported by ``flatcli.measures._options``), their subject "The '<option>' parameter of
<measure>"; messages written by hand elsewhere follow the same sentence
(tests/run/test_error_grammar.py reads the source for the old "; got" form).

This module sits beside `flatcli.errors` at the bottom of the import graph (it imports nothing else
of flatcli, nor torch), so the engine may use it.
"""

from __future__ import annotations

import abc
import dataclasses
import difflib
import math
import numbers
import re
from typing import Any

from .errors import ConfigError

# ------------------------------------------------------------------ the allowed values, once
PRECISIONS = ("auto", "fp32", "tf32", "bf16", "fp64")  # flatcli.engine.precision
LOSS_NAMES = ("cross_entropy", "mse", "causal_lm")  # the keys of flatcli.engine.losses.LOSSES
HVP_MODES = ("auto", "reverse", "forward", "finite_difference")  # flatcli.engine.facade
RECOMPUTE = ("auto", "true", "false")  # flatcli.engine.recompute
SPLITS = ("train", "test")  # measure_data.split
OPTIMIZERS = ("sgd", "adam", "adamw")  # flatcli.training
TRAINING_DTYPES = ("float32", "float64")  # flatcli.training.Recipe.dtype
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")  # model.dtype (flatcli.loading.factory)
FORMATS = ("table", "csv", "json")  # output.format
EXECUTORS = ("local", "slurm", "local-array")  # sweep's executor (flatcli.sweep.runner)
TRANSFORMS = ("node", "layer", "both")  # check-invariance's rescalings (flatcli.invariance)
BIAS_BN = ("zero", "keep")  # landscape directions: biases and norm layers (flatcli.landscape)
STATS = (
    "psi",
    "kendall_tau_b",
    "jiang_tau",
    "spearman",
    "pearson",
    "cmi",
)  # correlate's statistics (flatcli.analysis)

FP16_REFUSED = (
    "fp16 is not offered: float16's range (largest 65504, smallest normal 6.1e-5) does not hold "
    "second derivatives of a mean loss without loss scaling; use bf16 (float32's range)"
)


# ------------------------------------------------------------------ checks
class Check(abc.ABC):
    """A constraint on one value: `Real`, `Integral`, `OneOf`, `Either`, ..."""

    @abc.abstractmethod
    def ok(self, v: Any) -> bool:
        """Whether ``v`` (after `coerce`) satisfies the constraint."""

    @abc.abstractmethod
    def describe(self) -> str:
        """The constraint in words, for error messages and ``flatcli measures``."""

    def coerce(self, v: Any) -> Any:
        """``v`` in the type the check wants (a YAML ``4.0`` as ``4``), else unchanged."""
        return v

    def parts(self) -> list[str]:
        """The alternatives in words (`Either` and `Optional` join them: "a, b or c")."""
        return [self.describe()]

    def refusal(self, v: Any) -> str | None:
        """A reason of its own for refusing ``v`` (fp16), said instead of "must be ..."; None if none."""
        return None


def _join(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " or " + parts[-1]


def _interval(lo, hi, closed: str) -> str:
    left = "[" if closed in ("both", "left") else "("
    right = "]" if closed in ("both", "right") else ")"
    return f"{left}{lo!r}, {hi!r}{right}"


def _bounds(kind: str, lo, hi, closed: str) -> str:
    """``kind`` with its bounds: "an int ≥ 1", "a float > 0", "a float in [0, 1)", "an int"."""
    if lo is not None and hi is not None:
        return f"{kind} in {_interval(lo, hi, closed)}"
    if lo is not None:
        return f"{kind} {'≥' if closed in ('both', 'left') else '>'} {lo!r}"
    if hi is not None:
        return f"{kind} {'≤' if closed in ('both', 'right') else '<'} {hi!r}"
    return kind


class Real(Check):
    """A finite number in an interval (ints accepted, kept as floats); ``closed`` in {"both", "left",
    "right", "neither"}; ``text``: also a number written as text (YAML reads ``1e-3`` as a string)."""

    def __init__(self, lo=None, hi=None, closed: str = "both", text: bool = True):
        self.lo, self.hi, self.closed, self.text = lo, hi, closed, text

    def coerce(self, v):
        if isinstance(v, bool):
            return v
        if isinstance(v, (int, float)):
            return float(v)
        if isinstance(v, str) and self.text:
            try:
                return float(v)
            except ValueError:
                return v
        return v

    def ok(self, v):
        if not isinstance(v, float) or isinstance(v, bool) or not math.isfinite(v):
            return False
        lo_ok = self.lo is None or (
            v >= self.lo if self.closed in ("both", "left") else v > self.lo
        )
        hi_ok = self.hi is None or (
            v <= self.hi if self.closed in ("both", "right") else v < self.hi
        )
        return lo_ok and hi_ok

    def describe(self):
        return _bounds("a float", self.lo, self.hi, self.closed)


MAX_SEED = 2**63 - 1  # torch's and numpy's generators take seeds in [0, 2⁶³)
MAX_THREADS = 4096  # intra-op threads: a larger count is a typo (and overflows torch's C int)


class Integral(Check):
    """An int in ``[lo, hi]`` (a float with an integer value and numpy's ints accepted, kept as
    ``int``; ``text``: also digits as text, as environment variables give them)."""

    def __init__(self, lo=None, hi=None, text: bool = False):
        self.lo, self.hi, self.text = lo, hi, text

    def coerce(self, v):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, numbers.Integral) and not isinstance(v, bool):  # numpy's ints too
            return int(v)
        if self.text and isinstance(v, str) and re.fullmatch(r"\s*-?\d+\s*", v):
            return int(v)
        return v

    def ok(self, v):
        if not isinstance(v, int) or isinstance(v, bool):
            return False
        return (self.lo is None or v >= self.lo) and (self.hi is None or v <= self.hi)

    def describe(self):
        return _bounds("an int", self.lo, self.hi, "both")


class OneOf(Check):
    """One of fixed values; ``refused``: value → a reason said instead of the list (fp16)."""

    def __init__(self, *values, refused: dict[Any, str] | None = None):
        self.values = values
        self.refused = refused or {}

    def ok(self, v):
        return v in self.values

    def describe(self):
        if len(self.values) == 1:
            return self._word(self.values[0])
        return "one of " + ", ".join(self._word(v) for v in self.values)

    @staticmethod
    def _word(v) -> str:
        return v if isinstance(v, str) else repr(v)  # as YAML writes it: auto, not 'auto'

    def refusal(self, v):
        return self.refused.get(v) if isinstance(v, str) else None


class Bool(Check):
    """A bool (YAML true or false)."""

    def ok(self, v):
        return isinstance(v, bool)

    def describe(self):
        return "a bool (true or false)"


class Str(Check):
    """A non-empty string."""

    def ok(self, v):
        return isinstance(v, str) and v != ""

    def describe(self):
        return "a non-empty string"


class Function(Check):
    """A callable (a hook such as ``on_progress``)."""

    def ok(self, v):
        return callable(v)

    def describe(self):
        return "a callable"


class Kind(Check):
    """An instance of one of ``types`` (a mapping of results, a sequence of specs); ``words``: the
    kind in words ("a mapping")."""

    def __init__(self, *types: type, words: str):
        self.types, self.words = types, words

    def ok(self, v):
        return isinstance(v, self.types)

    def describe(self):
        return self.words


class Either(Check):
    """Whatever one of ``checks`` accepts (the first that accepts its coerced value wins);
    ``words``: the constraint in words when joining the alternatives' would not read well."""

    def __init__(self, *checks: Check, words: str | None = None):
        self.checks, self.words = checks, words

    def coerce(self, v):
        for c in self.checks:
            w = c.coerce(v)
            if c.ok(w):
                return w
        return v

    def ok(self, v):
        return any(c.ok(v) for c in self.checks)

    def parts(self):
        return [self.words] if self.words else [p for c in self.checks for p in c.parts()]

    def describe(self):
        return _join(self.parts())


class Optional(Check):
    """``None`` (YAML ``null``) or whatever ``inner`` accepts."""

    def __init__(self, inner: Check):
        self.inner = inner

    def coerce(self, v):
        return None if v is None else self.inner.coerce(v)

    def ok(self, v):
        return v is None or self.inner.ok(v)

    def parts(self):
        return [*self.inner.parts(), "null"]

    def describe(self):
        return _join(self.parts())

    def refusal(self, v):
        return None if v is None else self.inner.refusal(v)


class Device(Check):
    """A device name: auto (cuda when one is visible, else cpu), cpu, cuda or cuda:N. Apple's mps is
    not offered (decided once, for the config, `Settings` and the training recipe alike): nothing in
    flatcli is written or tested for it (fp64 products, TF32, the out-of-memory back-off read CUDA or
    the host)."""

    def ok(self, v):
        return isinstance(v, str) and (
            v in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", v) is not None
        )

    def describe(self):
        return "auto, cpu, cuda or cuda:N"


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


class Seconds(Check):
    """A positive number of seconds, or text as ``90``, ``90s``, ``10m``, ``1.5h`` (coerced to seconds)."""

    def coerce(self, v):
        if isinstance(v, str):
            text = v.strip().lower()
            unit = _UNITS.get(text[-1:], None) if text else None
            try:
                return float(text[:-1] if unit else text) * (unit or 1.0)
            except ValueError:
                return v
        if isinstance(v, int) and not isinstance(v, bool):
            return float(v)
        return v

    def ok(self, v):
        return isinstance(v, float) and math.isfinite(v) and v > 0

    def describe(self):
        return "a positive number of seconds or a duration like 90s, 10m, 1h"


# ------------------------------------------------------------------ the rules, once per setting
@dataclasses.dataclass(frozen=True)
class Rule:
    """One setting's constraint and help line."""

    check: Check
    help: str


_AUTO = OneOf("auto")
_BATCH = Integral(1)

SETTINGS: dict[str, Rule] = {
    "device": Rule(Device(), "where to compute"),
    "precision": Rule(
        OneOf(*PRECISIONS, refused={"fp16": FP16_REFUSED}),
        "products' precision (flatcli.engine.precision)",
    ),
    "loss": Rule(OneOf(*LOSS_NAMES), "the loss plug-in (flatcli.engine.losses)"),
    "hvp_mode": Rule(
        OneOf(*HVP_MODES), "how Hessian-vector products are taken (flatcli.engine.facade)"
    ),
    "split": Rule(OneOf(*SPLITS), "the measurement set's split"),
    "batch_size": Rule(_BATCH, "examples per batch"),
    "num_samples": Rule(Either(Integral(1), OneOf("all")), "examples in the measurement set"),
    "seed": Rule(Integral(0, MAX_SEED), "seed of the stochastic measures"),
    "data_seed": Rule(Integral(0, MAX_SEED), "seed of the measurement set's subset"),
    "block_size": Rule(
        Optional(Integral(1)), "most vectors per product call (null: from free memory)"
    ),
    "threads": Rule(
        Either(Integral(1, MAX_THREADS, text=True), _AUTO),
        "intra-op threads per worker (flatcli.threads)",
    ),
    "max_device_vectors": Rule(
        Optional(Either(Integral(1), _AUTO)),
        "most Krylov basis vectors kept on the device (null: unbounded)",
    ),
    "max_basis_vectors": Rule(
        Optional(Either(Integral(1), _AUTO)),
        "most Lanczos basis vectors kept at all, device and host; beyond it Lanczos "
        "thick-restarts (auto: what fits in half the free host memory; null: unbounded)",
    ),
    "recompute": Rule(
        Either(Bool(), OneOf(*RECOMPUTE), words="true, false or auto"),
        "activation checkpointing in Hessian products (flatcli.engine.recompute)",
    ),
    "cache_graphs": Rule(
        Either(Bool(), OneOf(*RECOMPUTE), words="true, false or auto"),
        "keep per-batch gradient graphs across Hessian products at one θ (auto: when the "
        "predicted peak with them fits in half the free memory; flatcli.run.prediction.memory.graph_choice)",
    ),
    "check_memory": Rule(
        Bool(),
        "check before loading the data and before the first product that the run fits in "
        "free memory (flatcli.run.prediction.memory)",
    ),
    "budget": Rule(Optional(Seconds()), "seconds for one checkpoint's measures (null: no cap)"),
    "max_hvps": Rule(
        Integral(1), "a measure's most Hessian-vector products (measures[i].NAME.max_hvps)"
    ),
}

TRAINING: dict[str, Rule] = {
    "optimizer": Rule(OneOf(*OPTIMIZERS), "the optimizer"),
    "lr": Rule(
        Real(0, None, "neither", text=False), "learning rate (a spec may give one per optimizer)"
    ),
    "lr_factor": Rule(
        Real(0, None, "neither", text=False), "factor on the learning rate (a grid axis)"
    ),
    "momentum": Rule(Real(0, 1, "left", text=False), "sgd's momentum"),
    "batch_size": Rule(_BATCH, "examples per step"),
    "weight_decay": Rule(Real(0, None, text=False), "the optimizer's weight decay"),
    "l2": Rule(Real(0, None, text=False), "l2/2 · Σ‖W‖² added to the objective"),
    "label_noise": Rule(Real(0, 1, text=False), "fraction of training labels replaced at random"),
    "max_steps": Rule(Integral(1), "most optimizer steps"),
    "eval_every": Rule(
        Optional(Integral(1)), "steps between checks of the criterion (null: once per epoch)"
    ),
    "dtype": Rule(OneOf(*TRAINING_DTYPES), "the parameters' floating type"),
    "device": SETTINGS["device"],
    "target_loss": Rule(
        Real(0, None, "neither", text=False), "train cross-entropy every model must reach"
    ),
}


def message(subject: str, check: Check, given: Any) -> str:
    """The one wording of a refused value, scikit-learn's: "<subject> must be <constraint>. Got
    <value> instead." (a check's own reason, fp16's, instead after "<subject>: ")."""
    reason = check.refusal(given)
    if reason is not None:
        return f"{subject}: {reason}"
    return f"{subject} must be {check.describe()}. Got {given!r} instead."


def validate(
    name: str,
    value: Any,
    subject: str | None = None,
    *,
    rules: dict[str, Rule] = SETTINGS,
    error: type[Exception] = ConfigError,
) -> Any:
    """``value`` (coerced) when setting ``name`` of ``rules`` accepts it, else ``error`` (a
    `ConfigError` by default; the engine's constructors raise ValueError, as they always have)
    saying `message` with ``subject`` (the config key or API parameter; default ``name``)."""
    check = rules[name].check
    v = check.coerce(value)
    if not check.ok(v):
        raise error(message(subject or name, check, value))
    return v


def parse_seconds(value: Any, where: str = "runtime.budget") -> float:
    """Seconds from ``value``: a number, or text as ``90``, ``90s``, ``10m``, ``1.5h``; a
    `ConfigError` naming ``where`` for anything else (zero, negative, another unit).

    >>> parse_seconds("10m"), parse_seconds(90), parse_seconds("1h")
    (600.0, 90.0, 3600.0)
    """
    check = Seconds()
    v = check.coerce(value)
    if not check.ok(v):
        raise ConfigError(message(where, check, value))
    return v


# ------------------------------------------------------------------ measure options
def opt(default: Any, check: Check, help: str = "") -> Any:
    """A dataclass field with a constraint and a help text."""
    return dataclasses.field(default=default, metadata={"check": check, "help": help})


def check_fields(obj: Any) -> None:
    """Validate, at construction, every field of the frozen options object ``obj`` made with `opt`
    (call it from ``__post_init__``): each value is coerced in place (``4.0`` to ``4``), and the
    first one refused is a `ConfigError` in the one wording of `message`, naming the field as an
    API parameter (```bend_steps` must be an int ≥ 0. Got -1 instead.``; the CLI turns it into the
    flag)."""
    for f in option_fields(type(obj)):
        check: Check = f.metadata["check"]
        given = getattr(obj, f.name)
        value = check.coerce(given)
        if not check.ok(value):
            raise ConfigError(message(f"`{f.name}`", check, given))
        object.__setattr__(obj, f.name, value)


def option_fields(cls) -> list[dataclasses.Field]:
    """The fields of an options dataclass that carry a constraint."""
    return [f for f in dataclasses.fields(cls) if "check" in f.metadata]


def parse_options(cls, raw: dict[str, Any] | None, measure: str):
    """Validate ``raw`` against the options dataclass ``cls`` of ``measure``.

    ``None`` values are dropped so that unset CLI/Python defaults never override a
    measure's own defaults.
    """
    raw = {k: v for k, v in (raw or {}).items() if v is not None}
    fields = {f.name: f for f in option_fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            hint = difflib.get_close_matches(key, list(fields), n=1)
            valid = ", ".join(fields) or "(none)"
            msg = f"Unknown option '{key}' for measure {measure}."
            msg += f" Did you mean '{hint[0]}'?" if hint else f" Valid options: {valid}."
            raise ConfigError(msg)
        check: Check = fields[key].metadata["check"]
        given = value
        value = check.coerce(value)
        if not check.ok(value):
            raise ConfigError(message(f"The '{key}' parameter of {measure}", check, given))
        kwargs[key] = value
    return cls(**kwargs)


def describe_options(cls) -> list[tuple[str, str, str]]:
    """(name, default, help) for every option of ``cls``."""
    out = []
    for f in option_fields(cls):
        out.append((f.name, repr(f.default), f.metadata.get("help", "")))
    return out
