"""``sgl-longgen bench --engine sglang``: every method inside SGLang's ``sgl.Engine``.

The acceptance part runs for real on SGLang's CPU engine (the shipped proxy and its drafters, one
engine per method); the step costs need a GPU, so here they are refused, and their projection,
tables and plot are checked on measured rows of the shape ``run_step_costs`` writes.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers import one_error_line
from sgl_longgen.bench import engine_bench
from sgl_longgen.commands import bench

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
METHODS = ("ar", "ngram", "tokenswift", "owl", "howl", "longspec")
SPECULATIVE = ("tokenswift", "owl", "howl", "longspec")
NEW_TOKENS = 16



def test_every_method_in_sgl_engine(cli, tmp_path):
    out = tmp_path / "bench"
    res = cli("bench", "--engine", "sglang", "--out", str(out), "--max-new-tokens", str(NEW_TOKENS),
              "--num-prompts", "1", "--penalties", "1.0", "--methods", *METHODS)
    assert res.returncode == 0, res.stderr[-3000:]
    for name in ("bench.json", "bench.md", "bench.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0
    assert (out / "bench.png").read_bytes()[:8] == PNG_SIGNATURE

    report = json.loads((out / "bench.json").read_text())
    assert report["engine"] == "sglang" and report["on_cpu"] is not torch.cuda.is_available()
    rows = report["acceptance"]
    for decoding in ("greedy", "sampled"):
        got = [r["method"] for r in rows if r["decoding"] == decoding]
        assert sorted(got) == sorted(METHODS), (decoding, got)
    ran = [r for r in rows if r["error"] is None]
    assert all(r["tokens"] == NEW_TOKENS for r in ran)
    assert all(r["tau"] == 1.0 and r["steps"] == NEW_TOKENS for r in ran if r["method"] == "ar")
    spec = [r for r in ran if r["method"] in SPECULATIVE]
    assert len(spec) == 2 * len(SPECULATIVE), [r["method"] for r in spec]
    for r in spec:  # SGLang's tau: completion tokens / spec_verify_ct
        assert r["tau"] >= 1.0 and r["tau"] == pytest.approx(r["tokens"] / r["steps"])
        assert r["steps"] < r["tokens"] or r["decoding"] == "sampled"  # greedy: drafts were accepted
    greedy = [r for r in rows if r["decoding"] == "greedy" and r["method"] != "ar" and r["error"] is None]
    assert greedy and all(r["identical"] is True for r in greedy)
    assert max(r["tau"] for r in greedy) > 2.0  # the trained proxy drafters really speculate
    assert all(r["identical"] is None for r in rows if r["decoding"] == "sampled")
    records = [r for r in report["records"] if r["method"] == "tokenswift" and r["decoding"] == "greedy"]
    assert records and records[0]["verify_steps"] == next(
        r["steps"] for r in rows if r["method"] == "tokenswift" and r["decoding"] == "greedy")

    ngram = [r for r in rows if r["method"] == "ngram"]
    reason = engine_bench.ngram_unavailable(report["on_cpu"])
    if reason is None:  # a CPU build of sgl_kernel, or a GPU
        assert all(r["error"] is None and r["tau"] >= 1.0 for r in ngram)
    else:  # the stand-in: reported as not run, every other method still measured
        assert all(r["error"] == f"not run: {reason}" and r["tau"] is None for r in ngram)

    md = (out / "bench.md").read_text()
    assert "`sgl-longgen bench --out" in md and "--engine sglang" in md
    assert "inside sgl.Engine" in md and "| greedy θ=1.0 | tokenswift | 16 |" in md
    assert "No step costs: give --step-costs" in md

    # --resume (the same command): complete acceptance rows are kept, no engine starts again.
    again = cli("bench", "--engine", "sglang", "--out", str(out), "--max-new-tokens", str(NEW_TOKENS),
                "--num-prompts", "1", "--penalties", "1.0", "--methods", *METHODS, "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "acceptance: kept from the stopped run" in again.stdout
    assert "== ar (plain decoding) in sgl.Engine" not in again.stdout and "== tokenswift" not in again.stdout
    resumed = json.loads((out / "bench.json").read_text())
    assert resumed["acceptance"] == rows and resumed["command"] == report["command"]
    # Another command's bench.json is not continued.
    line = one_error_line(cli("bench", "--engine", "sglang", "--out", str(out), "--max-new-tokens", "8",
                              "--num-prompts", "1", "--penalties", "1.0", "--methods", *METHODS, "--resume"))
    assert "--resume" in line and "another command" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="refused on machines without CUDA")
def test_step_costs_refused_without_cuda(cli, tmp_path):
    out = tmp_path / "bench"
    line = one_error_line(cli("bench", "--engine", "sglang", "--step-costs", "--out", str(out)))
    assert "--step-costs" in line and "CUDA" in line
    assert not out.exists()  # refused before any work


def test_bad_engine_input(cli, tmp_path):
    out = tmp_path / "bench"
    line = one_error_line(cli("bench", "--step-costs", "--out", str(out)))
    assert "--engine sglang" in line
    config = tmp_path / "c.toml"
    config.write_text("max_new_tokens = 8\n")
    line = one_error_line(cli("bench", "--engine", "sglang", "--config", str(config), "--out", str(out)))
    assert "--config" in line and "longgen.toml" in line
    line = one_error_line(cli("bench", "--engine", "sglang", "--methods", "ar", "medusa", "--out", str(out)))
    assert "unknown method 'medusa'" in line and "ngram" in line
    line = one_error_line(cli("bench", "--methods", "ngram", "--out", str(out)))  # the runtime has no NGRAM
    assert "unknown method 'ngram'" in line
    assert not out.exists()


def test_resume_refused_for_the_reference_runtime(cli, tmp_path):
    line = one_error_line(cli("bench", "--resume", "--out", str(tmp_path / "b")))
    assert "--resume" in line and "--engine sglang" in line


def test_step_costs_start_no_engine_for_what_a_stopped_run_measured(tmp_path):
    """Rows of every (shape, method) from the stopped run: nothing to start (no model is built,
    no engine opened: that would fail here without CUDA), the rows come back as they were."""
    import argparse

    done = [measured(shape, method, c, 1, 5.0, steps=None if method == "ar" else 4)
            for shape in ("llama8b", "qwen7b") for method in ("ar", "tokenswift") for c in (4096, 98304)]
    saved = []
    args = argparse.Namespace(contexts=[4096, 98304], batches=[1], step_tokens=8)
    got = engine_bench.run_step_costs(args, ["ar", "tokenswift"], engine_bench.parse_shapes(["llama8b", "qwen7b"]),
                                      saved.append, done)
    assert got == done and not saved


def test_qwen_shape_and_shape_names():
    from sgl_longgen.bench.gpu_check import QWEN_7B

    assert QWEN_7B["architectures"] == ["Qwen2ForCausalLM"]
    assert (QWEN_7B["hidden_size"], QWEN_7B["intermediate_size"], QWEN_7B["num_hidden_layers"]) == (3584, 18944, 28)
    assert (QWEN_7B["num_attention_heads"], QWEN_7B["num_key_value_heads"], QWEN_7B["vocab_size"]) == (28, 4, 152064)
    assert list(engine_bench.parse_shapes(["qwen7b", "llama8b"])) == ["qwen7b", "llama8b"]
    with pytest.raises(Exception, match="unknown shape 'mistral'"):
        engine_bench.parse_shapes(["mistral"])


# -- step costs: projection, tables and plot from measured rows (what run_step_costs writes) --------

GREEDY = "greedy θ=1.0"
SAMPLED = "sampled T=1 min_p=0.1 θ=1.0"


def measured(shape, method, context, batch, ms, steps=None):
    row = {"shape": shape, "method": method, "context": context, "batch": batch, "one_token_s": 0.05,
           "figure": engine_bench.MEASURED, "greedy_ms_per_token": ms, "sampled_ms_per_token": ms * 1.5}
    if steps is not None:
        row.update(greedy_steps=steps, greedy_ms_per_step=ms * 4, greedy_tau=4.0,
                   sampled_steps=steps * 3, sampled_ms_per_step=ms * 4.2, sampled_tau=1.1)
    return row


def test_projection_divides_measured_step_cost_by_proxy_tau(tmp_path):
    costs = [measured("llama8b", "ar", c, b, 7.0 + c / 32768) for c in (4096, 98304) for b in (1, 4)]
    costs += [measured("llama8b", "tokenswift", c, b, 3.0, steps=10) for c in (4096, 98304) for b in (1, 4)]
    costs.append({"shape": "llama8b", "method": "owl", "error": "RuntimeError: out of memory"})
    acceptance = [{"method": "ar", "setting": GREEDY, "tau": 1.0}, {"method": "ar", "setting": SAMPLED, "tau": 1.0},
                  {"method": "tokenswift", "setting": GREEDY, "tau": 6.0},
                  {"method": "tokenswift", "setting": SAMPLED, "tau": 2.0},
                  {"method": "owl", "setting": GREEDY, "tau": 3.0}]
    projected = engine_bench.project(costs, acceptance)
    assert len(projected) == 2 * 2 * 2 * 2  # (ar, tokenswift) x 2 contexts x 2 batches x 2 settings
    for p in projected:
        assert p["figure"].startswith("projected")
        src = next(c for c in costs if c.get("context") == p["context"] and c.get("batch") == p["batch"]
                   and c["method"] == p["method"])
        plain = next(c for c in costs if c.get("context") == p["context"] and c.get("batch") == p["batch"]
                     and c["method"] == "ar")
        if p["method"] == "ar":  # its measured ms/token, tau 1 in every setting
            assert p["proxy_tau"] == 1.0 and p["projected_ms_per_token"] == pytest.approx(src["greedy_ms_per_token"])
        else:  # the sampled requests were timed over three times the steps: their step cost prices both
            tau = {GREEDY: 6.0, SAMPLED: 2.0}[p["setting"]]
            assert p["proxy_tau"] == tau and p["step_ms"] == src["sampled_ms_per_step"]
            assert p["step_timed"] == "sampled"
            assert p["projected_ms_per_token"] == pytest.approx(src["sampled_ms_per_step"] / tau, abs=1e-4)
        assert p["projected_speedup"] == pytest.approx(plain["greedy_ms_per_token"] / p["projected_ms_per_token"],
                                                       rel=1e-3)

    result = {"engine": "sglang", "on_cpu": False, "command": "sgl-longgen bench --engine sglang --step-costs",
              "model": "tiny", "adaptive": False, "max_new_tokens": 16, "prompts": [{"id": "p"}],
              "acceptance": [{"setting": a["setting"], "decoding": a["setting"].split()[0], "method": a["method"],
                              "tokens": 16, "tau": a["tau"], "alpha": None, "tokens_per_second": 10.0,
                              "speedup": 1.0, "identical": None, "error": None,
                              **{f"distinct_{n}": 0.5 for n in (1, 2, 3, 4)}} for a in acceptance],
              "projection": None,
              "step_costs": {"note": "n", "projection_note": "p", "measured": costs, "projected": projected}}
    md = bench.markdown(result)
    assert md.startswith("# sgl-longgen bench: tiny\n\n`sgl-longgen bench --engine sglang --step-costs`")
    assert engine_bench.GREEDY_BOUND in md and engine_bench.SAMPLED_BOUND in md
    assert "| llama8b | tokenswift | 98304 | 4 | 12.00 | 4.00 | 3.000 |" in md
    assert "| llama8b | owl | failed: RuntimeError: out of memory |" in md
    assert "ms/token (projected)" in md and f"| llama8b | tokenswift | 4096 | 1 | {GREEDY} | 6.00 | 12.60 | 2.100 |" in md
    bench.plot(result, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").read_bytes()[:8] == PNG_SIGNATURE


def test_projection_prices_a_step_with_the_larger_of_the_steady_figures():
    """A repetitive greedy run commits its tokens in a few steps, and a few milliseconds of jitter
    over two or three steps once came out negative: a figure from under half the steps of the other
    does not price a step, nor does a missing or non-positive one; of two steady figures the larger
    does (a first-use cost in one short request once made a step look 2.3x cheaper)."""
    acceptance = [{"method": "tokenswift", "setting": GREEDY, "tau": 4.0}]
    base = {"shape": "llama8b", "method": "tokenswift", "context": 4096, "batch": 1}
    greedy_longer = {**base, "greedy_ms_per_step": 10.0, "greedy_timed_steps": 60,
                     "sampled_ms_per_step": 12.0, "sampled_timed_steps": 48}
    noisy_greedy = {**base, "batch": 4, "greedy_ms_per_step": -206.8, "greedy_timed_steps": 3,
                    "sampled_ms_per_step": 20.0, "sampled_timed_steps": 64}
    older_bench = {**base, "context": 98304, "greedy_ms_per_step": 90.0, "greedy_steps": 5,
                   "sampled_ms_per_step": 18.0, "sampled_steps": 64}  # no *_timed_steps: ranked by steps
    nothing = {**base, "context": 32768, "greedy_ms_per_step": None, "sampled_ms_per_step": None}
    got = {(p["context"], p["batch"]): (p["step_ms"], p["step_timed"], p["projected_ms_per_token"])
           for p in engine_bench.project([greedy_longer, noisy_greedy, older_bench, nothing], acceptance)}
    assert got == {(4096, 1): (12.0, "sampled", 3.0), (4096, 4): (20.0, "sampled", 5.0),
                   (98304, 1): (18.0, "sampled", 4.5)}
    polluted = {**base, "context": 65536, "greedy_ms_per_step": 5.61, "greedy_timed_steps": 63,
                "sampled_ms_per_step": 13.17, "sampled_timed_steps": 48}  # the H200 run's figures
    heavier_greedy = {**polluted, "context": 131072, "greedy_ms_per_step": 14.0}
    assert engine_bench.step_cost(polluted) == (13.17, "sampled")
    assert engine_bench.step_cost(heavier_greedy) == (14.0, "greedy")


def test_bench_imports_without_sglang():
    """The command and its engine module import SGLang only when an engine starts."""
    import os
    import subprocess
    import sys

    code = ("import sys, sgl_longgen.commands.bench, sgl_longgen.bench.engine_bench; "
            "assert 'sglang' not in sys.modules, 'imported sglang'; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


# -- what the step-cost requests and the identity check compute --------------------------------------


def test_step_figures_cancel_what_each_request_pays_once():
    """A request that pays 700 ms once (a method's set-up over a long prompt, the prefill of its
    cached prompt) and 20 ms a step: the two-length difference recovers the step and the set-up,
    where one request's wall over its steps would give 60 ms."""
    setup, step = 0.7, 0.020
    short = (setup + 16 * step, 17, 16)  # (wall s, new tokens, steps)
    long = (setup + 64 * step, 65, 64)
    got = engine_bench.step_figures(short, long)
    assert got["ms_per_step"] == pytest.approx(20.0) and got["ms_per_token"] == pytest.approx(20.0)
    assert got["request_ms"] == pytest.approx(700.0)
    assert long[0] / long[2] * 1e3 == pytest.approx(30.9375)  # what dividing one wall by its steps says
    # Speculation: 4 tokens a step; the difference of steps, not of tokens, prices a step.
    spec = engine_bench.step_figures((setup + 4 * step, 17, 4), (setup + 16 * step, 65, 16))
    assert spec["ms_per_step"] == pytest.approx(20.0) and spec["ms_per_token"] == pytest.approx(5.0)
    # No more steps in the longer request (everything accepted in one): no figure, not a made-up one.
    flat = engine_bench.step_figures((0.5, 17, 1), (0.51, 65, 1))
    assert flat["ms_per_step"] is None and flat["request_ms"] is None and flat["ms_per_token"] is None
    assert flat["timed_steps"] == 0
    # Three steps apart, jitter made the longer request the faster one: below min_steps, no figure.
    jitter = engine_bench.step_figures((0.200, 17, 2), (0.195, 65, 5), min_steps=16)
    assert jitter == {"ms_per_token": None, "ms_per_step": None, "request_ms": None, "timed_steps": 3}
    assert engine_bench.step_figures((0.200, 17, 2), (0.195, 65, 5))["ms_per_step"] < 0  # what it once said
    assert engine_bench.step_figures(short, long, min_steps=48)["ms_per_step"] == pytest.approx(20.0)


def test_the_longer_timed_request_spans_about_n_steps_whatever_the_acceptance():
    """1 + n tokens when a step commits one; n times a step's tokens when the workload repeats."""
    assert engine_bench.long_request_tokens(64, 17, 16, cap=3584) == 65  # plain decoding, nothing accepted
    assert engine_bench.long_request_tokens(64, 17, 2, cap=3584) == 1 + 64 * 8  # 16 tokens in 2 steps
    assert engine_bench.long_request_tokens(64, 17, 1, cap=3584) == 1025  # all 16 in one step
    assert engine_bench.long_request_tokens(64, 17, 0, cap=3584) == 1025  # no step counted: as one
    assert engine_bench.long_request_tokens(64, 17, 1, cap=600) == 600  # the context's headroom
    assert engine_bench.long_request_tokens(4, 2, 1, cap=2) == 3  # always longer than the short one
    # A repeating workload's first steps commit few tokens: 17 in 4 steps, then 257 in 14 (an H200
    # run). The second try is priced by the 240 tokens in 10 steps between the two requests.
    assert engine_bench.long_request_tokens(64, 17, 4, cap=3584) == 257
    assert engine_bench.retry_request_tokens(64, 17, 4, 257, 14, cap=3584) == 1 + 64 * 24
    assert engine_bench.retry_request_tokens(64, 17, 1, 257, 1, cap=3584) == 3584  # no step between: the cap
    assert engine_bench.retry_request_tokens(64, 17, 8, 65, 32, cap=3584) == 1 + 64 * 2  # two tokens a step
    assert engine_bench.retry_request_tokens(4, 2, 1, 3, 1, cap=3) == 4  # always longer than the first try


def test_step_cost_requests_in_an_engine():
    """The step-cost requests on SGLang's CPU engine with the proxy and its TOKENSWIFT heads: the
    greedy requests commit several tokens a step, so the longer one is lengthened to keep about
    ``n`` steps between the two; every figure is over at least ``n // 4`` steps, or absent."""
    from sgl_longgen.runtime import default_heads_dir
    from sgl_longgen.runtime.embedded import resolve_model

    on_cpu = engine_bench.prepare_engine()
    model = resolve_model("tiny")
    kw = engine_bench.with_method(engine_bench.proxy_engine_kwargs(model, on_cpu, 1024, None, 0), "tokenswift",
                                  default_heads_dir(model))
    n, lines = 8, []
    rows = engine_bench.with_engine(kw, False, lambda engine: engine_bench.measure_engine(
        engine, "tokenswift", [96], [1, 2], n, 8192, lines.append))
    assert [(r["context"], r["batch"]) for r in rows] == [(96, 1), (96, 2)] and len(lines) == 2
    for r in rows:
        for d in ("greedy", "sampled"):
            short, long = r[f"{d}_new_tokens"]
            assert short == 1 + n // 4 and long > short and r[f"{d}_steps"] >= r[f"{d}_timed_steps"]
            if r[f"{d}_ms_per_step"] is None:
                assert r[f"{d}_timed_steps"] < n // 4 and r[f"{d}_ms_per_token"] is None
            else:
                assert r[f"{d}_timed_steps"] >= n // 4 and r[f"{d}_ms_per_step"] > 0
    greedy_tau = max(r["greedy_tau"] for r in rows)
    assert greedy_tau > 1.5  # the heads' drafts are accepted on the proxy's greedy text
    assert max(r["greedy_new_tokens"][1] for r in rows) > 1 + n  # so the longer request was lengthened


def test_a_greedy_difference_reports_where_and_how_close_plain_decoding_was_to_a_tie(tmp_path):
    def out(ids):
        return {"output_ids": ids, "meta_info": {"completion_tokens": len(ids), "spec_verify_ct": 2}}

    items = [{"id": "a"}, {"id": "b"}]
    baseline = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]}
    gaps = {"a": [2.0, 1.5, 0.004, 3.0], "b": [1.0, 0.5, 0.3, 0.2]}
    outputs = [(items[0], out([1, 2, 9, 9]), 0.1), (items[1], out([5, 6, 7, 8]), 0.1)]
    row, records = engine_bench.acceptance_row("owl", "greedy", 1.0, outputs, baseline, lambda ids, k: 0.0, (1,), gaps)
    assert row["identical"] is False and row["first_difference"] == 2 and row["tie_gap"] == pytest.approx(0.004)
    assert [(r["first_difference"], r["tie_gap"]) for r in records] == [(2, 0.004), (None, None)]
    assert bench.is_tie(row, 0.01) and not bench.is_tie(row, 0.001) and not bench.is_tie(row, 0.0)
    far = engine_bench.acceptance_row("owl", "greedy", 1.0, [(items[1], out([5, 0, 7, 8]), 0.1)], baseline,
                                      lambda ids, k: 0.0, (1,), gaps)[0]
    assert far["first_difference"] == 1 and not bench.is_tie(far, 0.01)  # a 0.5-nat gap is no tie
    table = "\n".join(bench.acceptance_table([{**row, "setting": GREEDY, "speedup": 1.0, "distinct_1": 0.5,
                                               "distinct_2": 0.5, "distinct_3": 0.5, "distinct_4": 0.5}]))
    assert "**NO** (from token 2; plain's top-2 gap there 0.0040)" in table
    assert "SGLang accept rate" not in table  # no engine reported one
    rated = "\n".join(bench.acceptance_table([{**row, "setting": GREEDY, "speedup": 1.0, "sglang_accept_rate": 0.0894,
                                               **{f"distinct_{n}": 0.5 for n in (1, 2, 3, 4)}}]))
    assert "| tau | alpha | SGLang accept rate | Distinct-1 |" in rated and "| - | 0.089 | 0.500 |" in rated
    assert engine_bench.first_difference([1, 2], [1, 2, 3]) == 2 and engine_bench.first_difference([1], [1]) is None


def test_tie_tolerance_input_checks(cli, tmp_path):
    line = one_error_line(cli("bench", "--engine", "sglang", "--tie-tolerance", "-1", "--out", str(tmp_path / "b")))
    assert "--tie-tolerance" in line and ">= 0" in line
    line = one_error_line(cli("bench", "--tie-tolerance", "0.01", "--out", str(tmp_path / "b")))
    assert "--tie-tolerance" in line and "--engine sglang" in line
