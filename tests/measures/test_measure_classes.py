"""Measures are classes: every registered measure is a `Measure` subclass with validated options,
the registry is the list of those classes (no `register` decorator), the registry's view reads the
class, and the docs' recipe class runs as written."""

import dataclasses
import importlib
import importlib.util
import inspect
import math
from dataclasses import dataclass
from pathlib import Path

import pytest

import flatcli
import flatcli.measures as reg
from flatcli.engine import CurvatureEngine
from flatcli.errors import ConfigError
from flatcli.measures import (
    Cost,
    Dims,
    Measure,
    MeasureContext,
    MeasureInfo,
    MeasureResult,
    MeasureSpec,
    get_measure,
    list_measures,
    run_measure,
)
from flatcli.validation import Real, opt, option_fields
from tests.oracles import mlp_problem

ROOT = Path(__file__).resolve().parents[2]

# The 24 measures of the package: each one a class.
MEASURES = {
    "distance_from_init",
    "feature_robustness",
    "first_order_flatness",
    "fisher_rao_norm",
    "fisher_rao_term",
    "frobenius_norm",
    "gradient_norm",
    "hessian_lambda_max",
    "hessian_spectrum",
    "hessian_top_eigenvalues",
    "hessian_trace",
    "inverse_margin",
    "keskar_sharpness",
    "local_entropy",
    "normalized_sharpness",
    "ns_bound",
    "pacbayes_flatness",
    "path_norm",
    "preconditioned_lambda_max",
    "relative_flatness",
    "sharpness_average",
    "sharpness_worst",
    "spectral_norm",
    "weightwatcher_alpha",
}
HOOKS = ("declare_cost", "applicable", "shared", "invariance_note", "artifacts")


def test_every_registered_measure_is_a_measure_class_with_validated_options():
    """Each registry entry is the view of a `Measure` subclass defined in a family module: its
    name, its compute, its options a frozen dataclass whose every field carries a check of the
    validation vocabulary, and its defaults pass that validation."""
    infos = list_measures()
    assert {i.name for i in infos} == MEASURES
    families = {importlib.import_module(m) for m in reg._FAMILY_MODULES}
    classes = [c for mod in families for c in reg.measure_classes(mod)]
    assert sorted(c.name for c in classes) == sorted(MEASURES)  # one class per measure
    for info in infos:
        cls = type(info.measure)
        assert issubclass(cls, Measure) and cls is not Measure, info.name
        assert cls.name == info.name and cls.__module__ in reg._FAMILY_MODULES, info.name
        assert inspect.ismethod(info.fn) and info.fn.__func__ is cls.compute, info.name
        assert cls.compute is not Measure.compute, info.name
        assert cls.__doc__ and cls.description, info.name
        assert dataclasses.is_dataclass(info.options) and info.options.__dataclass_params__.frozen
        assert option_fields(info.options) == list(dataclasses.fields(info.options)), info.name
        parsed = reg.parse_options(info.options, {}, info.name)  # the defaults are valid
        assert isinstance(parsed, info.options)


def test_register_is_gone():
    """No decorator registers a function: the registry holds classes only."""
    assert not hasattr(reg, "register") and "register" not in reg.__all__
    assert "register" not in flatcli.__all__ and "Measure" in flatcli.__all__
    for path in (ROOT / "flatcli" / "measures").glob("*.py"):
        assert "@register" not in path.read_text(), path.name


def test_the_view_reads_the_class():
    """`MeasureInfo` is built from the class: its tags, its options and its rules (a rule the
    class does not define is None in the view), and the rules give what the class's methods give."""
    dims = Dims(P=1000, n=100, C=10, tensors=(600, 400), matrices=(600, 400), matrix_tensors=(0, 1))
    for info in list_measures():
        cls = type(info.measure)
        for tag in ("options", "description", "reference", "stochastic", "needs_init"):
            assert getattr(info, tag) == getattr(cls, tag), (info.name, tag)
        for tag in ("low_precision", "revision", "invariance_options"):
            assert getattr(info, tag) == getattr(cls, tag), (info.name, tag)
        for hook in HOOKS:
            defined = getattr(cls, hook) is not getattr(Measure, hook)
            assert (getattr(info, hook) is not None) == defined, (info.name, hook)
        opts = reg.parse_options(info.options, {}, info.name)
        assert info.declare_cost is not None, info.name  # every measure declares its cost
        assert info.declare_cost(opts, dims) == cls().declare_cost(opts, dims), info.name
        for tag in ("stops_early", "invariant"):
            value = getattr(cls, tag)
            got = getattr(info, tag)
            assert got(opts) == getattr(cls(), tag)(opts) if callable(got) else got == value


def _measure(**attrs):
    """A class statement of a measure with these class attributes (and a compute)."""

    def compute(self, ctx, opts):
        return MeasureResult(value=0.0)

    return type("Toy", (Measure,), {"compute": compute, **attrs})


@dataclass(frozen=True)
class _Checked:
    tol: float = opt(0.1, Real(0, 1), "a tolerance")


@dataclass
class _Mutable:
    tol: float = opt(0.1, Real(0, 1), "a tolerance")


@dataclass(frozen=True)
class _Loose:
    tol: float = opt(0.1, Real(0, 1), "a tolerance")
    steps: int = 3  # no check: not validated


@pytest.mark.parametrize(
    "attrs, words",
    [
        ({"name": "Toy Measure", "description": "d"}, "snake_case"),
        ({"name": "toy"}, "no description"),
        ({"name": "toy", "description": "d", "options": _Mutable}, "frozen dataclass"),
        ({"name": "toy", "description": "d", "options": dict}, "frozen dataclass"),
        ({"name": "toy", "description": "d", "options": _Loose}, "['steps']"),
    ],
)
def test_a_class_without_a_validated_declaration_is_refused(attrs, words):
    """A measure class states a snake_case name, a description and options of the validation
    vocabulary; one that does not is refused where it is defined."""
    with pytest.raises(TypeError, match=words.replace("[", r"\[").replace("]", r"\]")):
        _measure(**attrs)
    assert issubclass(_measure(name="toy", description="d", options=_Checked), Measure)


def test_a_class_without_compute_is_refused():
    with pytest.raises(TypeError, match="no compute"):
        type("Toy", (Measure,), {"name": "toy", "description": "d"})


@dataclass(frozen=True)
class ScaledNormOptions:
    scale: float = opt(1.0, Real(0, None, "neither"), "factor on the squared norm")


class ScaledSquaredNorm(Measure):
    """scale · ‖θ‖², the trainable parameters' squared Euclidean norm."""

    name = "scaled_squared_norm"
    options = ScaledNormOptions
    description = "scale times the squared Euclidean norm of the trainable parameters"
    reference = "a closed form"

    def declare_cost(self, opts, dims):
        """No pass over the data (the parameters only)."""
        return Cost()

    def compute(self, ctx, opts):
        theta = ctx.problem.theta
        return MeasureResult(value=opts.scale * float(theta @ theta))


def recipe_measure():
    """The class of docs/architecture.md's "How to add a measure", run as written."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## How to add a measure") :]
    start = section.index("```python\n") + len("```python\n")
    namespace = {
        "dataclass": dataclass,
        "opt": opt,
        "Real": Real,
        "Measure": Measure,
        "MeasureResult": MeasureResult,
        "Cost": Cost,
        "__name__": "recipe",
    }
    exec(section[start : section.index("```", start)], namespace)
    return namespace["ScaledSquaredNorm"]


def _docs_ext():
    spec = importlib.util.spec_from_file_location(
        "flatcli_docs", ROOT / "docs" / "_ext" / "flatcli_docs.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("source", ["test", "docs"])
@pytest.mark.parametrize("scale", [0.5, 1.0, 3.0])
def test_a_new_measure_is_one_class(monkeypatch, source, scale):
    """A measure added as one class (the docs' recipe, run from the docs) is listed, validated, run
    by `run_measure` to its closed form on several problems, costed, and gets its reference page."""
    cls = ScaledSquaredNorm if source == "test" else recipe_measure()
    reg._load_all()
    monkeypatch.setitem(reg._REGISTRY, cls.name, MeasureInfo.of(cls))
    assert get_measure(cls.name).measure.__class__ is cls
    assert [i.name for i in list_measures("scaled_*")] == [cls.name]
    for seed in range(3):
        p = mlp_problem(seed=seed)
        ctx = MeasureContext(problem=p, engine=CurvatureEngine(p))
        res = run_measure(MeasureSpec(cls.name, "n", {"scale": scale}), ctx)
        expected = scale * sum(float((w.detach() ** 2).sum()) for w in p.model.parameters())
        assert math.isclose(res.value, expected, rel_tol=1e-12) and res.status == "ok"
        assert res.diagnostics["n_hvp"] == 0
    with pytest.raises(ConfigError, match="scale"):
        MeasureSpec(cls.name, "n", {"scale": -1.0}).parsed()
    spec = MeasureSpec(cls.name, "n", {"scale": scale})
    assert spec.cost(Dims(P=10, n=5)) == Cost() and not spec.stops_early()
    page = _docs_ext().measure_page(get_measure(cls.name))
    assert "scale · ‖θ‖², the trainable parameters' squared Euclidean norm." in page
    assert f"Defined by the class ``{cls.__module__}.ScaledSquaredNorm``" in page
    assert "No pass over the data (the parameters only)." in page


def test_each_reference_page_is_read_from_its_class():
    """The measure reference page of every measure opens its Definition with the class's docstring
    and names the class."""
    docs = _docs_ext()
    for info in list_measures():
        cls = type(info.measure)
        page = docs.measure_page(info)
        first = inspect.cleandoc(cls.__doc__).splitlines()[0]
        definition = page.split("\nDefinition\n----------\n", 1)[1]
        assert definition.lstrip().startswith(first), info.name
        assert f"Defined by the class ``{cls.__module__}.{cls.__qualname__}``" in page
