"""The next call's first plain step, queued before a run of plain steps returns (``.run_ahead``).

A TOKENSWIFT engine with ``SGLANG_LONGGEN_PLAIN_RUN_AHEAD=1`` (on by default on GPUs only)
against plain decoding and against the same worker without it (the module's ``spec_engine``):
same greedy tokens, and at temperature 1 the very same draws, including where a request ends on
a stop token after its next forward was queued (the forward is dropped, the generators it drew
from go back).
"""

from __future__ import annotations

import pytest
import torch
from sglang_harness import PROMPTS, check_same_draws, greedy, spec_engine_with

from sgl_longgen.sglang.run_ahead import RUN_AHEAD_ENV, RunAhead, run_ahead_enabled

OFF = {"longgen_speculation": "off"}


@pytest.fixture(scope="module")
def ahead_engine():
    yield from spec_engine_with(PLAIN_RUN_AHEAD="1")


def series(meta: dict, key: str) -> list[float]:
    return [v for v in meta.get(key, []) if v is not None]


def test_plain_runs_take_the_forward_the_last_call_queued(plain_engine, ahead_engine):
    n = 96
    want = plain_engine.generate(input_ids=PROMPTS, sampling_params=greedy(n))
    got = ahead_engine.generate(input_ids=PROMPTS, sampling_params=greedy(
        n, custom_params={**OFF, "longgen_timing": "host"}))
    for w, g in zip(want, got):
        assert g["output_ids"] == w["output_ids"]
        meta = g["meta_info"]
        assert meta["spec_verify_ct"] == n - 1  # one verify counted per forward, queued ahead or not
        taken = series(meta, "longgen_plain_run_ahead")
        # Every call after the first takes the forward the one before queued (none is queued past
        # a request's budget, and the batch stays the same to the end).
        assert taken[0] == 0.0 and all(taken[1:]) and len(taken) >= 4, taken


@pytest.mark.parametrize("n", [1, 2, 7, 33])
def test_token_budgets(plain_engine, ahead_engine, n):
    want = plain_engine.generate(input_ids=PROMPTS, sampling_params=greedy(n))
    got = ahead_engine.generate(input_ids=PROMPTS, sampling_params=greedy(n, custom_params=OFF))
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert all(len(g["output_ids"]) == n for g in got)


def test_sampled_draws_are_the_ones_made_without_it(spec_engine, ahead_engine):
    """Unseeded requests share one generator, seeded ones have their own. Requests end on stop
    tokens at different points, so calls queue forwards for batches that do not come."""
    check_same_draws(spec_engine, ahead_engine, OFF)


def test_greedy_mixes_of_plain_and_speculative_steps(plain_engine, ahead_engine):
    """``auto``: runs of plain steps and speculative steps (where the n-grams of a looping prompt
    pay) in one request, so queued forwards are also dropped for a speculative step."""
    prompts = [*PROMPTS, [256] + [41, 182, 48] * 40]
    want = plain_engine.generate(input_ids=prompts, sampling_params=greedy(160))
    got = ahead_engine.generate(input_ids=prompts, sampling_params=greedy(160, custom_params={
        "longgen_speculation": "auto"}))
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]


def test_a_dropped_forward_gives_its_draws_back():
    shared, own = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    ahead = RunAhead(torch.device("cpu"), enabled=True)

    def forward():
        token = torch.cat([torch.randint(0, 100, (2,), generator=shared), torch.randint(0, 100, (1,), generator=own)])
        return "launched", token, None

    ahead.queue(("a", 0, 10), [shared, own, shared], forward)
    first = ahead.queued.token.clone()
    assert ahead.take(("a", 0, 11)) is None and ahead.queued is None  # another batch: dropped
    ahead.queue(("a", 0, 10), [shared, own], forward)
    assert torch.equal(ahead.queued.token, first)  # the same draws again
    taken = ahead.take(("a", 0, 10))
    assert taken is not None and torch.equal(taken.token, first)
    # Taken, the draws stand: the generators move on.
    after = torch.cat([torch.randint(0, 100, (2,), generator=shared), torch.randint(0, 100, (1,), generator=own)])
    assert not torch.equal(after, first)


def test_on_by_default_where_the_device_has_streams(monkeypatch):
    monkeypatch.delenv(RUN_AHEAD_ENV, raising=False)
    assert run_ahead_enabled(torch.device("cuda")) and not run_ahead_enabled(torch.device("cpu"))
    monkeypatch.setenv(RUN_AHEAD_ENV, "0")
    assert not run_ahead_enabled(torch.device("cuda"))
    monkeypatch.setenv(RUN_AHEAD_ENV, "1")
    assert run_ahead_enabled(torch.device("cpu"))
    monkeypatch.setenv(RUN_AHEAD_ENV, "sometimes")
    with pytest.raises(ValueError, match=RUN_AHEAD_ENV):
        run_ahead_enabled(torch.device("cpu"))
