"""A request's settings: parsed once at admission, read back in the step without parsing.

No engine here: the parser and checks on their own, on SGLang's real ``SamplingParams``; the
engines' admission of the same inputs is :mod:`test_request_fuzz`.
"""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor, DisallowedTokensLogitsProcessor
from sglang.srt.sampling.sampling_params import SamplingParams

from sgl_longgen.sglang.penalty import ContextualPenaltyProcessor
from sgl_longgen.sglang.request_settings import (
    DEFAULT_SETTINGS,
    SETTINGS_KEY,
    RequestSettings,
    parse_custom_params,
    parse_request,
    penalty_of,
    settings_of,
    with_settings,
)
from sgl_longgen.sglang.requests import PenaltyDefaults, sampling_config, tree_blocker
from sgl_longgen.sglang.validation import (
    check_input_ids,
    check_request_shape,
    check_sampling_params,
    is_penalty_processor,
)

VOCAB = 258

GOOD_CUSTOM = {
    "penalty": 1.25, "penalty_window": 64, "longgen_speculation": "off", "longgen_width": 8, "longgen_report": True,
    "longgen_timing": "host", "longgen_timing_steps": 3, "longgen_host_profile": True,
    "thinking_budget": 5, "someone_elses": [1, "x"],  # not ours: left alone
}

BAD_CUSTOM = [
    ("penalty", "abc"), ("penalty", math.nan), ("penalty", math.inf), ("penalty", 0.5), ("penalty", True),
    ("penalty", 1e7), ("penalty", [1.2]),
    ("penalty_window", -1), ("penalty_window", 1.5), ("penalty_window", "64"), ("penalty_window", 1 << 40),
    ("longgen_speculation", "sometimes"), ("longgen_speculation", 1), ("longgen_speculation", True),
    ("longgen_width", 1), ("longgen_width", 2.0), ("longgen_width", "4"), ("longgen_width", 1 << 40),
    ("longgen_report", "yes"), ("longgen_report", 1),
    ("longgen_timing", "nonsense"), ("longgen_timing", 2),
    ("longgen_timing_steps", -1), ("longgen_timing_steps", "many"),
    ("longgen_host_profile", "true"),
    ("longgen_bogus", 1), (SETTINGS_KEY, {"penalty": 2.0}),
]


def test_every_key_of_ours_is_parsed_into_the_settings():
    s = parse_custom_params(GOOD_CUSTOM)
    assert (s.penalty, s.penalty_window, s.speculation, s.width, s.report) == (1.25, 64, "off", 8, True)
    assert (s.timing, s.timing_steps, s.host_profile) == ("host", 3, True)
    assert parse_custom_params({"longgen_timing": True}).timing == "sync"
    assert parse_custom_params({"longgen_timing": "off"}).timing is None
    # Left out or null: the server's default.
    assert parse_custom_params(None) == parse_custom_params({}) == parse_custom_params({"penalty": None}) \
        == DEFAULT_SETTINGS
    assert DEFAULT_SETTINGS.penalty is None and DEFAULT_SETTINGS.speculation is None


@pytest.mark.parametrize("key,value", BAD_CUSTOM, ids=[f"{k}={v!r}" for k, v in BAD_CUSTOM])
def test_a_bad_value_is_refused_naming_its_key(key, value):
    with pytest.raises(ValueError, match=f"custom_params.{key} "):
        parse_custom_params({"penalty": 1.1, key: value})


def test_a_plain_server_checks_only_the_penalty_keys():
    assert parse_custom_params({"longgen_bogus": "x", "longgen_width": "y"}, ours=False) == DEFAULT_SETTINGS
    with pytest.raises(ValueError, match="custom_params.penalty "):
        parse_custom_params({"penalty": "abc"}, ours=False)
    with pytest.raises(ValueError, match="custom_params must be an object"):
        parse_custom_params("abc")


def test_the_target_distribution_comes_from_sglangs_normalised_fields():
    greedy = parse_request(SamplingParams(temperature=0.0, top_k=40, custom_params={"penalty": 1.5}))
    assert (greedy.temperature, greedy.top_k, greedy.penalty) == (0.0, 0, 1.5)
    sampled = parse_request(SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, sampling_seed=11))
    assert (sampled.temperature, sampled.top_p, sampled.top_k, sampled.min_p, sampled.seed) == (0.7, 0.9, 40, 0.05, 11)
    assert parse_request(SamplingParams(top_k=-1)).top_k == 0  # the whole vocabulary
    assert parse_request(SamplingParams(top_k=1)).temperature == 0.0  # SGLang's greedy
    assert parse_request(SamplingParams(), penalty_processor=True).penalty_processor
    with pytest.raises(ValueError, match="custom_params.longgen_width"):
        parse_request(SamplingParams(custom_params={"longgen_width": 0}))


def req_with(sp: SamplingParams, **fields):
    """An SGLang ``Req`` as far as the step reads it."""
    return SimpleNamespace(**{"rid": "r", "sampling_params": sp, "output_ids": [], "grammar": None,
                              "custom_logit_processor": None, "return_logprob": False, **fields})


def test_the_step_reads_the_carried_settings_and_merges_the_server_defaults():
    sp = SamplingParams(temperature=0.5, top_k=7, custom_params={"penalty_window": 16, "x": 1})
    settings = parse_request(sp)
    original = dict(sp.custom_params)
    sp.custom_params = with_settings(sp.custom_params, settings)
    assert original == {"penalty_window": 16, "x": 1}  # the request's own dict is left as it was
    assert settings_of(req_with(sp)) == settings
    defaults = PenaltyDefaults(penalty=1.3, window=1024)
    assert penalty_of(settings, defaults) == (1.3, 16)  # theta from the server, the window the request's
    config = sampling_config(req_with(sp), defaults)
    assert (config.temperature, config.top_k, config.penalty, config.penalty_window) == (0.5, 7, 1.3, 16)
    # What the penalty value reads (the SGLang scheduler's copy, with "__req__" added) parses nothing.
    sp.custom_params = {**sp.custom_params, "__req__": object()}
    assert settings_of(req_with(sp)) == settings


def test_a_request_that_was_not_admitted_gets_the_server_defaults_without_parsing():
    sp = SamplingParams(temperature=0.0, custom_params={"penalty": "abc", "longgen_width": "x"})
    s = settings_of(req_with(sp))
    assert s == RequestSettings(temperature=0.0)  # its raw keys are not read
    sp.custom_params = {SETTINGS_KEY: {"not": "ours"}}
    assert settings_of(req_with(sp)) == RequestSettings(temperature=0.0)


def test_only_our_penalty_processor_leaves_drafts_verifiable():
    sp = SamplingParams()
    theirs = req_with(sp, custom_logit_processor=DisallowedTokensLogitsProcessor.to_str())
    assert tree_blocker(theirs, parse_request(sp)) == "custom logit processor"
    ours = req_with(sp, custom_logit_processor=ContextualPenaltyProcessor.to_str())
    assert tree_blocker(ours, parse_request(sp, penalty_processor=True)) is None
    assert tree_blocker(ours, DEFAULT_SETTINGS) == "custom logit processor"  # not admitted: decoded exactly
    assert is_penalty_processor(ContextualPenaltyProcessor.to_str())
    assert not is_penalty_processor(DisallowedTokensLogitsProcessor.to_str())
    assert isinstance(CustomLogitProcessor.from_str(ContextualPenaltyProcessor.to_str()), ContextualPenaltyProcessor)
    for broken in ("abc", '{"callable": "00"}', 5):
        with pytest.raises(ValueError, match="custom_logit_processor cannot be loaded"):
            is_penalty_processor(broken)


GOOD_SAMPLING = {
    "max_new_tokens": 8, "temperature": 0, "top_p": 0.5, "top_k": -1, "min_p": 0.1, "frequency_penalty": 0.5,
    "repetition_penalty": 1.1, "min_new_tokens": 2, "stop_token_ids": [1, None], "logit_bias": {"5": -100, 7: 2.5},
    "sampling_seed": -3, "stream_interval": 2, "n": 1, "ignore_eos": 1, "stop": ["x"], "regex": None,
    "custom_params": {"a": [1, None], "b": {"c": math.nan}},
}

BAD_SAMPLING = [
    ("temperature", "abc"), ("temperature", math.nan), ("temperature", math.inf), ("temperature", 1e300),
    ("temperature", True), ("top_p", "0.5"), ("top_p", math.nan), ("top_k", 0.5), ("top_k", 1 << 40), ("top_k", "5"),
    ("min_p", math.nan), ("frequency_penalty", "x"), ("repetition_penalty", math.inf),
    ("max_new_tokens", 1.5), ("max_new_tokens", "abc"), ("max_new_tokens", 1 << 70), ("min_new_tokens", 1 << 40),
    ("sampling_seed", "7"), ("sampling_seed", 1.5), ("sampling_seed", 1 << 64), ("sampling_seed", -(1 << 64)),
    ("stop_token_ids", [999]), ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]), ("stop_token_ids", 5),
    ("logit_bias", {"x": 1}), ("logit_bias", {"999": 1}), ("logit_bias", {"5": math.nan}), ("logit_bias", {"5": "a"}),
    ("logit_bias", {"5": 1e300}), ("logit_bias", {True: 1}), ("logit_bias", "abc"),
    ("stream_interval", "x"), ("stop", 5), ("regex", 5),
    ("custom_params", "abc"), ("custom_params", {"a": [[1]]}), ("custom_params", {"a": 1 << 64}),
    ("foo", 1), ("is_normalized", True), ("stop_strs", ["x"]),
]


def test_good_sampling_fields_pass():
    check_sampling_params(GOOD_SAMPLING, SamplingParams, VOCAB)
    check_sampling_params({"temperature": None, "top_k": None, "max_new_tokens": None}, SamplingParams, VOCAB)


@pytest.mark.parametrize("key,value", BAD_SAMPLING, ids=[f"{k}={v!r}"[:40] for k, v in BAD_SAMPLING])
def test_a_bad_sampling_field_is_refused_naming_it(key, value):
    with pytest.raises(ValueError, match=f"sampling_params.{key}"):
        check_sampling_params({"max_new_tokens": 4, key: value}, SamplingParams, VOCAB)


def test_token_ids_outside_the_vocabulary_or_not_integers_are_refused():
    check_input_ids([0, 5, VOCAB - 1], VOCAB)
    for ids, where in (([0, VOCAB], "input_ids[1] = 258"), ([-3], "input_ids[0] = -3"),
                       ([1, "a"], "input_ids[1] = 'a'"), ([1.0], "input_ids[0] = 1.0"), ([True], "input_ids[0] = True")):
        with pytest.raises(ValueError, match="^" + re.escape(f"{where} is not a token id")):
            check_input_ids(ids, VOCAB)


def test_a_malformed_request_is_refused_before_sglang_splits_it():
    def obj(sampling_params=None, input_ids=None):
        return SimpleNamespace(sampling_params=sampling_params, input_ids=[1, 2] if input_ids is None else input_ids)

    check_request_shape(obj({"n": 1}))
    check_request_shape(obj([{}, None], input_ids=[[1], [2]]))
    for bad, key in ((obj("abc"), "sampling_params"), (obj([{}, 5]), "sampling_params"),
                     (obj({"n": "2"}), "sampling_params.n"), (obj({"n": 0}), "sampling_params.n"),
                     (obj({"n": None}), "sampling_params.n"), (obj(input_ids="abc"), "input_ids"),
                     (obj(input_ids=[1, [2]]), "input_ids")):
        with pytest.raises(ValueError, match=key):
            check_request_shape(bad)
