"""Every shipped config file loads and validates: batch job files (``*batch*.toml``) as job specs,
the others as generation configs."""

from pathlib import Path

import pytest

from sgl_longgen.cluster.prompts import read_prompts
from sgl_longgen.cluster.spec import Job, load_job
from sgl_longgen.config import GenerateConfig, load_generate_config

ALL = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))
JOBS = [p for p in ALL if "batch" in p.stem]
CONFIGS = [p for p in ALL if p not in JOBS]


def test_there_are_configs():
    assert CONFIGS and JOBS


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_loads(path):
    assert isinstance(load_generate_config(path), GenerateConfig)


@pytest.mark.parametrize("path", JOBS, ids=[p.name for p in JOBS])
def test_job_loads(path):
    job = load_job(path)
    assert isinstance(job, Job)
    prompts, bad = read_prompts(job.input_path)
    assert prompts and not bad
    assert isinstance(job.generate_config(), GenerateConfig)
