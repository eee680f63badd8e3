"""SUFFIX behind ``sgl.Engine``: no draft model, lossless against the same engine without speculation.

The engine reads its settings from a directory holding only a ``longgen.toml`` (the shared
corpus of past outputs on); engines started without any path are in the tests every algorithm
runs (test_request_fuzz, test_context_end). Requests force speculation (``longgen_speculation:
"on"``) where a test checks what the drafts did: SUFFIX's default is adaptive speculation, whose
plain steps would hide them.
"""

from __future__ import annotations

import pytest

from sgl_longgen.sglang.penalty import ContextualPenaltyProcessor

from sglang_harness import PROMPTS, check_budgets, engine_args, greedy, last, stop

NEW_TOKENS = 160
PENALTY = {"penalty": 1.2, "penalty_window": 32}
ON = {"longgen_speculation": "on"}
UNSEEN = [256] + list(b"class Stack:\n    def push(self, x):\n")  # no other test's prompt


@pytest.fixture(scope="module")
def suffix_engine(tmp_path_factory):
    """SUFFIX with the outputs of the last 8 finished requests shared."""
    import sglang as sgl

    settings = tmp_path_factory.mktemp("suffix")
    (settings / "longgen.toml").write_text("[suffix]\nglobal_requests = 8\n")
    engine = sgl.Engine(**engine_args(speculative_algorithm="SUFFIX", speculative_draft_model_path=str(settings)))
    yield engine
    stop(engine)


def test_greedy_outputs_are_identical_for_concurrent_requests(plain_engine, suffix_engine):
    assert suffix_engine.server_args.speculative_num_draft_tokens == 65  # a whole 64-node tree and the root
    want = plain_engine.generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS))
    forced = suffix_engine.generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS, custom_params=ON))
    auto = suffix_engine.generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS, custom_params={
        "longgen_report": True}))
    for w, f, a in zip(want, forced, auto):
        assert len(w["output_ids"]) == NEW_TOKENS
        assert f["output_ids"] == w["output_ids"] and a["output_ids"] == w["output_ids"]
    # The greedy text repeats itself: drafts from the requests' own text were accepted.
    assert max(f["meta_info"]["spec_accept_length"] for f in forced) > 2.0
    # Adaptive speculation is on by default: a controller estimated each request's steps.
    assert all(last(a["meta_info"], "longgen_expected_tokens") is not None for a in auto)
    assert sum(last(a["meta_info"], "longgen_spec_steps") for a in auto) > 0


def test_greedy_with_the_contextual_penalty(plain_engine, suffix_engine):
    processor = ContextualPenaltyProcessor.to_str()
    want = plain_engine.generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS, custom_params=PENALTY),
                                 custom_logit_processor=[processor] * len(PROMPTS))
    got = suffix_engine.generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS, custom_params={**PENALTY, **ON}))
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]


def test_the_token_budget_is_exact(plain_engine, suffix_engine):
    check_budgets(plain_engine, suffix_engine, custom_params=ON)


def test_a_repeated_request_drafts_from_the_shared_corpus(plain_engine, suffix_engine):
    """A request repeated after the first finished drafts from its output: most of it is accepted."""
    want = plain_engine.generate(input_ids=[UNSEEN], sampling_params=greedy(96))[0]["output_ids"]
    first = suffix_engine.generate(input_ids=[UNSEEN], sampling_params=greedy(96, custom_params=ON))[0]
    again = suffix_engine.generate(input_ids=[UNSEEN], sampling_params=greedy(96, custom_params=ON))[0]
    assert first["output_ids"] == again["output_ids"] == want
    assert again["meta_info"]["spec_accept_length"] > max(8.0, first["meta_info"]["spec_accept_length"])


def test_bad_settings_stop_startup_naming_them(tmp_path):
    import sglang as sgl

    file = tmp_path / "longgen.toml"
    file.write_text("[suffix]\nmax_spec_tokens = 0\n")
    with pytest.raises(ValueError, match=r"SUFFIX needs no draft model.*longgen.toml is not a directory"):
        sgl.Engine(**engine_args(speculative_algorithm="SUFFIX", speculative_draft_model_path=str(file)))
    with pytest.raises(ValueError, match=r"longgen.toml.*max_spec_tokens"):
        sgl.Engine(**engine_args(speculative_algorithm="SUFFIX", speculative_draft_model_path=str(tmp_path)))
