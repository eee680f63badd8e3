"""``sgl-longgen bench``: every method side by side on the embedded model, with GPU projections.

In-process (``cli.main``: the same parser and error handling as the installed script), tiny
settings: a few tokens, one prompt, one penalty.
"""

from __future__ import annotations

import json
import math

import pytest

from helpers import one_error_line
from sgl_longgen.commands.eval import BASELINE, method_names

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"




def gpu_step(context: int, ar_ms: float, tau: float, draft: float, verify: float, overhead: float,
             wall_median: float | None) -> dict:
    """One row of a gpu_check spec run's ``steps``, with the keys phase_spec writes."""
    per_token = (draft + verify + overhead + 0.3) / tau
    row = {"context": context, "ar_step_ms": round(ar_ms, 2), "tau": tau,
           "ms_per_token": round(per_token, 3), "speedup": round(ar_ms / per_token, 2),
           "ms_per_token_difference": round(per_token * 0.98, 3),
           "phases_from": "host", "draft_ms": draft, "verify_ms": verify, "overhead_ms": overhead,
           "between_steps_ms": 0.3, "draft_vs_ar": round(draft / ar_ms, 2), "verify_vs_ar": round(verify / ar_ms, 2),
           "scheduler_ms": 0.1}
    if wall_median is not None:  # host-mode figures (host_figures)
        row.update(detail_host_ms={"draft": draft, "verify": verify}, detail_host_steps=127,
                   host_step_wall_ms=wall_median + 0.2, host_step_wall_median_ms=wall_median,
                   host_ms_per_token=round((wall_median + 0.2) / tau, 3),
                   host_ms_per_token_median=round(wall_median / tau, 3),
                   host_speedup=round(ar_ms / (wall_median / tau), 2))
    return row


def synthetic_gpu_report() -> dict:
    """What gpu_check writes: phase_plain's top-level keys, then one entry per spec run."""
    ar = {"4096": 6.66, "98304": 10.66}
    equality = [{"identical": True, "first_difference": None, "lengths": [64, 64],
                 "plain_top2_logprob_gap_there": None, "tau": 5.1}]
    report = {"config": {"phase": "all"}, "plain_engine_start_s": 30.0, "plain_attention_backend": "fa3",
              "plain_outputs": [{"output_ids": [1, 2, 3], "top2_gaps": [0.5, 0.1, 0.2]}], "ar_step_ms": ar}
    walls = {"TOKENSWIFT": (1.6, 8.0, 0.5, 10.4), "OWL": (1.0, 9.5, 0.4, None), "HOWL": (1.1, 9.6, 0.4, 11.3)}
    for algorithm, (draft, verify, overhead, wall) in walls.items():
        report[f"{algorithm.lower()}_default"] = {
            "algorithm": algorithm, "attention_backend": None, "cuda_graph": True, "engine_start_s": 40.0,
            "attention_backend_used": "longgen", "equality": equality,
            "steps": [gpu_step(int(L), ms, 5.0, draft, verify * (1 + (L == "98304")), overhead,
                               None if wall is None else wall * (1 + (L == "98304"))) for L, ms in ar.items()]}
    report["ngram_default"] = {"algorithm": "NGRAM", "attention_backend": None, "cuda_graph": True,
                               "equality": equality,
                               "steps": [{"context": 4096, "ar_step_ms": 6.66, "tau": 3.0, "ms_per_token": 4.0,
                                          "speedup": 1.66, "draft_ms": math.nan, "verify_ms": math.nan,
                                          "overhead_ms": math.nan}]}
    return report


def test_bench_writes_json_markdown_and_png(cli, tmp_path):
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps(synthetic_gpu_report(), indent=2))  # NaN as gpu_check writes it
    out = tmp_path / "bench"
    res = cli("bench", "--out", str(out), "--model", "tiny", "--max-new-tokens", "8", "--num-prompts", "1",
              "--penalties", "1.0", "--gpu-report", str(gpu))
    assert res.returncode == 0, res.stderr
    for name in ("bench.json", "bench.md", "bench.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0
    assert (out / "bench.png").read_bytes()[:8] == PNG_SIGNATURE

    report = json.loads((out / "bench.json").read_text())
    assert report["adaptive"] in (False, None)  # off (or absent): tau counts speculative steps only
    methods = method_names()
    rows = report["acceptance"]
    for decoding in ("greedy", "sampled"):
        got = [r["method"] for r in rows if r["decoding"] == decoding]
        assert sorted(got) == sorted(methods), (decoding, got)
    assert all(r["tau"] >= 1.0 and r["tokens"] == 8 for r in rows)
    assert all(r["tau"] == 1.0 for r in rows if r["method"] == BASELINE)
    greedy_spec = [r for r in rows if r["decoding"] == "greedy" and r["method"] != BASELINE]
    assert greedy_spec and all(r["identical"] is True for r in greedy_spec)
    assert all(r["identical"] is None for r in rows if r["decoding"] == "sampled")
    sampled = next(r for r in rows if r["decoding"] == "sampled")
    assert sampled["temperature"] == 1.0 and sampled["min_p"] == 0.1

    proj = report["projection"]
    tau = {(r["method"], r["setting"]): r["tau"] for r in rows}
    plain = {str(p["context"]): p["plain_ms_per_token"] for p in proj["plain"]}
    gpu_report = synthetic_gpu_report()
    assert len(proj["projected"]) == 3 * 2 * 2  # (tokenswift, owl, howl) x 2 contexts x 2 settings
    for p in proj["projected"]:
        step = next(s for s in gpu_report[f"{p['method']}_default"]["steps"] if s["context"] == p["context"])
        wall = step.get("host_step_wall_median_ms")
        if wall is None:  # OWL here: no host-mode figures
            wall = step["draft_ms"] + step["verify_ms"] + step["overhead_ms"]
            assert p["step_wall_source"] == "draft_ms+verify_ms+overhead_ms"
        assert p["step_wall_ms"] == pytest.approx(wall)
        assert p["proxy_tau"] == tau[(p["method"], p["setting"])]
        assert p["projected_ms_per_token"] == pytest.approx(p["step_wall_ms"] / p["proxy_tau"])
        assert p["projected_speedup"] == pytest.approx(plain[str(p["context"])] / p["projected_ms_per_token"])
        assert p["figure"].startswith("projected")
    measured = proj["measured_dummy"]
    assert {m["method"] for m in measured} == {"tokenswift", "owl", "howl", "ngram"}
    assert all(m["figure"] == "measured, dummy weights: repetitive greedy (upper bound)" for m in measured)
    ngram = next(m for m in measured if m["method"] == "ngram")
    assert ngram["step_wall_ms"] is None and ngram["measured_dummy_ms_per_token"] == 4.0  # NaN parts: no wall

    md = (out / "bench.md").read_text()
    assert "| greedy θ=1.0 | tokenswift |" in md and "projected" in md
    assert "measured, dummy weights: repetitive greedy (upper bound)" in md



def test_bench_bad_input(cli, tmp_path):
    out = tmp_path / "bench"
    line = one_error_line(cli("bench", "--out", str(out), "--gpu-report", str(tmp_path / "missing.json")))
    assert "--gpu-report" in line and "not found" in line
    no_ar = tmp_path / "no_ar.json"
    no_ar.write_text(json.dumps({"tokenswift_default": {"algorithm": "TOKENSWIFT", "steps": []}}))
    line = one_error_line(cli("bench", "--out", str(out), "--gpu-report", str(no_ar)))
    assert "ar_step_ms" in line
    line = one_error_line(cli("bench", "--out", str(out), "--methods", "ar", "medusa"))
    assert "unknown method 'medusa'" in line
    assert not out.exists()  # refused before any work
