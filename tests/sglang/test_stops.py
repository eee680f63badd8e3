"""Stops inside a step that commits several tokens: every algorithm ends a request at the token
where plain decoding ends it, with the same output, text and finish reason (the matched string,
regex or token), greedy.

SGLang checks a speculative step's tokens as one (``Req.update_finish_state``): an end-anchored
``stop_regex`` that matched inside the step is missed, ``max_new_tokens`` reached in the step wins
over a stop before it, a stop string later in the step over an earlier stop token. The plugin
checks after each token (:mod:`sgl_longgen.sglang.stops`). The shipped ``tiny`` model (a real
tokenizer: stop strings and regexes are matched on text) and its trained drafters, which get
several tokens a step accepted, run one engine per algorithm. Requests aborted while others
decode beside them leave those others' outputs, token counts included, as plain decoding's.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from sglang_harness import engine_args, stop
from sgl_longgen.runtime import resolve_model

DRAFTS = {"TOKENSWIFT": "tokenswift-heads", "OWL": "owl-drafter", "HOWL": "owl-drafter", "LONGSPEC": "longspec-drafter"}
PROMPTS = ['def quicksort(xs):\n    """', '"""Utilities for', 'class Error(Exception):\n    """',
           '    def close(self):\n        """Close the', 'import os\n\n\ndef main():\n', 'import re\n\n# A']
NEW_TOKENS = 64
COMMA, EQUALS, CLOSE = 13, 30, 10  # "," "=" ")" in the tiny model's vocabulary
STOPS = {
    "end-anchored regex": {"stop_regex": r"[.!?]\s*$"},
    "end-anchored regexes": {"stop_regex": [r"\)$", r"\bfor$"]},
    "regex": {"stop_regex": r"\w+\(\w+\)"},
    "strings": {"stop": ["\n\n", "()"]},
    "token ids": {"stop_token_ids": [COMMA, EQUALS]},
    "token id or string, the first": {"stop_token_ids": [CLOSE], "stop": ["=", "\n\n"]},
}


def tiny_args(**extra) -> dict:
    return engine_args(model_path=str(resolve_model("tiny")), skip_tokenizer_init=False, **extra)


def params(stops: dict, budget: int = NEW_TOKENS) -> dict:
    return {"max_new_tokens": budget, "temperature": 0, **stops}


def seen(out: dict) -> tuple:
    """What a request's client sees of its end."""
    meta = out["meta_info"]
    return out["output_ids"], out["text"], meta["finish_reason"], meta["completion_tokens"]


@pytest.fixture(scope="module")
def plain():
    import sglang as sgl

    engine = sgl.Engine(**tiny_args())
    yield engine
    stop(engine)


@pytest.fixture(scope="module")
def wants(plain):
    """Plain decoding's outputs of ``requests`` [(prompt, params)], computed once per request."""
    cache: dict[str, dict] = {}

    def get(requests: list[tuple[str, dict]]) -> list[dict]:
        keys = [json.dumps(r, sort_keys=True) for r in requests]
        todo = [r for k, r in zip(keys, requests) if k not in cache]
        if todo:
            outs = plain.generate([p for p, _ in todo], [s for _, s in todo])
            cache.update({json.dumps(r, sort_keys=True): o for r, o in zip(todo, outs)})
        return [cache[k] for k in keys]

    return get


@pytest.fixture(scope="module", params=list(DRAFTS))
def spec(request):
    import sglang as sgl

    algorithm = request.param
    draft = resolve_model("tiny") / DRAFTS[algorithm]
    engine = sgl.Engine(**tiny_args(speculative_algorithm=algorithm, speculative_draft_model_path=str(draft)))
    yield engine
    stop(engine)


def stop_budgets(wants) -> list[tuple[str, dict]]:
    """Each prompt that plain decoding stops on a stop token, with budgets right at that token
    (plain decoding then ends on the length) and one past it (on the token)."""
    stops = STOPS["token ids"]
    outs = wants([(p, params(stops)) for p in PROMPTS])
    requests = []
    for prompt, out in zip(PROMPTS, outs):
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            n = out["meta_info"]["completion_tokens"]
            requests += [(prompt, params(stops, n)), (prompt, params(stops, n + 1))]
    assert len(requests) >= 6, "too few prompts stop on the tokens to test their budgets"
    return requests


def check(engine, wants, requests: list[tuple[str, dict]]) -> list[dict]:
    want = wants(requests)
    got = engine.generate([p for p, _ in requests], [s for _, s in requests])
    for (prompt, sampling), w, g in zip(requests, want, got):
        assert seen(g) == seen(w), (prompt, sampling)
    return got


def test_stops_as_plain_decoding(spec, wants):
    requests = [(p, params(stops)) for stops in STOPS.values() for p in PROMPTS]
    want = wants(requests)
    k = len(PROMPTS)
    for i, name in enumerate(STOPS):
        stopped = [w["meta_info"]["finish_reason"]["type"] == "stop" for w in want[i * k:(i + 1) * k]]
        assert sum(stopped) >= 2, f"{name}: plain decoding stops on too few prompts to test it"
    got = check(spec, wants, requests)
    tokens = sum(out["meta_info"]["completion_tokens"] for out in got)
    steps = sum(out["meta_info"]["spec_verify_ct"] for out in got)
    assert tokens / steps > 1.5  # steps of several tokens, where a stop can fall inside one


def test_budget_at_a_stop_token(spec, wants):
    """A budget reached in the step that holds a stop token ends as plain decoding ends: on the
    length where the token is the budget's last, else on the token."""
    check(spec, wants, stop_budgets(wants))


def test_abort_beside_running_requests(spec, wants):
    """Two long requests aborted at different points while the stop-budget requests and the
    end-anchored regex requests decode beside them: the batch loses a member mid-way, twice."""
    survivors = stop_budgets(wants)[1::2] + [(p, params(STOPS["end-anchored regex"])) for p in PROMPTS[:2]]
    want = wants(survivors)
    long = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}

    async def victim(prompt: str, after: int) -> dict:
        rid = f"abort-{uuid.uuid4().hex}"
        last, asked = None, False
        async for chunk in await spec.async_generate(prompt, long, rid=rid, stream=True):
            last = chunk
            if not asked and chunk["meta_info"]["completion_tokens"] >= after:
                spec.tokenizer_manager.abort_request(rid=rid)
                asked = True
        return last

    async def run():
        victims = [victim(PROMPTS[4], 8), victim(PROMPTS[5], 24)]
        outs = await asyncio.gather(*victims, *(spec.async_generate(p, s) for p, s in survivors))
        return outs[:2], outs[2:]

    aborted, got = spec.loop.run_until_complete(run())
    for out in aborted:
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert out["meta_info"]["completion_tokens"] < long["max_new_tokens"]
    for (prompt, sampling), w, g in zip(survivors, want, got):
        assert seen(g) == seen(w), (prompt, sampling)
