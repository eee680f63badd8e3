"""Adaptive speculation in the SGLang worker: plain steps where drafts do not pay, the output unchanged.

One TOKENSWIFT engine with ``SGLANG_LONGGEN_ADAPTIVE=1`` (the server default becomes ``auto``);
requests override it with ``custom_params {"longgen_speculation": ...}`` and ask for the
per-step report with ``longgen_report``.
"""

from __future__ import annotations

import math

import pytest
from sglang_harness import (
    PROMPTS,
    check_budgets,
    greedy,
    heads_with,
    last,
    spec_args,
    spec_engine_with,
    stop,
)

from sgl_longgen.sglang.penalty import ContextualPenaltyProcessor
from sgl_longgen.sglang.worker import PLAIN_RUN

NEW_TOKENS = 96
REPORT = {"longgen_report": True}


@pytest.fixture(scope="module")
def adaptive_engine():
    yield from spec_engine_with(ADAPTIVE="1")


def steps_of(meta: dict) -> tuple[int, int]:
    return last(meta, "longgen_spec_steps"), last(meta, "longgen_plain_steps")


def params(n: int, **custom) -> dict:
    return greedy(n, custom_params={**REPORT, **custom})


def test_greedy_output_is_plain_decodings_whatever_the_mix(plain_engine, adaptive_engine):
    want = plain_engine.generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS))
    got = adaptive_engine.generate(input_ids=PROMPTS, sampling_params=params(NEW_TOKENS))
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    for g in got:
        meta = g["meta_info"]
        spec, plain = steps_of(meta)
        # Every step is counted once, and the report's steps are SGLang's verify steps.
        assert spec + plain == meta["spec_verify_ct"]
        assert spec >= 1  # the warm-up step speculates
        assert last(meta, "longgen_plain_ms") is not None or plain == 0


def test_per_request_override(plain_engine, adaptive_engine):
    want = plain_engine.generate(input_ids=PROMPTS[:2], sampling_params=greedy(NEW_TOKENS))
    off = adaptive_engine.generate(input_ids=PROMPTS[:2], sampling_params=params(NEW_TOKENS, longgen_speculation="off"))
    on = adaptive_engine.generate(input_ids=PROMPTS[:2], sampling_params=params(NEW_TOKENS, longgen_speculation="on"))
    for w, o, s in zip(want, off, on):
        assert o["output_ids"] == w["output_ids"] == s["output_ids"]
        assert steps_of(o["meta_info"]) == (0, NEW_TOKENS - 1)  # one token per step (the prefill drew one)
        assert steps_of(s["meta_info"])[1] == 0


def test_a_bad_override_is_refused_and_the_server_goes_on(plain_engine, adaptive_engine):
    want = plain_engine.generate(input_ids=PROMPTS[0], sampling_params=greedy(8))
    with pytest.raises(Exception, match="longgen_speculation"):
        adaptive_engine.generate(input_ids=PROMPTS[0], sampling_params=params(8, longgen_speculation="sometimes"))
    again = adaptive_engine.generate(input_ids=PROMPTS[0], sampling_params=greedy(8))
    assert again["output_ids"] == want["output_ids"]


def spec_share(outputs: list[dict]) -> float:
    """The share of the output the speculative steps committed (each plain step commits one token)."""
    spec = sum(steps_of(o["meta_info"])[0] * (last(o["meta_info"], "longgen_tau") or 0) for o in outputs)
    plain = sum(steps_of(o["meta_info"])[1] for o in outputs)
    return spec / (spec + plain)


def test_plain_steps_where_drafts_do_not_pay_drafting_where_they_do(adaptive_engine):
    """Sampled at temperature 1 the random-init model's text is noise to the heads and n-grams:
    after the first measurements most steps are plain. Greedy from a prompt in the model's own
    loop, the n-gram drafts are accepted and far more steps speculate."""
    sampling = {"max_new_tokens": 160, "temperature": 1.0, "ignore_eos": True, "custom_params": REPORT}
    noise = adaptive_engine.generate(input_ids=PROMPTS, sampling_params=[{**sampling, "sampling_seed": i}
                                                                         for i in range(len(PROMPTS))])
    assert all(len(o["output_ids"]) == 160 for o in noise)
    loop = adaptive_engine.generate(input_ids=[[256] + [41, 182, 48] * 40], sampling_params=params(160))
    noisy, looping = spec_share(noise), spec_share(loop)
    print(f"share of tokens from speculative steps: sampled {noisy:.2f}, looping greedy {looping:.2f}")
    # On a CPU a 64-node verify costs about five plain tokens (plain steps run back to back), so
    # even these drafts (about 4 tokens a step) pay only in part: the controller mixes the two.
    assert noisy < 1 / 4
    meta = loop[0]["meta_info"]
    assert looping > 3 * noisy and looping > 0.15, {k: [v for v in meta[k] if v is not None][-3:] for k in (
        "longgen_spec_steps", "longgen_plain_steps", "longgen_tau", "longgen_expected_tokens", "longgen_spec_ms",
        "longgen_plain_ms", "longgen_hinted_steps")}
    assert (last(loop[0]["meta_info"], "longgen_tau") or 0) > 2.0


def test_token_budgets_with_plain_steps(plain_engine, adaptive_engine):
    check_budgets(plain_engine, adaptive_engine)


def calls(meta: dict) -> int:
    """Worker calls that served the request (each reports once, on its first token)."""
    return sum(v is not None for v in meta["longgen_plain_steps"])


def test_plain_steps_run_back_to_back_unless_a_token_needs_the_host(plain_engine, adaptive_engine):
    """Speculation off and nothing that reads the newest token on the host: each call queues up to
    PLAIN_RUN plain steps, same tokens as plain decoding, SGLang still counting one verify per
    forward. With the contextual penalty (its window needs every new token) it is one per call."""
    want = plain_engine.generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS))
    got = adaptive_engine.generate(input_ids=PROMPTS, sampling_params=params(NEW_TOKENS, longgen_speculation="off"))
    # Runs grow from one token after the prefill, doubling with each plain call: 1, 2, 4, ... PLAIN_RUN.
    runs, left = 0, NEW_TOKENS - 1
    while left > 0:
        left -= min(PLAIN_RUN, 1 << runs, left)
        runs += 1
    for w, g in zip(want, got):
        meta = g["meta_info"]
        assert g["output_ids"] == w["output_ids"]
        assert calls(meta) <= runs < math.ceil((NEW_TOKENS - 1) / 4)
        assert meta["spec_verify_ct"] == NEW_TOKENS - 1 and meta["spec_accept_length"] < 1.05
    penalty = {"penalty": 1.2, "penalty_window": 16}
    processor = ContextualPenaltyProcessor.to_str()
    n = 24
    want = plain_engine.generate(input_ids=PROMPTS, sampling_params=greedy(n, custom_params=penalty),
                                 custom_logit_processor=[processor] * len(PROMPTS))
    got = adaptive_engine.generate(input_ids=PROMPTS, sampling_params=params(n, longgen_speculation="off", **penalty))
    for w, g in zip(want, got):
        assert g["output_ids"] == w["output_ids"]
        assert calls(g["meta_info"]) == n - 1


def test_a_request_that_arrives_mid_run_is_admitted_at_plain_decodings_pace(adaptive_engine):
    """A request that arrives while another decodes in runs of plain steps waits for the run in
    flight only: after its prefill the runs start again from one token, so a burst of arrivals is
    admitted one token apart and decodes together with the running requests."""
    import asyncio

    async def main():
        first = await adaptive_engine.async_generate(
            input_ids=PROMPTS[0], sampling_params=params(160, longgen_speculation="off"), stream=True)
        second = None
        async for chunk in first:
            done = chunk["meta_info"]["completion_tokens"]
            if second is None and done >= 40:
                second = asyncio.ensure_future(adaptive_engine.async_generate(
                    input_ids=PROMPTS[1], sampling_params=params(16, longgen_speculation="off")))
            last = chunk
        await second
        return last["meta_info"]

    meta = adaptive_engine.loop.run_until_complete(main())
    totals = [v for v in meta["longgen_plain_steps"] if v is not None]
    runs = [b - a for a, b in zip([0, *totals], totals)]
    assert runs[:5] == [1, 2, 4, 8, 16]  # after its own prefill
    later = runs[5:]
    assert PLAIN_RUN in later and later.index(1) > later.index(PLAIN_RUN), runs  # restarted by the arrival


@pytest.fixture(scope="module")
def widths_engine(tmp_path_factory):
    """TOKENSWIFT with ``[adaptive] widths = [4, 99]`` in its draft directory: a 99-node cut is
    not narrower than the engine's 64-row verify, so it is the whole draft."""
    import sglang as sgl

    heads = heads_with(tmp_path_factory.mktemp("widths") / "heads", "[adaptive]\nenabled = true\nwidths = [4, 99]\n")
    engine = sgl.Engine(**spec_args(speculative_draft_model_path=str(heads)))
    yield engine
    stop(engine)


def width_steps(meta: dict) -> dict:
    return last(meta, "longgen_width_steps") if any(v is not None for v in meta.get("longgen_width_steps", [])) else {}


def test_draft_widths_leave_the_output_plain_decodings(plain_engine, widths_engine):
    """Each step's width is the controller's, or the request's own ``longgen_width``: a trie cut to
    its first nodes is still a trie, so greedy output stays plain decoding's, and the report
    counts the steps per width."""
    prompts = [*PROMPTS, [256] + [41, 182, 48] * 40]
    want = plain_engine.generate(input_ids=prompts, sampling_params=greedy(NEW_TOKENS))
    auto = widths_engine.generate(input_ids=prompts, sampling_params=params(NEW_TOKENS))
    narrow = widths_engine.generate(input_ids=prompts, sampling_params=params(
        NEW_TOKENS, longgen_speculation="on", longgen_width=4))
    whole = widths_engine.generate(input_ids=prompts, sampling_params=params(
        NEW_TOKENS, longgen_speculation="on", longgen_width=99))
    for w, a, n, f in zip(want, auto, narrow, whole):
        assert a["output_ids"] == n["output_ids"] == f["output_ids"] == w["output_ids"]
        spec = steps_of(n["meta_info"])[0]
        assert width_steps(n["meta_info"]) == {"4": spec}
        assert width_steps(f["meta_info"]) == {}  # the whole draft only: no per-width report
    # Cut to 4 nodes a step commits at most 4 tokens, and on the looping prompt the cut drafts
    # are accepted (the walk runs over cut tries, not root-only ones).
    taus = [last(n["meta_info"], "longgen_tau") for n in narrow]
    assert max(taus) <= 4 and taus[-1] > 1.5, taus
