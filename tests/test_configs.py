"""Every shipped config file loads and validates."""

from pathlib import Path

import pytest

from sgl_longgen.config import GenerateConfig, load_generate_config

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))


def test_there_are_configs():
    assert CONFIGS


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_loads(path):
    assert isinstance(load_generate_config(path), GenerateConfig)
