"""A result's key (flatcli.keys): every input but a named list, data files, revisions, caps."""

from __future__ import annotations

import dataclasses
import json
import os

import pandas as pd
import pytest
import torch
import yaml

from flatcli import api
from flatcli.config import load_config
from flatcli.keys import NOT_IN_KEY, SPEC_NOT_IN_KEY, data_fingerprints, measure_hash
from flatcli.measures import MeasureSpec
from tests.helpers import write_project

LAM = {"hessian_lambda_max": {"tol": 1e-4}}


def _leaves(d, prefix=""):
    """Every leaf path of a plain config (dicts walked, anything else a leaf)."""
    for k, v in d.items():
        path = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict) and v and k not in ("kwargs", "normalize"):
            yield from _leaves(v, path)
        else:
            yield path


def _changed(v):
    """Another value of the same kind."""
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return v + 1
    if isinstance(v, float):
        return v + 0.5
    if isinstance(v, str):
        return v + "x"
    if isinstance(v, list):
        return [*v, "x"]
    if isinstance(v, dict):
        return {**v, "x": 1}
    return "x"  # None


def _set(d, path, value):
    *head, last = path.split(".")
    for p in head:
        d = d[p]
    d[last] = value


def _get(d, path):
    for p in path.split("."):
        d = d[p]
    return d


def _schema_config(tmp_path, precision):
    """A config with both splits and every key at some value (defaults written out)."""
    cfg = load_config(write_project(tmp_path, measures=[LAM]))
    d = cfg.to_dict(defaults=True)
    d["runtime"]["precision"] = precision
    d["data"]["normalize"] = {"mean": [0.0], "std": [1.0]}
    return d, cfg.measure_specs()[0]


def _walked_schema_keys():
    """Every leaf key of the config schema (the dataclasses), data splits as DataSource."""
    from flatcli.config import Config, DataSource, yaml_key

    def walk(cls, prefix):
        for f in dataclasses.fields(cls):
            if f.metadata.get("internal"):
                continue
            path = f"{prefix}.{yaml_key(f)}" if prefix else yaml_key(f)
            sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
            if path in ("data.train", "data.test"):
                yield from walk(DataSource, path)
            elif dataclasses.is_dataclass(sub):
                yield from walk(sub, path)
            else:
                yield path

    return set(walk(Config, ""))


@pytest.mark.parametrize("precision", ["fp32", "auto"])
def test_every_config_key_outside_the_named_list_changes_the_key(tmp_path, precision):
    base, spec = _schema_config(tmp_path, precision)
    leaves = set(_leaves(base))
    assert leaves == _walked_schema_keys()  # the walk covers every key of the schema
    assert set(NOT_IN_KEY) <= leaves
    h0 = measure_hash(base, spec)
    # with precision auto the device's type is keyed (TF32 on a tensor-core GPU, fp32 elsewhere)
    out = set(NOT_IN_KEY) - ({"runtime.device"} if precision == "auto" else set())
    wrong = []
    for path in sorted(leaves):
        d = json.loads(json.dumps(base))
        _set(d, path, _changed(_get(d, path)))
        if (measure_hash(d, spec) != h0) != (path not in out):
            wrong.append(path)
    assert not wrong, f"keys that break the rule: {wrong}"
    if precision == "auto":  # only the device's type counts, not its index
        a, b = json.loads(json.dumps(base)), json.loads(json.dumps(base))
        a["runtime"]["device"], b["runtime"]["device"] = "cuda:0", "cuda:1"
        assert measure_hash(a, spec) == measure_hash(b, spec) != h0


def test_every_entry_of_a_measure_but_its_caps_changes_the_key(tmp_path, monkeypatch):
    import flatcli.measures as reg

    base, spec = _schema_config(tmp_path, "fp32")
    h0 = measure_hash(base, spec)
    other = {
        "name": dataclasses.replace(spec, name="hessian_trace", options={}),
        "label": dataclasses.replace(spec, label="lam2"),
        "options": dataclasses.replace(spec, options={"tol": 2e-4}),
        "seed": dataclasses.replace(spec, seed=3),
        "max_seconds": dataclasses.replace(spec, max_seconds=5.0),
        "max_hvps": dataclasses.replace(spec, max_hvps=10),
    }
    assert set(other) == {f.name for f in dataclasses.fields(MeasureSpec)}
    for name, s in other.items():
        assert (measure_hash(base, s) != h0) == (name not in SPEC_NOT_IN_KEY), name
    # defaults filled in: the default tolerance written out is the same key
    default = reg.get_measure(spec.name).options().tol
    assert measure_hash(base, dataclasses.replace(spec, options={"tol": default})) == (
        measure_hash(base, dataclasses.replace(spec, options={}))
    )
    # the measure's revision is in the key
    info = reg.get_measure(spec.name)
    monkeypatch.setitem(reg._REGISTRY, spec.name, dataclasses.replace(info, revision=2))
    assert measure_hash(base, spec) != h0


def test_the_package_version_is_not_in_the_key(tmp_path, monkeypatch):
    import flatcli.sweep.plan as plan_mod
    from flatcli.loading.jobs import resolve_jobs
    from flatcli.sweep.plan import build_plan

    cfg = load_config(write_project(tmp_path, measures=[LAM, "frobenius_norm"]))
    jobs, specs = resolve_jobs(cfg), cfg.measure_specs()
    ids = [u.id for u in build_plan(cfg, specs, jobs).units]
    import flatcli
    import flatcli._version

    for mod in (plan_mod, flatcli, flatcli._version):
        monkeypatch.setattr(mod, "__version__", "99.0.0")
    assert [u.id for u in build_plan(cfg, specs, jobs).units] == ids


def test_a_data_file_is_hashed_once_until_it_changes(tmp_path, monkeypatch):
    import flatcli.keys as keys

    cfg_path = _tensors_project(tmp_path)
    cfg = load_config(cfg_path)
    opened = []
    real_open = open

    def counting(path, *a, **k):
        opened.append(str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(keys, "open", counting, raising=False)
    fp = data_fingerprints(cfg)
    assert data_fingerprints(cfg) == fp and len(opened) == 1  # the second is from the cache
    _scale_inputs(tmp_path / "train.pt", 1.7)
    new = data_fingerprints(cfg)
    assert new != fp and len(opened) == 2
    size, _ = new["data.train.path"].split(":")
    assert int(size) == (tmp_path / "train.pt").stat().st_size


def _tensors_project(tmp, params=None):
    """One MLP checkpoint, a training set in a tensors file; returns the config path."""
    from flatcli.demo.models import MLP

    tmp.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    torch.save(MLP(16, 8, 1, 4).state_dict(), tmp / "m0.pt")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(40, 16, generator=g), torch.randint(0, 4, (40,), generator=g)
    if not (tmp / "train.pt").exists():
        torch.save({"x": x, "y": y}, tmp / "train.pt")
    cfg = {
        "model": {
            "target": "flatcli.demo.models:MLP",
            "kwargs": {"in_features": 16, "width": 8, "depth": 1, "num_classes": 4},
        },
        "checkpoints": ["m0.pt"],
        "data": {"train": {"source": "tensors", "path": "train.pt"}},
        "measure_data": {"split": "train", "batch_size": 40},
        "measures": [LAM],
        "runtime": {"device": "cpu", "seed": 0},
    }
    if params:
        cfg["params"] = params
    name = "b.yaml" if params else "a.yaml"
    (tmp / name).write_text(yaml.safe_dump(cfg))
    return tmp / name


def _scale_inputs(path, factor):
    """Rewrite a tensors file in place: the same size, other inputs, a new modification time."""
    d = torch.load(path)
    d["x"] = d["x"] * factor
    st = path.stat()
    torch.save(d, path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


def _lam(out):
    return pd.read_csv(out / "results.csv")["hessian_lambda_max"][0]


def _measure(cfg, out, resume=False):
    seen, notes = [], []
    api.measure(
        cfg,
        outdir=out,
        resume=resume,
        reporting=api.Reporting(
            on_measure=lambda row, lab, reused: seen.append(reused), on_note=notes.append
        ),
    )
    return seen, notes


def test_resume_after_a_parameter_selection_recomputes_and_keeps_the_old_results(tmp_path):
    a = _tensors_project(tmp_path)
    b = _tensors_project(tmp_path, params={"include": ["features.*"]})
    _measure(a, tmp_path / "o")
    whole = _lam(tmp_path / "o")
    _measure(b, tmp_path / "fresh")
    seen, notes = _measure(b, tmp_path / "o", resume=True)
    assert seen == [False]  # not "ok (reused)"
    assert _lam(tmp_path / "o") == _lam(tmp_path / "fresh") != pytest.approx(whole, rel=0.05)
    assert notes == [
        "0 reused; 1 recomputed: params.include changed; 1 result of another configuration "
        f"kept in {tmp_path / 'o' / 'results.prev.json'}"
    ]
    assert pd.read_csv(tmp_path / "o" / "results.prev.csv")["hessian_lambda_max"][0] == whole
    # the same run again reuses its own result and keeps nothing aside
    seen, notes = _measure(b, tmp_path / "o", resume=True)
    assert seen == [True] and notes == ["1 reused; 0 recomputed"]


def test_a_sweep_after_a_parameter_selection_recomputes(tmp_path):
    a = _tensors_project(tmp_path)
    b = _tensors_project(tmp_path, params={"include": ["features.*"]})
    _measure(b, tmp_path / "fresh")
    assert api.sweep(a, tmp_path / "s", log=None).computed == 1
    rep = api.sweep(b, tmp_path / "s", log=None)
    assert rep.already_done == 0 and rep.computed == 1
    api.collect_report(tmp_path / "s")
    assert _lam(tmp_path / "s") == _lam(tmp_path / "fresh")


def test_a_data_file_rewritten_in_place_is_recomputed(tmp_path):
    a = _tensors_project(tmp_path)
    _measure(a, tmp_path / "o")
    api.sweep(a, tmp_path / "s", log=None)
    before = _lam(tmp_path / "o")
    _scale_inputs(tmp_path / "train.pt", 1.7)
    seen, notes = _measure(a, tmp_path / "o", resume=True)
    _measure(a, tmp_path / "fresh")
    assert seen == [False] and _lam(tmp_path / "o") == _lam(tmp_path / "fresh")
    assert _lam(tmp_path / "fresh") > 1.5 * before
    assert notes[0].startswith("0 reused; 1 recomputed: contents of data.train.path changed")
    assert api.sweep(a, tmp_path / "s", log=None).computed == 1


@pytest.mark.parametrize("how", ["sweep", "measure"])
def test_a_result_a_cap_stopped_is_reused_only_under_the_same_caps(tmp_path, how):
    def project(cap):
        m = [{"hessian_lambda_max": {"tol": 1e-6, "max_hvps": cap}}]
        return write_project(tmp_path / f"p{cap}", measures=m, n_ckpt=1)

    def run(cfg):
        if how == "sweep":
            rep = api.sweep(cfg, tmp_path / "s", log=None)
            api.collect_report(tmp_path / "s")
            st = pd.read_csv(tmp_path / "s" / "results.csv")["hessian_lambda_max_status"][0]
            return rep.computed == 0, st
        seen, _ = _measure(cfg, tmp_path / "o", resume=True)
        return seen == [True], pd.read_csv(tmp_path / "o" / "results.csv")[
            "hessian_lambda_max_status"
        ][0]

    for d in ("p3", "p400"):
        (tmp_path / d).mkdir(parents=True)
    tight, loose = project(3), project(400)
    for name in ("m0.pt",):  # the same checkpoint bytes under both configs
        (tmp_path / "p400" / name).write_bytes((tmp_path / "p3" / name).read_bytes())
    assert run(tight) == (False, "budget")
    assert run(tight) == (True, "budget")  # the same caps: reused
    assert run(loose) == (False, "ok")  # a larger cap: recomputed
    assert run(loose) == (True, "ok")
    assert run(tight) == (True, "ok")  # a cap that would not stop it: the value stands
