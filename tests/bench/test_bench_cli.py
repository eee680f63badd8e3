"""The GPU tools of ``sgl_longgen.bench`` import and parse arguments on a CPU machine, and
gpu_check's report helpers read a timed request's ``meta_info`` right.

The tools' imports and ``--help`` run in subprocesses: ``sgl_longgen.bench.kernels`` defines
the Triton kernels on import, which here must wait until the kernel tests' conftest has chosen
the interpreter.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from sgl_longgen.bench import gpu_check
from sgl_longgen.sglang.timing import STEPS_PARAM, TIMING_PARAM

TOOLS = ("gpu_check", "kernels", "engine_check", "compile_report", "long_run")


def run_python(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60, env=env)


def test_tools_import_without_sglang():
    code = "; ".join([
        "import sys",
        *(f"import sgl_longgen.bench.{tool}" for tool in TOOLS),
        "assert 'sglang' not in sys.modules, 'a bench tool imported sglang'",
        "print('ok')",
    ])
    proc = run_python("-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


@pytest.mark.parametrize("tool", TOOLS)
def test_help_exits_0_and_shows_the_new_invocation(tool):
    proc = run_python("-m", f"sgl_longgen.bench.{tool}", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout
    if tool == "gpu_check":  # the whole docstring is its description
        assert "python -m sgl_longgen.bench.gpu_check" in proc.stdout
        assert "--detail-modes" in proc.stdout


def test_importing_gpu_check_defines_no_kernel():
    """The suite imports this module while collecting, before tests/kernels' conftest chooses the
    Triton interpreter: a kernel defined at that point would be compiled-mode for every later test."""
    code = ("import sys, sgl_longgen.bench.gpu_check; "
            "print(sorted(m for m in sys.modules if m.startswith('sgl_longgen.kernels')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


def test_timed_requests_ask_for_timing():
    params = gpu_check.timed(128, "host")
    assert params["custom_params"] == {TIMING_PARAM: "host", STEPS_PARAM: 128}
    assert TIMING_PARAM == "longgen_timing"
    assert params["max_new_tokens"] == 128 and params["temperature"] == 0
    assert "custom_params" not in gpu_check.greedy(128)  # untimed: the product's steps


def test_sampled_timing_forces_speculation_on_our_methods_only():
    import argparse

    def args(sampling, algorithm=None):
        return argparse.Namespace(timed_sampling=sampling, algorithm=algorithm)

    assert gpu_check.timed_request(9, args("greedy", "TOKENSWIFT"), spec=True) == gpu_check.greedy(9)
    ours = gpu_check.timed_request(9, args("sampled", "TOKENSWIFT"), spec=True)
    assert ours["temperature"] == 1.0 and ours["max_new_tokens"] == 9
    assert ours["custom_params"] == {"longgen_speculation": "on"}  # else the controller would turn it off
    for request in (gpu_check.timed_request(9, args("sampled", "NGRAM"), spec=True),  # SGLang's worker
                    gpu_check.timed_request(9, args("sampled"))):  # plain decoding
        assert request["temperature"] == 1.0 and "custom_params" not in request


# Five timed steps of one request, at the positions of the first token each committed (token 0
# came from the prefill). The first step is the warm-up; the fifth has no GPU spans.
POSITIONS = [1, 3, 6, 8, 9]
STEPS = [
    dict(draft_ms=100.0, verify_ms=100.0, overhead_ms=100.0, draft_gpu_ms=5.0, verify_gpu_ms=5.0,
         gap_draft_verify_ms=50.0, walk_ms=9.0, draft_chained=0.0),
    dict(draft_ms=6.0, verify_ms=9.0, overhead_ms=1.0, between_steps_ms=1.0, draft_gpu_ms=5.5, verify_gpu_ms=8.5,
         gap_draft_verify_ms=0.2, gap_verify_draft_ms=0.1, walk_ms=0.1, gc_ms=0.0, draft_chained=1.0,
         draft_queued_ahead=1.0),
    dict(draft_ms=6.5, verify_ms=9.5, overhead_ms=1.5, between_steps_ms=0.5, draft_gpu_ms=5.5, verify_gpu_ms=9.0,
         gap_draft_verify_ms=0.4, gap_verify_draft_ms=0.1, walk_ms=0.3, gc_ms=0.0, draft_chained=0.0,
         draft_queued_ahead=1.0),
    dict(draft_ms=6.0, verify_ms=9.0, overhead_ms=1.0, between_steps_ms=6.0, draft_gpu_ms=5.5, verify_gpu_ms=8.5,
         gap_draft_verify_ms=0.3, gap_verify_draft_ms=0.1, walk_ms=0.2, gc_ms=3.0, draft_chained=1.0,
         draft_queued_ahead=1.0),
    dict(draft_ms=6.0, verify_ms=9.0, overhead_ms=1.0, between_steps_ms=2.0, gc_ms=0.0, draft_chained=1.0,
         draft_queued_ahead=1.0),
]


def make_meta(length: int = 10) -> dict:
    """``meta_info`` as SGLang returns it: one entry per output token, None where no step began."""
    meta: dict = {"spec_accept_length": 2.0, "completion_tokens": length, "longgen_not_a_series": 3.0}
    for position, step in zip(POSITIONS, STEPS):
        for key, value in step.items():
            series = meta.setdefault(f"longgen_{key}", [None] * length)
            series[position] = value
    meta["longgen_gap_verify_draft_ms"] = meta["longgen_gap_verify_draft_ms"][:9]  # a shorter series
    return meta


def test_timed_steps_follow_the_draft_phase_and_drop_the_warm_up():
    steps = gpu_check.timed_steps(make_meta())
    assert len(steps) == 4
    assert steps[0]["draft_ms"] == 6.0 and steps[0]["between_steps_ms"] == 1.0
    assert "draft_gpu_ms" not in steps[3] and steps[3]["between_steps_ms"] == 2.0
    assert len(gpu_check.timed_steps(make_meta(), warmup=0)) == 5


def test_phase_and_section_means():
    steps = gpu_check.timed_steps(make_meta())
    phases = gpu_check.phase_means(steps)
    assert phases == {"draft_ms": 6.125, "verify_ms": 9.125, "overhead_ms": 1.125, "between_steps_ms": 2.375}
    sections = gpu_check.section_means(steps)
    assert sections["walk"] == 0.2  # over the steps that have it; the warm-up's 9.0 left out
    assert sections["gc"] == 0.75
    assert sections["draft_gpu"] == 5.5
    assert sections["gap_draft_verify"] == 0.3
    assert "draft_chained" not in sections and "not_a_series" not in sections


def test_host_figures():
    figures = gpu_check.host_figures(gpu_check.timed_steps(make_meta()), tau=2.0)
    # Step walls 17, 18, 22, 18; outside the two forwards 17 - 14, 18 - 14.5, 22 - 14 (the fifth
    # step has no GPU spans).
    assert figures["host_step_wall_ms"] == 18.75
    assert figures["host_step_wall_median_ms"] == 18.0
    assert figures["host_outside_forwards_ms"] == pytest.approx(14.5 / 3, abs=1e-3)
    assert figures["host_outside_forwards_median_ms"] == 3.5
    assert figures["host_ms_per_token"] == 9.375  # ms / token = step wall / tau
    assert figures["host_ms_per_token_median"] == 9.0
    assert figures["gap_draft_verify_median_ms"] == 0.3
    assert figures["gap_verify_draft_median_ms"] == 0.1
    assert figures["draft_chained_share"] == 0.75
    assert figures["draft_queued_ahead_share"] == 1.0


def test_host_figures_without_gpu_spans_or_tau():
    meta = make_meta()
    for key in ("longgen_draft_gpu_ms", "longgen_verify_gpu_ms", "longgen_gap_draft_verify_ms",
                "longgen_gap_verify_draft_ms", "longgen_draft_chained", "longgen_draft_queued_ahead"):
        del meta[key]
    figures = gpu_check.host_figures(gpu_check.timed_steps(meta), tau=None)
    assert figures == {"host_step_wall_ms": 18.75, "host_step_wall_median_ms": 18.0}
    assert gpu_check.host_figures([], tau=2.0) == {}
    assert math.isnan(gpu_check.phase_means([])["draft_ms"])


def test_summary_has_one_row_per_run_and_context():
    report = {
        "plain_attention_backend": "fa3", "ar_step_ms": {"4096": 6.6, "98304": 10.9},
        "config": {"tokens": "2048"},
        "tokenswift_default": {"attention_backend_used": "longgen",
                               "equality": [{"identical": True}, {"identical": False}],
                               "steps": [{"context": 4096, "tau": 3.0, "ms_per_token": 3.3, "speedup": 2.0},
                                         {"context": 98304, "tau": 3.0, "ms_per_token": 5.45, "speedup": 2.0}]},
        "ngram_default": {"attention_backend_used": "fa3", "equality": [{"identical": True}],
                          "steps": [{"context": 98304, "tau": 16.0, "ms_per_token": 0.9, "speedup": 12.1}]},
    }
    table = gpu_check.summary(report).splitlines()
    assert table[0] == "plain decoding: fa3 backend, 6.60 ms/token at 4096, 10.90 ms/token at 98304"
    rows = [line for line in table if line.startswith("| tokenswift") or line.startswith("| ngram")]
    assert len(rows) == 3
    assert rows[1].startswith("| tokenswift_default | longgen | 1/2 | 98304 | 3.0 | 5.45 | 2.0 | - |")
    assert rows[2].startswith("| ngram_default | fa3 | 1/1 | 98304 | 16.0 | 0.9 | 12.1 |")


def test_gpu_check_writes_the_spec_phases_drafter_settings(tmp_path):
    """``--drafter-tree-size`` / ``--spec-drafter-weights`` / ``--spec-drafter-beam`` reach the
    drafter directory as the defaults its worker reads: OWL's 15-node trees verify 32 rows with
    [SPEC]; LONGSPEC's compiled step."""
    from sgl_longgen.core.owl import verify_width
    from sgl_longgen.sglang.draft_dir import read_defaults

    gpu_check.set_drafter_defaults(tmp_path, "OWL", 15, "fp8")
    owl = read_defaults(tmp_path).owl
    assert (owl.tree_size, owl.weights, verify_width(owl.tree_size, owl.spec)) == (15, "fp8", 32)
    gpu_check.set_drafter_defaults(tmp_path, "LONGSPEC", None, "bf16")
    defaults = read_defaults(tmp_path)
    assert defaults.longspec.weights == "bf16" and defaults.owl.tree_size == 30  # the section rewritten, OWL's gone
    assert defaults.longspec.beam == "torch"
    gpu_check.set_drafter_defaults(tmp_path, "LONGSPEC", None, "fp8", "compiled")
    defaults = read_defaults(tmp_path).longspec
    assert (defaults.weights, defaults.beam) == ("fp8", "compiled")
