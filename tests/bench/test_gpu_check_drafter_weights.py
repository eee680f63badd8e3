"""``gpu_check --drafter-weights bf16 fp8``: the OWL and LongSpec drafter timings once per setting,
side by side, the bf16 figures under their keys of before. On a CPU with the shipped proxy's
shape and a wall-clock timer (the Triton and CUDA-graph paths are GPU-only)."""

from __future__ import annotations

import argparse
import json
import time

import pytest

from sgl_longgen.bench import gpu_check
from sgl_longgen.runtime import resolve_model


def wall_us(fn):
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def test_the_weights_setting_parses_and_refuses_a_repeat():
    assert gpu_check.parser().parse_args(["--phase", "owl"]).drafter_weights == ["bf16"]
    args = gpu_check.parser().parse_args(["--phase", "longspec", "--drafter-weights", "bf16", "fp8", "fp8-addr"])
    assert args.drafter_weights == ["bf16", "fp8", "fp8-addr"]
    with pytest.raises(SystemExit):
        gpu_check.parser().parse_args(["--drafter-weights", "int8"])
    with pytest.raises(SystemExit):
        gpu_check.main(["--phase", "owl", "--drafter-weights", "fp8", "fp8"])


def test_the_longspec_phase_times_each_setting_side_by_side(monkeypatch, capsys):
    import sgl_longgen.bench.kernels as bench_kernels

    monkeypatch.setattr(bench_kernels, "time_us", wall_us)
    cfg = json.loads((resolve_model("tiny") / "config.json").read_text())
    timed = gpu_check.longspec_drafter_ms
    monkeypatch.setattr(gpu_check, "longspec_drafter_ms",
                        lambda *a, **kw: timed(*a, **{**kw, "config": cfg, "device": "cpu"}))
    args = argparse.Namespace(contexts=[100], longspec_batch=1, longspec_draft_vocab=100, profile=None,
                              drafter_weights=["bf16", "fp8", "fp8-addr"], longspec_compile=False, out="r.json")
    report = {"ar_step_ms": {"100": 1.0}}
    gpu_check.phase_longspec(args, report)
    r = report["longspec_drafter"]
    assert r["weights"] == ["bf16", "fp8", "fp8-addr"]
    row = r["100"]
    for prefix in ("", "reduced_", "fp8_", "fp8_reduced_", "fp8-addr_", "fp8-addr_reduced_"):
        assert row[f"{prefix}beam_torch_ms"] > 0 and f"{prefix}beam_torch_vs_ar" in row
    out = capsys.readouterr().out
    assert "graphed step ms" in out and " bf16 " in out and " fp8 " in out
    assert "No plain decode step" not in out

    # Without plain decoding's step in the report: the times alone and a note, no ratios (not nan).
    args.drafter_weights = ["bf16"]
    alone: dict = {}
    gpu_check.phase_longspec(args, alone)
    row = alone["longspec_drafter"]["100"]
    assert row["beam_torch_ms"] > 0 and row["ar_step_ms"] is None
    assert not [k for k in row if k.endswith("_vs_ar")]
    out = capsys.readouterr().out
    assert "No plain decode step in r.json at [100]" in out and "--phase plain --out r.json" in out
    assert "nan" not in out


def test_the_owl_phase_keeps_its_bf16_keys_and_adds_the_fp8_ones(monkeypatch, capsys):
    def fake(width, draft_vocab, compiled, profile_dir, weights):
        return {"weights": weights, "eager_ms": 4.0, "graph_ms": 2.0, "fused_graph_ms": 1.0 if weights == "bf16" else 0.6}

    monkeypatch.setattr(gpu_check, "owl_drafter_ms", fake)
    args = argparse.Namespace(contexts=[4096], owl_draft_vocab=32768, owl_width=[4096], owl_compile=False,
                              profile=None, drafter_weights=["bf16", "fp8"])
    report = {"ar_step_ms": {"4096": 4.0}}
    gpu_check.phase_owl(args, report)
    owl = report["owl_drafter"]
    assert set(owl) == {"4096x32768", "4096x32768-fp8"}
    assert owl["4096x32768"]["fused_graph_vs_ar"] == 0.25 and owl["4096x32768-fp8"]["fused_graph_vs_ar"] == 0.15
    table = capsys.readouterr().out.split("ms per tree")[1].splitlines()
    assert [line.split()[2] for line in table[2:]] == ["bf16", "fp8"]
