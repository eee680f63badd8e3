"""TOKENSWIFT behind ``sgl.Engine``: lossless against the same engine without speculation."""

from __future__ import annotations


import pytest

from sgl_longgen.sglang.penalty import ContextualPenaltyProcessor

from sglang_harness import CONTEXT, PROMPTS, check_budgets, greedy, heads_with, spec_args, stop

NEW_TOKENS = 256
PENALTY = {"penalty": 1.2, "penalty_window": 64}


@pytest.fixture(scope="module")
def spec_engine(tmp_path_factory):
    """TOKENSWIFT with a partial KV of 64 positions: these requests spend most steps in its
    steady state (each draft's inputs built on the device behind the commit) and re-select
    every few dozen tokens."""
    import sglang as sgl

    heads = heads_with(tmp_path_factory.mktemp("heads") / "tokenswift-heads", "[tokenswift.partial_kv]\nbudget = 64\nsinks = 4\n")
    engine = sgl.Engine(**spec_args(speculative_draft_model_path=str(heads)))
    yield engine
    stop(engine)


def test_greedy_outputs_are_identical_for_concurrent_requests(plain_engine, spec_engine):
    want = plain_engine.generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS))
    got = spec_engine.generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS))
    for w, g in zip(want, got):
        assert len(w["output_ids"]) == NEW_TOKENS
        assert g["output_ids"] == w["output_ids"]
        meta = g["meta_info"]
        # It really speculated: several tokens per verify step; no timings unless asked for.
        assert meta["spec_accept_length"] > 1.5
        assert not any(k.startswith("longgen_") for k in meta)


def test_greedy_with_the_contextual_penalty(plain_engine, spec_engine):
    processor = ContextualPenaltyProcessor.to_str()
    want = plain_engine.generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS, custom_params=PENALTY),
                                 custom_logit_processor=[processor] * len(PROMPTS))
    unpenalized = plain_engine.generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS))
    got = spec_engine.generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS, custom_params=PENALTY))
    for w, u, g in zip(want, unpenalized, got):
        assert w["output_ids"] != u["output_ids"]  # the penalty changes what the model writes
        assert g["output_ids"] == w["output_ids"]
    # The processor itself is recognised too: same tokens when a client sends it to TOKENSWIFT.
    again = spec_engine.generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS, custom_params=PENALTY),
                                 custom_logit_processor=[processor] * len(PROMPTS))
    assert [a["output_ids"] for a in again] == [w["output_ids"] for w in want]


def test_sampled_generation_completes_and_reports_acceptance(spec_engine):
    params = [{"max_new_tokens": 128, "temperature": 0.8, "top_p": 0.95, "min_p": 0.02, "ignore_eos": True,
               "sampling_seed": seed} for seed in range(len(PROMPTS))]
    out = spec_engine.generate(input_ids=PROMPTS, sampling_params=params)
    for o in out:
        assert len(o["output_ids"]) == 128
        assert o["meta_info"]["spec_accept_length"] >= 1.0
    # The per-request seed makes a sampled run reproducible.
    again = spec_engine.generate(input_ids=PROMPTS[:1], sampling_params=params[:1])
    assert again[0]["output_ids"] == out[0]["output_ids"]


def test_unsupported_sampling_features_fall_back_to_exact_single_tokens(plain_engine, spec_engine):
    params = greedy(48, frequency_penalty=0.5)
    want = plain_engine.generate(input_ids=PROMPTS[:1], sampling_params=params)
    got = spec_engine.generate(input_ids=PROMPTS[:1], sampling_params=params)
    assert got[0]["output_ids"] == want[0]["output_ids"]
    assert got[0]["meta_info"]["spec_accept_length"] == pytest.approx(1.0, abs=0.05)


def test_prompt_plus_max_new_tokens_beyond_the_context_gets_sglangs_error(plain_engine, spec_engine):
    prompt = [256] + [7] * (CONTEXT - 10)
    outcomes = []
    for engine in (plain_engine, spec_engine):
        try:
            res = engine.generate(input_ids=[prompt], sampling_params=greedy(100))
            outcomes.append(("result", res[0]["meta_info"]["finish_reason"]))
        except ValueError as exc:
            outcomes.append(("error", "context" in str(exc).lower() or "length" in str(exc).lower()))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] == "error" or outcomes[0][1]["type"] == "abort"


def test_drafts_queued_ahead_serve_most_steps(plain_engine, spec_engine):
    """Each step's draft forward is queued at the end of the step before; the next step uses it."""
    params = greedy(NEW_TOKENS, custom_params={"longgen_timing": "host"})
    want = plain_engine.generate(input_ids=PROMPTS[:1], sampling_params=greedy(NEW_TOKENS))
    got = spec_engine.generate(input_ids=PROMPTS[:1], sampling_params=params)
    assert got[0]["output_ids"] == want[0]["output_ids"]
    meta = got[0]["meta_info"]
    draft_ms = [x for x in meta["longgen_draft_ms"] if x is not None]
    assert len(draft_ms) == meta["spec_verify_ct"] and all(x >= 0 for x in draft_ms)
    ahead = [x for x in meta["longgen_draft_queued_ahead"] if x is not None]
    assert len(ahead) == meta["spec_verify_ct"]
    # The first decode step scores the prompt (no draft ahead of it), as do re-selections.
    assert ahead[0] == 0.0 and sum(ahead) >= 0.75 * len(ahead)
    assert meta["spec_accept_length"] > 1.5  # a stale draft would propose the wrong continuations
    # Most were queued on the device right behind the commit, before the host read the draws.
    chained = [x for x in meta["longgen_draft_chained"] if x is not None]
    assert len(chained) == len(ahead) and sum(chained) >= 0.5 * len(chained)


def test_the_token_budget_is_exact(plain_engine, spec_engine):
    check_budgets(plain_engine, spec_engine)
