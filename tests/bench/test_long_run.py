"""``python -m sgl_longgen.bench.long_run``: the 100K-token batch job's files and its report.

The job files must be what ``batch run`` accepts (the same loader); the report's ms/token by
position must come from the decode seconds between marks of one stretch, never across a resume
(a new stretch's first mark follows a prefill); the greedy identity must find a difference.
"""

from __future__ import annotations

import json

import pytest

from sgl_longgen.bench import long_run
from sgl_longgen.cluster.spec import load_job

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name, method, n, drafts, field", [
    ("plain", "ar", 8192, {}, None),
    ("tokenswift", "tokenswift", 100_000, {"heads": "model-heads"}, "heads"),
    ("howl", "howl", 100_000, {"drafter": "owl-1024x32768"}, "drafter"),
])
def test_job_files_load_as_batch_jobs(tmp_path, name, method, n, drafts, field):
    path = tmp_path / f"{name}.toml"
    path.write_text(long_run.job_text(name, method, n, 2048, 101_536, drafts))
    job = load_job(path)
    assert (job.spec.method, job.spec.max_new_tokens, job.spec.checkpoint_every) == (method, n, 2048)
    assert job.spec.runtime == "sglang" and job.spec.sampling.temperature == 0.0 and job.spec.ignore_eos
    assert job.output_dir == tmp_path / f"out-{name}"
    assert {k: v for k, v in job.drafts.items() if v} == ({field: str(tmp_path / drafts[field])} if field else {})
    kw = job.spec.sglang.engine_kwargs
    assert kw["load_format"] == "dummy" and kw["context_length"] == 101_536


def test_rates_per_position_bin_within_stretches():
    # Stretch 1 from 0: 10 ms/token. Stretch 2 (resumed at 300) starts with a mark after its
    # prefill; then 20 ms/token with 4 tokens per step.
    timeline = [[0, 100, 1.0, 99], [0, 200, 2.0, 199], [0, 300, 3.0, 299],
                [300, 40, 0.5, 10], [300, 140, 2.5, 35], [300, 240, 4.5, 60]]
    rows = long_run.rates(timeline, 200)
    assert [r["position"] for r in rows] == [100, 300, 500]  # intervals binned by their middles
    assert rows[0]["ms_per_token"] == pytest.approx(10.0) and rows[0]["tau"] == pytest.approx(1.0)
    # 200-300 of stretch 1 and 340-440 of stretch 2 (300-340 is its prefill and first report, not decode).
    assert rows[1]["ms_per_token"] == pytest.approx(15.0) and rows[1]["tau"] == pytest.approx(200 / 125)
    assert rows[2]["ms_per_token"] == pytest.approx(20.0) and rows[2]["tau"] == pytest.approx(4.0)
    # Steps unknown (0: a speculative stretch mid-stream): no tau, ms/token still measured.
    rows = long_run.rates([[0, 10, 0.1, 0], [0, 110, 1.1, 0]], 1000)
    assert rows[0]["tau"] is None and rows[0]["ms_per_token"] == pytest.approx(10.0)
    # The stretch's last mark knows its steps, the one before it does not: still no tau.
    rows = long_run.rates([[0, 10, 0.1, 0], [0, 110, 1.1, 0], [0, 120, 1.2, 30]], 1000)
    assert rows[0]["tau"] is None and rows[0]["ms_per_token"] == pytest.approx(10.0)


def record(ids: list[int], timeline: list[list[float]], resumed: int = 0) -> dict:
    return {"id": "long-0", "output_ids": ids, "num_new_tokens": len(ids), "finish_reason": "length",
            "decode_seconds": 12.0, "prefill_seconds": 1.0, "tokens_per_second": len(ids) / 12.0,
            "accept_length": 3.5, "resumed_tokens": resumed, "attempts": 2,
            "segments": [{"start": 0, "tokens": 60}, {"start": 60, "tokens": len(ids) - 60}], "timeline": timeline}


def write(path, rec):
    path.mkdir(parents=True)
    (path / "records.jsonl").write_text(json.dumps(rec) + "\n")


def test_report_identity_rates_costs_and_plot(tmp_path):
    ids = [5, 6] * 60
    write(tmp_path / "out-tokenswift", record(ids, [[0, 30, 0.3, 0], [0, 60, 0.6, 0], [60, 30, 0.2, 0],
                                                    [60, 60, 0.8, 20]], resumed=60))
    write(tmp_path / "out-howl", record(ids, [[0, 50, 0.1, 0], [0, 100, 0.3, 4]]))
    plain = ids[:40]
    plain[33] = 7
    write(tmp_path / "out-plain", record(plain, [[0, 20, 0.2, 19], [0, 40, 0.4, 39]]))
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"step_costs": {"measured": [
        {"shape": "llama8b", "method": "ar", "context": 4096, "batch": 1, "greedy_ms_per_token": 6.6},
        {"shape": "llama8b", "method": "ar", "context": 98304, "batch": 4, "greedy_ms_per_token": 30.0},
        {"shape": "qwen7b", "method": "ar", "context": 98304, "batch": 1, "greedy_ms_per_token": 9.0},
        {"shape": "llama8b", "method": "tokenswift", "context": 98304, "batch": 1, "greedy_ms_per_token": 3.0}]}}))
    args = long_run.parser().parse_args(["report", "--dir", str(tmp_path), "--plain-costs", str(bench), "65536=9.5",
                                         "--bin-tokens", "32"])
    result = long_run.report(args)
    assert list(result["jobs"]) == ["tokenswift", "howl"]  # every method job with a record
    for name in ("tokenswift", "howl"):
        assert result["greedy_identity"][name] == {"tokens": 40, "identical": False, "first_difference": 33}
    assert result["jobs"]["tokenswift"]["resumed_tokens"] == 60
    assert result["jobs"]["tokenswift"]["stretch_starts"] == [0, 60]
    assert result["plain_ms_per_token_at_context"] == {4096: 6.6, 65536: 9.5}  # llama8b plain, batch 1 only
    pos = {r["position"]: r["ms_per_token"] for r in result["ms_per_token_by_position"]["tokenswift"]}
    assert pos == {48: pytest.approx(10.0), 112: pytest.approx(20.0)}
    pos = {r["position"]: r["ms_per_token"] for r in result["ms_per_token_by_position"]["howl"]}
    assert pos == {80: pytest.approx(4.0)}
    assert (tmp_path / "long_run.png").read_bytes()[:8] == PNG_SIGNATURE
    md = (tmp_path / "long_run.md").read_text()
    assert "tokenswift: greedy identity" in md and "howl: greedy identity" in md and "differs at 33" in md
    assert "| 80 | - | - | 4.000 | - |" in md  # a row per position, a column pair per method
    assert result["plain_ms_per_token_by_position"] and result["plain"]["decode_seconds"] is not None

    # A plain record made on another host serves the identity check; its times stay out.
    args = long_run.parser().parse_args(["report", "--dir", str(tmp_path), "--plain-identity-only",
                                         "--bin-tokens", "32", "--methods", "howl"])
    elsewhere = long_run.report(args)
    assert list(elsewhere["jobs"]) == ["howl"]
    assert elsewhere["greedy_identity"]["howl"] == result["greedy_identity"]["howl"]
    assert "plain_ms_per_token_by_position" not in elsewhere
    assert elsewhere["plain"]["decode_seconds"] is None and elsewhere["plain"]["tokens_per_second"] is None
    assert "| plain | 40 | length | another host's | another host's |" in (tmp_path / "long_run.md").read_text()


def test_report_before_the_job_finished_is_a_clear_error(tmp_path, capsys):
    assert long_run.main(["report", "--dir", str(tmp_path)]) == 2
    assert "has not finished" in capsys.readouterr().out
    assert long_run.main(["report", "--dir", str(tmp_path), "--methods", "howl"]) == 2
    assert f"no record in {tmp_path / 'out-howl'}" in capsys.readouterr().out
    assert long_run.main(["prepare", "--dir", str(tmp_path / "p"), "--shape", "mistral"]) == 2
    assert "unknown shape 'mistral'" in capsys.readouterr().out
