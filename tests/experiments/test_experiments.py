"""The experiment package: specs (parsing, merging, grids, recipes, the papers' numbers), the
analysis steps on synthetic tables, the ``flatcli experiments`` commands, and one end-to-end
smoke per experiment at the smallest size that still trains → sweeps → collects → correlates
(through a spec derived from the shipped one: its quick mode with fewer models and measures)."""

from __future__ import annotations

import csv
import dataclasses
import re
from pathlib import Path

import pytest
import torch
import yaml

from flatcli.cli import app
from flatcli.config import load_config, parse_measures
from flatcli.errors import ConfigError
from flatcli.experiments import available, list_experiments, load_spec, publish, run_experiment
from flatcli.experiments.base import Experiment, work_seconds
from flatcli.experiments.report import StudyOutcome, correlation_table
from flatcli.experiments.spec import Study, merge
from flatcli.training import LossTarget, Plateau
from tests.helpers import cli_output
from tests.oracles import runner

pytest.importorskip("mnist1d")

ROOT = Path(__file__).resolve().parents[2]
SPECS = ROOT / "flatcli" / "experiments" / "specs"
EXPERIMENTS = [
    "ns_regularization",
    "random_labels",
    "relative_flatness",
    "reparameterization",
    "cifar10_resnet18",
    "modular_addition",
]


def _rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="") as f:
        r = csv.DictReader(f)
        return list(r.fieldnames or []), list(r)


def _labels(study) -> list[str]:
    return [s.label for s in parse_measures(study.flatcli["measures"])]


def _out(res) -> str:
    return cli_output(res)


def small_spec(
    tmp_path: Path, name: str, measures: list, study: str | None = None, **quick
) -> Path:
    """The shipped spec ``name`` with its quick mode cut down: ``measures`` (with the quick
    options of those kept), no bootstrap, and ``quick`` merged into the quick block (into
    ``study``'s own quick block when given)."""
    raw = yaml.safe_load((SPECS / f"{name}.yaml").read_text())
    names = {m if isinstance(m, str) else next(iter(m)) for m in measures}
    opts = {k: v for k, v in raw["quick"].get("measure_options", {}).items() if k in names}
    raw["quick"] = merge(
        raw["quick"], {"measures": measures, "bootstrap": 0, **({} if study else quick)}
    )
    raw["quick"]["measure_options"] = opts
    labels = {
        m.label for m in parse_measures(measures)
    }  # the compare pairs among the measures kept
    pairs = [p for st in (raw, *raw["studies"].values()) for p in st.get("compare", [])]
    raw["quick"]["compare"] = [
        p for p in pairs if all(x in labels or x == "*" for x in p.split(","))
    ]
    if study:
        raw["studies"][study]["quick"] = merge(raw["studies"][study].get("quick") or {}, quick)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


# ------------------------------------------------------------------ specs
def test_every_experiment_has_a_spec():
    assert available() == sorted(EXPERIMENTS)


@pytest.mark.parametrize("name", EXPERIMENTS)
@pytest.mark.parametrize("quick", [False, True])
def test_specs_load_and_follow_the_rules(name, quick):
    spec = load_spec(name, quick=quick)
    assert spec.name == name and spec.studies
    if not quick:
        assert spec.target_loss == 0.01 and spec.bootstrap == 1000  # Jiang et al. 2020's target
    for st in spec.studies:
        assert "seed" in st.grid and all(a in st.grid for a in st.axes)
        assert _labels(st)
        if not quick and name in ("ns_regularization", "relative_flatness"):
            assert len(st.points()) >= 24 and len(st.grid["seed"]) >= 2
        if (
            not quick and name == "ns_regularization"
        ):  # Tsuzuku's regularizers, each at ≥ 2 strengths besides 0
            assert (
                st.axes == ["l2", "weight_decay", "dropout"] and st.training["optimizer"] == "adamw"
            )
            assert all(
                len(st.grid[a]) >= 3 and st.grid[a][0] == 0 for a in st.axes
            ) and st.model_axes == ["dropout"]
    if not quick and name == "ns_regularization":
        assert spec.criterion == Plateau(0.01, min_accuracy=1.0, window=10, rtol=0.01)
    elif not quick:
        assert spec.criterion == LossTarget(0.01)


def test_quick_measure_options_keep_labels_and_columns():
    full, quick = load_spec("ns_regularization"), load_spec("ns_regularization", quick=True)
    for a, b in zip(full.studies, quick.studies, strict=True):
        assert _labels(a) == _labels(b)
    ns = [
        m
        for m in quick.studies[0].flatcli["measures"]
        if isinstance(m, dict) and "normalized_sharpness" in m
    ]
    assert ns == [
        {"normalized_sharpness": {"samples": 8}}
    ]  # the quick options merged into the default NS
    assert (
        quick.bootstrap == 100
    )  # the fewest a 95% interval takes: `flatcli experiments run NAME --quick` works


def _paper_tables(text: str) -> dict[str, dict[str, list[float]]]:
    """Tsuzuku et al. 2020's Tables 1–2 as text: data set → row name → {column: value}."""
    tables = {}
    for m in re.finditer(
        r"Table \d\. Correlation coefficients.*?trained on (\w+)\.\s+(.*?)(?=Table \d\.|\Z)",
        text,
        re.S,
    ):
        lines = [ln.strip() for ln in m.group(2).splitlines() if ln.strip()]
        head = lines[0].split()
        rows = {}
        for ln in lines[1:]:
            nums = re.findall(r"[−-]?\d+\.\d+", ln)
            rows[ln[: ln.index(nums[0])].strip()] = dict(
                zip(head, (float(v.replace("−", "-")) for v in nums), strict=True)
            )
        tables[m.group(1)] = rows
    return tables


def test_exp1_paper_values_match_tsuzuku_tables_1_and_2():
    """The spec's paper numbers are read off the paper's text (Sec. 8.2, Tables 1–2: MNIST and
    CIFAR10, MLP column). tests/data holds the tables verbatim from the text extraction in the
    shared papers folder; when that folder is beside the checkout, the excerpt is checked
    against it too."""
    excerpt = (ROOT / "tests" / "data" / "tsuzuku2020_tables_1_2.txt").read_text()
    for papers in (ROOT.parent / "shared" / "papers", ROOT.parent.parent / "shared" / "papers"):
        full = papers / "tsuzuku2020-normalized-flat-minima.txt"
        if full.is_file():
            assert excerpt in full.read_text()
    tables = _paper_tables(excerpt)
    rows = {
        "normalized_sharpness": "Normalized sharpness",
        "hessian_trace": "Trace of Hessian",
        "frobenius_norm": "Frobenius norm",
    }
    paper = load_spec("ns_regularization").paper
    assert paper["columns"] == ["MNIST MLP", "CIFAR-10 MLP"]
    assert (
        paper["statistic"] == "correlation coefficient" and "Correlation coefficients" in excerpt
    )  # not named Pearson
    assert set(paper["values"]) == set(rows)
    for label, row in rows.items():
        assert paper["values"][label] == [
            tables["MNIST"][row]["MLP"],
            tables["CIFAR10"][row]["MLP"],
        ], label


def test_shipped_cifar_configs_match_the_spec():
    spec = load_spec("cifar10_resnet18")
    for st in spec.studies:
        cfg = load_config(ROOT / "configs" / f"cifar10_resnet18_{st.name}.yaml")
        assert [s.label for s in cfg.measure_specs()] == _labels(st)
        assert cfg.model.target == st.flatcli["model"]["target"]
        assert isinstance(cfg.checkpoints, dict) and "manifest" in cfg.checkpoints


def _write_spec(tmp_path: Path, **over) -> Path:
    raw = yaml.safe_load((SPECS / "ns_regularization.yaml").read_text())
    for k, v in over.items():
        cur = raw
        keys = k.split(".")
        for kk in keys[:-1]:
            cur = cur[kk]
        cur[keys[-1]] = v
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def test_compare_pairs_expand_and_are_checked(tmp_path):
    """``compare``: "A,B" or [A, B] by label; "A,*" is A against every other measure, each
    unordered pair once; a label that is not a measure of the study is a config error."""
    st = load_spec("relative_flatness").studies[0]
    labels = _labels(st)
    rf = [b for a, b in st.compare if a == "relative_flatness"]
    assert rf == [x for x in labels if x != "relative_flatness"]
    fr = [b for a, b in st.compare if a == "fisher_rao_norm"]
    assert fr == [
        x for x in labels if x not in ("relative_flatness", "fisher_rao_norm")
    ]  # (FR, RF) is (RF, FR)
    assert load_spec("ns_regularization").studies[0].compare[:2] == [("normalized_sharpness", "hessian_trace"),
                                                                  ("normalized_sharpness", "frobenius_norm")]  # fmt: skip
    p = _write_spec(
        tmp_path, compare=[["hessian_trace", "frobenius_norm"], "hessian_trace, path_norm"]
    )
    assert load_spec(p).studies[0].compare == [
        ("hessian_trace", "frobenius_norm"),
        ("hessian_trace", "path_norm"),
    ]


@pytest.mark.parametrize(
    ("over", "match"),
    [
        (
            {"compare": ["normalized_sharpnes,*"]},
            r"compare: 'normalized_sharpnes' is not a measure label of the study; "
            r"did you mean 'normalized_sharpness'\?",
        ),
        ({"compare": ["hessian_trace"]}, r"compare: each entry must name two different measures"),
        (
            {"subsets": {"no dropout": ""}},
            r"subsets.no dropout must be a condition on results.csv",
        ),
        (
            {"subsets": {"escape": "@pd.io.common.os.system('true')"}},
            r"subsets.escape: not an expression of columns",
        ),
        (
            {"subsets": {"call": "hp_l2.__class__ == 1"}},
            r"subsets.call: 'hp_l2.__class__' \(Attribute\) is not allowed",
        ),
        ({"studie": {}}, r"unknown key 'studie'. Did you mean 'studies'\?"),
        (
            {"studies.digits.grid": {"weight_decay": [0.0], "batch_sise": [32]}},
            r"grid .*unknown key 'batch_sise'. Did you mean 'batch_size'\?",
        ),
        (
            {"training": {"optimizer": "rmsprop"}},
            r"optimizer must be one of sgd, adam, adamw. Got 'rmsprop'",
        ),
        (
            {"training": {"momentum": 1.0}},
            r"training: momentum must be a float in \[0, 1\). Got 1.0",
        ),
        ({"training": {"l2": -1.0}}, r"training: l2 must be a float ≥ 0. Got -1.0"),
        (
            {"training": {"dtype": "float16"}},
            r"training: dtype must be one of float32, float64. Got 'float16'",
        ),
        (
            {"studies.digits.grid": {"max_steps": [10, 20]}},
            r"max_steps is a training setting, not a grid axis",
        ),
        ({"axes": ["width"]}, r"axes: 'width' is not a grid axis"),
        (
            {"quick": {"measure_options": {"local_entropy": {"gamma": 2.0}}}},
            r"'local_entropy' is not among the configured measures",
        ),
        (
            {"measures": ["hessian_trac"]},
            r"studies\.\w+: Unknown measure 'hessian_trac'. Did you mean 'hessian_trace'\?",
        ),
        ({"target_loss": 0}, r"target_loss must be a float > 0. Got 0"),
        (
            {"quick": {"bootstrap": -1}},
            r"bootstrap must be 0 \(no intervals\) or an int ≥ 100 .*. Got -1",
        ),
        (
            {"quick": {"bootstrap": 20}},
            r"bootstrap must be 0 \(no intervals\) or an int ≥ 100 .*. Got 20",
        ),
        ({"studies.digits.grid": {"seed": [0, 0]}}, r"grid.seed repeats a value"),
        ({"plateau": {"windw": 5}}, r"plateau: unknown key 'windw'. Did you mean 'window'\?"),
        (
            {"quick": {"plateau": {"rtol": 1.5}}},
            r"quick: plateau rtol must be in \[0, 1\). Got 1.5",
        ),
        (
            {"plateau": {"window": 2.5}},
            r"plateau window must be an int ≥ 1 \(evaluations\). Got 2.5",
        ),
    ],
)
def test_bad_specs_are_one_line_config_errors(tmp_path, over, match):
    path = _write_spec(tmp_path, **over)
    with pytest.raises(ConfigError, match=match):
        load_spec(path, quick=True)


def test_grid_points_recipes_and_tasks():
    """Grid expansion (last axis fastest), the recipe of each point (training axes override the
    defaults; lr per optimizer × lr_factor), model axes as model kwargs, seeds, label noise."""
    spec = load_spec("relative_flatness")
    st = next(s for s in spec.studies if s.name == "digits")
    pts = st.points()
    assert len(pts) == 2 * 2 * 2 * 3 and pts[:2] == [
        {"optimizer": "sgd", "batch_size": 32, "lr_factor": 1.0, "seed": 0},
        {"optimizer": "sgd", "batch_size": 32, "lr_factor": 1.0, "seed": 1}]  # fmt: skip
    adam3 = {"optimizer": "adam", "batch_size": 128, "lr_factor": 3.0, "seed": 2}
    recipe, noise = st.recipe(adam3)
    assert (recipe.optimizer, recipe.batch_size, recipe.momentum, noise) == ("adam", 128, 0.9, None)
    assert recipe.lr == pytest.approx(0.003) and st.recipe(pts[0])[0].lr == pytest.approx(0.01)
    assert st.recipe(adam3, device="cuda:1")[0].device == "cuda:1"
    tasks = Experiment(spec, "out").tasks(st, Path("out/digits"))
    assert [t.name for t in tasks[:2]] == ["000_optimizersgd_batch_size32_lr_factor1_seed0",
                                           "001_optimizersgd_batch_size32_lr_factor1_seed1"]  # fmt: skip
    assert [t.seed for t in tasks[:3]] == [0, 1, 2] and all(
        t.criterion.target == 0.01 for t in tasks
    )
    noisy = load_spec("random_labels").studies[0]
    assert (
        noisy.recipe({"label_noise": 0.4, "seed": 1})[1] == 0.4
        and noisy.recipe({"label_noise": 0.0, "seed": 1})[1] == 0.0
    )
    cifar = load_spec("cifar10_resnet18", quick=True)
    task = Experiment(cifar, "out").tasks(cifar.studies[0], Path("out/r"))[0]
    assert (
        task.model_kwargs["width"] == 4
        and task.recipe.batch_size == 16
        and task.criterion.target == 2.0
    )


# ------------------------------------------------------------------ the command line
def test_experiments_list_and_the_module_alias(capsys):
    res = runner.invoke(app, ["experiments", "list"])
    assert res.exit_code == 0, _out(res)
    for info in list_experiments():
        assert info.name in res.stdout
    exp1 = next(e for e in list_experiments() if e.name == "ns_regularization")
    assert exp1.studies == (("mnist1d", 54), ("digits", 54)) and "Tsuzuku" in exp1.reference
    from flatcli.experiments.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["random_label", "--quick"])
    assert e.value.code == 2
    assert (
        "unknown experiment 'random_label'; did you mean 'random_labels'?"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["random_label", "--quick"],
            "error: unknown experiment 'random_label'; did you mean 'random_labels'?",
        ),
        (
            ["ns_regularization", "--quick", "--study", "cifar"],
            "error: --study: cifar not in ns_regularization (studies: mnist1d, digits)",
        ),
        (
            ["ns_regularization", "--quick", "--device", "tpu:9"],
            "error: --device must be auto, cpu, cuda or cuda:N. Got 'tpu:9'",
        ),
        (["ns_regularization", "--jobs", "0"], "error: --jobs must be an int ≥ 1. Got 0 instead."),
    ],
)
def test_experiments_run_usage_and_config_errors_exit_2(tmp_path, args, message):
    res = runner.invoke(app, ["experiments", "run", *args, "-o", str(tmp_path / "o")])
    assert res.exit_code == 2, _out(res)
    assert message in _out(res) and "Traceback" not in _out(res)
    assert not (tmp_path / "o" / "mnist1d").exists()  # nothing trained


@pytest.mark.slow
def test_a_failed_measurement_exits_1(tmp_path):
    """Models that diverge have NaN weights: their sweep units fail, the experiment exits 1."""
    spec = small_spec(tmp_path, "ns_regularization", ["frobenius_norm"], grid={"optimizer": ["sgd"], "lr": [1.0e6], "l2": [0.0], "weight_decay": [0.0], "dropout": [0.0],
                      "seed": [0, 1, 2]})  # fmt: skip
    res = runner.invoke(
        app,
        [
            "experiments",
            "run",
            str(spec),
            "--quick",
            "--study",
            "digits",
            "-o",
            str(tmp_path / "o"),
            "--no-plots",
        ],
    )
    assert res.exit_code == 1, _out(res)
    _, train = _rows(tmp_path / "o" / "digits" / "training.csv")
    diverged = {r["path"] for r in train if r["diverged"] == "1"}
    _, results = _rows(tmp_path / "o" / "digits" / "results" / "results.csv")
    assert diverged and {r["checkpoint"] for r in results if r["status"] == "error"} == diverged
    assert "error" in _out(res)


# ------------------------------------------------------------------ the end-to-end smokes
def _check_study(
    out: Path, spec, study, *, converged_min: int = 3
) -> tuple[list[str], list[dict[str, str]]]:
    """The files of a trained, swept and collected study; the training's own eval-mode train
    loss equals the one flatcli measures on the same checkpoint and labels."""
    sd = out / study.name
    n = len(study.points())
    labels = _labels(study)
    for f in ("manifest.csv", "training.csv", "config.yaml", "study.json"):
        assert (sd / f).is_file(), f
    cfg = load_config(sd / "config.yaml")
    assert [s.label for s in cfg.measure_specs()] == labels
    _, train = _rows(sd / "training.csv")
    assert len(train) == n and {"steps", "train_loss", "reached_target"} <= set(train[0])
    cols, rows = _rows(sd / "results" / "results.csv")
    assert len(rows) >= n
    assert set(labels) <= set(cols) and {"train_loss", "gen_gap"} <= set(cols)
    assert all(f"hp_{k}" in cols for k in study.grid)
    measured = {r["checkpoint"]: float(r["train_loss"]) for r in rows}
    for t in train:
        assert measured[t["path"]] == pytest.approx(float(t["train_loss"]), rel=1e-4), t["path"]
    _, conv = _rows(sd / "results" / "results_converged.csv")
    _, unconv = _rows(sd / "results" / "unconverged.csv")
    assert len(conv) + len(unconv) == len(rows) and len(conv) >= converged_min
    if spec.plateau is None:
        assert all(float(r["train_loss"]) <= spec.target_loss for r in conv)
        assert all(float(r["train_loss"]) > spec.target_loss for r in unconv)
    else:  # the training's criterion, recorded in the manifest, decides
        met = {t["path"]: t["reached_target"] for t in train}
        assert all(met[r["checkpoint"]] == r["hp_converged"] == "1" for r in conv)
        assert all(met[r["checkpoint"]] == r["hp_converged"] == "0" for r in unconv)
        acc = spec.criterion.min_accuracy
        assert all(
            float(r["train_loss"]) <= spec.target_loss or float(r["train_acc"]) >= acc for r in conv
        )
    return labels, conv


def _check_correlations(sd: Path, labels: list[str], n_conv: int, axes: list[str]) -> None:
    cols, corr = _rows(sd / "results" / "correlations.csv")
    assert sorted(r["measure"] for r in corr) == sorted(labels)
    assert {"pearson", "kendall_tau_b", "psi", "cmi"} <= set(cols)
    assert all(f"psi_{a}" in cols for a in axes)
    assert max(int(r["n"]) for r in corr) == n_conv


@pytest.mark.slow
def test_ns_regularization_smoke_through_the_cli(tmp_path):
    spec = small_spec(tmp_path, "ns_regularization", ["normalized_sharpness", "hessian_trace", "frobenius_norm"],
                      grid={"l2": [0.0, 0.003, 0.01], "weight_decay": [0.0], "dropout": [0.0], "seed": [0]},
                      bootstrap=100)  # fmt: skip
    out = tmp_path / "exp1"
    args = [
        "experiments",
        "run",
        str(spec),
        "--quick",
        "--study",
        "digits",
        "-o",
        str(out),
        "--no-plots",
    ]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, _out(res)
    assert (
        "| `normalized_sharpness` |" in res.stdout
        and "+0.73 | +0.92 |" in res.stdout
        and "quick mode" in res.stdout
    )
    assert "[1/3] l2=0.0" in _out(res)  # progress on stderr
    assert (
        '--where "hp_converged == 1" --by l2,weight_decay,dropout' in res.stdout
    )  # the plateau criterion's filter
    # normalized sharpness against every other measure, as `flatcli correlate --compare` computes it
    cols, comp = _rows(out / "digits" / "results" / "comparisons.csv")
    assert [(r["measure_a"], r["measure_b"], r["statistic"]) for r in comp][::3] == [
        ("normalized_sharpness", "hessian_trace", "kendall_tau_b"),
        ("normalized_sharpness", "frobenius_norm", "kendall_tau_b"),
    ]
    assert (
        all(int(r["resamples"]) + int(r["undefined_resamples"]) == 100 for r in comp)
        and "zou_lo" in cols
    )
    assert (
        "| `normalized_sharpness` | `hessian_trace` | 3 |" in res.stdout
        and "--compare A,B" in res.stdout
    )
    assert "- differs from the paper: data: MNIST-1D" in res.stdout  # the spec's paper.setup
    _, conv = _rows(out / "digits" / "results" / "results_converged.csv")
    gaps = [float(r["gen_gap"]) for r in conv]
    assert f"the 3 converged models: {min(gaps):.3f} to {max(gaps):.3f}." in res.stdout
    (st,) = [s for s in load_spec(spec, quick=True).studies if s.name == "digits"]
    labels, conv = _check_study(out, load_spec(spec, quick=True), st)
    _check_correlations(out / "digits", labels, len(conv), ["weight_decay"])
    # rerunning reuses the models and the sweep, and gives the same table
    before = (out / "digits" / "results" / "results.csv").read_text()
    res = runner.invoke(app, args)
    assert (
        res.exit_code == 0
        and "reusing the 3 trained models" in _out(res)
        and "0 to run" in _out(res)
    )
    assert (out / "digits" / "results" / "results.csv").read_text() == before
    # the summary's work figures come from the files, so a rerun that reuses everything keeps them
    train_s, measure_s = work_seconds(out / "digits")
    assert train_s > 0 and measure_s > 0
    assert (
        f"Work: training {train_s:.0f} s and measurement {measure_s:.0f} s"
        in (out / "summary.md").read_text()
    )


@pytest.fixture(scope="module")
def exp2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("exp2")
    spec = small_spec(tmp, "random_labels", ["normalized_sharpness", "frobenius_norm"],
                      grid={"label_noise": [0.0, 0.25, 0.5, 1.0], "seed": [0]})  # fmt: skip
    return tmp / "out", run_experiment(spec, tmp / "out", quick=True, log=lambda m: None)


@pytest.mark.slow
def test_random_labels_smoke(exp2):
    out, rep = exp2
    (st,) = rep.spec.studies
    labels, conv = _check_study(out, rep.spec, st)
    _check_correlations(out / st.name, labels, len(conv), ["label_noise"])
    _, man = _rows(out / st.name / "manifest.csv")
    assert [r["train_data"] for r in man] == [
        f"data/train_noise{f}_seed0.pt" for f in ("0", "0.25", "0.5", "1")
    ]
    _, unconv = _rows(out / st.name / "results" / "unconverged.csv")
    assert [r["hp_label_noise"] for r in unconv] == [
        "1.0"
    ]  # random labels: not fitted in 400 steps
    _, vs = _rows(out / st.name / "results" / "vs_noise" / "correlations.csv")
    assert sorted(r["measure"] for r in vs) == sorted(labels)
    assert (out / st.name / "results" / "plots" / "random_labels.png").is_file()
    assert (out / st.name / "results" / "plots" / "scatter_all.png").is_file()
    assert "Against the random-label fraction" in rep.summary.read_text()


@pytest.mark.slow
def test_relative_flatness_smoke(tmp_path):
    spec = small_spec(tmp_path, "relative_flatness", ["relative_flatness", {"relative_flatness": {
        "normalize_features": True, "label": "relative_flatness_normalized"}}, "frobenius_norm"])  # fmt: skip
    out = tmp_path / "exp3"
    rep = run_experiment(
        spec, out, quick=True, studies=["mnist1d"], plots=False, log=lambda m: None
    )
    (st,) = [s for s in rep.spec.studies if s.name == "mnist1d"]
    labels, conv = _check_study(out, rep.spec, st)
    assert labels == ["relative_flatness", "relative_flatness_normalized", "frobenius_norm"]
    _check_correlations(out / st.name, labels, len(conv), st.axes)
    _, train = _rows(out / st.name / "training.csv")
    assert {r["lr_effective"] for r in train} == {"0.1", "0.01"}  # lr per optimizer × lr_factor


@pytest.mark.slow
def test_reparameterization_smoke(tmp_path):
    measures = ["hessian_trace", "normalized_sharpness", {"relative_flatness": {"normalize_features": True,
                "label": "relative_flatness_normalized"}}, "path_norm", "frobenius_norm"]  # fmt: skip
    spec = small_spec(tmp_path, "reparameterization", measures)
    out = tmp_path / "exp4"
    rep = run_experiment(spec, out, quick=True, studies=["digits_mlp"], log=lambda m: None)
    (st,) = [s for s in rep.spec.studies if s.name == "digits_mlp"]
    sd = out / st.name
    _, man = _rows(sd / "manifest.csv")
    assert [(r["transform"], r["scale"]) for r in man] == [
        ("none", "1.0"),
        ("layer", "10.0"),
        ("layer", "1000.0"),
        ("node", "10.0"),
        ("node", "1000.0"),
    ]
    _check_study(out, rep.spec, st, converged_min=0)
    cols, table = _rows(sd / "results" / "relative_change.csv")
    assert cols == ["measure", "claims_invariance", "transform", "scale", "median", "max", "n"]
    assert len(table) == len(_labels(st)) * 4
    rel = {(r["measure"], r["transform"], r["scale"]): float(r["median"]) for r in table}
    for t in ("layer", "node"):  # Dinh et al.: the trace moves, the invariant measures stay
        assert rel[("hessian_trace", t, "1000.0")] > 1.0
        assert rel[("relative_flatness_normalized", t, "1000.0")] < 1e-4
        assert rel[("normalized_sharpness", t, "1000.0")] < 1e-4
        assert rel[("path_norm", t, "1000.0")] < 1e-4
    assert rel[("frobenius_norm", "layer", "1000.0")] > 1.0
    assert (sd / "results" / "plots" / "reparameterization.png").is_file()
    summary = rep.summary.read_text()
    assert "| `hessian_trace` | no |" in summary
    # the counts are over the trained networks (1 in quick mode), not over them and their 4 copies
    (o,) = rep.studies
    assert o.models == 1 and o.extra["checkpoints"] == 5
    assert (
        "1 trained network(s), measured with their rescaled copies (5 checkpoints in all)"
        in summary
    )
    assert " of 5 models" not in summary and "trained networks)" not in summary
    # rerunning reuses the trained networks and rescales them again, not their copies
    logs: list[str] = []
    run_experiment(spec, out, quick=True, studies=["digits_mlp"], plots=False, log=logs.append)
    assert any("reusing the 1 trained models" in m for m in logs) and any(
        "0 to run" in m for m in logs
    )
    assert len(_rows(sd / "manifest.csv")[1]) == 5


@pytest.mark.slow
def test_cifar10_resnet18_smoke_on_synthetic_data(tmp_path):
    """The GPU recipe at a tiny size on the CPU (synthetic 3×32×32 data, width-4 ResNet-18 with
    BatchNorm): trained in training mode (running statistics move), judged in eval mode (the
    training's train loss is the one flatcli measures), swept and collected."""
    spec = small_spec(tmp_path, "cifar10_resnet18", ["frobenius_norm", "hessian_trace"], study="optimizers",
                      grid={"optimizer": ["sgd", "adam"], "batch_size": [16], "lr_factor": [1.0], "seed": [0]},
                      training={"max_steps": 12})  # fmt: skip
    out = tmp_path / "exp5"
    rep = run_experiment(
        spec, out, quick=True, studies=["optimizers"], plots=False, log=lambda m: None
    )
    st = next(s for s in rep.spec.studies if s.name == "optimizers")
    _check_study(out, rep.spec, st, converged_min=0)
    sd = out / "optimizers"
    _, train = _rows(sd / "training.csv")
    assert len(train) == 2 and all(r["reached_target"] == "1" or r["steps"] == "12" for r in train)
    for r in train:
        init = torch.load(sd / r["init_checkpoint"], weights_only=True)["state_dict"]
        final = torch.load(sd / r["path"], weights_only=True)
        assert (
            final["model_kwargs"]["width"] == 4 and final["hparams"]["optimizer"] == r["optimizer"]
        )
        assert not torch.equal(init["bn1.running_mean"], final["state_dict"]["bn1.running_mean"])
        assert int(final["state_dict"]["bn1.num_batches_tracked"]) == int(r["steps"])


def test_publish_copies_the_small_outputs(exp2, tmp_path):
    _, rep = exp2
    files = publish(rep, tmp_path / "docs")
    names = {p.relative_to(tmp_path / "docs").as_posix() for p in files}
    assert {"random_labels/summary.md", "random_labels/digits/results.csv", "random_labels/digits/correlations.csv",
            "random_labels/digits/vs_noise_correlations.csv", "random_labels/digits/unconverged.csv",
            "random_labels/digits/training.csv", "random_labels/digits/random_labels.png"} <= names  # fmt: skip
    assert not any(n.endswith(".pt") for n in names)
    assert "(in this folder)" in (tmp_path / "docs" / "random_labels" / "summary.md").read_text()


# ------------------------------------------------------------------ the analysis on a synthetic table
def _write_results(path, rows):
    """A results.csv of ``rows`` (dicts with the same keys) at ``path``."""
    path.parent.mkdir()
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def test_converged_filter_seed_spread_and_table(tmp_path):
    """keep_converged splits results.csv by train_loss; each seed's models are correlated alone."""
    spec = dataclasses.replace(
        load_spec("ns_regularization"), plateau=None
    )  # a LossTarget criterion
    study = Study(
        "s",
        "s",
        {},
        {},
        {"weight_decay": [0.0, 1e-4, 2e-4, 3e-4], "seed": [0, 1]},
        ["weight_decay"],
        "weight_decay",
    )
    rows = []
    for seed in (0, 1):
        for i, wd in enumerate(study.grid["weight_decay"]):
            gap = 0.1 + 0.01 * i + 0.001 * seed
            rows.append({"checkpoint": f"m{seed}{i}.pt", "status": "ok", "error": "",
                         "normalized_sharpness": gap * 10 + (0.05 if seed else 0.0), "normalized_sharpness_status": "ok",
                         "hessian_trace": -gap if seed == 0 else gap, "hessian_trace_status": "ok",
                         "train_loss": 0.005 if i < 3 or seed == 0 else 0.02, "train_acc": 1.0, "test_loss": 1.0,
                         "test_acc": 1 - gap, "gen_gap": gap, "hp_weight_decay": wd, "hp_seed": seed})  # fmt: skip
    res = _write_results(tmp_path / "results" / "results.csv", rows)
    exp = Experiment(spec, tmp_path, log=lambda m: None)
    conv, unconv, kept = exp.keep_converged(res)
    assert (
        kept == 7
        and [u["checkpoint"] for u in unconv] == ["m13.pt"]
        and unconv[0]["train_loss"] == "0.02"
    )
    _, listed = _rows(tmp_path / "results" / "unconverged.csv")
    assert listed[0]["hp_weight_decay"] == "0.0003"
    spread = exp.seed_spread(study, conv)
    by = {(r["measure"], r["seed"]): r for r in spread}
    assert by[("normalized_sharpness", 0)]["kendall_tau_b"] == pytest.approx(1.0)
    assert by[("hessian_trace", 0)]["kendall_tau_b"] == pytest.approx(-1.0)
    assert (
        by[("hessian_trace", 1)]["kendall_tau_b"] == pytest.approx(1.0)
        and by[("hessian_trace", 1)]["n"] == 3
    )
    assert (tmp_path / "results" / "by_seed" / "results_seed1.csv").is_file()
    rep = exp.correlate(conv, study, tmp_path / "results", False)
    o = StudyOutcome("s", tmp_path, models=8, converged=7, correlation=rep, by_seed=spread)
    table = "\n".join(correlation_table(spec, study, o))
    # without a bootstrap the cells carry {min, max} over the seeds' own correlations
    assert (
        "| `normalized_sharpness` | 7 |" in table
        and "{+1.00, +1.00}" in table
        and "{-1.00, +1.00}" in table
    )
    assert "+0.73 | +0.92 |" in table  # the paper's Pearson values beside ours
    assert (
        "(1,000 resamples, seed 0)" in table
    )  # the spec's bootstrap, as correlations.csv was made
    # with one, the bootstrap interval that `flatcli correlate --bootstrap 200 --seed 0` prints
    rep = exp.correlate(conv, study, None, False, bootstrap=200)
    iv = next(m for m in rep.measures if m.measure == "hessian_trace").intervals["kendall_tau_b"]
    table = "\n".join(
        correlation_table(
            spec,
            study,
            StudyOutcome("s", tmp_path, models=8, converged=7, correlation=rep, by_seed=spread),
        )
    )
    assert f"[{iv.lo:+.2f}, {iv.hi:+.2f}]" in table and iv.lo < iv.hi
    assert exp.correlate_command(study, "s").endswith("--by weight_decay --bootstrap 1000 --seed 0")


def test_plateau_studies_are_filtered_by_the_recorded_criterion(tmp_path):
    """With a plateau criterion the manifest's ``converged`` (``hp_converged`` in results.csv), not
    the train loss, decides: a model on a plateau above the target loss is kept, one that missed
    the criterion is left out, and `flatcli correlate --where "hp_converged == 1"` does the same."""
    spec = dataclasses.replace(
        load_spec("ns_regularization"), bootstrap=100
    )  # the fewest resamples: a fast test
    assert isinstance(spec.criterion, Plateau)
    study = Study(
        "s",
        "s",
        {},
        {},
        {"l2": [0.0, 1e-3, 3e-3], "seed": [0, 1, 2]},
        ["l2"],
        "l2",
        compare=[("hessian_trace", "frobenius_norm")],
        subsets={"weak": "hp_l2 < 0.002", "none": "hp_l2 == 0"},
    )
    rows = []
    for seed in (0, 1, 2):
        for i, l2 in enumerate(study.grid["l2"]):
            gap = 0.3 - 0.05 * i + 0.01 * seed
            rows.append({"checkpoint": f"m{seed}{i}.pt", "status": "ok", "error": "", "hessian_trace": 1 / gap,
                         "hessian_trace_status": "ok", "frobenius_norm": (seed - 1) * gap, "frobenius_norm_status": "ok",
                         "train_loss": [0.008, 0.03, 0.2][i], "train_acc": [1.0, 1.0, 0.97][i],
                         "test_acc": 1 - gap, "gen_gap": gap, "hp_l2": l2, "hp_seed": seed,
                         "hp_converged": int(i < 2)})  # fmt: skip
    res = _write_results(tmp_path / "results" / "results.csv", rows)
    exp = Experiment(spec, tmp_path, log=lambda m: None)
    assert exp.converged_filter == ("hp_converged == 1", None)
    conv, unconv, kept = exp.keep_converged(res)
    assert kept == 6 and [u["checkpoint"] for u in unconv] == ["m02.pt", "m12.pt", "m22.pt"]
    assert (
        sorted(r["train_loss"] for r in _rows(conv)[1]) == ["0.008"] * 3 + ["0.03"] * 3
    )  # plateau models kept
    rep = exp.correlate(res, study, None, False)
    trace = next(m for m in rep.measures if m.measure == "hessian_trace")
    assert trace.n == 6 and trace.kendall_tau_b == pytest.approx(-1.0)
    assert exp.correlate_command(study, "s") == ('flatcli correlate s/results/results.csv --where "hp_converged == 1" '
                                                 "--by l2 --bootstrap 100 --seed 0")  # fmt: skip
    res_cli = runner.invoke(
        app, ["correlate", str(res), "--where", "hp_converged == 1", "--by", "l2"]
    )
    assert res_cli.exit_code == 0 and "dropped 3 of 9 rows: m02.pt, m12.pt, m22.pt" in _out(res_cli)
    # the study's compare pairs and subsets, on the same converged models
    comp = exp.compare(study, res, tmp_path / "comparisons.csv")
    assert list(comp["n"]) == [6, 6, 6] and comp.iloc[0]["a"] == pytest.approx(-1.0)
    weak = exp.subset(study, res, "weak", "hp_l2 < 0.002", tmp_path / "weak")
    assert weak["axes"] == ["l2"] and weak["where"] == "(hp_converged == 1) and (hp_l2 < 0.002)"
    assert {m.n for m in weak["correlation"].measures} == {6} and list(
        weak["comparisons"]["n"]
    ) == [6, 6, 6]
    none = exp.subset(study, res, "none", "hp_l2 == 0", tmp_path / "none")
    assert none["axes"] == [] and {m.n for m in none["correlation"].measures} == {
        3
    }  # l2 constant: no Ψ axis
    assert exp.correlate_command(study, "s", "hp_l2 == 0", []) == (
        'flatcli correlate s/results/results.csv --where "(hp_converged == 1) and (hp_l2 == 0)" --bootstrap 100 --seed 0'
    )
    assert (
        exp.subset(study, res, "few", "hp_l2 > 0.002", tmp_path / "few") is None
    )  # no converged model left
    lines = "\n".join(
        exp.subset_sections(study, StudyOutcome("s", tmp_path, 9, 6, subsets=[weak, none]))
    )
    assert (
        "### Subset: weak" in lines
        and '--where "(hp_converged == 1) and (hp_l2 < 0.002)" --by l2 ' in lines
    )
