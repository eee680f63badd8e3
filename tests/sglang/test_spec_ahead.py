"""The next speculative step's draft and verify, queued before a speculative step returns (``.spec_ahead``).

A TOKENSWIFT engine with ``SGLANG_LONGGEN_SPEC_RUN_AHEAD=1`` (opt-in) against
plain decoding and against the same worker without it (the module's ``spec_engine``): the same
greedy tokens, and at temperature 1 the very same draws (the draws stay in the call that takes the
queued verify, in the order they had), including where requests end on stop tokens mid-way and
queued steps are dropped for batches that never come.
"""

from __future__ import annotations

import pytest
import torch
from sglang_harness import (
    PROMPTS,
    check_budgets,
    check_same_draws,
    greedy,
    last,
    spec_engine_with,
)

from sgl_longgen.sglang.spec_ahead import (
    SPEC_RUN_AHEAD_ENV,
    SpecAhead,
    spec_ahead_enabled,
)

ON = {"longgen_speculation": "on"}


@pytest.fixture(scope="module")
def ahead_engine():
    yield from spec_engine_with(SPEC_RUN_AHEAD="1")


def test_speculative_steps_take_the_step_the_last_call_queued(plain_engine, ahead_engine):
    n = 160
    want = plain_engine.generate(input_ids=PROMPTS, sampling_params=greedy(n))
    got = ahead_engine.generate(input_ids=PROMPTS, sampling_params=greedy(
        n, custom_params={**ON, "longgen_report": True}))
    for w, g in zip(want, got):
        assert g["output_ids"] == w["output_ids"]
        meta = g["meta_info"]
        spec = last(meta, "longgen_spec_steps")
        ahead = last(meta, "longgen_ahead_steps")
        # Every step but the first (nothing queued it) and those after a step that could end a
        # request (its budget in reach) is the one the call before queued.
        assert spec >= 4 and ahead is not None and ahead >= spec // 2, (spec, ahead)


def test_token_budgets(plain_engine, ahead_engine):
    check_budgets(plain_engine, ahead_engine, custom_params=ON)


def test_sampled_draws_are_the_ones_made_without_it(spec_engine, ahead_engine):
    """Unseeded requests share one generator, a seeded one has its own. The requests end on stop
    tokens at different points, so queued steps are dropped for batches that do not come."""
    check_same_draws(spec_engine, ahead_engine, ON)


def test_greedy_mixes_of_plain_and_speculative_steps_and_widths(plain_engine, ahead_engine):
    """``auto`` (plain runs where drafts do not pay, speculative steps on a looping prompt) and
    requests arriving while others decode: queued steps are also dropped for a plain step and
    for a batch that changed."""
    prompts = [*PROMPTS, [256] + [41, 182, 48] * 40]
    want = plain_engine.generate(input_ids=prompts, sampling_params=greedy(160))
    got = ahead_engine.generate(input_ids=prompts, sampling_params=[
        greedy(160, custom_params={"longgen_speculation": "auto"}), greedy(160, custom_params=ON),
        greedy(160, custom_params={"longgen_speculation": "auto"}), greedy(160, custom_params=ON)])
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]


def test_a_queued_step_is_taken_once_only_by_its_batch_at_its_width():
    ahead = SpecAhead(torch.device("cpu"), enabled=True)
    calls = []

    def step():
        calls.append(len(calls))
        return [f"draft {len(calls)}"], f"launched {len(calls)}"

    ahead.queue(("a", 0, 10), None, step)
    assert ahead.take_at(("a", 0, 11), None) is None and ahead.queued is None  # another batch: dropped
    ahead.queue(("a", 0, 10), 4, step)
    assert ahead.take_at(("a", 0, 10), None) is None and ahead.queued is None  # another width: dropped
    ahead.queue(("a", 0, 10), 4, step)
    taken = ahead.take_at(("a", 0, 10), 4)
    assert taken is not None and taken.launched == "launched 3" and ahead.queued is None
    assert ahead.take_at(("a", 0, 10), 4) is None


def test_opt_in_and_then_on_either_device(monkeypatch):
    """Off unless asked for, on GPUs and CPUs alike."""
    monkeypatch.delenv(SPEC_RUN_AHEAD_ENV, raising=False)
    assert not spec_ahead_enabled(torch.device("cuda")) and not spec_ahead_enabled(torch.device("cpu"))
    for value, on in (("1", True), ("0", False)):
        monkeypatch.setenv(SPEC_RUN_AHEAD_ENV, value)
        assert spec_ahead_enabled(torch.device("cuda")) is on and spec_ahead_enabled(torch.device("cpu")) is on
    monkeypatch.setenv(SPEC_RUN_AHEAD_ENV, "sometimes")
    with pytest.raises(ValueError, match=SPEC_RUN_AHEAD_ENV):
        spec_ahead_enabled(torch.device("cpu"))
