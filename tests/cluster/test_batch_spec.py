"""The job spec: strict, loadable from TOML and JSON, errors that name the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sgl_longgen.cluster.engine_common import effective_config

from sgl_longgen.cluster.spec import load_job
from sgl_longgen.errors import LonggenError

EXAMPLE = Path(__file__).parents[2] / "configs" / "tiny_batch.toml"

MINIMAL = 'model = "tiny"\ninput = "p.jsonl"\noutput_dir = "out"\n'


def write(tmp_path: Path, text: str, name: str = "job.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(path: Path) -> str:
    with pytest.raises(LonggenError) as info:
        load_job(path)
    return str(info.value)


def test_the_example_job_loads():
    job = load_job(EXAMPLE)
    assert job.name == "tiny-batch"
    assert job.spec.runtime == "reference" and job.spec.engines.count == 2
    assert job.input_path == EXAMPLE.parent / "tiny_prompts.jsonl"
    assert effective_config(job.generation, {}).sampling.temperature == 0.0


def test_json_and_toml_give_the_same_job(tmp_path):
    toml = load_job(write(tmp_path, MINIMAL + "max_new_tokens = 64\n[engines]\ncount = 3\n"))
    data = {"model": "tiny", "input": "p.jsonl", "output_dir": "out", "max_new_tokens": 64, "engines": {"count": 3}}
    js = load_job(write(tmp_path, json.dumps(data), "job.json"))
    assert toml.spec == js.spec
    assert toml.settings() == js.settings()


def test_relative_paths_resolve_against_the_job_file(tmp_path):
    (tmp_path / "sub").mkdir()
    job = load_job(write(tmp_path / "sub", MINIMAL))
    assert job.input_path == (tmp_path / "sub" / "p.jsonl").resolve()
    assert job.output_dir == (tmp_path / "sub" / "out").resolve()
    assert job.name == "job"


@pytest.mark.parametrize("extra, field", [
    ("enginez = 2\n", "enginez"),
    ("[engines]\ncont = 2\n", "cont"),
    ("[tokenswift.partial_kv]\nbudgett = 10\n", "budgett"),
    ("[engines]\ncount = 0\n", "$.engines.count"),
    ("checkpoint_every = 0\n", "$.checkpoint_every"),
    ("max_retries = -1\n", "$.max_retries"),
    ('runtime = "vllm"\n', "$.runtime"),
    ("[sampling]\ntemperature = -1.0\n", "$.sampling.temperature"),
])
def test_unknown_or_invalid_fields_are_named(tmp_path, extra, field):
    assert field in error_of(write(tmp_path, MINIMAL + extra))


def test_missing_required_field_is_named(tmp_path):
    assert "`model`" in error_of(write(tmp_path, 'input = "p.jsonl"\noutput_dir = "out"\n'))


def test_tp_size_needs_sglang(tmp_path):
    msg = error_of(write(tmp_path, MINIMAL + "[engines]\ntp_size = 2\n"))
    assert "engines.tp_size" in msg and "reference" in msg


@pytest.mark.parametrize("sampling, field", [
    ("min_tokens_to_keep = 20", "sampling.min_tokens_to_keep"),
    ("eta = 0.01", "sampling.eta"),
    ("top_k = 20\ntop_p = 0.9", "sampling.filter_order"),
])
def test_sglang_refuses_sampling_it_cannot_do(tmp_path, sampling, field):
    msg = error_of(write(tmp_path, MINIMAL + f'runtime = "sglang"\n[sampling]\n{sampling}\n'))
    assert field in msg
    ok = 'runtime = "sglang"\n[sampling]\ntop_k = 20\ntop_p = 0.9\nfilter_order = "joint"\npenalty = 1.2\n'
    load_job(write(tmp_path, MINIMAL + ok))


def test_sglang_gpu_accounting(tmp_path):
    job = load_job(write(tmp_path, MINIMAL + 'runtime = "sglang"\n[engines]\ntp_size = 2\ncount = 4\n'))
    assert job.spec.gpus_per_engine == 2
    from sgl_longgen.cluster.placement import engine_bundle

    assert engine_bundle(job.spec) == {"CPU": 1.0, "GPU": 2.0}


def test_settings_follow_generation_settings_only(tmp_path):
    a = load_job(write(tmp_path, MINIMAL + "max_new_tokens = 64\n"))
    b = load_job(write(tmp_path, MINIMAL + "max_new_tokens = 64\ncheckpoint_every = 8\n[engines]\ncount = 5\n"))
    c = load_job(write(tmp_path, MINIMAL + "max_new_tokens = 65\n"))
    assert a.settings() == b.settings() != c.settings()


def test_generation_settings_layer_over_the_heads_defaults(tmp_path):
    job = load_job(write(tmp_path, MINIMAL + "[tokenswift.partial_kv]\nsinks = 8\n"))
    heads = tmp_path / "heads"
    heads.mkdir()
    (heads / "longgen.toml").write_text("[tokenswift.partial_kv]\nbudget = 256\nsinks = 16\n")
    cfg = effective_config(job.generation, {"heads": heads})
    assert (cfg.tokenswift.partial_kv.budget, cfg.tokenswift.partial_kv.sinks) == (256, 8)


def test_bad_toml_is_reported(tmp_path):
    assert "not valid TOML" in error_of(write(tmp_path, "model = \n"))
    assert "not found" in error_of(tmp_path / "nope.toml")


def test_a_job_of_any_method_layers_its_drafters_defaults(tmp_path):
    """heads' longgen.toml < the method's drafter's < the job, as `sgl-longgen generate` layers them."""
    job = load_job(write(tmp_path, MINIMAL + 'method = "howl"\ndrafter = "owl"\n[owl]\ntop_k = 3\n'))
    assert job.drafts == {"heads": None, "drafter": str(tmp_path / "owl"), "longspec_drafter": None}
    assert job.settings()["drafter"] == str(tmp_path / "owl")
    for name, text in (("heads", "[owl]\ndepth = 2\ntop_k = 2\n[suffix]\nmax_depth = 7\n"),
                       ("owl", "[owl]\ndepth = 5\ntop_k = 4\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "longgen.toml").write_text(text)
    dirs = {"heads": tmp_path / "heads", "drafter": tmp_path / "owl", "longspec_drafter": None}
    cfg = effective_config(job.generation, dirs)
    assert (cfg.method, cfg.owl.depth, cfg.owl.top_k, cfg.suffix.max_depth) == ("howl", 5, 3, 7)
    # Another method does not read the OWL drafter's defaults.
    cfg = effective_config({**job.generation, "method": "tokenswift"}, dirs)
    assert (cfg.owl.depth, cfg.owl.top_k) == (2, 3)


def test_an_unknown_method_is_named(tmp_path):
    assert "$.method" in error_of(write(tmp_path, MINIMAL + 'method = "medusa"\n'))
