"""Loading a Hugging Face checkpoint prints no third-party progress bar unless --debug."""

from __future__ import annotations

import pytest

from flatcli.console import DEBUG_ENV
from flatcli.loading.hf import load_pretrained
from tests import hf_models as H
from tests.oracles import runner


@pytest.mark.parametrize("debug", [False, True])
def test_loading_weights_bar_only_with_debug(tmp_path, capfd, monkeypatch, debug):
    H.transformers()
    folder = H.save_gpt2(tmp_path / "gpt2")
    if debug:
        monkeypatch.setenv(DEBUG_ENV, "1")
    else:
        monkeypatch.delenv(DEBUG_ENV, raising=False)
    capfd.readouterr()
    load_pretrained("AutoModelForCausalLM", folder)
    err = capfd.readouterr().err
    assert ("Loading weights" in err) == debug, err


def test_debug_flag_sets_the_environment_for_the_command_only(tmp_path, monkeypatch):
    import os

    from flatcli.cli import app

    monkeypatch.delenv(DEBUG_ENV, raising=False)
    seen = []
    import flatcli.api as api

    def fake(*a, **k):
        seen.append(os.environ.get(DEBUG_ENV))
        raise SystemExit(0)

    monkeypatch.setattr(api, "correlate_report", fake)
    path = tmp_path / "r.csv"
    path.write_text("a,b\n1,2\n")
    runner.invoke(app, ["correlate", str(path), "--debug"])
    runner.invoke(app, ["correlate", str(path)])
    assert seen == ["1", None] and DEBUG_ENV not in os.environ
