"""One source of truth for hyperparameters: the manifest as the last run read it (the sweep's plan,
or the config at `measure --resume`) wins over the values stored beside reused results, so
`collect` and `measure --resume` show the same edited values."""

from __future__ import annotations

import csv

import pytest
import torch
import yaml

from flatcli import api
from flatcli.cli import app
from tests.oracles import runner


def project(tmp_path, lrs):
    from flatcli.demo.models import MLP

    for i in range(2):
        torch.manual_seed(i)
        torch.save(MLP(16, 8, 1, 4).state_dict(), tmp_path / f"m{i}.pt")
    (tmp_path / "man.csv").write_text(
        "path,lr,opt\n" + "".join(f"m{i}.pt,{lr},sgd\n" for i, lr in enumerate(lrs))
    )
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "model": {
                    "target": "flatcli.demo.models:MLP",
                    "kwargs": {"in_features": 16, "width": 8, "depth": 1, "num_classes": 4},
                },
                "checkpoints": {"manifest": "man.csv"},
                "hparams": {"from_keys": []},
                "data": {
                    "train": {
                        "source": "synthetic",
                        "num_samples": 20,
                        "input_shape": [16],
                        "num_classes": 4,
                    }
                },
                "measures": ["frobenius_norm"],
            }
        )
    )
    return cfg


def hp(csv_path, key="hp_lr"):
    return [r[key] for r in csv.DictReader(open(csv_path))]


@pytest.mark.parametrize("edit", [(0.5, 0.25), (3, 7)])
def test_an_edited_manifest_shows_in_collect_as_in_measure_resume(tmp_path, edit):
    cfg = project(tmp_path, (0.1, 0.2))
    assert api.sweep(cfg, tmp_path / "s", log=None).computed == 2
    assert runner.invoke(app, ["measure", "-c", str(cfg), "-o", str(tmp_path / "o")]).exit_code == 0
    project(tmp_path, edit)  # same checkpoints, new hyperparameters
    rep = api.sweep(cfg, tmp_path / "s", log=None)
    assert rep.computed == 0  # the values are reused: the checkpoints did not change
    res = runner.invoke(app, ["collect", str(tmp_path / "s")])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["measure", "-c", str(cfg), "-o", str(tmp_path / "o"), "--resume"])
    assert res.exit_code == 0, res.output
    want = [str(float(v)) if isinstance(v, float) else str(v) for v in edit]
    assert hp(tmp_path / "s" / "results.csv") == want
    assert hp(tmp_path / "o" / "results.csv") == want
    assert hp(tmp_path / "s" / "results.csv", "hp_opt") == ["sgd", "sgd"]
