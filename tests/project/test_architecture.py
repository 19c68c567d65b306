"""The layering rules of docs/architecture.md, checked on the source tree.

* No module outside ``flatcli/measures/`` names a measure (registry hooks carry the rules).
* Nothing below the CLI imports ``flatcli.cli`` (entry-point ``__main__`` modules excepted).
* The engine knows nothing of measures.
* No import cycles between flatcli modules (imports inside functions count too).
* No public estimator of ``flatcli.engine.linalg`` takes more than 8 parameters.
* Curvatures and the product loop receive a ``ProductContext``, never the engine.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from pathlib import Path

import pytest

from flatcli.measures import list_measures

PKG = Path(__file__).resolve().parents[2] / "flatcli"


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.with_suffix("").relative_to(PKG.parent).parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


MODULES = _modules()


@functools.cache
def _tree(path: Path) -> ast.Module:
    """A module's syntax tree, parsed once for every test of this file (none modifies it)."""
    return ast.parse(path.read_text())


@functools.cache
def _imports(name: str, typing_too: bool = False) -> frozenset[str]:
    """flatcli modules imported anywhere in module ``name`` (function-level imports included;
    ``typing_too``: also those under ``if TYPE_CHECKING:``)."""
    path = MODULES[name]
    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    tree = _tree(path)
    typing_only = {  # `if TYPE_CHECKING:` imports exist for annotations only: no runtime edge
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only and not typing_too:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                stem = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(stem + ([node.module] if node.module else []))
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
            ]
        else:
            continue
        found |= {t for t in targets if t in MODULES and t != name}
    return frozenset(found)


def _string_constants(path: Path) -> set[str]:
    """String literals of a module, docstrings excluded."""
    tree = _tree(path)
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docs.add(id(body[0].value))
    return {
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
    }


@pytest.mark.slow
def test_no_module_outside_measures_names_a_measure():
    names = {m.name for m in list_measures()}
    offenders = {}
    for mod, path in MODULES.items():
        if mod == "flatcli.measures" or mod.startswith("flatcli.measures."):
            continue
        hit = names & _string_constants(path)
        if hit:
            offenders[mod] = sorted(hit)
    assert not offenders, f"measure names outside flatcli/measures/: {offenders}"


def test_nothing_below_the_cli_imports_it():
    """Only the entry point ``flatcli.__main__`` imports the CLI; the ``python -m flatcli.sweep`` and
    ``python -m flatcli.experiments`` aliases call it (`flatcli.__main__.run`) and import nothing
    else of flatcli, and nothing but a ``__main__`` module imports it."""
    entry = "flatcli.__main__"
    cli = [m for m in MODULES if m == "flatcli.cli" or m.startswith("flatcli.cli.")]
    bad = [m for m in MODULES if m != entry and m not in cli and any(i in cli for i in _imports(m))]
    assert not bad, f"modules importing flatcli.cli: {bad}"
    aliases = {
        m for m in MODULES if m.endswith(".__main__") and m not in (entry, "flatcli.cli.__main__")
    }
    assert aliases == {"flatcli.sweep.__main__", "flatcli.experiments.__main__"}
    assert {m: _imports(m) for m in aliases} == {m: {entry} for m in aliases}
    users = {m for m in MODULES if entry in _imports(m)}
    assert users == aliases, users


# what flatcli.api may import of the folders it wraps: their package, and only its public names
WRAPPED = ("flatcli.landscape", "flatcli.sweep")


def _reaches(tree: ast.Module, module: str, public: dict[str, set[str]]) -> list[str]:
    """The imports of ``module`` (syntax ``tree``) into a folder of `WRAPPED` other than its
    package's public names (``public``: package → its ``__all__``): ``from flatcli.sweep.store import
    x``, ``from flatcli.sweep import _private_or_unlisted``, ``import flatcli.sweep.store``, ``from
    flatcli import sweep`` (which reaches the modules by attribute)."""
    pkg = module.split(".")[:-1]
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            found += [
                f"{n.lineno}: import {a.name}"
                for a in n.names
                if any(a.name == w or a.name.startswith(w + ".") for w in WRAPPED)
            ]
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                base = ".".join(pkg[: len(pkg) - (n.level - 1)] + ([n.module] if n.module else []))
            names = [a.name for a in n.names]
            if base == "flatcli":
                found += [
                    f"{n.lineno}: from flatcli import {a}"
                    for a in names
                    if f"flatcli.{a}" in WRAPPED
                ]
            elif base in WRAPPED:
                found += [f"{n.lineno}: {a} from {base}" for a in names if a not in public[base]]
            elif any(base.startswith(w + ".") for w in WRAPPED):
                found.append(f"{n.lineno}: from {base} import {', '.join(names)}")
    return found


def _public_names() -> dict[str, set[str]]:
    import importlib

    return {w: set(importlib.import_module(w).__all__) for w in WRAPPED}


def test_the_api_uses_landscape_and_sweep_through_their_entry_points():
    """flatcli/api/ imports the landscape and the sweep only from their packages (``from ..sweep
    import run_sweep``), and only names of their ``__all__``: no reach into a module
    (``landscape.plots``, ``sweep.store``); what both need sits at the bottom (`flatcli.locks`,
    `flatcli.extras`)."""
    public = _public_names()
    found = {
        m: hits
        for m, path in MODULES.items()
        if m.startswith("flatcli.api") and (hits := _reaches(_tree(path), m, public))
    }
    assert not found, found


def test_the_entry_point_check_finds_reaches():
    """`_reaches` flags each way into a wrapped folder's modules, and passes the public names."""
    public = {"flatcli.landscape": {"SliceView"}, "flatcli.sweep": {"collect", "run_sweep"}}
    src = """
from ..sweep import collect, run_sweep
from ..landscape import SliceView
from ..run.results import Row
from ..sweep.store import hold_folder
from ..landscape.plots import PLOT_HINT
from ..sweep import Store
from flatcli.sweep.runner import SweepOptions
import flatcli.landscape.plots
from .. import sweep
def f():
    from ..sweep import worker
"""
    hits = _reaches(ast.parse(src), "flatcli.api.measure", public)
    assert [h.split(":")[0] for h in hits] == ["5", "6", "7", "8", "9", "10", "12"], hits


# the bottom of the import graph, which the engine may use: they import nothing of flatcli but each other
# (flatcli.validation, the one validation vocabulary, raises flatcli.errors' ConfigError)
LEAVES = ("flatcli.errors", "flatcli.engine.linalg.sem", "flatcli.validation")


def test_engine_knows_nothing_of_measures():
    bad = {
        m: sorted(i for i in _imports(m) if not i.startswith("flatcli.engine") and i not in LEAVES)
        for m in MODULES
        if m.startswith("flatcli.engine")
    }
    assert not any(bad.values()), bad
    assert all(i in LEAVES for leaf in LEAVES for i in _imports(leaf, typing_too=True))


def test_one_standard_error_of_a_mean():
    """Every estimator takes its standard error from `flatcli.engine.linalg.sem` (issue 28): no ``std(...,
    ddof=1)`` / ``unbiased=True`` / ``sqrt(len(`` idiom left in the engine's estimators or the measures."""
    pat = re.compile(r"ddof\s*=\s*1|unbiased\s*=\s*True|/\s*(?:math\.|np\.)?sqrt\(\s*len\(")
    offenders = [
        str(f.relative_to(PKG))
        for f in sorted(PKG.rglob("*.py"))
        if f.name != "sem.py" and pat.search(f.read_text())
    ]
    assert not offenders, f"standard errors written by hand: {offenders}"


def test_the_vocabulary_sits_at_the_bottom():
    """flatcli.validation (the one validation vocabulary) imports nothing of flatcli but the errors."""
    assert _imports("flatcli.validation", typing_too=True) <= {"flatcli.errors"}
    assert _imports("flatcli.errors", typing_too=True) == frozenset()


def _vocabularies() -> dict[str, frozenset[str]]:
    """The allowed-values sets of the rules of flatcli.validation with at least two strings."""
    from flatcli.validation import SETTINGS, TRAINING, Either, OneOf, Optional

    def sets(check):
        if isinstance(check, OneOf):
            yield frozenset(v for v in check.values if isinstance(v, str))
        inners = (
            check.checks
            if isinstance(check, Either)
            else (check.inner,)
            if isinstance(check, Optional)
            else ()
        )
        for inner in inners:
            yield from sets(inner)

    out = {}
    for table, rules in (("SETTINGS", SETTINGS), ("TRAINING", TRAINING)):
        for name, rule in rules.items():
            for s in sets(rule.check):
                if len(s) >= 2:
                    out[f"{table}[{name!r}]"] = s
    from flatcli import validation

    for name in ("FORMATS", "EXECUTORS"):  # STATS and TRANSFORMS: titles per value are data
        out[name] = frozenset(getattr(validation, name))
    return out


def _literal_string_sets(tree: ast.AST):
    """(line, strings) of every tuple, list or set literal and every dict literal's keys made of
    two or more string constants."""
    for n in ast.walk(tree):
        elts = (
            n.elts
            if isinstance(n, (ast.Tuple, ast.List, ast.Set))
            else n.keys
            if isinstance(n, ast.Dict)
            else None
        )
        if (
            elts
            and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in elts)
            and len(elts) >= 2
        ):
            yield n.lineno, frozenset(e.value for e in elts)


def test_allowed_values_are_spelled_out_once():
    """No module but flatcli.validation spells out the allowed values of a shared setting (a literal
    tuple, list, set or dict keys holding all of them: ``("cross_entropy", "mse", "causal_lm")``,
    ``("sgd", "adam", "adamw")``): a second copy would drift; import the rule or its tuple instead.
    (A subset is logic, not a copy: ``("cross_entropy", "mse")`` for a measure that applies to two
    losses, ``("bf16", "tf32")`` for the precisions that verify.)"""
    vocab = _vocabularies()
    assert {
        "SETTINGS['loss']",
        "SETTINGS['precision']",
        "SETTINGS['hvp_mode']",
        "TRAINING['optimizer']",
    } <= set(vocab)
    split = vocab.pop(
        "SETTINGS['split']"
    )  # train/test also name data splits everywhere: only as the rule's copy
    found = []
    for mod, path in MODULES.items():
        if mod == "flatcli.validation":
            continue
        for line, strings in _literal_string_sets(_tree(path)):
            hits = [name for name, allowed in vocab.items() if allowed <= strings]
            if hits:
                found.append(f"{mod}:{line}: {sorted(strings)} repeats {', '.join(hits)}")
    assert not found, found
    assert split == {"train", "test"}


def test_no_enum_spells_out_a_value_list():
    """No Enum class in flatcli lists string members literally (``table = "table"``): the CLI's
    choices are built from the vocabulary tuples (`flatcli.cli._app._choices`), so a new precision
    or format is added in one place. (An IntEnum of numbers, `flatcli.errors.ExitCode`, is itself
    the one declaration of its values.)"""
    found = []
    for mod, path in MODULES.items():
        for n in ast.walk(_tree(path)):
            if isinstance(n, ast.ClassDef) and any(
                (isinstance(b, ast.Name) and b.id.endswith("Enum"))
                or (isinstance(b, ast.Attribute) and b.attr.endswith("Enum"))
                for b in n.bases
            ):
                members = [
                    s
                    for s in n.body
                    if isinstance(s, ast.Assign)
                    and isinstance(s.value, ast.Constant)
                    and isinstance(s.value.value, str)
                ]
                if len(members) >= 2:
                    found.append(f"{mod}:{n.lineno}: {n.name}")
    assert not found, found


def test_cli_choices_are_the_vocabulary():
    """Each CLI choice Enum holds exactly its vocabulary tuple, in order."""
    from flatcli import validation as V
    from flatcli.cli import _app

    pairs = {
        _app.Format: V.FORMATS,
        _app.BiasBN: V.BIAS_BN,
        _app.Transform: V.TRANSFORMS,
        _app.Executor: V.EXECUTORS,
        _app.SortBy: V.STATS,
        _app.Precision: V.PRECISIONS,
    }
    for enum, values in pairs.items():
        assert tuple(m.value for m in enum) == values, enum


def test_config_settings_and_spec_take_their_rules_from_the_vocabulary():
    """The config sections, `Settings`, the experiment spec, the training recipe and the engine's
    constructors call `flatcli.validation.validate` (the rule, not a copy of it)."""
    callers = {
        "flatcli.config",
        "flatcli.run.settings",
        "flatcli.experiments.spec",
        "flatcli.training",
        "flatcli.threads",
        "flatcli.engine.facade",
        "flatcli.engine.products",
        "flatcli.engine.losses",
        "flatcli.engine.precision",
        "flatcli.engine.recompute",
    }
    missing = sorted(
        m
        for m in callers
        if "flatcli.validation" not in _imports(m)
        or "validate"
        not in {n.id for n in ast.walk(_tree(MODULES[m])) if isinstance(n, ast.Name)}
        | {n.attr for n in ast.walk(_tree(MODULES[m])) if isinstance(n, ast.Attribute)}
    )
    assert not missing, missing


def test_the_loss_registry_matches_its_rule():
    from flatcli.engine.losses import LOSSES
    from flatcli.validation import LOSS_NAMES

    assert tuple(LOSSES) == LOSS_NAMES


@pytest.mark.parametrize("typing_too", [False, True], ids=["runtime", "with-type-checking"])
def test_no_import_cycles(typing_too):
    """No import cycles; none either through annotation-only (``TYPE_CHECKING``) imports, which
    would mean two modules know each other's types (a result that knows its plots)."""
    edges = {m: _imports(m, typing_too) for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


DERIVATIVES = {
    "grad",
    "jvp",
    "vjp",
    "vmap",
    "hessian",
    "jacrev",
    "jacfwd",
    "grad_and_value",
    "linearize",
}


def _autograd_uses(tree: ast.AST) -> set[str]:
    """torch.autograd, torch.func derivative transforms and .backward() used in a module
    (torch.func.functional_call, a plain forward pass, is not a derivative)."""
    hits = set()
    for n in ast.walk(tree):
        text = ast.unparse(n) if isinstance(n, (ast.Attribute, ast.Import, ast.ImportFrom)) else ""
        if "torch.autograd" in text or "functorch" in text:
            hits.add(text)
        if isinstance(n, ast.ImportFrom) and n.module == "torch.func":
            hits |= {f"torch.func.{a.name}" for a in n.names if a.name in DERIVATIVES}
        if (
            isinstance(n, ast.Attribute)
            and n.attr in DERIVATIVES
            and ast.unparse(n.value) == "torch.func"
        ):
            hits.add(text)
        if isinstance(n, ast.Attribute) and n.attr == "backward":
            hits.add(text)
    return hits


def test_measures_import_no_autograd():
    """Statically: no module under flatcli/measures/ reaches for autograd or torch.func derivatives."""
    offenders = {
        m: sorted(h)
        for m, p in MODULES.items()
        if m.startswith("flatcli.measures") and (h := _autograd_uses(_tree(p)))
    }
    assert not offenders, f"autograd outside the engine: {offenders}"


def test_every_measure_computes_its_derivatives_through_the_engine(monkeypatch):
    """Dynamically: over the whole catalogue on a tiny model, every call of torch.autograd.grad
    comes from flatcli/engine/ (the measures only drive the engine)."""
    import torch
    from torch import nn

    from flatcli.run.measuring import measure_model

    real = torch.autograd.grad
    callers: set[str] = set()

    def watched(*args, **kwargs):
        frame = sys._getframe(1)  # the caller's frames, without inspect.stack's source reading
        while frame is not None:
            f = frame.f_code.co_filename.replace("\\\\", "/")
            if "/torch/" not in f:
                callers.add(f)
                break
            frame = frame.f_back
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", watched)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(12, 4, dtype=torch.float64), torch.randint(0, 3, (12,))
    small = {
        "hessian_trace": {"min_probes": 8, "max_probes": 8},
        "weightwatcher_alpha": {"min_evals": 3},
        "sharpness_worst": {"steps": 2},
        "pacbayes_flatness": {"samples": 2, "depth": 3},
        "hessian_spectrum": {"slq_runs": 2, "slq_steps": 5},
        "local_entropy": {"slq_runs": 2, "slq_steps": 5},
        "ns_bound": {"mc_samples": 5},
        "feature_robustness": {"samples": 2, "curve": 1},
    }
    specs = [{m.name: small.get(m.name, {})} for m in list_measures()]
    init = {k: v + 0.1 for k, v in model.state_dict().items()}
    row = measure_model(model, (x, y), specs, precision="fp64", batch_size=6, init_state=init)
    assert row.status == "ok", row.errors
    engine = str(PKG / "engine")
    assert callers and all(c.startswith(engine) for c in callers), sorted(callers)


def test_modules_stay_under_700_lines():
    """No module over 700 lines: a larger one is split along its responsibilities (as linalg,
    correlation, the sweep runner, the CLI and the API were)."""
    big = {
        mod: n for mod, path in MODULES.items() if (n := len(path.read_text().splitlines())) > 700
    }
    assert not big, big


def test_functions_stay_short():
    """No function body over 85 lines of `ruff format`-ed code (the signature is not counted: a
    Typer command declares one option per line), and no docstring over 60 lines (a numpydoc
    ``Parameters`` section is documentation, not code, so it is not added to the code's count);
    ruff's complexity rules do the rest. Long derivations and proofs go to the module docstring
    (`lanczos`'s near-zero floor, `checked_gauss_newton_diagonal`'s false-pass bound)."""
    long = []
    for mod, path in MODULES.items():
        for n in ast.walk(_tree(path)):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = n.body
                doc = (
                    body[0]
                    if body
                    and isinstance(body[0], ast.Expr)
                    and isinstance(getattr(body[0], "value", None), ast.Constant)
                    else None
                )
                code_from = body[1].lineno if doc and len(body) > 1 else body[0].lineno
                code = n.end_lineno - code_from + 1
                docs = (doc.end_lineno - doc.lineno + 1) if doc else 0
                if docs > 60 or code > 85:
                    long.append(f"{mod}.{n.name}: {docs} lines of docstring, {code} of code")
    assert not long, long


def test_no_flag_text_in_raises_below_the_cli():
    """Errors below cli.py name API parameters (```where```), never command-line flags: cli.py alone
    turns them into flags (`flatcli.cli.cli_message`), so Python users never read of a flag."""
    import re

    found = []
    for mod, path in MODULES.items():
        if mod == "flatcli.cli" or mod.startswith("flatcli.cli.") or mod.endswith("__main__"):
            continue
        for n in ast.walk(_tree(path)):
            if isinstance(n, ast.Raise) and n.exc is not None:
                texts = [
                    c.value
                    for c in ast.walk(n.exc)
                    if isinstance(c, ast.Constant) and isinstance(c.value, str)
                ]
                if any(re.search(r"(?<![\w-])--[a-z]", t) for t in texts):
                    found.append(f"{mod}:{n.lineno}")
    assert not found, found


def test_the_cli_turns_api_parameters_into_flags():
    from flatcli.cli import cli_message
    from flatcli.errors import ConfigError

    msg = cli_message(ConfigError("`max_train_loss` must be ≥ 0 with `where`; `not_a_param` stays"))
    assert msg == "--max-train-loss must be ≥ 0 with --where; `not_a_param` stays"


def test_measures_touch_no_engine_internals():
    """Measures use the engine's interface (docs/architecture.md), never its state objects (counters,
    memory policy, the products' state, graph cache) or private members, and build no
    `Problem` or `CurvatureEngine` themselves: `CurvatureEngine.derive(model)` is the one way to get
    one for another model (a BatchNorm-folded copy)."""
    import re

    internals = {
        "tally",
        "memory",
        "loop",
        "graphs",
        "state",
        "batches",
        "_options",
        "block_size",
    }
    found = []
    for mod, path in MODULES.items():
        if not mod.startswith("flatcli.measures"):
            continue
        src = path.read_text()
        for m in re.finditer(r"\b(?:eng|engine)\.(\w+)", src):
            if m.group(1) in internals or m.group(1).startswith("_"):
                found.append(f"{mod}: .{m.group(1)}")
        for n in ast.walk(_tree(path)):
            if isinstance(n, ast.Call) and ast.unparse(n.func).split(".")[-1] in (
                "Problem",
                "CurvatureEngine",
            ):
                found.append(f"{mod}:{n.lineno}: {ast.unparse(n.func)}(...)")
    assert not found, found


MAX_ESTIMATOR_PARAMS = 8


def test_linalg_public_functions_take_at_most_eight_parameters():
    """Estimators take an operator (which carries P, device, dtype, block size, basis-store capacity and
    the progress hook) and a stopping-rule object (`KrylovStop`, `ProbeStop`, `DiagonalCheck`), not the
    operator's fields one by one: every public function of ``flatcli.engine.linalg`` (its ``__all__``
    and the public names of its modules) has at most 8 parameters."""
    import importlib
    import inspect
    import pkgutil

    import flatcli.engine.linalg as la

    funcs = {f"linalg.{n}": getattr(la, n) for n in la.__all__ if not n.startswith("_")}
    for info in pkgutil.iter_modules(la.__path__):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{la.__name__}.{info.name}")
        funcs.update(
            {
                f"{info.name}.{n}": f
                for n, f in vars(mod).items()
                if not n.startswith("_") and getattr(f, "__module__", None) == mod.__name__
            }
        )
    funcs = {n: f for n, f in funcs.items() if inspect.isfunction(f)}
    assert {
        "linalg.lanczos",
        "linalg.hutchinson",
        "linalg.hutchpp",
        "linalg.slq",
        "linalg.as_operator",
        "linalg.checked_gauss_newton_diagonal",
        "linalg.remainder_block_gaps",
    } <= set(funcs)
    wide = {
        n: len(inspect.signature(f).parameters)
        for n, f in funcs.items()
        if len(inspect.signature(f).parameters) > MAX_ESTIMATOR_PARAMS
    }
    assert not wide, (
        f"public linalg functions with more than {MAX_ESTIMATOR_PARAMS} parameters: {wide}"
    )


RUN_OPTION_NAMES = ("device", "precision", "seed", "threads", "allow_unsafe_pickle", "budget")
CONFIG_ENTRY_POINTS = (
    "measure",
    "sweep",
    "estimate_costs",
    "landscape",
    "check_invariance",
    "correlate_report",
)


def test_api_functions_take_the_run_options_as_one_object():
    """No public function of flatcli.api takes a run option (device, precision, seed, threads,
    allow_unsafe_pickle, budget) as a parameter of its own; every entry point that takes a config
    takes ``run`` (a `RunOptions`) instead."""
    import inspect

    from flatcli import api

    public = {n: getattr(api, n) for n in dir(api) if not n.startswith("_")}
    found = []
    for name, obj in public.items():
        if inspect.isfunction(obj):
            params = inspect.signature(obj).parameters
            found += [f"{name}({p})" for p in params if p in RUN_OPTION_NAMES]
    assert not found, found
    assert all("run" in inspect.signature(public[n]).parameters for n in CONFIG_ENTRY_POINTS)


PRODUCT_MODULES = ("flatcli.engine.curvatures", "flatcli.engine.products", "flatcli.engine.routes")
ENGINE_NAMES = {"engine", "eng", "CurvatureEngine"}


def test_curvatures_and_their_state_receive_no_engine():
    """A curvature is the operator and owns its loop: curvatures and the `ProductContext` they share get
    the context, never the engine. Statically, no identifier, parameter, attribute or import named
    ``engine``/``eng``/``CurvatureEngine`` in engine/curvatures.py, engine/products.py and engine/routes.py, and
    ``Curvature.__init__`` takes ``state``; dynamically, nothing reachable from an engine's
    curvatures (their attributes and state) is the engine or one of its bound methods."""
    from flatcli.engine import CurvatureEngine, Problem
    from tests.helpers import tiny_data, tiny_mlp

    found = []
    for mod in PRODUCT_MODULES:
        for n in ast.walk(_tree(MODULES[mod])):
            names = {getattr(n, "id", None), getattr(n, "arg", None), getattr(n, "attr", None)}
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                names |= {a.asname or a.name for a in n.names} | {getattr(n, "module", None)}
            if isinstance(n, ast.ClassDef) and n.name == "Curvature":
                init = next(
                    f for f in n.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"
                )
                if [a.arg for a in init.args.args[:2]] != ["self", "state"]:
                    found.append(
                        f"{mod}: {n.name}.__init__ takes {[a.arg for a in init.args.args]}"
                    )
            found += [f"{mod}:{n.lineno}: {name}" for name in names & ENGINE_NAMES]
    x, y = tiny_data(n=6)
    eng = CurvatureEngine(Problem(tiny_mlp(), x, y, batch_size=3, dtype=x.dtype))
    for curvature in (eng.hessian(), eng.ggn(), eng.fd_hessian(), eng.hessian(precision="fp32")):
        for owner in (curvature, curvature.state):
            found += [
                f"curvature {curvature.name!r}: {type(owner).__name__}.{k}"
                for k, v in vars(owner).items()
                if isinstance(v, CurvatureEngine)
                or isinstance(getattr(v, "__self__", None), CurvatureEngine)
            ]
        assert curvature.state is eng.state
    assert not found, f"engine references in the curvatures or their state: {found}"


def test_no_private_name_crosses_a_package():
    """No module imports a private name (one leading underscore) from another package of flatcli:
    what another package needs is public there (``set_path``, ``result_from``, ``default_log``)."""
    found = []
    for mod, path in MODULES.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for n in ast.walk(_tree(path)):
            if not isinstance(n, ast.ImportFrom) or (
                n.level == 0 and not (n.module or "").startswith("flatcli")
            ):
                continue
            base = pkg.split(".")
            target = ".".join(
                (base[: len(base) - n.level + 1] if n.level else []) + [n.module or ""]
            ).strip(".")
            if target.rpartition(".")[0] == pkg or target == pkg:
                continue  # the same package
            private = [
                a.name for a in n.names if a.name.startswith("_") and not a.name.startswith("__")
            ]
            if private and target.split(".")[:2] != mod.split(".")[:2]:
                found.append(f"{mod}:{n.lineno}: {', '.join(private)} from {target}")
    assert not found, found


def test_low_precision_is_a_registry_hook():
    """Which measures run their products in bfloat16 is each registry entry's `low_precision`,
    read by the run (no tuple of names outside measures/): the Hessian family only."""
    from flatcli.measures import list_measures

    low = {m.name for m in list_measures() if m.low_precision}
    assert low == {"hessian_lambda_max", "hessian_trace", "hessian_spectrum"}
    run = (PKG / "run" / "measuring.py").read_text() + (
        PKG / "run" / "prediction" / "memory.py"
    ).read_text()
    assert "low_precision" in run and "LOW_PRECISION_MEASURES" not in run


MAX_PUBLIC_PARAMS = 8
# Public functions that keep more than MAX_PUBLIC_PARAMS parameters, each with its reason.
WIDE_ALLOWED: dict[str, str] = {}
# Public functions still to be given option objects (the list only shrinks).
WIDE_PENDING = {
    "flatcli.analysis.correlation.correlate_table",
    "flatcli.analysis.compare.compare_measures",
    "flatcli.sweep.worker.run_worker",
    "flatcli.sweep.worker.run_worker_process",
    "flatcli.sweep.store.unit_record",
}


def _cli_command(fn: ast.FunctionDef) -> bool:
    """Decorated as a command (``@app.command(...)``, ``@view_command(...)``): Typer makes one
    parameter per flag, and the command builds the API's option objects from them."""
    for d in fn.decorator_list:
        f = d.func if isinstance(d, ast.Call) else d
        if getattr(f, "attr", getattr(f, "id", None)) in ("command", "view_command"):
            return True
    return False


def _public_functions(tree: ast.Module):
    """(qualified name, parameter count) of every public function and public method of a public
    class at module level: its positional and keyword parameters, but a method's ``self``/``cls``
    (``**fields``, which collects the fields of one object, `Settings` or an executor's options,
    is not counted)."""
    todo = [("", n) for n in tree.body]
    while todo:
        owner, n = todo.pop()
        if isinstance(n, ast.ClassDef) and not owner and not n.name.startswith("_"):
            todo += [(n.name, b) for b in n.body]
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and not n.name.startswith("_"):
            a = n.args
            names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
            static = any(getattr(d, "id", None) == "staticmethod" for d in n.decorator_list)
            if owner and not static and names[:1] in (["self"], ["cls"]):
                names = names[1:]
            if not _cli_command(n):
                yield (f"{owner}.{n.name}" if owner else n.name), len(names)


def test_public_functions_take_at_most_eight_parameters():
    """No public function or method of flatcli takes more than 8 parameters: wide signatures take
    option objects (`RunOptions`, `Settings`, `MeasureOptions`, `Reuse`, `Reporting`, `InvarianceOptions`, the views
    `SliceView` ... `ConnectView`), frozen and validated when built. CLI commands are exempt (one
    parameter per flag; they build the objects), and the functions of `WIDE_ALLOWED` say why."""
    found = {
        f"{mod}.{name}": n
        for mod, path in MODULES.items()
        for name, n in _public_functions(_tree(path))
        if n > MAX_PUBLIC_PARAMS
    }
    wide = {k: n for k, n in found.items() if k not in WIDE_ALLOWED and k not in WIDE_PENDING}
    assert not wide, f"public functions with more than {MAX_PUBLIC_PARAMS} parameters: {wide}"
    narrow = (set(WIDE_ALLOWED) | WIDE_PENDING) - set(found)
    assert not narrow, f"no longer wide, remove from the allow-list: {sorted(narrow)}"


def _folder(module: str) -> str | None:
    """The package folder a flatcli module lives in (None for the modules at the top)."""
    parts = module.split(".")
    if MODULES[module].name == "__init__.py":
        return parts[1] if len(parts) > 1 else None
    return parts[1] if len(parts) > 2 else None


# two-way ties between folders still there, each with its reason; the list only shrinks
FOLDER_TIES_LEFT: set[tuple[str, str]] = set()


def test_no_two_folders_import_each_other():
    """A folder is a floor: when a imports b, nothing in b imports a (loading/ read run/jobs and
    run/ read loading/ until jobs moved down a floor)."""
    edges: dict[str, set[str]] = {}
    for m in MODULES:
        a = _folder(m)
        for w in _imports(m):
            b = _folder(w)
            if a and b and a != b:
                edges.setdefault(a, set()).add(b)
    ties = {tuple(sorted((a, b))) for a in edges for b in edges[a] if a in edges.get(b, ())}
    assert ties <= FOLDER_TIES_LEFT, sorted(ties - FOLDER_TIES_LEFT)
    assert FOLDER_TIES_LEFT <= ties, (
        f"no longer tied, remove from the list: {FOLDER_TIES_LEFT - ties}"
    )
