"""Bad requests to every algorithm's engine: each refused at admission, naming what is wrong, and
the engine keeps serving with its output unchanged.

One engine per algorithm (its drafter as ``tiny-random`` ships it; SUFFIX, none), one table of bad inputs for
all: our ``custom_params`` keys and SGLang's sampling fields of the wrong type, out of range,
NaN / inf, huge, empty, outside the vocabulary, and malformed token ids. Every one of them gets
a ``ValueError`` from ``sgl.Engine`` naming the field (a scheduler meeting such a value inside a
step would die, and every running request with it); after each, a batch of good requests (one
with the contextual penalty and forced speculation) gives exactly the tokens it gave before. A
plain engine checks only the penalty keys, of requests that send our penalty processor.
"""

from __future__ import annotations

import math
import re

import pytest
from sglang_harness import engine_args, greedy, heads_path, model_path, stop

from sgl_longgen.sglang.penalty import ContextualPenaltyProcessor

DRAFTERS = {
    "TOKENSWIFT": heads_path,
    "OWL": lambda: model_path() / "owl-drafter",
    "HOWL": lambda: model_path() / "owl-drafter",
    "LONGSPEC": lambda: model_path() / "longspec-drafter",
    "SUFFIX": lambda: None,  # no draft model
}
PROMPT = [256, 100, 101, 102, 103]
NEW_TOKENS = 5
GOOD = [greedy(NEW_TOKENS, custom_params={"penalty": 1.3, "penalty_window": 8, "longgen_speculation": "on"}),
        greedy(NEW_TOKENS, custom_params={"longgen_width": 4})]


def custom(key: str, value) -> tuple[str, dict, str]:
    return f"custom_params.{key}={value!r}", {"sampling_params": greedy(2, custom_params={key: value})}, \
        f"custom_params.{key}"


def field(key: str, value, named: str | None = None) -> tuple[str, dict, str]:
    return f"{key}={value!r}"[:48], {"sampling_params": {"max_new_tokens": 2, key: value}}, named or key


def ids(value, named: str = "input_ids") -> tuple[str, dict, str]:
    return f"input_ids={value!r}"[:48], {"input_ids": value, "sampling_params": greedy(2)}, named


BAD = [
    # Our custom_params: the bug report's penalty first.
    custom("penalty", "abc"), custom("penalty", math.nan), custom("penalty", math.inf), custom("penalty", 0.5),
    custom("penalty", 1e300), custom("penalty_window", -1), custom("penalty_window", "64"),
    custom("penalty_window", 1 << 62), custom("longgen_speculation", "sometimes"), custom("longgen_width", 1),
    custom("longgen_width", 2.5), custom("longgen_report", "yes"), custom("longgen_timing", "nonsense"),
    custom("longgen_timing_steps", -1), custom("longgen_host_profile", 1), custom("longgen_typo", True),
    custom("longgen_settings", {"penalty": 2.0}),
    # SGLang's sampling fields.
    field("temperature", "abc"), field("temperature", math.nan), field("temperature", math.inf),
    field("temperature", 1e300), field("top_p", math.nan), field("top_p", 0.0), field("top_k", 1 << 40),
    field("top_k", 2.5), field("min_p", math.inf), field("repetition_penalty", math.nan),
    field("max_new_tokens", -1), field("max_new_tokens", 1 << 70), field("max_new_tokens", 1.5),
    field("max_new_tokens", 10**9, "context length"), field("min_new_tokens", 1 << 40),
    field("sampling_seed", "7"), field("sampling_seed", 1 << 64), field("stop_token_ids", [99999]),
    field("stop_token_ids", [-1]), field("logit_bias", {"99999": 1.0}), field("logit_bias", {"5": math.nan}),
    field("logit_bias", {"x": 1.0}), field("stream_interval", "x"), field("n", "2"),
    field("custom_params", "abc"), field("custom_params", {"a": [[1]]}), field("no_such_field", 1),
    field("is_normalized", True),
    ("sampling_params='abc'", {"sampling_params": "abc"}, "sampling_params"),
    # Token ids.
    ids([]), ids([256, 99999], "input_ids[1] = 99999"), ids([256, -1], "input_ids[1] = -1"),
    ids([256, "a"], "input_ids[1] = 'a'"), ids([256, 1.5], "input_ids[1] = 1.5"), ids("abc"),
    # One bad request in a batch of good ones; a logit processor that cannot be loaded.
    ("batch", {"input_ids": [PROMPT, PROMPT], "sampling_params": [greedy(2), greedy(2, top_k=0.5)]}, "top_k"),
    ("custom_logit_processor='abc'", {"sampling_params": greedy(2), "custom_logit_processor": "abc"},
     "custom_logit_processor"),
]


@pytest.fixture(scope="module", params=list(DRAFTERS))
def engine(request):
    import sglang as sgl

    draft = DRAFTERS[request.param]()
    args = engine_args(speculative_algorithm=request.param,
                       **({} if draft is None else {"speculative_draft_model_path": str(draft)}))
    engine = sgl.Engine(**args)
    yield engine
    stop(engine)


def answer(engine) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=[PROMPT] * len(GOOD), sampling_params=GOOD)]


@pytest.fixture(scope="module")
def reference(engine) -> list[list[int]]:
    """The good requests' tokens before any bad request."""
    out = answer(engine)
    assert [len(o) for o in out] == [NEW_TOKENS] * len(GOOD)
    return out


@pytest.mark.parametrize("name,request_args,named", BAD, ids=[case[0] for case in BAD])
def test_a_bad_request_is_refused_naming_it_and_the_engine_serves_on(engine, reference, name, request_args, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        engine.generate(**{"input_ids": PROMPT, **request_args})
    assert answer(engine) == reference


def test_a_plain_engine_checks_only_the_penalty_keys_of_our_processors_requests(plain_engine):
    with pytest.raises(ValueError, match=re.escape("custom_params.penalty")):
        plain_engine.generate(input_ids=PROMPT, sampling_params=greedy(2, custom_params={"penalty": "abc"}),
                              custom_logit_processor=ContextualPenaltyProcessor.to_str())
    # Nothing reads these keys on a plain server: served as before.
    out = plain_engine.generate(input_ids=PROMPT, sampling_params=greedy(2, custom_params={"penalty": "abc",
                                                                                         "longgen_typo": 1}))
    assert len(out["output_ids"]) == 2
