"""The experiment package: specs, training to a loss target, and every experiment's --quick
mode end to end (train → manifest → flatcli sweep → collect → converged filter → correlate)."""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path

import pytest
import torch
import yaml

from flatcli.config import load_config
from flatcli.errors import ConfigError
from flatcli.experiments import available, load_spec, run_experiment
from flatcli.experiments.__main__ import main
from flatcli.experiments.pipeline import Experiment
from flatcli.experiments.training import noisy_labels, train_to_target

pytest.importorskip("mnist1d")

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = ["ns_regularization", "random_labels", "relative_flatness", "reparameterization", "cifar10_resnet18"]


def _rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="") as f:
        r = csv.DictReader(f)
        return list(r.fieldnames or []), list(r)


def _labels(study) -> list[str]:
    from flatcli.config import parse_measures

    return [s.label for s in parse_measures(study.flatcli["measures"])]


# ------------------------------------------------------------------ specs
def test_every_experiment_has_a_spec():
    assert available() == sorted(EXPERIMENTS)


@pytest.mark.parametrize("name", EXPERIMENTS)
@pytest.mark.parametrize("quick", [False, True])
def test_specs_load_and_follow_the_rules(name, quick):
    spec = load_spec(name, quick=quick)
    assert spec.name == name and spec.studies
    if not quick:
        assert spec.target_loss == 0.01  # Jiang et al. 2020's target
    for st in spec.studies:
        assert "seed" in st.grid and all(a in st.grid for a in st.axes)
        assert _labels(st)
        if not quick and name in ("ns_regularization", "relative_flatness"):
            assert len(st.points()) >= 24 and len(st.grid["seed"]) >= 2
        if not quick and name == "ns_regularization":
            assert max(st.grid["weight_decay"]) <= 5e-4  # the target stays reachable


def test_quick_measure_options_keep_labels_and_columns():
    full, quick = load_spec("ns_regularization"), load_spec("ns_regularization", quick=True)
    for a, b in zip(full.studies, quick.studies, strict=True):
        assert _labels(a) == _labels(b)
    ns = [m for m in quick.studies[0].flatcli["measures"] if isinstance(m, dict) and "normalized_sharpness" in m]
    assert ns == [{"normalized_sharpness": {"samples": 8}}]  # the quick options merged into the default NS


def test_exp1_paper_values_from_tsuzuku_tables():
    p = load_spec("ns_regularization").paper
    assert p["columns"] == ["MNIST MLP", "CIFAR-10 MLP"]
    assert p["values"] == {"normalized_sharpness": [0.73, 0.92], "hessian_trace": [-0.62, -0.42], "frobenius_norm": [0.58, 0.72]}


def test_shipped_cifar_configs_match_the_spec():
    spec = load_spec("cifar10_resnet18")
    for st in spec.studies:
        cfg = load_config(ROOT / "configs" / f"cifar10_resnet18_{st.name}.yaml")
        assert [s.label for s in cfg.measure_specs()] == _labels(st)
        assert cfg.model.target == st.flatcli["model"]["target"]
        assert isinstance(cfg.checkpoints, dict) and "manifest" in cfg.checkpoints


def _write_spec(tmp_path: Path, **over) -> Path:
    raw = yaml.safe_load((ROOT / "flatcli" / "experiments" / "specs" / "ns_regularization.yaml").read_text())
    for k, v in over.items():
        cur = raw
        keys = k.split(".")
        for kk in keys[:-1]:
            cur = cur[kk]
        cur[keys[-1]] = v
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"studie": {}}, r"unknown key 'studie'. Did you mean 'studies'\?"),
        ({"studies.digits.grid": {"weight_decay": [0.0], "batch_sise": [32]}}, r"grid .*unknown key 'batch_sise'. Did you mean 'batch_size'\?"),
        ({"training": {"optimizer": "rmsprop"}}, r"optimizer must be one of sgd, adam; got 'rmsprop'"),
        ({"training": {"momentum": 1.0}}, r"momentum must be a number in \[0, 1\); got 1.0"),
        ({"studies.digits.grid": {"max_steps": [10, 20]}}, r"max_steps is a training setting, not a grid axis"),
        ({"axes": ["width"]}, r"axes: 'width' is not a grid axis"),
        ({"quick": {"measure_options": {"local_entropy": {"gamma": 2.0}}}}, r"'local_entropy' is not among the configured measures"),
        ({"measures": ["hessian_trac"]}, r"studies\.\w+: Unknown measure 'hessian_trac'. Did you mean 'hessian_trace'\?"),
        ({"target_loss": 0}, r"target_loss must be a positive number; got 0"),
        ({"studies.digits.grid": {"seed": [0, 0]}}, r"grid.seed repeats a value"),
    ],
)
def test_bad_specs_are_one_line_config_errors(tmp_path, over, match):
    path = _write_spec(tmp_path, **over)
    with pytest.raises(ConfigError, match=match):
        load_spec(path, quick=True)


def test_unknown_experiment_suggests_and_exits_2(capsys):
    with pytest.raises(ConfigError, match=r"unknown experiment 'random_label'; did you mean 'random_labels'\?"):
        load_spec("random_label")
    assert main(["random_label", "--quick"]) == 2
    assert "error: unknown experiment" in capsys.readouterr().err
    assert main(["list"]) == 0
    assert "ns_regularization" in capsys.readouterr().out


# ------------------------------------------------------------------ training
def _tiny_problem(seed=0, n=60):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    return x, y


def _tiny_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


TRAIN = {"optimizer": "adam", "lr": 0.02, "lr_factor": 1.0, "batch_size": 16, "weight_decay": 1e-4,
         "momentum": 0.9, "max_steps": 3000, "eval_every": None}  # fmt: skip


def test_train_to_target_stops_at_the_eval_mode_target_and_is_deterministic():
    x, y = _tiny_problem()
    a, b = _tiny_model(), _tiny_model()
    ra = train_to_target(a, x, y, TRAIN, seed=3, target=0.05)
    rb = train_to_target(b, x, y, TRAIN, seed=3, target=0.05)
    assert ra.reached_target and ra.train_loss <= 0.05 and not ra.diverged
    with torch.no_grad():
        assert float(torch.nn.functional.cross_entropy(a.eval()(x), y)) == pytest.approx(ra.train_loss, rel=1e-6)
    assert (ra.steps, ra.train_loss) == (rb.steps, rb.train_loss)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert ra.steps % 4 == 0  # checked once per epoch (60 samples / 16 → 4 steps)


def test_train_to_target_records_a_miss_and_a_divergence():
    x, y = _tiny_problem()
    r = train_to_target(_tiny_model(), x, y, {**TRAIN, "max_steps": 5}, seed=0, target=1e-4)
    assert not r.reached_target and r.steps == 5 and math.isfinite(r.train_loss)
    r = train_to_target(_tiny_model(), x * 1e4, y, {**TRAIN, "optimizer": "sgd", "lr": 1e3}, seed=0, target=1e-4)
    assert not r.reached_target and r.diverged and r.steps < TRAIN["max_steps"]


def test_weight_decay_only_on_weights():
    from flatcli.experiments.training import _optimizer

    opt = _optimizer(_tiny_model(), {**TRAIN, "optimizer": "sgd", "weight_decay": 5e-4})
    decayed = [p.ndim for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]]
    plain = [p.ndim for g in opt.param_groups if g["weight_decay"] == 0 for p in g["params"]]
    assert decayed == [2, 2] and plain == [1, 1]


def test_noisy_labels_are_seeded_nested_and_of_the_right_fraction():
    y = torch.arange(1000) % 10
    a = noisy_labels(y, 0.4, seed=1, num_classes=10)
    assert torch.equal(a, noisy_labels(y, 0.4, seed=1, num_classes=10))
    changed = (a != y).float().mean().item()
    assert 0.4 * 0.8 < changed <= 0.4  # a random class may equal the true one (p = 1/10)
    b = noisy_labels(y, 0.8, seed=1, num_classes=10)
    assert bool(((a != y) <= (b != y)).all())  # the corrupted sets are nested
    assert torch.equal(noisy_labels(y, 0.0, seed=1, num_classes=10), y)


def test_parallel_training_gives_the_same_checkpoints(tmp_path):
    """Two spawned workers (one thread each) write the same weights as one process does."""
    spec = load_spec("ns_regularization", quick=True)
    study = spec.studies[1]  # digits
    exp = Experiment(spec, tmp_path / "a", jobs=1, log=lambda m: None)
    rec1 = exp.train(study, tmp_path / "a" / "digits")
    exp2 = Experiment(spec, tmp_path / "b", jobs=2, log=lambda m: None)
    rec2 = exp2.train(study, tmp_path / "b" / "digits")
    assert [r["result"]["steps"] for r in rec1] == [r["result"]["steps"] for r in rec2]
    for r in rec1:
        a = torch.load(tmp_path / "a" / "digits" / r["row"]["path"], weights_only=True)["state_dict"]
        b = torch.load(tmp_path / "b" / "digits" / r["row"]["path"], weights_only=True)["state_dict"]
        assert all(torch.equal(a[k], b[k]) for k in a)
    _, m = _rows(tmp_path / "a" / "digits" / "manifest.csv")
    assert list(m[0]) == ["path", "init_checkpoint", "weight_decay", "batch_size", "lr", "seed"]


# ------------------------------------------------------------------ quick modes, end to end
def _check_study(out: Path, spec, study, *, converged_min: int = 3) -> tuple[list[str], list[dict[str, str]]]:
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
    _, conv = _rows(sd / "results" / "results_converged.csv")
    _, unconv = _rows(sd / "results" / "unconverged.csv")
    assert len(conv) + len(unconv) == len(rows) and len(conv) >= converged_min
    assert all(float(r["train_loss"]) <= spec.target_loss for r in conv)
    assert all(float(r["train_loss"]) > spec.target_loss for r in unconv)
    return labels, conv


def _check_correlations(sd: Path, labels: list[str], n_conv: int, axes: list[str]) -> None:
    cols, corr = _rows(sd / "results" / "correlations.csv")
    assert sorted(r["measure"] for r in corr) == sorted(labels)
    assert {"pearson", "kendall_tau_b", "psi", "cmi"} <= set(cols)
    assert all(f"psi_{a}" in cols for a in axes)
    assert max(int(r["n"]) for r in corr) == n_conv


def test_quick_ns_regularization(tmp_path):
    out = tmp_path / "exp1"
    rep = run_experiment("ns_regularization", out, quick=True, log=lambda m: None)
    spec = rep.spec
    for st in spec.studies:
        labels, conv = _check_study(out, spec, st)
        _check_correlations(out / st.name, labels, len(conv), st.axes)
        assert (out / st.name / "results" / "plots" / "scatter_all.png").is_file()
    text = rep.summary.read_text()
    assert "| `normalized_sharpness` |" in text and "+0.73 | +0.92 |" in text and "quick mode" in text
    # rerunning reuses the models and the sweep, and gives the same table
    before = (out / "digits" / "results" / "results.csv").read_text()
    logs: list[str] = []
    run_experiment("ns_regularization", out, quick=True, studies=["digits"], plots=False, log=logs.append)
    assert any("reusing the 4 trained models" in m for m in logs)
    assert any("0 to run" in m for m in logs)
    assert (out / "digits" / "results" / "results.csv").read_text() == before
    # the summary's work figures come from the files, so a rerun that reuses everything keeps them
    from flatcli.experiments.pipeline import work_seconds

    train_s, measure_s = work_seconds(out / "digits")
    assert train_s > 0 and measure_s > 0
    assert f"Work: training {train_s:.0f} s and measurement {measure_s:.0f} s" in (out / "summary.md").read_text()


@pytest.fixture(scope="module")
def exp2(tmp_path_factory):
    out = tmp_path_factory.mktemp("exp2")
    return out, run_experiment("random_labels", out, quick=True, log=lambda m: None)


def test_quick_random_labels(exp2):
    out, rep = exp2
    (st,) = rep.spec.studies
    labels, conv = _check_study(out, rep.spec, st)
    _check_correlations(out / st.name, labels, len(conv), ["label_noise"])
    _, man = _rows(out / st.name / "manifest.csv")
    assert all(r["train_data"].startswith("data/train_noise") for r in man)
    assert len({r["train_data"] for r in man}) == len(man)  # one label set per fraction and seed
    _, unconv = _rows(out / st.name / "results" / "unconverged.csv")
    assert unconv and all(r["hp_label_noise"] == "1.0" for r in unconv)  # random labels: not fitted in 300 steps
    cols, vs = _rows(out / st.name / "results" / "vs_noise" / "correlations.csv")
    assert sorted(r["measure"] for r in vs) == sorted(labels)
    assert (out / st.name / "results" / "plots" / "random_labels.png").is_file()
    assert "Against the random-label fraction" in rep.summary.read_text()


def test_quick_relative_flatness(tmp_path):
    out = tmp_path / "exp3"
    rep = run_experiment("relative_flatness", out, quick=True, plots=False, log=lambda m: None)
    for st in rep.spec.studies:
        labels, conv = _check_study(out, rep.spec, st)
        assert labels[:2] == ["relative_flatness", "relative_flatness_normalized"]
        _check_correlations(out / st.name, labels, len(conv), st.axes)
        _, train = _rows(out / st.name / "training.csv")
        assert {r["lr_effective"] for r in train} == {"0.1", "0.01"}  # lr per optimizer × lr_factor


def test_quick_reparameterization(tmp_path):
    out = tmp_path / "exp4"
    rep = run_experiment("reparameterization", out, quick=True, log=lambda m: None)
    for st in rep.spec.studies:
        sd = out / st.name
        _, man = _rows(sd / "manifest.csv")
        assert [(r["transform"], r["scale"]) for r in man] == [
            ("none", "1.0"), ("layer", "10.0"), ("layer", "1000.0"), ("node", "10.0"), ("node", "1000.0")]
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
    assert "| `hessian_trace` | no |" in rep.summary.read_text()
    # rerunning reuses the trained networks and rescales them again, not their copies
    logs: list[str] = []
    run_experiment("reparameterization", out, quick=True, studies=["digits_mlp"], plots=False, log=logs.append)
    assert any("reusing the 1 trained models" in m for m in logs) and any("0 to run" in m for m in logs)
    assert len(_rows(out / "digits_mlp" / "manifest.csv")[1]) == 5


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("FLATCLI_SLOW_TESTS"), reason="set FLATCLI_SLOW_TESTS=1 (ResNet-18s on the CPU, ~20 s)")
def test_quick_cifar10_resnet18_on_synthetic_data(tmp_path):
    out = tmp_path / "exp5"
    rep = run_experiment("cifar10_resnet18", out, quick=True, plots=False, log=lambda m: None)
    for st in rep.spec.studies:
        _check_study(out, rep.spec, st, converged_min=0)


def test_cifar10_resnet18_trains_one_grid_point(tmp_path):
    """The GPU recipe's training step runs (CPU, synthetic CIFAR-shaped data, width-4 ResNet-18)."""
    from flatcli.experiments.training import train_task

    spec = load_spec("cifar10_resnet18", quick=True)
    st = spec.studies[0]
    hp = st.points()[1]
    rec = train_task({"flatcli": st.flatcli, "base_dir": str(spec.path.parent), "outdir": str(tmp_path), "name": "m",
                      "hp": hp, "training": {**st.training, **{k: v for k, v in hp.items() if k in st.training}},
                      "model_axes": st.model_axes, "target": spec.target_loss})  # fmt: skip
    assert rec["result"]["steps"] >= 1 and (tmp_path / "checkpoints" / "m.pt").is_file()
    obj = torch.load(tmp_path / "checkpoints" / "m.pt", weights_only=True)
    assert obj["model_kwargs"]["width"] == 4 and obj["hparams"] == hp


def test_publish_copies_the_small_outputs(exp2, tmp_path):
    from flatcli.experiments import publish

    _, rep = exp2
    files = publish(rep, tmp_path / "docs")
    names = {p.relative_to(tmp_path / "docs").as_posix() for p in files}
    assert {"random_labels/summary.md", "random_labels/digits/results.csv", "random_labels/digits/correlations.csv",
            "random_labels/digits/vs_noise_correlations.csv", "random_labels/digits/unconverged.csv",
            "random_labels/digits/training.csv", "random_labels/digits/random_labels.png"} <= names  # fmt: skip
    assert not any(n.endswith(".pt") for n in names)



def test_converged_filter_seed_spread_and_table(tmp_path):
    """keep_converged splits results.csv by train_loss; each seed's models are correlated alone."""
    from flatcli.experiments.pipeline import StudyOutcome, correlation_table
    from flatcli.experiments.spec import Study

    spec = load_spec("ns_regularization")
    study = Study("s", "s", {}, {}, {"weight_decay": [0.0, 1e-4, 2e-4, 3e-4], "seed": [0, 1]}, ["weight_decay"], "weight_decay")
    rows = []
    for seed in (0, 1):
        for i, wd in enumerate(study.grid["weight_decay"]):
            gap = 0.1 + 0.01 * i + 0.001 * seed
            rows.append({"checkpoint": f"m{seed}{i}.pt", "status": "ok", "error": "",
                         "normalized_sharpness": gap * 10 + (0.05 if seed else 0.0), "normalized_sharpness_status": "ok",
                         "hessian_trace": -gap if seed == 0 else gap, "hessian_trace_status": "ok",
                         "train_loss": 0.005 if i < 3 or seed == 0 else 0.02, "train_acc": 1.0, "test_loss": 1.0,
                         "test_acc": 1 - gap, "gen_gap": gap, "hp_weight_decay": wd, "hp_seed": seed})  # fmt: skip
    res = tmp_path / "results" / "results.csv"
    res.parent.mkdir()
    with open(res, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    exp = Experiment(spec, tmp_path, log=lambda m: None)
    conv, unconv, kept = exp.keep_converged(res)
    assert kept == 7 and [u["checkpoint"] for u in unconv] == ["m13.pt"] and unconv[0]["train_loss"] == "0.02"
    _, listed = _rows(tmp_path / "results" / "unconverged.csv")
    assert listed[0]["hp_weight_decay"] == "0.0003"
    spread = exp.seed_spread(study, conv)
    by = {(r["measure"], r["seed"]): r for r in spread}
    assert by[("normalized_sharpness", 0)]["kendall_tau_b"] == pytest.approx(1.0)
    assert by[("hessian_trace", 0)]["kendall_tau_b"] == pytest.approx(-1.0)
    assert by[("hessian_trace", 1)]["kendall_tau_b"] == pytest.approx(1.0) and by[("hessian_trace", 1)]["n"] == 3
    assert (tmp_path / "results" / "by_seed" / "results_seed1.csv").is_file()
    rep = exp.correlate(conv, study, tmp_path / "results", False)
    o = StudyOutcome("s", tmp_path, models=8, converged=7, correlation=rep, by_seed=spread)
    table = "\n".join(correlation_table(spec, study, o))
    # without a bootstrap the cells carry {min, max} over the seeds' own correlations
    assert "| `normalized_sharpness` | 7 |" in table and "{+1.00, +1.00}" in table and "{-1.00, +1.00}" in table
    assert "+0.73 | +0.92 |" in table  # the paper's Pearson values beside ours
    # with one, the bootstrap interval that `flatcli correlate --bootstrap 200 --seed 0` prints
    rep = exp.correlate(conv, study, None, False, bootstrap=200)
    iv = next(m for m in rep.measures if m.measure == "hessian_trace").intervals["kendall_tau_b"]
    table = "\n".join(correlation_table(spec, study, StudyOutcome("s", tmp_path, models=8, converged=7, correlation=rep, by_seed=spread)))
    assert f"[{iv.lo:+.2f}, {iv.hi:+.2f}]" in table and iv.lo < iv.hi
