"""The SGLang runtime of batch jobs, end to end on the CPU: ``sglang.Engine`` with TOKENSWIFT (and
HOWL, the OWL drafter's method) inside a Ray actor (SGLang's CPU engine and the ``sgl_kernel`` shim of ``tests/conftest.py``).

One job, one engine, three concurrent requests, one of them resumed from a checkpoint: the records
equal plain greedy decoding of the reference runtime, the resumed request's engine generated only
the missing tokens, and SGLang's acceptance metrics reach the records.
"""

from __future__ import annotations

import io

import pytest

from batch_helpers import PROMPTS, read_records, write_job
from sgl_longgen.cluster.checkpoint import Checkpoint, CheckpointStore, prompt_key
from sgl_longgen.cluster.messages import Segment
from sgl_longgen.cluster.runner import run_job
from sgl_longgen.cluster.spec import load_job

N = 48
RESUME_AT = 20
ENGINE = {"device": "cpu", "dtype": "float32", "attention_backend": "longgen_torch", "disable_cuda_graph": True,
          "mem_fraction_static": 0.05, "max_total_tokens": 16384, "max_running_requests": 8, "context_length": 1024,
          "log_level": "error"}


@pytest.fixture(scope="module")
def oracle() -> dict[str, list[int]]:
    from sgl_longgen.config import GenerateConfig
    from sgl_longgen.runtime import build_decoder, load_model, resolve_model

    loaded = load_model(resolve_model("tiny"), "float32")
    dec = build_decoder(loaded, GenerateConfig(method="ar", ignore_eos=True))
    out = {}
    for p in PROMPTS[:3]:
        ids = p["input_ids"] if "input_ids" in p else loaded.tokenizer.encode(p["prompt"])
        out[p["id"]] = dec.generate(ids, N).output_ids
    return out


@pytest.mark.parametrize("method", ["tokenswift", "howl"])
def test_sglang_engine_actor_runs_the_jobs_method(ray_cluster, tmp_path, oracle, method):
    pytest.importorskip("sglang")
    job_file = write_job(tmp_path, "sgl", prompts=PROMPTS[:3], runtime="sglang", max_new_tokens=N, method=method,
                         engines={"count": 1, "cpus": 1, "max_concurrent_requests": 3, "startup_timeout_s": 1800},
                         sglang={"engine_kwargs": ENGINE})
    job = load_job(job_file)
    assert job.spec.gpus_per_engine == 0  # device = "cpu": the engine reserves no GPU
    # A checkpoint left by an earlier run: the first RESUME_AT tokens of "story".
    story = PROMPTS[1]
    CheckpointStore(job.output_dir).save(Checkpoint(
        id="story", prompt_key=prompt_key(story["prompt"], None), tokens=oracle["story"][:RESUME_AT],
        segments=[Segment(engine=0, start=0, tokens=RESUME_AT, steps=8)], attempts=1))

    summary = run_job(job, live=False, stream=io.StringIO(), out=io.StringIO())

    records = {r["id"]: r for r in read_records(job.output_dir)}
    assert sorted(records) == sorted(oracle)
    for rid, r in records.items():
        assert r["runtime"] == "sglang" and r["finish_reason"] == "length", r
        assert r["output_ids"] == oracle[rid], f"{rid}: SGLang + {method} differs from plain greedy decoding"
        assert r["accept_length"] > 1.0  # SGLang's spec_verify_ct made it into the record: it speculated
        # The timeline: one mark per engine report, the last one at the end of the generation. SGLang
        # reports verify counts with a request's last chunk only, so only that mark knows its steps.
        marks = r["timeline"]
        start = RESUME_AT if rid == "story" else 0
        assert marks and all(m[0] == start for m in marks), marks
        assert marks[-1][0] + marks[-1][1] == N and marks[-1][3] > 0, marks
        assert all(m[3] == 0 for m in marks[:-1]), marks
    assert records["story"]["resumed_tokens"] == RESUME_AT
    assert records["story"]["segments"][-1]["start"] == RESUME_AT
    assert summary["run"]["tokens_generated"] == 3 * N - RESUME_AT
    assert summary["run"]["engines"][0]["requests"] == 3
