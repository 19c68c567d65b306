"""The pandas table layer: results.csv ⇄ DataFrame, manifests, the DataFrame forms of the API."""

from __future__ import annotations

import csv
import io
import math
import subprocess
import sys

import pandas as pd
import pytest
import torch
import yaml

import flatcli
from flatcli import api
from flatcli.config import load_config
from flatcli.errors import ConfigError
from flatcli.loading.jobs import resolve_jobs
from flatcli.run.results import read_results, status_columns
from tests.helpers import write_project

MEASURES = [
    {"hessian_lambda_max": {"tol": 1e-3}},
    {"hessian_trace": {"min_probes": 8, "max_probes": 8}},
    "frobenius_norm",
]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """Three checkpoints from a manifest (int, float, text and blank hyperparameters), the third
    with the wrong width (an error row): the report and its results.csv."""
    from flatcli.demo.models import MLP

    tmp = tmp_path_factory.mktemp("tables")
    cfg = write_project(tmp / "proj", n_ckpt=2, measures=MEASURES)
    torch.save(MLP(16, 9, 1, 4).state_dict(), tmp / "proj" / "m2.pt")
    (tmp / "proj" / "man.csv").write_text(
        "path,lr,width,opt\nm0.pt,0.1,8,adam\nm1.pt,0.05,8,\nm2.pt,0.1,9,sgd\n"
    )
    d = yaml.safe_load(cfg.read_text())
    d["checkpoints"] = {"manifest": "man.csv"}
    cfg.write_text(yaml.safe_dump(d))
    report = flatcli.measure(cfg, outdir=tmp / "o")
    return report, tmp / "o" / "results.csv"


def documented_dtypes(table: pd.DataFrame) -> pd.DataFrame:
    """The dtypes flatcli documents (flatcli.run.results), applied by hand to what pd.read_csv gives."""
    out = table.copy()
    out["checkpoint"] = out["checkpoint"].astype(str)
    out["error"] = out["error"].fillna("").astype(str)
    for c in out.columns:
        if c == "status" or (c.endswith("_status") and c[: -len("_status")] in out.columns):
            out[c] = out[c].astype("category")
        elif out[c].dtype == object and out[c].dropna().isin([True, False]).all():
            out[c] = out[c].astype("boolean")
        elif pd.api.types.is_bool_dtype(out[c]):
            out[c] = out[c].astype("boolean")
        elif pd.api.types.is_numeric_dtype(out[c]):
            out[c] = out[c].astype("float64")
    return out


# ------------------------------------------------------------------ results.csv ⇄ DataFrame
def test_measure_to_pandas_equals_read_csv_of_results(measured):
    report, path = measured
    df = report.to_pandas()
    with open(path) as f:
        header = next(csv.reader(f))
    assert list(df.columns) == header  # the column contract: the same columns, the same order
    pd.testing.assert_frame_equal(df, documented_dtypes(pd.read_csv(path)), check_exact=True)
    pd.testing.assert_frame_equal(df, read_results(path), check_exact=True)
    # dtypes: numeric float64, statuses categorical, booleans nullable, text as text
    assert isinstance(df["status"].dtype, pd.CategoricalDtype) and set(
        df["status"].cat.categories
    ) == {"ok", "error"}
    assert all(isinstance(df[c].dtype, pd.CategoricalDtype) for c in status_columns(df.columns))
    for c in (
        "hessian_trace",
        "hessian_trace_stderr",
        "frobenius_norm",
        "train_loss",
        "gen_gap",
        "hp_lr",
        "hp_width",
    ):
        assert df[c].dtype == "float64", c
    assert str(df["hessian_lambda_max_converged"].dtype) == "boolean"
    assert df["hp_opt"].tolist()[0] == "adam" and pd.isna(df["hp_opt"].tolist()[1])
    # values are exactly the rows' values (floats written with their repr read back bit for bit)
    for i, row in enumerate(report.rows[:2]):
        for lab, res in row.results.items():
            assert df.loc[i, lab] == res.value
        assert df.loc[i, "train_loss"] == row.metrics["train_loss"]
    assert df.loc[2, "status"] == "error" and "does not match the model" in df.loc[2, "error"]
    assert math.isnan(df.loc[2, "frobenius_norm"]) and df.loc[0, "error"] == ""


def test_results_csv_keeps_its_text_form(measured):
    report, path = measured
    text = path.read_text()
    rows = list(csv.DictReader(io.StringIO(text)))
    assert [r["hp_width"] for r in rows] == ["8", "8", "9"]  # integers stay integers
    assert rows[0]["frobenius_norm"] == repr(report.rows[0].results["frobenius_norm"].value)
    assert rows[2]["frobenius_norm"] == ""  # missing: an empty field


def test_read_results_of_an_older_results_csv(tmp_path):
    # written by flatcli's former csv.DictWriter: NaN as "nan", empty statuses, ints
    old = (
        "checkpoint,status,error,mu,mu_status,mu_seconds,gen_gap,hp_w\n"
        "a.pt,ok,,0.5,ok,1.0,0.1,4\n"
        'b.pt,error,"mu: boom, ""x""",nan,error,,0.2,8\n'
    )
    (tmp_path / "results.csv").write_text(old)
    df = read_results(tmp_path / "results.csv")
    assert df["error"].tolist() == ["", 'mu: boom, "x"']
    assert df["mu"].dtype == "float64" and math.isnan(df.loc[1, "mu"]) and df.loc[0, "mu"] == 0.5
    assert isinstance(df["mu_status"].dtype, pd.CategoricalDtype) and df["hp_w"].tolist() == [
        4.0,
        8.0,
    ]
    rep = api.correlate_report(tmp_path / "results.csv")
    assert rep.measures[0].measure == "mu" and rep.measures[0].n == 1


def test_collect_returns_the_table(measured, tmp_path):
    report, path = measured
    cfg = report.config
    api.sweep(cfg, tmp_path / "s", log=lambda m: None)
    df = flatcli.collect(tmp_path / "s")
    assert isinstance(df, pd.DataFrame) and len(df) == 3
    pd.testing.assert_frame_equal(
        df, read_results(tmp_path / "s" / "results.csv"), check_exact=True
    )
    pd.testing.assert_frame_equal(
        df, api.collect_report(tmp_path / "s").to_pandas(), check_exact=True
    )
    pd.testing.assert_frame_equal(
        df.drop(columns=[c for c in df if c.endswith("_seconds")]),
        report.to_pandas().drop(columns=[c for c in df if c.endswith("_seconds")]),
        check_exact=True,
    )


def test_correlate_takes_a_dataframe_and_returns_one(measured, tmp_path):
    report, path = measured
    df = report.to_pandas()
    by_path = api.correlate_report(path, outdir=tmp_path / "c")
    df.attrs["big"] = list(range(10))  # the caller's attrs are not carried into the computation
    table = flatcli.correlate(df)
    assert isinstance(table, pd.DataFrame) and table.attrs["report"].source is None
    assert set(table.attrs) == {"report"} and table.attrs["report"].table is None
    assert table["measure"].tolist() == [mc.measure for mc in by_path.measures]
    assert table.attrs["report"].measures_source.startswith("inferred")
    written = pd.read_csv(tmp_path / "c" / "correlations.csv")
    for col in ("n", "kendall_tau_b", "jiang_tau", "spearman", "pearson", "cmi"):
        pd.testing.assert_series_equal(
            table[col], written[col], check_dtype=False, check_exact=True
        )
    pd.testing.assert_frame_equal(table, by_path.to_pandas(), check_exact=True)


@pytest.mark.slow
def test_pandas_is_not_imported_by_flatcli_or_the_cli():
    code = "import sys, flatcli, flatcli.cli, flatcli.api, flatcli.run.results; print('pandas' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------ manifests
def _manifest_cfg(tmp_path, text: str):
    tmp_path.joinpath("man.csv").write_text(text)
    for name in ("a.pt", "b.pt", "init.pt"):
        tmp_path.joinpath(name).write_bytes(b"")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        yaml.safe_dump({"model": {"target": "x:Y"}, "checkpoints": {"manifest": "man.csv"}})
    )
    return load_config(cfg)


def test_manifest_read_by_pandas_keeps_the_coercion(tmp_path):
    cfg = _manifest_cfg(
        tmp_path,
        "path,init_checkpoint,lr,width,opt,note,\na.pt,init.pt,0.1,8,adam,,\nb.pt,,1e-3,16,sgd,x\n",
    )
    a, b = resolve_jobs(cfg)
    assert a.hparams == {
        "lr": 0.1,
        "width": 8,
        "opt": "adam",
        "note": "",
    }  # blank stays "", unnamed column left out
    assert b.hparams == {"lr": 0.001, "width": 16, "opt": "sgd", "note": "x"}
    assert type(a.hparams["width"]) is int and type(a.hparams["lr"]) is float
    assert a.init_checkpoint == tmp_path / "init.pt" and b.init_checkpoint is None


@pytest.mark.parametrize(
    ("text", "message"),
    [("", "needs a 'path' column"), ("ckpt,lr\na.pt,1\n", "needs a 'path' column")],
)
def test_manifest_errors_name_the_file(tmp_path, text, message):
    cfg = _manifest_cfg(tmp_path, text)
    with pytest.raises(ConfigError, match=message) as e:
        resolve_jobs(cfg)
    assert "man.csv" in str(e.value) and "\n" not in str(e.value)
