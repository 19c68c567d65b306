"""Every config shipped in configs/ parses and validates."""

from pathlib import Path

import pytest

from flatcli.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_config_validates(path):
    cfg = load_config(path)
    assert (cfg.model.target or cfg.model.class_) and cfg.measure_specs()
