"""Every shipped config file loads and validates: batch job files (``*batch*.toml``) as job specs,
the others as generation configs."""

from pathlib import Path

import pytest

from sgl_longgen.cluster.prompts import read_prompts
from sgl_longgen.cluster.spec import Job, load_job
from sgl_longgen.cluster.engine_common import effective_config
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
    assert isinstance(effective_config(job.generation, {}), GenerateConfig)


def test_every_settings_struct_refuses_unknown_keys():
    """One strict base for generation, batch and trainer settings: a typo fails in every file alike."""
    import msgspec

    from sgl_longgen import config
    from sgl_longgen.cluster import spec
    from sgl_longgen.training import config as train_config, owl, proxy

    structs = [obj for module in (config, spec, train_config, owl, proxy) for obj in vars(module).values()
               if isinstance(obj, type) and issubclass(obj, msgspec.Struct) and obj.__module__ == module.__name__]
    assert len(structs) > 20
    assert [s.__name__ for s in structs if not issubclass(s, config.Strict)] == []
    assert config.Strict.__struct_config__.forbid_unknown_fields
    for cls in (spec.EnginesSpec, train_config.DataConfig, owl.OwlShape, proxy.ProxyConfig):
        with pytest.raises(msgspec.ValidationError, match="unknown field `typo`"):
            msgspec.convert({"typo": 1}, cls)
