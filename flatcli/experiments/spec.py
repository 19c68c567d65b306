"""Experiment specs: one YAML file per experiment (``flatcli/experiments/specs/NAME.yaml``).

A spec names the models to train (a grid of hyperparameters per *study*, e.g. one study per
data set), how to train them (to a training-loss target, not for a fixed number of steps) and
what flatcli measures on them (a flatcli config without ``checkpoints``: ``model``, ``data``,
``measure_data``, ``loss``, ``measures``, ``runtime``). ``quick`` holds the overrides of the
``--quick`` mode (a tiny grid, tiny models, few steps) used by the tests.

Top-level keys: ``experiment`` (the name), ``title``, ``reference``, ``target_loss`` (train
cross-entropy in eval mode every model must reach; default 0.01), ``bootstrap`` (resamples of
the correlations' intervals; default 1000), ``plateau`` (optional: the `flatcli.training.Plateau`
criterion's ``min_accuracy``, ``window`` and ``rtol``; a model then also counts as trained when it
fits its training set with the loss on a plateau, for regularization too strong to reach
``target_loss``; such a study's models are filtered by the manifest column ``converged``,
``hp_converged`` in results.csv, instead of by train loss), ``measures``, ``model``, ``data``,
``measure_data``, ``loss``, ``runtime``, ``measure_options`` (measure name → options merged
into every configured entry of that measure, labels kept: the quick mode's cheap settings),
``training`` (`TRAINING_DEFAULTS`' keys: the `flatcli.training.Recipe` plus ``lr`` per
optimizer, ``lr_factor`` and ``label_noise``), ``grid``, ``axes``, ``color_by`` and ``compare``
(measure pairs ``"A,B"``, ``"A,*"`` for A against every other measure, whose correlations with
the gap the summary compares by ``flatcli correlate --compare A,B``) and ``subsets`` (title →
``flatcli correlate --where`` query, e.g. ``hp_dropout == 0``: those converged models correlated
and compared alone as well) (defaults for every study), ``studies`` (name → study: any of the defaults' keys), ``quick`` (overrides
merged into every study, plus ``target_loss``, ``bootstrap`` and ``rescale``; a study's own
``quick`` is merged after it), ``paper`` (the papers' numbers printed beside ours:
``statistic``, ``columns``, ``values: {measure label: [one value per column]}``, ``claims``, and
``setup``: how our setup differs from the paper's, one line each)
and ``rescale`` (the reparameterization experiment: ``transforms``, ``scales``, ``seed``).

Merging: mappings merge key by key; ``grid``, ``measures``, ``data`` and lists are replaced whole.
"""

from __future__ import annotations

import copy
import difflib
import inspect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..analysis.expressions import check_condition
from ..config import from_dict, parse_measures
from ..errors import ConfigError
from ..loading.factory import resolve_target
from ..training import LossTarget, Plateau, Recipe
from ..validation import OPTIMIZERS as OPTIMIZERS  # re-exported: the vocabulary is declared there
from ..validation import TRAINING, validate
from ..yaml_loader import read_yaml

SPEC_DIR = Path(__file__).parent / "specs"

FLATCLI_KEYS = ("model", "data", "measure_data", "loss", "measures", "runtime")
TRAINING_KEYS = (
    "optimizer", "lr", "lr_factor", "batch_size", "weight_decay", "l2", "momentum", "label_noise",
    "max_steps", "eval_every", "dtype", "device",
)  # fmt: skip
NOT_A_GRID_AXIS = ("max_steps", "eval_every", "dtype", "device")
STUDY_KEYS = (
    *FLATCLI_KEYS,
    "measure_options",
    "training",
    "grid",
    "axes",
    "color_by",
    "compare",
    "subsets",
    "title",
)
TOP_KEYS = (
    "experiment", "title", "reference", "target_loss", "plateau", "bootstrap", *STUDY_KEYS, "studies", "quick", "paper",
    "rescale",
)  # fmt: skip
QUICK_KEYS = (*STUDY_KEYS, "target_loss", "plateau", "bootstrap", "rescale")
PLATEAU_KEYS = ("min_accuracy", "window", "rtol")
PAPER_KEYS = ("statistic", "columns", "values", "claims", "setup")
RESCALE_KEYS = ("transforms", "scales", "seed")
BOOTSTRAP = 1000  # resamples of the percentile intervals in correlations.csv (seed 0)
MIN_BOOTSTRAP = 100  # the fewest `flatcli correlate --bootstrap` takes for 95% intervals
WHOLE = ("grid", "measures", "data")  # replaced whole when merged
TRAINING_DEFAULTS: dict[str, Any] = {
    "optimizer": "sgd",
    "lr": 0.01,
    "lr_factor": 1.0,
    "batch_size": 32,
    "weight_decay": 0.0,
    "l2": 0.0,
    "momentum": 0.9,
    "label_noise": 0.0,
    "max_steps": 20000,
    "eval_every": None,  # None: once per epoch
    "dtype": "float32",
    "device": "cpu",
}


@dataclass
class Study:
    """One set of models: trained over ``grid``, measured with the flatcli config ``flatcli``."""

    name: str
    title: str
    flatcli: dict[str, Any]  # a flatcli config without checkpoints
    training: dict[str, Any]  # TRAINING_DEFAULTS overridden by the spec
    grid: dict[str, list[Any]]  # axis → values (full product); always has 'seed'
    axes: list[str]  # the hyperparameter axes for Ψ and CMI (correlate --by)
    color_by: str | None
    model_axes: list[str] = field(default_factory=list)  # grid keys passed to the model as kwargs
    data_axes: list[str] = field(
        default_factory=list
    )  # grid keys set in data.train.kwargs (per-model training sets)
    compare: list[tuple[str, str]] = field(
        default_factory=list
    )  # measure pairs for `flatcli correlate --compare`
    subsets: dict[str, str] = field(
        default_factory=dict
    )  # title → a condition on results.csv (`--where`): the models also analysed alone

    def points(self) -> list[dict[str, Any]]:
        """Every grid point, in a fixed order (the last key varies fastest)."""
        import itertools

        keys = list(self.grid)
        return [
            dict(zip(keys, vals, strict=True)) for vals in itertools.product(*self.grid.values())
        ]

    def recipe(self, hp: dict[str, Any], device: str | None = None) -> tuple[Recipe, float | None]:
        """The training recipe of grid point ``hp`` (its training axes override ``training``) and
        its label-noise fraction (None: the data's own labels). The learning rate is ``lr`` (or
        ``lr[optimizer]``) × ``lr_factor``; ``device`` overrides ``training.device``."""
        t = {**self.training, **{k: v for k, v in hp.items() if k in self.training}}
        lr = t["lr"][t["optimizer"]] if isinstance(t["lr"], dict) else t["lr"]
        recipe = Recipe(
            optimizer=t["optimizer"], lr=float(lr) * float(t["lr_factor"]), momentum=float(t["momentum"]),
            batch_size=int(t["batch_size"]), weight_decay=float(t["weight_decay"]), l2=float(t["l2"]),
            max_steps=int(t["max_steps"]), eval_every=t["eval_every"], dtype=t["dtype"], device=device or t["device"],
        )  # fmt: skip
        noise = float(t["label_noise"]) if "label_noise" in hp or t["label_noise"] > 0 else None
        return recipe, noise


@dataclass
class Spec:
    """A loaded experiment spec: its studies (full or quick), target loss, the papers' numbers."""

    name: str
    title: str
    reference: str
    target_loss: float
    studies: list[Study]
    paper: dict[str, Any]
    rescale: dict[str, Any] | None
    quick: bool
    path: Path
    bootstrap: int = BOOTSTRAP  # resamples of the bootstrap intervals (0: none)
    plateau: dict[str, Any] | None = None  # Plateau's settings; None: LossTarget

    @property
    def criterion(self) -> LossTarget | Plateau:
        """When a model counts as trained: its train cross-entropy ≤ ``target_loss`` (eval mode),
        or, with ``plateau``, that or 100% train accuracy on a plateau (`flatcli.training.Plateau`)."""
        if self.plateau is not None:
            return Plateau(self.target_loss, **self.plateau)
        return LossTarget(self.target_loss)


def available() -> list[str]:
    """The names of the shipped experiment specs."""
    return sorted(p.stem for p in SPEC_DIR.glob("*.yaml"))


def _unknown(key: str, valid: tuple[str, ...] | list[str], where: str) -> ConfigError:
    hint = difflib.get_close_matches(str(key), list(valid), n=1)
    msg = f"{where}: unknown key {key!r}."
    return ConfigError(
        msg + (f" Did you mean {hint[0]!r}?" if hint else f" Valid keys: {', '.join(valid)}.")
    )


def _check_keys(d: Any, valid, where: str) -> dict[str, Any]:
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise ConfigError(f"{where} must be a mapping. Got {type(d).__name__} instead.")
    for k in d:
        if k not in valid:
            raise _unknown(k, valid, where)
    return d


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` merged into a copy of ``base``: mappings key by key; grid, measures, data and lists whole."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k not in WHOLE:
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _resolve_path(name_or_path: str | Path) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.is_file():
        if not p.is_file():
            raise ConfigError(f"experiment spec not found: {p}")
        return p
    names = available()
    if str(name_or_path) not in names:
        hint = difflib.get_close_matches(str(name_or_path), names, n=1)
        raise ConfigError(
            f"unknown experiment {str(name_or_path)!r}"
            + (f"; did you mean {hint[0]!r}?" if hint else ".")
            + f" Available: {', '.join(names)} (or a spec YAML file)."
        )
    return SPEC_DIR / f"{name_or_path}.yaml"


def load_spec(name_or_path: str | Path, quick: bool = False) -> Spec:
    """Read, merge and validate a spec (a shipped experiment's name or a YAML path)."""
    path = _resolve_path(name_or_path)
    raw = read_yaml(path, "experiment spec")
    where = path.name
    raw = _check_keys(raw, TOP_KEYS, where)
    name = raw.get("experiment")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: 'experiment' (the experiment's name) is required")
    quick_over = _check_keys(raw.get("quick"), QUICK_KEYS, f"{where}: quick")
    targets = (
        raw.get("target_loss", 0.01),
        quick_over.get("target_loss", raw.get("target_loss", 0.01)),
    )
    for t in targets:
        validate("target_loss", t, f"{where}: target_loss", rules=TRAINING)
    target = targets[1] if quick else targets[0]
    plateau = [_plateau(raw.get("plateau"), target, where)]
    if "plateau" in quick_over:
        plateau.append(
            _plateau(
                merge(raw.get("plateau") or {}, quick_over["plateau"] or {}),
                target,
                f"{where}: quick",
            )
        )
    plateau = plateau[-1] if quick else plateau[0]
    defaults = {k: raw[k] for k in STUDY_KEYS if k in raw}
    studies_raw = _check_keys(
        raw.get("studies"), list(raw.get("studies") or {}), f"{where}: studies"
    )
    if not studies_raw:
        raise ConfigError(f"{where}: 'studies' must name at least one study")
    studies = []
    for sname, sraw in studies_raw.items():
        swhere = f"{where}: studies.{sname}"
        sraw = _check_keys(sraw, (*STUDY_KEYS, "quick"), swhere)
        full = merge(defaults, {k: v for k, v in sraw.items() if k != "quick"})
        small = merge(full, {k: v for k, v in quick_over.items() if k in STUDY_KEYS})
        small = merge(small, _check_keys(sraw.get("quick"), STUDY_KEYS, f"{swhere}.quick"))
        # both modes are validated, whichever runs: the quick tests catch a broken full spec
        built = [
            _study(str(sname), full, swhere, path.parent),
            _study(str(sname), small, f"{swhere} (quick)", path.parent),
        ]
        studies.append(built[1] if quick else built[0])
    rescale = raw.get("rescale")
    if "rescale" in quick_over:
        quick_rescale = _rescale(
            merge(rescale or {}, quick_over["rescale"]), f"{where}: quick.rescale"
        )
        rescale = quick_rescale if quick else rescale
    return Spec(
        name=name,
        title=str(raw.get("title", name)),
        reference=str(raw.get("reference", "")),
        target_loss=float(target),
        studies=studies,
        paper=_paper(raw.get("paper"), f"{where}: paper"),
        rescale=_rescale(rescale, f"{where}: rescale") if rescale is not None else None,
        quick=quick,
        plateau=plateau,
        path=path,
        bootstrap=_bootstrap(
            quick_over.get("bootstrap", raw.get("bootstrap", BOOTSTRAP))
            if quick
            else raw.get("bootstrap", BOOTSTRAP),
            where,
        ),
    )


def _plateau(raw: Any, target: float, where: str) -> dict[str, Any] | None:
    """The ``plateau`` mapping, checked by building the criterion (None when absent)."""
    if raw is None:
        return None
    p = _check_keys(raw, PLATEAU_KEYS, f"{where}: plateau")
    try:
        Plateau(float(target), **p)
    except TypeError as e:
        raise ConfigError(f"{where}: plateau: {e}") from None
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    return dict(p)


def _bootstrap(v: Any, where: str) -> int:
    """0 (no intervals) or at least the 100 resamples `flatcli correlate` takes for a 95% interval."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 0 or 0 < v < MIN_BOOTSTRAP:
        raise ConfigError(
            f"{where}: bootstrap must be 0 (no intervals) or an int ≥ {MIN_BOOTSTRAP} (resamples: a 95% "
            f"percentile interval needs 5 / 0.05). Got {v!r} instead."
        )
    return v


def _as_list(v: Any) -> list[Any]:
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _model_params(target: str, base_dir: Path) -> tuple[set[str], bool]:
    """The model factory's parameter names and whether it takes **kwargs."""
    fn = resolve_target(target, base_dir)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return set(), True
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    return set(sig.parameters), var_kw


def _flatcli_part(s: dict[str, Any], where: str, base_dir: Path) -> dict[str, Any]:
    """The study's flatcli config (measure_options applied), validated by flatcli's own schema."""
    flat = {k: s[k] for k in FLATCLI_KEYS if k in s}
    if s.get("measure_options"):
        flat["measures"] = _with_options(
            flat.get("measures") or [], s["measure_options"], f"{where}.measure_options"
        )
    if "model" not in flat or "data" not in flat:
        raise ConfigError(f"{where}: 'model' and 'data' are required")
    try:
        from_dict({**flat, "checkpoints": []}, base_dir=base_dir, env={})
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    if not flat.get("measures"):
        raise ConfigError(f"{where}: 'measures' must list at least one measure")
    return flat


def _grid_axis(
    k: str,
    vals: list[Any],
    training: dict[str, Any],
    model: tuple[set[str], bool, str],
    where: str,
    data_keys: set[str] = frozenset(),
) -> bool:
    """Validate one grid axis; True when it is an argument of the model (passed as a model kwarg).
    A key of ``data.train.kwargs`` (``data_keys``) is valid too: a data axis, possibly also a model argument."""
    if not vals:
        raise ConfigError(f"{where}.grid.{k} must hold at least one value")
    if len(set(map(repr, vals))) != len(vals):
        raise ConfigError(f"{where}.grid.{k} repeats a value: {vals}")
    params, var_kw, target = model
    if k == "seed":
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in vals):
            raise ConfigError(f"{where}.grid.seed must be a list of ints. Got {vals} instead.")
        return False
    if k in TRAINING_KEYS:
        if k in NOT_A_GRID_AXIS:
            raise ConfigError(
                f"{where}.grid.{k}: {k} is a training setting, not a grid axis; set it under 'training'"
            )
        for x in vals:
            _check_training({**training, k: x}, f"{where}.grid.{k}")
        return False
    if k in params or (var_kw and k not in data_keys):
        return True
    if k in data_keys:
        return False
    valid = sorted(
        {"seed", *(t for t in TRAINING_KEYS if t not in NOT_A_GRID_AXIS), *params, *data_keys}
        - {"self"}
    )
    raise _unknown(
        k,
        valid,
        f"{where}.grid (training settings, 'seed', keys of data.train.kwargs or arguments of {target})",
    )


def _data_keys(flat: dict[str, Any], where: str) -> set[str]:
    """The keys of ``data.train.kwargs``: grid axes that give each model its own training set. A key
    that ``data.test.kwargs`` sets too cannot vary: every model of a study shares the test set."""
    data = flat.get("data") or {}
    keys = set(((data.get("train") or {}).get("kwargs")) or {})
    shared = keys & set(((data.get("test") or {}).get("kwargs")) or {})
    return keys - shared


def _axes(
    s: dict[str, Any], grid: dict[str, list[Any]], where: str
) -> tuple[list[str], str | None]:
    """The Ψ/CMI axes (default: every grid key but seed with several values) and the colour axis."""
    if s.get("axes") is None:
        axes = [k for k, v in grid.items() if k != "seed" and len(v) > 1]
    else:
        axes = [str(a) for a in _as_list(s["axes"])]
        for a in axes:
            if a not in grid:
                raise ConfigError(f"{where}.axes: {a!r} is not a grid axis ({', '.join(grid)})")
    color_by = s.get("color_by")
    if color_by is not None and color_by not in grid:
        raise ConfigError(f"{where}.color_by: {color_by!r} is not a grid axis ({', '.join(grid)})")
    return axes, color_by if color_by is not None else (axes[0] if axes else None)


def _study(name: str, s: dict[str, Any], where: str, base_dir: Path) -> Study:
    """One merged study mapping → a validated `Study`."""
    flat = _flatcli_part(s, where, base_dir)
    training = dict(TRAINING_DEFAULTS)
    training.update(_check_keys(s.get("training"), TRAINING_KEYS, f"{where}.training"))
    _check_training(training, f"{where}.training")
    grid_raw = s.get("grid") or {}
    if not isinstance(grid_raw, dict):
        raise ConfigError(f"{where}.grid must be a mapping of axis → list of values")
    target = flat["model"]["target"]
    model = (*_model_params(target, base_dir), target)
    grid = {str(k): _as_list(v) for k, v in grid_raw.items()}
    data_keys = _data_keys(flat, where)
    model_axes = [
        k for k, vals in grid.items() if _grid_axis(k, vals, training, model, where, data_keys)
    ]
    data_axes = [k for k in grid if k in data_keys]
    grid.setdefault("seed", [0])
    axes, color_by = _axes(s, grid, where)
    compare = _compare(s.get("compare"), flat["measures"], f"{where}.compare")
    subsets = _check_keys(s.get("subsets"), list(s.get("subsets") or {}), f"{where}.subsets")
    for title, expr in subsets.items():
        if not isinstance(expr, str) or not expr.strip():
            raise ConfigError(
                f"{where}.subsets.{title} must be a condition on results.csv, e.g. 'hp_dropout == 0'. Got {expr!r} instead."
            )
        check_condition(expr, f"{where}.subsets.{title}")  # the grammar, before any training
    return Study(
        name,
        str(s.get("title", name)),
        flat,
        training,
        grid,
        axes,
        color_by,
        model_axes,
        data_axes,
        compare,
        {str(k): str(v) for k, v in subsets.items()},
    )


def _compare(raw: Any, measures: list[Any], where: str) -> list[tuple[str, str]]:
    """Measure pairs (``"A,B"`` or ``[A, B]``; ``B = "*"``: A against every other measure), by label."""
    if raw is None:
        return []
    labels = [m.label for m in parse_measures(measures)]
    out: list[tuple[str, str]] = []
    for item in _as_list(raw):
        pair = [
            str(x).strip() for x in (item.split(",") if isinstance(item, str) else _as_list(item))
        ]
        if len(pair) != 2 or pair[0] == pair[1]:
            raise ConfigError(
                f"{where}: each entry must name two different measures, 'A,B' or [A, B]. Got {item!r} instead."
            )
        for lab in pair[:1] + ([] if pair[1] == "*" else pair[1:]):
            if lab not in labels:
                hint = difflib.get_close_matches(lab, labels, n=1)
                raise ConfigError(
                    f"{where}: {lab!r} is not a measure label of the study"
                    + (f"; did you mean {hint[0]!r}?" if hint else f" ({', '.join(labels)})")
                )
        bs = [b for b in labels if b != pair[0]] if pair[1] == "*" else [pair[1]]
        out += [(pair[0], b) for b in bs if (pair[0], b) not in out and (b, pair[0]) not in out]
    return out


def _with_options(measures: list[Any], options: Any, where: str) -> list[Any]:
    """Every entry of a measure named in ``options`` with those options merged in (label kept)."""
    if not isinstance(options, dict):
        raise ConfigError(f"{where} must be a mapping measure name → options")
    names = [
        m if isinstance(m, str) else next(iter(m)) if isinstance(m, dict) and len(m) == 1 else None
        for m in measures
    ]
    for k, v in options.items():
        if k not in names:
            raise ConfigError(
                f"{where}: {k!r} is not among the configured measures ({', '.join(map(str, names))})"
            )
        if not isinstance(v, dict):
            raise ConfigError(f"{where}.{k} must be a mapping of options")
    out = []
    for m, name in zip(measures, names, strict=True):
        if name in options:
            own = {} if isinstance(m, str) else dict(m[name] or {})
            out.append(
                {
                    name: {
                        **own,
                        **options[name],
                        **({"label": own["label"]} if "label" in own else {}),
                    }
                }
            )
        else:
            out.append(m)
    return out


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_training(t: dict[str, Any], where: str) -> None:
    """The ``training`` keys, each with its rule in `flatcli.validation.TRAINING` (the rules
    `flatcli.training.Recipe` checks too); ``lr`` may also be a mapping optimizer → lr."""
    validate("optimizer", t["optimizer"], f"{where}: optimizer", rules=TRAINING)
    lr = t["lr"]
    if isinstance(lr, dict):
        for k, v in lr.items():
            if k not in OPTIMIZERS:
                raise _unknown(k, OPTIMIZERS, f"{where}.lr (a learning rate per optimizer)")
            validate("lr", v, f"{where}.lr.{k}", rules=TRAINING)
        if t["optimizer"] not in lr:
            raise ConfigError(f"{where}.lr gives no learning rate for optimizer {t['optimizer']!r}")
    else:
        validate("lr", lr, f"{where}: lr", rules=TRAINING)
    for k in TRAINING_KEYS:
        if k not in ("optimizer", "lr"):
            validate(k, t[k], f"{where}: {k}", rules=TRAINING)


def _paper(raw: Any, where: str) -> dict[str, Any]:
    p = _check_keys(raw, PAPER_KEYS, where)
    cols = [str(c) for c in _as_list(p.get("columns", []))]
    values = _check_keys(p.get("values"), list((p.get("values") or {}).keys()), f"{where}.values")
    for lab, vals in values.items():
        vals = _as_list(vals)
        if len(vals) != len(cols):
            raise ConfigError(
                f"{where}.values.{lab} has {len(vals)} values for {len(cols)} columns"
            )
    return {
        "statistic": str(p.get("statistic", "pearson")),
        "columns": cols,
        "values": {str(k): _as_list(v) for k, v in values.items()},
        "claims": [str(c) for c in _as_list(p.get("claims", []))],
        "setup": [str(c) for c in _as_list(p.get("setup", []))],
    }


def _rescale(raw: Any, where: str) -> dict[str, Any]:
    r = _check_keys(raw, RESCALE_KEYS, where)
    transforms = [str(t) for t in _as_list(r.get("transforms", ["layer", "node"]))]
    for t in transforms:
        if t not in ("layer", "node"):
            raise ConfigError(
                f"{where}.transforms: each must be 'layer' or 'node'. Got {t!r} instead."
            )
    scales = _as_list(r.get("scales", [10, 100, 1000]))
    for a in scales:
        if not (_num(a) and a > 1):
            raise ConfigError(f"{where}.scales: each must be a number > 1. Got {a!r} instead.")
    seed = r.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ConfigError(f"{where}.seed must be an int. Got {seed!r} instead.")
    return {"transforms": transforms, "scales": [float(a) for a in scales], "seed": seed}
