"""Configuration: schema (dataclasses), YAML loading, precedence, validation, hash.

Precedence: CLI flag > environment (``FLATCLI_*``) > YAML > defaults. Every
resolved value remembers where it came from (`Config.provenance`), which
``flatcli config show`` prints. Unknown keys are errors naming the key and the
closest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import json
import os
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from .errors import ConfigError
from .measures import MeasureSpec, get_measure
from .validation import FORMATS, MODEL_DTYPES, parse_options, validate
from .validation import (
    parse_seconds as parse_seconds,  # re-exported: config keys and CLI flags take durations
)
from .yaml_loader import read_yaml
from .yaml_loader import safe_yaml as safe_yaml  # re-exported: the one YAML reader

SOURCES = (
    "tensors",
    "torchvision",
    "imagefolder",
    "digits",
    "synthetic",
    "mnist1d",
    "text",
    "modular_addition",
)


MODEL_SOURCES = ("python", "huggingface")
# keys added after configs were first hashed: a key at its default is left out of `Config.to_dict`,
# so the hash (and a sweep's units) of a config that does not use it stay what they were
_NEW = {"omit_default": True}


def _rule(name: str, **more: Any) -> dict[str, Any]:
    """Field metadata of a key checked by the rule ``name`` of `flatcli.validation.SETTINGS` (the
    rule `flatcli.run.settings.Settings` uses too), instead of by its annotation (`_check_settings`)."""
    return {"setting": name, **more}


@dataclass
class ModelConfig:
    """``model``: the factory (``target``) and its keyword arguments, or, with ``source: huggingface``,
    a ``transformers`` class (YAML key ``class``) whose ``from_pretrained`` reads each checkpoint
    directory with ``kwargs`` (`flatcli.loading.hf`). ``dtype`` (auto | float32 | bfloat16 |
    float16): the type the checkpoint is loaded in; ``auto`` is its stored type for Hugging Face
    directories and ``.safetensors`` files, float32 for the rest (how it is measured is
    ``runtime.precision``'s business: fp32 upcasts, bf16 keeps bfloat16 products)."""

    source: str = field(default="python", metadata=_NEW)
    target: str = ""
    class_: str = field(default="", metadata={**_NEW, "yaml": "class"})
    kwargs: dict[str, Any] = field(default_factory=dict)
    dtype: str = field(default="auto", metadata=_NEW)


@dataclass
class DataSource:
    """One split. ``source`` picks the loader; the other keys are the loader's."""

    source: str = ""
    path: str | None = None  # tensors, imagefolder
    name: str | None = None  # torchvision dataset class
    root: str | None = None  # torchvision
    kwargs: dict[str, Any] = field(
        default_factory=dict
    )  # torchvision, imagefolder; mnist1d, modular_addition parameters
    download: bool = False
    split: str | None = (
        None  # digits, mnist1d, modular_addition: train | test (defaults to the key it sits under)
    )
    num_samples: int | None = None  # synthetic; mnist1d (both splits together)
    input_shape: list[int] | None = None  # synthetic
    num_classes: int | None = None  # synthetic
    seed: int = 0  # synthetic, mnist1d, modular_addition (the split)
    # text (`flatcli.loading.text`); left out of the config's hash and results.json while unset
    tokenizer: str | None = field(
        default=None, metadata=_NEW
    )  # a save_pretrained tokenizer directory
    text_field: str | None = field(default=None, metadata=_NEW)
    text_pair_field: str | None = field(
        default=None, metadata=_NEW
    )  # second segment (sentence pairs)
    label_field: str | None = field(
        default=None, metadata=_NEW
    )  # integer class labels (none for causal_lm)
    max_length: int | None = field(default=None, metadata=_NEW)
    padding: str = field(default="longest", metadata=_NEW)  # longest (over the file) | max_length
    truncation: bool = field(default=True, metadata=_NEW)
    text_split: str | None = field(default=None, metadata=_NEW)  # .txt: lines (default) | windows


@dataclass
class DataConfig:
    """``data``: the train and test splits and their normalization."""

    train: DataSource | None = None
    test: DataSource | None = None
    normalize: dict[str, list[float]] | None = None


@dataclass
class MeasureDataConfig:
    """``measure_data``: the measurement set (split, size, batch size, seed)."""

    split: str = field(default="train", metadata=_rule("split"))
    num_samples: int | str = field(default="all", metadata=_rule("num_samples"))
    batch_size: int = field(default=256, metadata=_rule("batch_size"))
    seed: int = field(default=0, metadata=_rule("data_seed"))


@dataclass
class RuntimeConfig:
    """``runtime``: device, precision, seed and engine options."""

    device: str = field(default="auto", metadata=_rule("device"))
    precision: str = field(default="auto", metadata=_rule("precision"))
    seed: int = field(default=0, metadata=_rule("seed"))
    hvp_mode: str = field(default="auto", metadata=_rule("hvp_mode"))
    block_size: int | None = field(default=None, metadata=_rule("block_size"))
    allow_unsafe_pickle: bool = False
    # intra-op threads per worker process (flatcli.threads)
    threads: int | str = field(default="auto", metadata=_rule("threads"))
    # memory: Hessian products keeping one block at a time (flatcli.engine.segments), and the
    # most basis vectors Krylov estimators keep on the device (flatcli.engine.linalg._store)
    recompute: bool | str = field(default="auto", metadata=_rule("recompute", **_NEW))
    max_device_vectors: int | str | None = field(
        default="auto", metadata=_rule("max_device_vectors", **_NEW)
    )
    # the most Lanczos basis vectors kept at all; beyond it thick restarts (flatcli.engine.linalg.lanczos)
    max_basis_vectors: int | str | None = field(
        default="auto", metadata=_rule("max_basis_vectors", **_NEW)
    )
    # per-batch gradient graphs kept across products at one θ (flatcli.run.prediction.memory.graph_choice)
    cache_graphs: bool | str = field(default="auto", metadata=_rule("cache_graphs", **_NEW))
    # predicted peak memory checked against free memory before the data and the first product (flatcli.run.prediction.memory)
    check_memory: bool = field(default=True, metadata=_rule("check_memory", **_NEW))
    # seconds per checkpoint (parse_seconds)
    budget: float | str | None = field(default=None, metadata=_rule("budget", **_NEW))


@dataclass
class ParamsConfig:
    """``params``: which parameters every measure perturbs and differentiates (glob patterns over
    ``named_parameters()`` names; see `flatcli.engine.params`)."""

    include: list[str] | None = None
    exclude: list[str] | None = None


@dataclass
class OutputConfig:
    """``output``: where results go and the default stdout format of ``measure``."""

    dir: str = "out"
    format: str = "table"


@dataclass
class HParamsConfig:
    """``hparams``: hyperparameters read from checkpoint paths or the dicts stored in checkpoints."""

    from_path: str | None = None  # regex with named groups
    from_keys: list[str] | None = None  # keys of a dict stored in the checkpoint


@dataclass
class Config:
    """A validated configuration (see the module docstring for precedence and provenance)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    checkpoints: Any = field(default_factory=list)
    init_checkpoint: str | None = None
    hparams: HParamsConfig = field(default_factory=HParamsConfig)
    data: DataConfig = field(default_factory=DataConfig)
    measure_data: MeasureDataConfig = field(default_factory=MeasureDataConfig)
    loss: str = field(default="cross_entropy", metadata=_rule("loss"))
    params: ParamsConfig = field(default_factory=ParamsConfig)
    measures: list[Any] = field(default_factory=list)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    # not part of the YAML schema
    base_dir: Path = field(default=Path("."), metadata={"internal": True})
    path: Path | None = field(default=None, metadata={"internal": True})
    provenance: dict[str, str] = field(default_factory=dict, metadata={"internal": True})

    # ------------------------------------------------------------ derived
    def measure_specs(self) -> list[MeasureSpec]:
        """The configured measures as `MeasureSpec` objects (validated)."""
        return parse_measures(self.measures, "measures")

    def resolve_path(self, p: str | os.PathLike) -> Path:
        """A path from the config, relative to the config file's folder."""
        q = Path(os.path.expanduser(str(p)))
        return q if q.is_absolute() else (self.base_dir / q)

    def output_dir(self, explicit: str | os.PathLike | None = None) -> Path:
        """Where results go: ``explicit`` (a CLI flag or API argument) as given; ``output.dir``
        from the YAML relative to the config file's folder; from the environment or the
        default (``out``) relative to the working directory."""
        if explicit is not None:
            return Path(os.path.expanduser(str(explicit)))
        if self.provenance.get("output.dir") == "yaml":
            return self.resolve_path(self.output.dir)
        return Path(os.path.expanduser(self.output.dir))

    def to_dict(self, defaults: bool = False) -> dict[str, Any]:
        """The config as plain data (what results.json records and the hash covers); ``defaults``:
        with the keys added later at their defaults too (``config show``), which are left out otherwise."""
        return _to_plain(self, defaults)

    def hash(self) -> str:
        """A short hash of everything that determines results (outputs excluded)."""
        d = self.to_dict()
        d.pop("output", None)
        d["runtime"].pop("threads", None)  # how fast, not what: results do not depend on it
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def yaml_key(f: dataclasses.Field) -> str:
    """A field's YAML key (``class`` for the Python field ``class_``)."""
    return f.metadata.get("yaml", f.name)


def _to_plain(obj, defaults: bool = False):
    if dataclasses.is_dataclass(obj):
        return {
            yaml_key(f): _to_plain(getattr(obj, f.name), defaults)
            for f in dataclasses.fields(obj)
            if not f.metadata.get("internal")
            and (
                defaults
                or not (f.metadata.get("omit_default") and getattr(obj, f.name) == f.default)
            )
        }
    if isinstance(obj, dict):
        return {k: _to_plain(v, defaults) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_plain(v, defaults) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


# ---------------------------------------------------------------- parsing
def _members(tp: Any) -> tuple[Any, ...]:
    """The alternatives of a union type (``X | None`` → (X, NoneType)), else (tp,)."""
    if get_origin(tp) in (Union, types.UnionType):
        return get_args(tp)
    return (tp,)


def _accepts(tp: Any, value: Any) -> bool:
    """Whether ``value`` (from YAML) fits the annotation ``tp`` (containers checked shallowly)."""
    if tp is Any:
        return True
    if tp is type(None):
        return value is None
    base = get_origin(tp) or tp
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if base is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(base, type) and isinstance(value, base)


def _type_name(tp: Any) -> str:
    base = get_origin(tp) or tp
    return {str: "str", int: "int", float: "float", bool: "bool", dict: "dict", list: "list"}.get(
        base, getattr(base, "__name__", str(base))
    )


def _check_type(key: str, value: Any, tp: Any) -> Any:
    members = _members(tp)
    if value is None:
        if type(None) in members or tp is Any:
            return None
        raise ConfigError(f"config key '{key}' must not be empty")
    if any(_accepts(m, value) for m in members):
        return value
    want = " or ".join(_type_name(m) for m in members if m is not type(None))
    raise ConfigError(
        f"config key '{key}' must be {want}. Got {type(value).__name__} {value!r} instead."
    )


def _dataclass_of(tp: Any) -> type | None:
    """The config dataclass a field holds (``DataSource | None`` → DataSource), else None."""
    for m in _members(tp):
        if dataclasses.is_dataclass(m):
            return m
    return None


@functools.cache
def _hints(cls) -> dict[str, Any]:
    """A config dataclass's resolved field types (evaluated once per class, not per config read)."""
    return get_type_hints(cls)


def _build(cls, raw: Any, prefix: str, prov: dict[str, str], origin: str):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(
            f"config key '{prefix or '(top level)'}' must be a mapping. Got {type(raw).__name__} instead."
        )
    hints = _hints(cls)
    fields = {yaml_key(f): f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    obj = cls()
    for key, value in raw.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            hint = difflib.get_close_matches(str(key), list(fields), n=1)
            msg = f"Unknown config key '{path}'."
            msg += (
                f" Did you mean '{(prefix + '.' if prefix else '') + hint[0]}'?"
                if hint
                else (f" Valid keys here: {', '.join(fields)}.")
            )
            raise ConfigError(msg)
        attr = fields[key].name
        tp = hints[attr]
        sub = _dataclass_of(tp)
        if sub is not None:
            if value is None and type(None) in _members(tp):
                setattr(obj, attr, None)
            else:
                setattr(obj, attr, _build(sub, value, path, prov, origin))
        else:
            setattr(obj, attr, _checked(fields[key], path, value, tp))
            prov[path] = origin
    return obj


def _checked(f: dataclasses.Field, path: str, value: Any, tp: Any) -> Any:
    """``value`` type-checked against its annotation, or kept as given for a key with a rule
    (checked with the other values in `_check_settings`, after the environment and CLI overrides)."""
    return value if f.metadata.get("setting") else _check_type(path, value, tp)


def _check_settings(obj: Any, prefix: str) -> None:
    """The keys of one section that have a rule in `flatcli.validation.SETTINGS`, each checked (and
    coerced: a duration to seconds) by it; errors name the config key."""
    for f in dataclasses.fields(obj):
        name = f.metadata.get("setting")
        if name:
            key = f"config key '{prefix}{yaml_key(f)}'"
            setattr(obj, f.name, validate(name, getattr(obj, f.name), key))


def parse_measures(raw: Any, key: str = "measures") -> list[MeasureSpec]:
    """``measures`` entries: ``name``, ``{name: {options}}`` or ``{name: null}``.

    ``label``, ``seed`` and the caps ``max_seconds`` (seconds or a duration like ``90s``, see
    `parse_seconds`) and ``max_hvps`` (an int ≥ 1) are taken out of the options; labels must be
    unique.
    Options are validated against the measure's declared constraints.
    """
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ConfigError(
            f"config key '{key}' must be a list of measure names or {{name: options}} entries"
        )
    specs: list[MeasureSpec] = []
    for i, entry in enumerate(raw):
        where = f"{key}[{i}]"
        if isinstance(entry, str):
            name, opts = entry, {}
        elif isinstance(entry, dict) and len(entry) == 1:
            name, opts = next(iter(entry.items()))
            if not isinstance(opts or {}, dict):
                raise ConfigError(f"config key '{where}.{name}' must be a mapping of options")
            opts = dict(opts or {})
        else:
            raise ConfigError(
                f"config key '{where}' must be a measure name or a one-key mapping {{name: options}}"
            )
        info = get_measure(str(name))
        label = opts.pop("label", name)
        if isinstance(label, bool) or not isinstance(label, (str, int, float)) or not str(label):
            raise ConfigError(
                f"config key '{where}.{name}.label' must be a name (text). Got {label!r} instead."
            )
        label = str(label)
        seed = opts.pop("seed", None)
        if seed is not None:
            seed = validate("seed", seed, f"config key '{where}.{name}.seed'")
        caps = _measure_caps(opts, f"config key '{where}.{name}")
        parse_options(info.options, opts, info.name)  # validate now, fail early
        specs.append(MeasureSpec(name=info.name, label=label, options=opts, seed=seed, **caps))
    labels = [s.label for s in specs]
    dup = {lab for lab in labels if labels.count(lab) > 1}
    if dup:
        raise ConfigError(
            f"config key '{key}' has the label(s) {', '.join(sorted(dup))} more than once; "
            "give each repeated measure a distinct 'label'"
        )
    return specs


def _measure_caps(opts: dict, where: str) -> dict[str, Any]:
    """The common options ``max_seconds`` and ``max_hvps``, taken out of ``opts`` and validated."""
    caps: dict[str, Any] = {}
    secs = opts.pop("max_seconds", None)
    if secs is not None:
        caps["max_seconds"] = parse_seconds(secs, f"{where}.max_seconds'")
    hvps = opts.pop("max_hvps", None)
    if hvps is not None:
        caps["max_hvps"] = validate("max_hvps", hvps, f"{where}.max_hvps'")
    return caps


CHOICES = {  # config keys with a fixed set of values and no rule in flatcli.validation (used in one place)
    "output.format": FORMATS,
    "model.source": MODEL_SOURCES,
    "model.dtype": MODEL_DTYPES,
}


def _get(cfg: Config, path: str) -> Any:
    obj = cfg
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _validate(cfg: Config) -> None:
    """Checks that span keys or depend on values (types were checked while building)."""
    for split_name in ("train", "test"):
        src = getattr(cfg.data, split_name)
        if src is not None:
            _validate_source(src, f"data.{split_name}")
    _check_settings(cfg, "")
    _check_settings(cfg.measure_data, "measure_data.")
    _check_settings(cfg.runtime, "runtime.")
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            raise ConfigError(
                f"config key '{key}' must be one of {', '.join(allowed)}. Got {value!r} instead."
            )
    for key in ("include", "exclude"):
        pats = getattr(cfg.params, key)
        if pats is not None and not all(isinstance(x, str) for x in pats):
            raise ConfigError(
                f"config key 'params.{key}' must be a list of glob patterns. Got {pats!r} instead."
            )
    _validate_model(cfg.model)
    cfg.measure_specs()


def _validate_source(src: DataSource, where: str) -> None:
    if src.source not in SOURCES:
        hint = difflib.get_close_matches(str(src.source), SOURCES, n=1)
        msg = f"config key '{where}.source' must be one of {', '.join(SOURCES)}. Got {src.source!r} instead."
        raise ConfigError(msg + (f" Did you mean '{hint[0]}'?" if hint else ""))
    _validate_text(src, where)


def _validate_model(m: ModelConfig) -> None:
    """``model``: ``target`` for Python factories, ``class`` (and no ``target``) for Hugging Face."""
    if m.source == "huggingface":
        if m.target:
            raise ConfigError(
                "config key 'model.target' does not apply with model.source: huggingface; "
                "name the transformers class in 'model.class' (e.g. AutoModelForCausalLM)"
            )
        if not m.class_:
            raise ConfigError(
                "config key 'model.class' is required with model.source: huggingface "
                "(e.g. AutoModelForCausalLM, AutoModelForSequenceClassification)"
            )
    elif m.class_:
        raise ConfigError(
            "config key 'model.class' needs model.source: huggingface "
            "(Python factories are named by 'model.target')"
        )


TEXT_KEYS = (
    "tokenizer",
    "text_field",
    "text_pair_field",
    "label_field",
    "max_length",
    "text_split",
)


def _validate_text(src: DataSource, where: str) -> None:
    """The text source's keys: ``path`` required, ``text_field`` too except for a ``.txt`` file,
    ``tokenizer`` unless the checkpoint folders hold one (checked when loading), ``padding`` one of
    longest | max_length (max_length needs ``max_length``), ``text_split`` (``.txt`` only) one of
    lines | windows (windows needs ``max_length``); text keys only with ``source: text``."""
    if src.source != "text":
        used = [k for k in TEXT_KEYS if getattr(src, k) is not None]
        if used:
            raise ConfigError(f"config key '{where}.{used[0]}' needs {where}.source: text")
        return
    if not src.path:
        raise ConfigError(f"config key '{where}.path' is required for source text")
    txt = str(src.path).lower().endswith(".txt")
    if not txt and not src.text_field:
        raise ConfigError(
            f"config key '{where}.text_field' is required for source text (except for a .txt file)"
        )
    if src.text_split is not None:
        if not txt:
            raise ConfigError(
                f"config key '{where}.text_split' applies to a .txt file only. Got path {src.path} instead."
            )
        if src.text_split not in ("lines", "windows"):
            raise ConfigError(
                f"config key '{where}.text_split' must be one of lines, windows. Got {src.text_split!r} instead."
            )
        if src.text_split == "windows" and src.max_length is None:
            raise ConfigError(
                f"config key '{where}.max_length' is required with text_split: windows"
            )
    if src.padding not in ("longest", "max_length"):
        raise ConfigError(
            f"config key '{where}.padding' must be one of longest, max_length. Got {src.padding!r} instead."
        )
    if src.max_length is not None and src.max_length < 2:
        raise ConfigError(
            f"config key '{where}.max_length' must be ≥ 2. Got {src.max_length} instead."
        )
    if src.padding == "max_length" and src.max_length is None:
        raise ConfigError(f"config key '{where}.max_length' is required with padding: max_length")


def overrides(
    *,
    device: str | None = None,
    seed: int | None = None,
    precision: str | None = None,
    allow_unsafe_pickle: bool | None = None,
    threads: int | str | None = None,
    budget: float | str | None = None,
) -> dict[str, Any]:
    """The config overrides of the common CLI flags / API keywords (None and False mean "not given")."""
    out: dict[str, Any] = {
        "runtime.device": device,
        "runtime.seed": seed,
        "runtime.precision": precision,
        "runtime.threads": threads,
        "runtime.budget": budget,
    }
    if allow_unsafe_pickle:
        out["runtime.allow_unsafe_pickle"] = True
    return {k: v for k, v in out.items() if v is not None}


ENV_VARS = {
    "FLATCLI_DEVICE": "runtime.device",
    "FLATCLI_SEED": "runtime.seed",
    "FLATCLI_PRECISION": "runtime.precision",
    "FLATCLI_THREADS": "runtime.threads",
    "FLATCLI_BUDGET": "runtime.budget",
    "FLATCLI_OUTPUT_DIR": "output.dir",
}
# the environment variables that set no config key (those of `ENV_VARS` do, and the CLI reads a few
# options from the environment too: ``envvar=`` in `flatcli.cli`): name -> what it does. The
# documentation's table of environment variables is generated from the three.
OTHER_ENV_VARS = {
    "FLATCLI_DATA_CACHE_MB": "MiB of data splits kept loaded at once (default 1024): a sweep over "
    "checkpoints that each bring their own `train_data` drops the least recently used past it",
    "FLATCLI_DEBUG": "set to 1 by `--debug` while the command runs (its worker processes inherit "
    "it): Hugging Face's loading progress bars show",
    "FLATCLI_SWEEP_POOL_WORKER": "set to 1 by `sweep` in the worker processes it starts (internal: "
    "a pool worker stops without a word on Ctrl-C, and the coordinator says once what is finished)",
    "FLATCLI_SWEEP_UNIT_DELAY": "a test hook: seconds every sweep unit sleeps (so that a test "
    "can interrupt a sweep mid-unit)",
}


def set_path(cfg: Config, path: str, value: Any, origin: str) -> None:
    """Set the dotted key ``path`` of ``cfg`` to ``value``, recording ``origin`` (cli, env, yaml)."""
    parts = path.split(".")
    obj = cfg
    for p in parts[:-1]:
        obj = getattr(obj, p)
    tp = _hints(type(obj))[parts[-1]]
    if (
        any(m is int for m in _members(tp))
        and isinstance(value, str)
        and value.lstrip("-").isdigit()
    ):
        value = int(value)
    f = next(f for f in dataclasses.fields(obj) if f.name == parts[-1])
    setattr(obj, parts[-1], _checked(f, path, value, tp))
    cfg.provenance[path] = origin


def _defaults_provenance(obj, prefix: str, prov: dict[str, str]) -> None:
    for f in dataclasses.fields(obj):
        if f.metadata.get("internal"):
            continue
        path = f"{prefix}.{yaml_key(f)}" if prefix else yaml_key(f)
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            _defaults_provenance(v, path, prov)
        else:
            prov.setdefault(path, "default")


def from_dict(
    raw: dict[str, Any] | None,
    *,
    base_dir: str | os.PathLike = ".",
    overrides: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    origin: str = "yaml",
) -> Config:
    """Build and validate a `Config` from a mapping, then apply env and CLI overrides."""
    prov: dict[str, str] = {}
    cfg = _build(Config, raw or {}, "", prov, origin)
    cfg.base_dir = Path(base_dir)
    cfg.provenance = prov
    env = os.environ if env is None else env
    for var, path in ENV_VARS.items():
        if var in env:
            set_path(cfg, path, env[var], f"env {var}")
    for path, value in (overrides or {}).items():
        if value is not None:
            set_path(cfg, path, value, "cli")
    _defaults_provenance(cfg, "", cfg.provenance)
    _validate(cfg)
    return cfg


def load_config(path: str | os.PathLike | None, overrides: dict[str, Any] | None = None) -> Config:
    """Read a YAML config with a safe loader (`safe_yaml`); relative paths in it resolve against its folder."""
    if path is None:
        return from_dict({}, overrides=overrides)
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    raw = read_yaml(p, "config file")
    if raw is not None and not isinstance(raw, dict):
        raise ConfigError(f"config file {p} must hold a mapping at the top level")
    cfg = from_dict(raw, base_dir=p.resolve().parent, overrides=overrides)
    cfg.path = p
    return cfg
