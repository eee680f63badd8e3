"""Resuming a greedy generation from a checkpoint gives the tokens of an uninterrupted run.

The engine is given the prompt plus the generated prefix (a re-prefill) and generates only the rest:
its decoder reports how many tokens it produced, so nothing before the checkpoint is made again.
The contextual penalty window and the n-gram pool are rebuilt from the history, so TokenSwift with
the penalty on resumes exactly too.
"""

from __future__ import annotations

import functools

import pytest

from sgl_longgen.cluster.reference_engine import ReferenceEngine
from sgl_longgen.cluster.messages import Finished, Progress, Task

N = 128
PROMPT = list(b"Once upon a time, in a city built on the back of a sleeping whale, ")

GENERATION = {
    "ar": {"method": "ar", "ignore_eos": True, "sampling": {"temperature": 0.0}},
    "tokenswift-penalty": {"method": "tokenswift", "ignore_eos": True,
                           "sampling": {"temperature": 0.0, "penalty": 1.2, "penalty_window": 32},
                           "tokenswift": {"partial_kv": {"budget": 64, "sinks": 8}}},
    # The drafters shipped inside the embedded model, found by the job's default draft directories.
    "howl": {"method": "howl", "ignore_eos": True, "sampling": {"temperature": 0.0}},
    "longspec": {"method": "longspec", "ignore_eos": True, "sampling": {"temperature": 0.0}},
}


@functools.lru_cache(maxsize=None)
def engine(kind: str) -> ReferenceEngine:
    return ReferenceEngine(index=0, model="tiny", drafts={}, generation=GENERATION[kind], threads=1)


def run(eng: ReferenceEngine, prefix: list[int], report_every: int = 16) -> tuple[list[int], Finished, int]:
    msgs = list(eng.generate(Task(id="x", input_ids=PROMPT, prefix=prefix, max_new_tokens=N), report_every))
    assert all(isinstance(m, Progress) for m in msgs[:-1]) and isinstance(msgs[-1], Finished)
    new = [t for m in msgs for t in m.new_tokens]
    return new, msgs[-1], len(msgs) - 1


@pytest.mark.parametrize("kind", sorted(GENERATION))
def test_greedy_resume_is_token_identical(kind):
    eng = engine(kind)
    full, fin, progress_msgs = run(eng, [])
    assert len(full) == N and fin.finish_reason == "length" and fin.segment.tokens == N
    # Deltas streamed while generating, not only at the end: every 16 tokens where steps commit a
    # few tokens each (HOWL's long suffix drafts commit up to ~60 in one step).
    assert progress_msgs >= (N // 16 - 1 if fin.segment.steps >= N // 4 else 1)
    for k in (1, 45, 100):
        before = eng.tokens_generated
        rest, fin, _ = run(eng, full[:k])
        assert full[:k] + rest == full, f"resume after {k} tokens diverged"
        assert fin.segment.start == k and fin.segment.tokens == N - k
        assert eng.tokens_generated - before == N - k  # the decoder produced only the missing tokens
        assert fin.text == eng.loaded.tokenizer.decode(full)


@pytest.mark.parametrize("kind", ["howl", "longspec"])
def test_every_method_of_a_job_decodes_what_plain_decoding_does(kind):
    full, fin, _ = run(engine(kind), [])
    assert engine(kind).config.method == kind and fin.segment.steps < N  # it speculated
    assert full == run(engine("ar"), [])[0]


def test_a_complete_checkpoint_generates_nothing():
    eng = engine("ar")
    before = eng.tokens_generated
    new, fin, _ = run(eng, list(range(65, 65 + N)))
    assert new == [] and fin.finish_reason == "length" and eng.tokens_generated == before


def test_an_unusable_prompt_is_an_error_result_not_a_crash():
    eng = engine("ar")
    msgs = list(eng.generate(Task(id="x", input_ids=[10**6], max_new_tokens=4), 16))
    (fin,) = msgs
    assert fin.finish_reason == "error" and "vocabulary" in fin.error
