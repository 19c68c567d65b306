"""`flatcli.api.SweepOptions`: how a sweep runs is one validated object that `api.sweep` takes as
``options=`` (the CLI builds it from its flags); the old option keywords warn for one release."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from types import SimpleNamespace

import pytest

from flatcli import api
from flatcli.api import sweeps as api_sweeps
from flatcli.cli import app
from flatcli.errors import ConfigError
from tests.oracles import runner


@pytest.mark.parametrize(
    "field, bad, words",
    [
        ("workers", 0, "an int ≥ 1"),
        ("workers", "two", "an int ≥ 1"),
        ("tasks", -1, "an int ≥ 1"),
        ("executor", "ssh", "one of local, slurm, local-array"),
        ("lock_timeout", 0, "a float > 0"),
        ("resume", "yes", "a bool"),
        ("retry_failed", 1, "a bool"),
        ("dry_run", None, "a bool"),
        ("wait", "no", "a bool"),
        ("debug", 0, "a bool"),
        ("slurm", "partition=gpu", "a mapping"),
        ("gpus", "", "a non-empty string"),
        ("cluster", "", "a non-empty string"),
        ("shard", "3/2", "0 ≤ I < N"),
        ("shard", "half", "I/N"),
        ("shard", 2, "a pair"),
    ],
)
def test_every_field_is_validated_in_one_line_naming_it(field, bad, words):
    with pytest.raises(ConfigError) as e:
        api.SweepOptions(**{field: bad})
    text = str(e.value)
    assert f"`{field}`" in text and words in text and len(text.splitlines()) == 1, text


def test_values_are_coerced_and_defaults_are_the_cli_defaults():
    o = api.SweepOptions(workers=2.0, shard=[1, 4], lock_timeout=5, tasks=3.0)
    assert (o.workers, o.shard, o.lock_timeout, o.tasks) == (2, (1, 4), 5.0, 3)
    assert type(o.workers) is int and type(o.lock_timeout) is float
    assert api.SweepOptions(shard="1/4").shard == (1, 4)
    d = api.SweepOptions()
    assert (d.executor, d.resume, d.retry_failed, d.dry_run, d.debug) == (
        "local",
        True,
        False,
        False,
        False,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.workers = 3  # frozen: validated once, at construction
    with pytest.raises(ConfigError, match="exclusive"):
        api.SweepOptions(executor="slurm", shard="0/2")


def test_a_mapping_is_accepted_and_an_unknown_key_is_named():
    assert api.SweepOptions.of({"workers": 2, "shard": "0/2"}) == api.SweepOptions(
        workers=2, shard=(0, 2)
    )
    assert api.SweepOptions.of(None) == api.SweepOptions()
    o = api.SweepOptions(workers=3)
    assert api.SweepOptions.of(o) is o
    with pytest.raises(
        ConfigError, match=r"^Unknown sweep option 'worker'\. Did you mean 'workers'\?$"
    ):
        api.SweepOptions.of({"worker": 2})
    with pytest.raises(ConfigError, match=r"Unknown sweep option 'zzz'\. Valid options: gpus, "):
        api.SweepOptions.of({"zzz": 2})
    with pytest.raises(ConfigError, match="`options` must be a SweepOptions or a mapping"):
        api.SweepOptions.of(["workers"])


@pytest.fixture
def spy(monkeypatch):
    """`api.sweep` down to the runner: the `SweepOptions` it passes (and their debug flag)."""
    seen = {}

    def fake_run_sweep(cfg, specs, jobs, out, opts, *, log, on_unit):
        seen.update(opts=opts, debug=opts.debug)
        return "report"

    monkeypatch.setattr(api_sweeps, "run_sweep", fake_run_sweep)
    monkeypatch.setattr(api_sweeps, "load_run", lambda config, run: SimpleNamespace(
        output_dir=lambda outdir: outdir
    ))  # fmt: skip
    monkeypatch.setattr(api_sweeps, "_jobs_and_specs", lambda cfg, c, m: ([], []))
    return seen


def test_sweep_takes_the_options_object_and_passes_it_on(spy, tmp_path):
    opts = api.SweepOptions(workers=2, retry_failed=True, debug=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert api.sweep("c.yaml", tmp_path / "s", options=opts) == "report"
    assert spy == {"opts": opts, "debug": True}
    api.sweep("c.yaml", tmp_path / "s", options={"shard": "1/3"})
    assert spy["opts"] == api.SweepOptions(shard=(1, 3)) and spy["debug"] is False
    import flatcli

    assert flatcli.SweepOptions is api.SweepOptions and "SweepOptions" in api.__all__
    params = inspect.signature(api.sweep).parameters
    assert params["options"].kind is inspect.Parameter.KEYWORD_ONLY
    assert "debug" not in params and "workers" not in params


def test_the_old_keywords_warn_and_mean_the_same(spy, tmp_path):
    with pytest.warns(FutureWarning, match=r"options=SweepOptions\(workers=2, debug=True\)"):
        api.sweep("c.yaml", tmp_path / "s", workers=2, debug=True)
    assert spy == {"opts": api.SweepOptions(workers=2, debug=True), "debug": True}
    with pytest.raises(ConfigError, match="Unknown sweep option 'wrokers'"):
        api.sweep("c.yaml", tmp_path / "s", wrokers=2)
    with pytest.raises(ConfigError, match="not both"):
        api.sweep("c.yaml", tmp_path / "s", options=api.SweepOptions(), workers=2)


def test_an_unknown_option_fails_before_any_work(tmp_path):
    out = tmp_path / "s"
    with pytest.raises(ConfigError, match="Unknown sweep option 'bogus'"):
        api.sweep(tmp_path / "nowhere.yaml", out, options={"bogus": 1})
    assert not out.exists()


def test_the_cli_builds_the_object_from_its_flags(monkeypatch, tmp_path):
    seen = {}

    def fake_sweep(config, outdir, *, measures=None, run=None, options=None, log=None):
        seen["options"] = options
        return SimpleNamespace(
            lines=[], dry_run=False, summary=lambda: "", executor="local", jobs=[], exit_code=0
        )

    monkeypatch.setattr(api, "sweep", fake_sweep)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("checkpoints: []\n")
    args = ["sweep", "-c", cfg, "-o", tmp_path / "s", "--workers", "3", "--shard", "1/4"]
    args += ["--no-resume", "--retry-failed", "--lock-timeout", "30", "--debug"]
    res = runner.invoke(app, [str(a) for a in args])
    assert res.exit_code == 0, res.output
    assert seen["options"] == api.SweepOptions(
        workers=3, shard=(1, 4), resume=False, retry_failed=True, lock_timeout=30.0, debug=True
    )
    res = runner.invoke(
        app, [str(a) for a in ["sweep", "-c", cfg, "-o", tmp_path / "s", "--lock-timeout", "0"]]
    )
    assert res.exit_code == 2 and "--lock-timeout must be a float > 0" in res.output, res.output
