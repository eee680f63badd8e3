"""Progress: a live bar on a terminal, log lines without one, the summary at the end, and the
command line's error reporting for a bad job file (no Ray needed for any of it)."""

from __future__ import annotations

import io
import subprocess
import sys

from sgl_longgen.cluster.progress import BatchProgress, format_summary


def test_live_bar_shows_requests_rate_and_eta():
    out = io.StringIO()
    bar = BatchProgress("job", total=6, done=1, live=True, stream=out)
    bar.start()
    bar.t0 -= 10.0  # ten seconds of decoding so far
    bar.update(done=3, failed=0, running=2, remaining_tokens=1000, generated=500)
    text = out.getvalue()
    assert "3/6 requests" in text and "2 running" in text and "50.0 tok/s" in text
    assert "ETA 0:00:20" in text  # 1000 tokens left at 50 tok/s
    bar.note("engine 0 lost")
    bar.close()
    assert "[job] engine 0 lost" in out.getvalue()


def test_log_lines_without_a_terminal():
    out = io.StringIO()
    bar = BatchProgress("job", total=4, done=0, live=False, stream=out, log_every=0.0)
    bar.update(done=1, failed=1, running=1, remaining_tokens=0, generated=10)
    assert out.getvalue().startswith("[job] 1/4 done, 1 running, 1 failed,")


def test_summary_names_bad_lines_and_engines():
    s = {"job": "j", "prompts": 7, "records": 6, "errors": 1, "unfinished": 0, "input": "p.jsonl",
         "bad_lines": [{"line": 3, "reason": "not valid JSON"}], "accept_length": 2.5,
         "records_file": "out/records.jsonl",
         "run": {"requests_finished": 6, "tokens_generated": 600, "tokens_resumed": 40, "seconds": 12.0,
                 "generate_seconds": 6.0, "tokens_per_second": 100.0,
                 "engines": [{"index": 0, "node": "n", "pid": 1, "gpus": ["0"], "requests": 6, "tokens": 600,
                              "restarts": 1}]}}
    text = format_summary(s)
    assert "6/7 records (1 failed, 0 unfinished), 1 bad input line(s)" in text
    assert "600 tokens generated in 6.0 s with engines up (100.0 tok/s)" in text
    assert "bad input: p.jsonl:3: not valid JSON" in text
    assert "tau" in text and "2.50" in text


def test_a_bad_job_file_is_one_error_line(tmp_path):
    job = tmp_path / "j_batch.toml"
    job.write_text('model = "tiny"\ninput = "p.jsonl"\noutput_dir = "o"\n[engines]\ncount = 0\n')
    res = subprocess.run([sys.executable, "-m", "sgl_longgen", "batch", "run", str(job)], capture_output=True,
                         text=True, timeout=600)
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert lines[0].startswith("sgl-longgen: error:") and "$.engines.count" in lines[0]
