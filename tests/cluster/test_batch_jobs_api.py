"""Batch jobs through the Ray Jobs API on a real head (dashboard included): ``batch submit``,
``status``, ``logs``, ``stop``, and the same job started by ``ray job submit -- sgl-longgen batch run``."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import pytest

from batch_helpers import PROMPTS, read_records, write_job
from sgl_longgen.cluster.checkpoint import CheckpointStore


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sgl_longgen", *args], capture_output=True, text=True, timeout=timeout)


def status(cluster, job_id: str) -> str:
    res = cli("batch", "status", job_id, "--address", cluster.dashboard, "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["status"]


def wait_status(cluster, job_id: str, want: set[str], timeout: float = 400) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = status(cluster, job_id)
        if st in want:
            return st
        time.sleep(1.0)
    pytest.fail(f"job {job_id} not in {want} after {timeout} s (last: {st})")


def test_submit_status_logs(jobs_api, tmp_path):
    job_file = write_job(tmp_path, "submitted", prompts=PROMPTS[:2], engines={"count": 1})
    out = tmp_path / "submitted-out"
    res = cli("batch", "submit", str(job_file), "--address", jobs_api.dashboard, "--output-dir", str(out),
              "--no-wait")
    assert res.returncode == 0, res.stderr
    job_id = res.stdout.strip().splitlines()[-1]
    assert wait_status(jobs_api, job_id, {"SUCCEEDED", "FAILED", "STOPPED"}) == "SUCCEEDED", \
        cli("batch", "logs", job_id, "--address", jobs_api.dashboard).stdout
    assert sorted(r["id"] for r in read_records(out)) == ["fib", "story"]
    logs = cli("batch", "logs", job_id, "--address", jobs_api.dashboard)
    assert logs.returncode == 0 and "job submitted: 2/2 records" in logs.stdout


def test_ray_job_submit_then_batch_stop_keeps_checkpoints(jobs_api, tmp_path):
    job_file = write_job(tmp_path, "stopped", prompts=PROMPTS[:1], engines={"count": 1}, max_new_tokens=8000)
    out = tmp_path / "out-stopped"
    job_id = f"sgl-longgen-test-{uuid.uuid4().hex[:8]}"
    res = subprocess.run(["ray", "job", "submit", "--address", jobs_api.dashboard, "--submission-id", job_id,
                          "--no-wait", "--", "sgl-longgen", "batch", "run", str(job_file), "--no-progress"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    store = CheckpointStore(out) if out.exists() else None
    deadline = time.monotonic() + 400
    seen = 0
    while time.monotonic() < deadline and seen < 16:
        if (out / "checkpoints").exists():
            store = store or CheckpointStore(out)
            ck = store.load("fib")
            seen = len(ck.tokens) if ck else 0
        assert status(jobs_api, job_id) in ("PENDING", "RUNNING")
        time.sleep(0.2)
    assert seen >= 16, "no checkpoint appeared"

    stop = cli("batch", "stop", job_id, "--address", jobs_api.dashboard, "--wait")
    assert stop.returncode == 0 and "stop requested" in stop.stdout, stop.stderr
    assert status(jobs_api, job_id) == "STOPPED"
    assert not read_records(out)
    assert len(store.load("fib").tokens) >= seen  # SIGTERM: what was received is checkpointed, not lost
    logs = cli("batch", "logs", job_id, "--address", jobs_api.dashboard).stdout
    assert "interrupted: every token received is checkpointed" in logs


def test_unknown_job_is_one_error_line(jobs_api):
    res = cli("batch", "status", "no-such-job", "--address", jobs_api.dashboard)
    assert res.returncode == 2
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("sgl-longgen: error:") and "no-such-job" in lines[0]


def test_submit_validates_the_job_before_sending_it(jobs_api, tmp_path):
    bad = tmp_path / "bad_batch.toml"
    bad.write_text('model = "tiny"\ninput = "p.jsonl"\noutput_dir = "o"\n[engines]\ncuont = 2\n')
    res = cli("batch", "submit", str(bad), "--address", jobs_api.dashboard, "--no-wait")
    assert res.returncode == 2 and "cuont" in res.stderr
