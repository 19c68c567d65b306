"""Files read back from disk are checked against a schema (flatcli.schema): a unit file,
results.json or plan.json of the wrong shape is treated as unreadable, named, and recomputed;
nothing crashes on it."""

from __future__ import annotations

import json
import shutil

import pytest

from flatcli import api
from flatcli.errors import ConfigError
from flatcli.schema import RESULTS, MapOf, OneOf, mismatch
from flatcli.sweep.plan import load_plan
from flatcli.sweep.store import Store, check_unit
from tests.helpers import write_project

TYPES = ["abc", 5, 1.5, None, [], {}, True]  # str, int, float, null, list, dict, bool


def _paths(d, prefix=()):
    """Every key path of a JSON object, containers and their insides (("result",), ("result",
    "value"), ...)."""
    for k, v in d.items():
        yield (*prefix, k)
        if isinstance(v, dict):
            yield from _paths(v, (*prefix, k))


def _mutated(rec, path, value):
    """``rec`` with the field at ``path`` set to ``value`` (the whole of it for the path ())."""
    if not path:
        return value
    out = json.loads(json.dumps(rec))
    d = out
    for p in path[:-1]:
        d = d[p]
    d[path[-1]] = value
    return out


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("schema")
    cfg = write_project(tmp / "p", measures=["frobenius_norm"], n_ckpt=1)
    assert api.sweep(cfg, tmp / "s", log=None).computed == 1
    return cfg, tmp / "s"


def test_the_validator_names_the_first_mismatch():
    schema = {"a": "int", "b?": ("float", "null"), "c": [{"d": "str"}], "e": MapOf("float")}
    ok = {"a": 1, "c": [{"d": "x"}], "e": {"k": 2.5}}
    assert mismatch(ok, schema) is None
    assert mismatch({**ok, "a": True}, schema) == "a must be int. Got bool True instead."
    assert mismatch({**ok, "b": "x"}, schema) == "b must be float or null. Got str 'x' instead."
    assert mismatch({**ok, "c": [{"d": 5}]}, schema) == "c[0].d must be str. Got int 5 instead."
    assert (
        mismatch({**ok, "e": {"k": None}}, schema)
        == "e.k must be float. Got NoneType None instead."
    )
    assert mismatch({"c": [], "e": {}}, schema) == "a is missing"
    assert mismatch([], schema) == "the top level must be a mapping. Got list [] instead."
    assert mismatch("inf", OneOf(("inf", "-inf"))) is None


@pytest.mark.slow
def test_every_field_of_a_unit_file_of_every_type_is_read_safely(sweep_dir):
    """Each field of a unit file set to each JSON type: collect never crashes, the sweep's resume
    check never crashes, and a file that does not match is unreadable (named) and not done."""
    _, out = sweep_dir
    plan = load_plan(out)
    (u,) = plan.units
    path = Store(out).unit_path(u.id)
    good = json.loads(path.read_text())
    cases = [(p, v) for p in [(), *_paths(good)] for v in TYPES]
    refused = set()
    try:
        for p, v in cases:
            rec = _mutated(good, p, v)
            path.write_text(json.dumps(rec))
            why = check_unit(rec, u.id)
            warned = []
            done = Store(out, warn=warned.append).is_done(u.id, key=u.key)
            rep = api.collect_report(out)  # must not raise
            if why is None:
                assert done and not rep.unreadable, (p, v)
                continue
            refused.add(p[:1])
            assert not done, (p, v, why)
            assert rep.unreadable == [str(path)] and rep.reasons[str(path)] == why
            assert rep.missing and rep.rows[0].status == "incomplete"
            assert len(warned) <= 1 and all(str(path) in w for w in warned)
    finally:
        path.write_text(json.dumps(good))
    assert refused == {(), *((k,) for k in good)}  # every field refuses some type


@pytest.mark.slow
def test_a_sweep_recomputes_every_unit_file_that_does_not_match(sweep_dir, monkeypatch):
    """One mismatching value per field (the first type the schema refuses): `sweep` warns once,
    naming the file, recomputes the unit, and collect reads the fresh file."""
    import flatcli.sweep.store as store

    monkeypatch.setattr(store, "_WARNED", set())  # the other tests saw the same contents
    cfg, out = sweep_dir
    (u,) = load_plan(out).units
    path = Store(out).unit_path(u.id)
    good = json.loads(path.read_text())
    for p in [(), *_paths(good)]:
        v = next((v for v in TYPES if check_unit(_mutated(good, p, v), u.id)), None)
        if v is None:
            continue  # a field that takes any JSON (diagnostics' entries)
        path.write_text(json.dumps(_mutated(good, p, v)))
        lines = []
        rep = api.sweep(cfg, out, log=lines.append)
        assert rep.computed == 1 and rep.exit_code == 0, (p, v)
        assert sum(str(path) in line for line in lines) == 1, (p, v, lines)
        assert check_unit(json.loads(path.read_text()), u.id) is None
        assert api.collect_report(out).rows[0].status == "ok"


@pytest.mark.slow
def test_plan_json_that_does_not_match_is_named_and_collect_goes_on(sweep_dir, tmp_path):
    _, src = sweep_dir
    out = tmp_path / "s"
    shutil.copytree(src, out)
    good = json.loads((out / "plan.json").read_text())
    paths = [p for p in _paths(good) if len(p) <= 2]
    for p in paths:
        for v in TYPES:
            (out / "plan.json").write_text(json.dumps(_mutated(good, p, v)))
            try:
                load_plan(out)
            except ConfigError as e:
                assert str(out / "plan.json") in str(e)
                rep = api.collect_report(out)  # the unit files alone
                assert rep.reasons[str(out / "plan.json")] == str(e)
                assert rep.rows[0].status == "ok"
    for bad in ([{"id": "x", "checkpoint_index": 7, "label": "frobenius_norm"}], [5]):
        (out / "plan.json").write_text(json.dumps({**good, "units": bad}))
        with pytest.raises(ConfigError, match="plan.json is not a flatcli sweep plan: units"):
            load_plan(out)


RESULTS_PATHS = [
    "rows",
    "rows.0",
    "rows.0.checkpoint",
    "rows.0.measures",
    "rows.0.measures.frobenius_norm",
    "rows.0.measures.frobenius_norm.value",
    "rows.0.measures.frobenius_norm.stderr",
    "rows.0.measures.frobenius_norm.status",
    "rows.0.measures.frobenius_norm.seconds",
    "rows.0.measures.frobenius_norm.diagnostics",
    "rows.0.keys",
    "rows.0.keys.frobenius_norm",
    "config",
]


def _set_in(d, path, value):
    *head, last = path.split(".")
    for p in head:
        d = d[int(p)] if isinstance(d, list) else d[p]
    if isinstance(d, list):
        d[int(last)] = value
    else:
        d[last] = value


@pytest.mark.slow
def test_measure_resume_with_every_field_of_results_json_of_every_type(tmp_path):
    """`measure --resume` over a results.json with one field of the wrong type: no crash; a file
    that does not match is named, kept as results.prev.json, and everything is recomputed."""
    cfg = write_project(tmp_path / "p", measures=["frobenius_norm"], n_ckpt=1)
    out = tmp_path / "o"
    api.measure(cfg, outdir=out)
    good = json.loads((out / "results.json").read_text())
    value = good["rows"][0]["measures"]["frobenius_norm"]["value"]
    for p in RESULTS_PATHS:
        for v in TYPES:
            bad = json.loads(json.dumps(good))
            _set_in(bad, p, v)
            (out / "results.json").write_text(json.dumps(bad))
            seen, notes = [], []
            rep = api.measure(
                cfg,
                outdir=out,
                resume=True,
                reporting=api.Reporting(
                    on_measure=lambda row, lab, reused, seen=seen: seen.append(reused),
                    on_note=notes.append,
                ),
            )
            assert rep.exit_code == 0, (p, v)
            if seen == [False]:  # recomputed (a well-formed entry with its key is reused as is)
                assert rep.rows[0].results["frobenius_norm"].value == pytest.approx(value)
            why = mismatch(bad, RESULTS)
            if why is None:
                continue
            assert seen == [False] and notes == [
                f"{out / 'results.json'} is unreadable (does not match the results schema: "
                f"{why}); every measure is computed; the unreadable results kept in "
                f"{out / 'results.prev.json'}"
            ]
            assert json.loads((out / "results.prev.json").read_text()) == bad
