"""Tensor parallelism (``tp_size=2``) on SGLang's CPU engine: greedy output of TOKENSWIFT, OWL and
HOWL is token-identical to plain TP=2 decoding.

Every rank runs our worker on identical inputs and must decide identically: TOKENSWIFT's heads
read logits gathered from every rank's LM head shard, and its partial-KV scores are summed over
the ranks' attention heads. Each engine is started once, used, and stopped before the next
(four TP=2 engines at once would crowd a small CPU host).
"""

from __future__ import annotations

import os

import pytest
import torch

from sgl_longgen.runtime import load_model
from helpers import fit_drafter
from sglang_harness import PROMPTS, engine_args, greedy, heads_with, model_path, spec_args, stop

TP = 2
NEW_TOKENS = 96

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU engine's tensor parallelism")


def threads_bind(tp: int) -> str:
    """One core group per rank. Unset, SGLang's CPU engine wants one NUMA node per rank."""
    cpus = sorted(os.sched_getaffinity(0))
    per = max(1, len(cpus) // tp)
    groups = [cpus[min(i * per, len(cpus) - 1):][:per] for i in range(tp)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)


@pytest.fixture(scope="module", autouse=True)
def cpu_binding():
    patch = pytest.MonkeyPatch()
    if "SGLANG_CPU_OMP_THREADS_BIND" not in os.environ:
        patch.setenv("SGLANG_CPU_OMP_THREADS_BIND", threads_bind(TP))
    yield
    patch.undo()


def run(args: dict) -> list[dict]:
    """Start an engine, generate greedily for every prompt, stop it."""
    import sglang as sgl

    engine = sgl.Engine(**args)
    try:
        return engine.generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS))
    finally:
        stop(engine)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return [o["output_ids"] for o in run(engine_args(tp_size=TP))]


@pytest.fixture(scope="module")
def sequences(reference) -> torch.Tensor:
    seqs = [p + o for p, o in zip(PROMPTS, reference)]
    length = min(len(s) for s in seqs)
    return torch.tensor([s[:length] for s in seqs])


def check(reference, outs, min_tau: float) -> None:
    assert [len(r) for r in reference] == [NEW_TOKENS] * len(PROMPTS)
    assert [o["output_ids"] for o in outs] == reference
    taus = [o["meta_info"]["spec_accept_length"] for o in outs]
    assert max(taus) > min_tau, taus  # it really speculated


def test_tokenswift_tp2_greedy_is_identical(reference, tmp_path):
    # A partial KV of 64 positions: these requests re-select it (scores summed over the ranks).
    heads = heads_with(tmp_path / "tokenswift-heads", "[tokenswift.partial_kv]\nbudget = 64\nsinks = 4\n")
    check(reference, run(spec_args(tp_size=TP, speculative_draft_model_path=str(heads))), min_tau=1.5)


@pytest.mark.parametrize("algorithm, draft_vocab", [("OWL", 0), ("HOWL", 48)])
def test_owl_tp2_greedy_is_identical(reference, sequences, tmp_path, algorithm, draft_vocab):
    target = load_model(model_path(), "float64").model
    drafter = fit_drafter(target, sequences, steps=12, draft_vocab=draft_vocab).save(tmp_path / "drafter")
    args = engine_args(tp_size=TP, speculative_algorithm=algorithm, speculative_draft_model_path=str(drafter))
    check(reference, run(args), min_tau=1.5)
