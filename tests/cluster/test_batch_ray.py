"""Batch jobs on a real local Ray cluster: two engine actors, the `tiny` model, greedy decoding.

- a 6-prompt job gives 6 records, equal to plain greedy decoding, and a malformed line is reported
  with its line number while the rest runs;
- killing an engine actor mid-job still gives 6 records, each once;
- killing the driver (SIGKILL) and rerunning resumes from the checkpoints: the engines generate
  exactly the tokens that were missing, and the outputs equal an uninterrupted run;
- a driver stopped by SIGTERM checkpoints what it received and exits with 143 (128 + 15);
- a request whose engine is lost more often than ``max_retries`` fails fast with its partial output
  kept, and ``--retry-errors`` continues it from there.
"""

from __future__ import annotations

import io
import json
import signal
import subprocess
import time
from pathlib import Path

import msgspec
import pytest
import ray

from sgl_longgen.cluster.checkpoint import CheckpointStore
from sgl_longgen.cluster.runner import run_job
from sgl_longgen.cluster.spec import load_job

from batch_helpers import PROMPTS, read_records, start_driver, write_job

N = 64


@pytest.fixture(scope="module")
def oracle() -> dict[str, list[int]]:
    """Plain greedy decoding, uninterrupted, straight from the reference runtime (no Ray, no batch code)."""
    from sgl_longgen.config import GenerateConfig
    from sgl_longgen.runtime import build_decoder, load_model, resolve_model

    loaded = load_model(resolve_model("tiny"), "float64")
    dec = build_decoder(loaded, GenerateConfig(method="ar", ignore_eos=True))
    out = {}
    for p in PROMPTS:
        ids = p["input_ids"] if "input_ids" in p else loaded.tokenizer.encode(p["prompt"])
        out[p["id"]] = dec.generate(ids, N).output_ids
    return out


def checkpoints(out: Path) -> dict:
    store = CheckpointStore(out)
    return {rid: store.load(rid) for rid in store.ids()}


def wait_for(cond, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the driver exited ({proc.returncode}) before {what}:\n{proc.stdout.read()}")
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def engine_actor(job_name: str, index: int):
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"{job_name}/") and a["name"].endswith(f"/engine-{index}.0")]
    assert len(names) == 1, names
    return ray.get_actor(names[0])


def running_checkpoint(out: Path, min_tokens: int = 8) -> tuple[str, int] | None:
    """(id, engine) of a request with a checkpoint and no record yet: a generation in flight."""
    done = {r["id"] for r in read_records(out)}
    store = CheckpointStore(out)
    for rid in store.ids():
        ck = store.load(rid)
        if rid not in done and len(ck.tokens) >= min_tokens and ck.segments and len(ck.tokens) < N - 24:
            return rid, ck.segments[-1].engine
    return None


def assert_complete(out: Path, oracle: dict[str, list[int]]) -> list[dict]:
    records = read_records(out)
    assert sorted(r["id"] for r in records) == sorted(oracle), "each id exactly once"
    for r in records:
        assert r["finish_reason"] == "length", r
        assert r["output_ids"] == oracle[r["id"]], f"{r['id']} differs from the uninterrupted greedy run"
        assert r["num_new_tokens"] == N
    return records


def test_six_prompts_on_two_engines(ray_cluster, tmp_path, oracle):
    bad = '{"id": "broken", "prompt": "no closing quote}'
    job_file = write_job(tmp_path, "six", extra_lines={3: bad})
    job = load_job(job_file)
    log = io.StringIO()
    summary = run_job(job, live=False, stream=log, out=io.StringIO())

    records = assert_complete(job.output_dir, oracle)
    assert "six.jsonl:3: not valid JSON" in log.getvalue()
    assert summary["bad_lines"] == [{"line": 3, "reason": summary["bad_lines"][0]["reason"]}]
    assert summary["records"] == 6 and summary["errors"] == 0
    # Two engines shared the work, and the metrics are there.
    engines = summary["run"]["engines"]
    assert len(engines) == 2 and sum(e["requests"] for e in engines) == 6
    assert sum(e["tokens"] for e in engines) == summary["run"]["tokens_generated"] == 6 * N
    assert all(r["accept_length"] > 1.0 and r["decode_seconds"] > 0 and r["text"] for r in records)
    assert {r["id"]: r["line"] for r in records}["essay"] == 4  # line numbers count the bad line
    assert not list((job.output_dir / "checkpoints").iterdir())
    assert json.loads((job.output_dir / "summary.json").read_text())["records"] == 6

    # Rerunning a finished job does nothing (and starts no engine).
    again = run_job(job, live=False, stream=io.StringIO(), out=io.StringIO())
    assert again["run"]["tokens_generated"] == 0 and again["run"]["engines"] == []
    assert len(read_records(job.output_dir)) == 6


def test_an_engine_killed_mid_job(ray_cluster, tmp_path, oracle):
    job_file = write_job(tmp_path, "killengine")
    out = load_job(job_file).output_dir
    driver = start_driver(ray_cluster, job_file)
    try:
        rid, engine = wait_for(lambda: running_checkpoint(out), 600, "a checkpoint", driver)
        ray.kill(engine_actor("killengine", engine), no_restart=True)
        log, _ = driver.communicate(timeout=900)
    finally:
        driver.kill()
    assert driver.returncode == 0, log
    records = assert_complete(out, oracle)
    victim = next(r for r in records if r["id"] == rid)
    assert victim["attempts"] == 2, victim
    assert len(victim["segments"]) == 2 and victim["segments"][1]["start"] > 0
    assert sum(s["tokens"] for s in victim["segments"]) == N  # nothing streamed before the kill was redone
    assert "goes back to the queue" in log and "starting a replacement" in log
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["tokens_generated"] == 6 * N
    assert sum(e["restarts"] for e in summary["run"]["engines"]) == 1


def test_driver_killed_then_resumed(ray_cluster, tmp_path, oracle):
    job_file = write_job(tmp_path, "killdriver")
    out = load_job(job_file).output_dir
    driver = start_driver(ray_cluster, job_file)
    try:
        wait_for(lambda: read_records(out) and running_checkpoint(out), 600, "a record and a checkpoint", driver)
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
    finally:
        driver.kill()
    done_before = {r["id"]: r for r in read_records(out)}
    ckpts = {rid: ck for rid, ck in checkpoints(out).items() if rid not in done_before}
    saved = {rid: ck.tokens for rid, ck in ckpts.items()}
    assert saved and all(len(t) >= 8 for t in saved.values())
    for rid, toks in saved.items():  # what was checkpointed is a prefix of the right answer
        assert toks == oracle[rid][: len(toks)]

    rerun = start_driver(ray_cluster, job_file)
    log, _ = rerun.communicate(timeout=900)
    assert rerun.returncode == 0, log
    records = {r["id"]: r for r in assert_complete(out, oracle)}
    for rid, r in done_before.items():
        assert records[rid] == r  # finished records are neither redone nor rewritten
    for rid, toks in saved.items():
        r = records[rid]
        assert r["resumed_tokens"] == len(toks)
        # The rerun's decoding started at the checkpoint and produced exactly the rest.
        rerun_segments = r["segments"][len(ckpts[rid].segments):]
        if len(toks) == N:
            # Its last tokens reached a checkpoint before the kill, its record had not: the rerun
            # writes the record from the checkpoint and decodes nothing.
            kept = [list(msgspec.structs.astuple(m)) for m in ckpts[rid].timeline]
            assert not rerun_segments and r["timeline"][: len(kept)] == kept
            continue
        assert rerun_segments[0]["start"] == len(toks)
        assert sum(seg["tokens"] for seg in rerun_segments) == N - len(toks)
        # The timeline keeps the killed run's marks and goes on from the checkpoint.
        kept = [list(msgspec.structs.astuple(m)) for m in ckpts[rid].timeline]
        assert kept and r["timeline"][: len(kept)] == kept
        later = r["timeline"][len(kept):]
        assert later[0][0] == len(toks) and later[-1][0] + later[-1][1] == N
        positions = [m[0] + m[1] for m in r["timeline"]]
        assert positions == sorted(positions)
    # The engines of the second run generated exactly the missing tokens: none before the kill again.
    summary = json.loads((out / "summary.json").read_text())
    missing = sum(N - len(saved.get(p["id"], [])) for p in PROMPTS if p["id"] not in done_before)
    assert summary["run"]["tokens_generated"] == missing
    assert summary["run"]["tokens_resumed"] == sum(len(t) for t in saved.values())
    assert f"({summary['run']['tokens_resumed']} tokens not generated again)" in log


def test_driver_stopped_by_sigterm(ray_cluster, tmp_path, oracle):
    job_file = write_job(tmp_path, "sigterm", prompts=PROMPTS[:1], engines={"count": 1}, max_new_tokens=8000)
    out = load_job(job_file).output_dir
    driver = start_driver(ray_cluster, job_file)
    try:
        seen = wait_for(lambda: len(getattr(CheckpointStore(out).load("fib"), "tokens", [])), 600,
                        "a checkpoint", driver)
        driver.send_signal(signal.SIGTERM)
        log, _ = driver.communicate(timeout=300)
    finally:
        driver.kill()
    assert driver.returncode == 143, log
    assert "interrupted: every token received is checkpointed" in log
    assert not read_records(out)
    tokens = CheckpointStore(out).load("fib").tokens
    assert len(tokens) >= seen and tokens[:N] == oracle["fib"][: len(tokens)]


def test_retries_exhausted_keep_the_partial_output_then_retry_errors(ray_cluster, tmp_path, oracle):
    prompts = PROMPTS[:2] + [{"id": "oov", "input_ids": [10**6, 1, 2]}]
    job_file = write_job(tmp_path, "retries", prompts=prompts, max_retries=0, engines={"count": 1})
    out = load_job(job_file).output_dir
    driver = start_driver(ray_cluster, job_file)
    try:
        rid, engine = wait_for(lambda: running_checkpoint(out), 600, "a checkpoint", driver)
        ray.kill(engine_actor("retries", engine), no_restart=True)
        log, _ = driver.communicate(timeout=900)
    finally:
        driver.kill()
    assert driver.returncode == 1, log  # some records are errors
    records = {r["id"]: r for r in read_records(out)}
    assert sorted(records) == ["fib", "oov", "story"]
    failed = records[rid]
    assert failed["finish_reason"] == "error" and "engine lost" in failed["error"]
    partial = failed["output_ids"]
    assert 8 <= len(partial) < N and partial == oracle[rid][: len(partial)]
    assert CheckpointStore(out).load(rid).tokens == partial  # kept for a retry
    assert records["oov"]["finish_reason"] == "error" and "vocabulary" in records["oov"]["error"]
    other = next(k for k in ("fib", "story") if k != rid)
    assert records[other]["output_ids"] == oracle[other]

    rerun = start_driver(ray_cluster, job_file, "--retry-errors")
    log, _ = rerun.communicate(timeout=900)
    assert rerun.returncode == 1, log  # oov fails again
    records = {r["id"]: r for r in read_records(out)}
    assert len(read_records(out)) == 3
    assert records[rid]["finish_reason"] == "length" and records[rid]["output_ids"] == oracle[rid]
    assert records[rid]["resumed_tokens"] == len(partial)
