"""Experiment 6 (modular addition): the ``modular_addition`` data source, the transformer (its
logits, and its second derivatives through the engine against a dense float64 Hessian, attention
included), integer token ids through training and measurement, grid axes over
``data.train.kwargs``, and a smoke of train → sweep → collect → correlate at the tiniest size."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch
import yaml
from torch.func import functional_call

from flatcli.config import DataSource
from flatcli.engine import Batch
from flatcli.errors import ConfigError
from flatcli.experiments import load_spec, run_experiment
from flatcli.experiments.spec import merge
from flatcli.experiments.transformer import ModularTransformer
from flatcli.loading.data import load_split, modular_addition_split
from flatcli.run.measuring import measure_model
from tests.oracles import model_hessian

SPEC = (
    Path(__file__).resolve().parents[2]
    / "flatcli"
    / "experiments"
    / "specs"
    / "modular_addition.yaml"
)


def split(name, seed=0, **kwargs):
    return modular_addition_split(name, kwargs, seed=seed)


# ------------------------------------------------------------------ the data source
def test_splits_sizes_labels_and_disjointness():
    p = 13
    tr, te = (
        split("train", p=p, train_fraction=0.4, test_fraction=0.3),
        split("test", p=p, test_fraction=0.3),
    )
    # test: round(0.3 · 169) = 51 pairs; train: rounded cumulatively, round(0.7 · 169) − 51 = 67
    assert te.rows == 51 and tr.rows == 67
    for b in (tr, te):
        x, y = b["x"], b["labels"]
        assert x.dtype == torch.int64 and y.dtype == torch.int64 and x.shape[1] == 3
        assert ((x[:, 0] + x[:, 1]) % p == y).all() and (x[:, 2] == p).all()  # the '=' token is p
        assert ((x[:, :2] >= 0) & (x[:, :2] < p)).all()
    pairs = lambda b: set(map(tuple, b["x"][:, :2].tolist()))  # noqa: E731
    assert not pairs(tr) & pairs(te) and len(pairs(tr)) == tr.rows
    # the test split does not depend on the training fraction; smaller training sets are subsets
    assert torch.equal(te["x"], split("test", p=p, train_fraction=0.6, test_fraction=0.3)["x"])
    assert pairs(tr) < pairs(split("train", p=p, train_fraction=0.6, test_fraction=0.3))
    # fractions summing to 1: every pair once (Power et al.'s split)
    assert (
        len(pairs(split("train", p=p, train_fraction=0.7, test_fraction=0.3)) | pairs(te)) == p * p
    )
    assert not torch.equal(
        split("test", seed=1, p=p, test_fraction=0.3)["x"], te["x"]
    )  # the seed draws the split


@pytest.mark.parametrize("kwargs, match", [
    ({"p": 1}, "p must be an int ≥ 2"),
    ({"train_fraction": 0.8}, "must be ≤ 1"),
    ({"test_fraction": 0.0}, "fraction in"),
    ({"train_frac": 0.5}, "Did you mean 'train_fraction'"),
])  # fmt: skip
def test_bad_parameters_are_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        modular_addition_split("train", kwargs)


def test_the_config_source_keeps_integer_ids_and_refuses_normalize():
    src = DataSource(source="modular_addition", kwargs={"p": 7, "train_fraction": 0.5})
    b = load_split(src, "train", Path("."))
    assert b["x"].dtype == torch.int64 and b.target_key == "labels"
    assert b.to(dtype=torch.float64)["x"].dtype == torch.int64  # Batch.to casts floats only
    with pytest.raises(ConfigError, match="normalize does not apply"):
        load_split(src, "train", Path("."), normalize={"mean": [0.0], "std": [1.0]})


# ------------------------------------------------------------------ the model
def tiny(seed=0, layers=1):
    torch.manual_seed(seed)
    return ModularTransformer(p=5, d_model=4, heads=2, d_mlp=6, layers=layers).double().eval()


@pytest.mark.parametrize("layers", [1, 2])
def test_last_position_shortcut_equals_the_full_last_block(layers):
    """The last block computes only the last position; running it on every position and reading
    the last one gives the same logits."""
    m = tiny(layers=layers)
    x = split("train", p=5, train_fraction=0.7)["x"]
    h = m.embed(x) + m.pos
    for b in m.blocks:
        h = h + b.attn(h)
        h = h + b.mlp(h)
    assert torch.allclose(m(x), m.unembed(h[:, -1]), atol=1e-12)
    with pytest.raises(TypeError, match="integer token ids"):
        m(x.double())


@pytest.mark.slow
@pytest.mark.parametrize("include", [None, "blocks.0.attn."])
def test_lambda_max_and_trace_match_a_dense_float64_hessian(include):
    """λmax (Lanczos) and the exact trace through flatcli, in uneven batches of 7, equal those of a
    dense float64 Hessian of the cross-entropy: the whole model, and the attention block alone."""
    m = tiny(layers=2)
    b = split("train", p=5, train_fraction=0.7)
    H = model_hessian(
        m,
        lambda ps: torch.nn.functional.cross_entropy(
            functional_call(m, ps, (b["x"],)), b["labels"]
        ),
        include,
    )
    row = measure_model(
        m,
        b,
        [
            {"hessian_lambda_max": {"tol": 1e-8, "max_steps": 300}},
            {"hessian_trace": {"method": "exact"}},
        ],
        precision="fp64",
        batch_size=7,
        params={"include": [f"{include}*"]} if include else None,
    )
    assert row.status == "ok", row.errors
    lam, tr = float(torch.linalg.eigvalsh(H)[-1]), float(H.diagonal().sum())
    assert abs(row.results["hessian_lambda_max"].value - lam) <= 1e-4 * abs(lam)
    assert abs(row.results["hessian_trace"].value - tr) <= 1e-4 * abs(tr)


# ------------------------------------------------------------------ grid axes over data.train.kwargs
def test_train_fraction_is_a_data_axis_and_the_test_set_is_shared(tmp_path):
    """A key of data.train.kwargs is a grid axis (a data axis); one that data.test.kwargs sets too is
    refused (every model of a study is tested on the same set)."""
    st = load_spec("modular_addition").studies[0]
    assert st.data_axes == ["train_fraction"] and "train_fraction" not in st.model_axes
    assert st.axes == ["train_fraction", "weight_decay"]
    raw = yaml.safe_load(SPEC.read_text())
    raw["studies"]["p59"]["data"]["test"]["kwargs"]["train_fraction"] = 0.5
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="grid.*unknown key 'train_fraction'"):
        load_spec(tmp_path / "bad.yaml")


# ------------------------------------------------------------------ end to end
def tiny_spec(tmp_path: Path) -> Path:
    raw = yaml.safe_load(SPEC.read_text())
    raw["quick"] = merge(raw["quick"], {
        "bootstrap": 0, "target_loss": 0.5,
        "model": {"kwargs": {"p": 7, "d_model": 8, "heads": 2}},
        "data": {"train": {"source": "modular_addition", "kwargs": {"p": 7, "train_fraction": 0.5, "test_fraction": 0.3}},
                 "test": {"source": "modular_addition", "kwargs": {"p": 7, "test_fraction": 0.3}}},
        "training": {"max_steps": 200, "lr": 0.03},
        "grid": {"train_fraction": [0.4, 0.7], "weight_decay": [0.0, 1.0], "seed": [0]},
        "measures": [{"hessian_lambda_max": {"tol": 1e-3}}, {"relative_flatness": {"normalize_features": True}}],
    })  # fmt: skip
    raw["quick"]["measure_options"] = {"hessian_lambda_max": {"max_steps": 20}}
    path = tmp_path / "modular_addition.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.mark.slow
def test_smoke_train_sweep_collect_correlate(tmp_path):
    """Each model trains on its own fraction (saved, listed as train_data) with integer ids; flatcli's
    train loss is the training loop's eval-mode loss; the converged models are correlated and compared."""
    rep = run_experiment(
        tiny_spec(tmp_path), tmp_path / "out", quick=True, plots=False, log=lambda m: None
    )
    sd = tmp_path / "out" / "p59"
    with open(sd / "training.csv", newline="") as f:
        trained = {r["path"]: r for r in csv.DictReader(f)}
    assert {r["train_data"] for r in trained.values()} == {
        "data/train_fraction0.4.pt",
        "data/train_fraction0.7.pt",
    }
    for r in trained.values():
        saved = torch.load(sd / r["train_data"])
        own = modular_addition_split(
            "train", {"p": 7, "train_fraction": float(r["train_fraction"]), "test_fraction": 0.3}
        )
        assert (
            saved["x"].dtype == torch.int64
            and torch.equal(saved["x"], own["x"])
            and torch.equal(saved["labels"], own["labels"])
        )
    with open(sd / "results" / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows)
    for r in rows:  # measured on the model's own training set, in the same eval mode
        t = trained[r["checkpoint"]]
        assert math.isclose(float(r["train_loss"]), float(t["train_loss"]), rel_tol=1e-5)
        assert math.isclose(float(r["train_acc"]), float(t["train_acc"]))
    o = rep.studies[0]
    assert o.correlation is not None and o.converged == 4 - len(o.unconverged)
    assert {m.measure for m in o.correlation.measures} == {
        "hessian_lambda_max",
        "relative_flatness",
    }
    comps = o.extra["comparisons"]
    assert {c["statistic"] for c in comps} == {"kendall_tau_b", "spearman", "pearson"}
    assert "Paired bootstrap" in rep.summary.read_text()


def test_batch_roundtrip_of_a_saved_training_set(tmp_path):
    """A tensors file holding x (int64) and labels keeps the ids as integers (no float cast)."""
    b = split("train", p=5, train_fraction=0.5)
    torch.save(dict(b), tmp_path / "t.pt")
    back = load_split(DataSource(source="tensors", path=str(tmp_path / "t.pt")), "train", tmp_path)
    assert (
        isinstance(back, Batch)
        and back["x"].dtype == torch.int64
        and torch.equal(back["x"], b["x"])
    )
