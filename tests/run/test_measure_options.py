"""`measure_model`'s option objects: `MeasureOptions` and `Reuse` at their defaults give the results
of a call without them (the values the keywords had), each value is checked when built, and every
field reaches the run."""

from __future__ import annotations

import dataclasses

import pytest

from flatcli.errors import ConfigError
from flatcli.run.kept import Reuse
from flatcli.run.measuring import measure_model
from flatcli.run.settings import MeasureOptions
from tests.helpers import tiny_data, tiny_mlp

# the keywords' defaults before measure_model took objects
TODAY = {
    MeasureOptions: dict(
        checkpoint="<model>", hparams=None, debug=False, progress=None, on_measure=None
    ),
    Reuse: dict(results=None, metrics=None, budget_among=None, checked=None, keep=None),
}
SPECS = [
    {"hessian_trace": {"max_hvps": 40}},
    {"hessian_lambda_max": {"max_steps": 8}},
    "frobenius_norm",
    "distance_from_init",
    {"sharpness_worst": {"steps": 3}},
]


def test_defaults_are_todays_values():
    for cls, values in TODAY.items():
        default = cls()
        assert {f.name: getattr(default, f.name) for f in dataclasses.fields(cls)} == values
        assert cls(**values) == default


def _summary(row) -> tuple:
    res = {lab: (r.value, r.stderr, r.status) for lab, r in row.results.items()}
    return res, dict(row.metrics), row.checkpoint, dict(row.hparams), row.status, row.errors


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("batch_size", [7, 64])
def test_defaults_give_the_results_of_a_call_without_options(seed, batch_size):
    """Stochastic measures (seeded) and deterministic ones, fp64: bit-identical rows."""
    model, init = tiny_mlp(seed=seed), tiny_mlp(seed=seed + 50).state_dict()
    train, test = tiny_data(29, seed=seed), tiny_data(11, seed=seed + 1)
    kw = dict(test=test, init_state=init, precision="fp64", seed=seed, batch_size=batch_size)
    bare = measure_model(model, train, SPECS, **kw)
    spelled = measure_model(
        model,
        train,
        SPECS,
        options=MeasureOptions(**TODAY[MeasureOptions]),
        reuse=Reuse(**TODAY[Reuse]),
        **kw,
    )
    assert bare.status == "ok"
    assert _summary(bare) == _summary(spelled)


def test_every_field_reaches_the_run():
    model, (x, y) = tiny_mlp(), tiny_data(20)
    seen, shown = [], []
    first = measure_model(model, (x, y), ["frobenius_norm", "hessian_trace"], precision="fp64")
    opts = MeasureOptions(
        checkpoint="ck.pt",
        hparams={"lr": 0.1},
        progress=lambda label, info: shown.append(label),
        on_measure=lambda row, label: seen.append(label),
    )
    row = measure_model(
        model,
        (x, y),
        ["frobenius_norm", "hessian_trace"],
        options=opts,
        reuse=Reuse(
            results={"frobenius_norm": first.results["frobenius_norm"]}, metrics={"m": 1.0}
        ),
        precision="fp64",
    )
    assert (row.checkpoint, row.hparams) == ("ck.pt", {"lr": 0.1})
    assert seen == ["frobenius_norm", "hessian_trace"] and set(shown) == {"hessian_trace"}
    assert row.results["frobenius_norm"] is first.results["frobenius_norm"]  # reused, not rerun
    assert row.metrics == {"m": 1.0}


def test_debug_prints_the_traceback_of_a_failed_measure(monkeypatch, capsys):
    import flatcli.run.measuring as checkpoint

    def fail(spec, ctx):
        raise RuntimeError("boom")

    monkeypatch.setattr(checkpoint, "run_measure", fail)
    for debug in (False, True):
        row = measure_model(
            tiny_mlp(), tiny_data(9), ["frobenius_norm"], options=MeasureOptions(debug=debug)
        )
        assert row.status != "ok" and "boom" in str(row.errors)
        assert ("Traceback" in capsys.readouterr().err) is debug


@pytest.mark.parametrize(
    "cls,field,value,words",
    [
        (MeasureOptions, "checkpoint", "", "`checkpoint` must be a non-empty string. Got ''"),
        (MeasureOptions, "hparams", [1], "`hparams` must be a mapping or null. Got [1]"),
        (MeasureOptions, "debug", 1, "`debug` must be a bool (true or false). Got 1"),
        (MeasureOptions, "progress", "p", "`progress` must be a callable or null. Got 'p'"),
        (MeasureOptions, "on_measure", 2, "`on_measure` must be a callable or null. Got 2"),
        (Reuse, "results", [1], "`results` must be a mapping or null. Got [1]"),
        (Reuse, "metrics", 3.0, "`metrics` must be a mapping or null. Got 3.0"),
        (Reuse, "budget_among", "a", "`budget_among` must be a list of MeasureSpec or null"),
        (Reuse, "keep", {}, "`keep` must be a CheckpointCache or null. Got {}"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_field(cls, field, value, words):
    with pytest.raises(ConfigError) as e:
        cls(**{field: value})
    assert words in str(e.value) and "\n" not in str(e.value)


def test_reporting_defaults_are_todays_values_and_checked():
    """`flatcli.api.measure`'s `Reporting`: no hooks and no tracebacks by default (the keywords'
    defaults), each value checked when built."""
    from flatcli.api import Reporting

    default = Reporting()
    today = dict(on_start=None, on_row=None, on_progress=None, on_measure=None, on_note=None)
    assert {f.name: getattr(default, f.name) for f in dataclasses.fields(Reporting)} == {
        **today,
        "debug": False,
    }
    with pytest.raises(
        ConfigError, match=r"^`on_note` must be a callable or null. Got 'x' instead\.$"
    ):
        Reporting(on_note="x")
    with pytest.raises(ConfigError, match="^`debug` must be a bool"):
        Reporting(debug="yes")


def test_reporting_hooks_reach_the_run(tmp_path):
    from flatcli import api
    from tests.helpers import write_project

    cfg = write_project(tmp_path / "p", measures=["frobenius_norm"])
    calls = []
    report = api.measure(
        cfg,
        outdir=tmp_path / "o",
        reporting=api.Reporting(
            on_start=lambda i, n, job: calls.append(("start", i)),
            on_row=lambda i, n, row: calls.append(("row", i)),
            on_measure=lambda row, lab, reused: calls.append(("measure", lab, reused)),
        ),
    )
    assert report.exit_code == 0
    assert calls == [
        ("start", 0),
        ("measure", "frobenius_norm", False),
        ("row", 0),
        ("start", 1),
        ("measure", "frobenius_norm", False),
        ("row", 1),
    ]
