"""What holds for any model when one of our algorithms serves a request: plain decoding's response
(the same tokens, text, finish reason and counts; logprobs within float32 rounding), and, for
structured output, a token sequence SGLang's own grammar accepts (whole, or a prefix of one that
``max_new_tokens`` cut)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

import requests

# Logprobs of the same tokens from plain decoding's one-token forwards and our verify forwards
# (other shapes, other summation orders): float32 rounding apart.
LOGPROB_TOL = 1e-3
LOGPROB_KEYS = ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs",
                "input_token_ids_logprobs", "output_token_ids_logprobs")
SAME_META = ("finish_reason", "prompt_tokens", "completion_tokens")
TIMEOUT = 300


def post(url: str, route: str, body: dict, timeout: float = TIMEOUT):
    """A response SGLang's server answered 200 to, as JSON."""
    res = requests.post(url + route, json=body, timeout=timeout)
    assert res.status_code == 200, f"{route} answered {res.status_code}: {res.text[:2000]}"
    return res.json()


def post_all(url: str, route: str, bodies: list[dict], alive: Callable[[], bool] | None = None) -> list:
    """``bodies`` sent side by side (the server batches them as they come); while ``alive``
    says the server runs (else the call fails at once)."""
    pool = ThreadPoolExecutor(len(bodies))
    try:
        futures = [pool.submit(post, url, route, body) for body in bodies]
        while alive is not None and wait(futures, timeout=0.5).not_done:
            assert alive(), "the server's scheduler exited with requests unanswered"
        return [f.result() for f in futures]
    finally:
        pool.shutdown(wait=False)  # requests left unanswered end when the server is stopped


class Streamed:
    """A streamed /generate request, read chunk by chunk."""

    def __init__(self, url: str, body: dict):
        self.body = body
        self.response = requests.post(url + "/generate", json={**body, "stream": True}, stream=True, timeout=300)
        assert self.response.status_code == 200, self.response.text
        self._lines = self.response.iter_lines(decode_unicode=True)
        self.chunk = None

    def next(self) -> dict | None:
        """The next chunk (None: the stream ended)."""
        for line in self._lines:
            if line and line.startswith("data:") and line[5:].strip() != "[DONE]":
                self.chunk = json.loads(line[5:])
                return self.chunk
        return None

    def last(self) -> dict:
        while self.next() is not None:
            pass
        return self.chunk

    def close(self) -> None:
        self.response.close()


class Reference:
    """Plain decoding's responses, each request sent once per module however many algorithms
    are compared with it."""

    def __init__(self, url: str):
        self.url = url
        self._cache: dict[str, object] = {}

    def post(self, route: str, body: dict):
        return self.post_all(route, [body])[0]

    def post_all(self, route: str, bodies: list[dict]) -> list:
        """Sent side by side."""
        return self._responses(route, bodies, lambda missing: post_all(self.url, route, missing))

    def post_each(self, route: str, bodies: list[dict]) -> list:
        """Each request served alone: one schedule of plain decoding, whatever the order in which
        the requests compared with these reach the other server."""
        return self._responses(route, bodies, lambda missing: [post(self.url, route, b) for b in missing])

    def _responses(self, route: str, bodies: list[dict], send) -> list:
        keys = [route + json.dumps(body, sort_keys=True) for body in bodies]
        missing = {k: b for k, b in zip(keys, bodies) if k not in self._cache}
        if missing:
            self._cache.update(zip(missing, send(list(missing.values()))))
        return [self._cache[k] for k in keys]


def assert_close(want, got, tol: float, where: str) -> None:
    """The same nested lists of token ids (equal), texts (equal) and logprobs (within ``tol``)."""
    if isinstance(want, float) or isinstance(got, float):
        assert isinstance(want, (int, float)) and isinstance(got, (int, float)), f"{where}: {want!r} vs {got!r}"
        assert math.isclose(want, got, abs_tol=tol) or (math.isinf(want) and want == got), \
            f"{where}: logprob {got!r}, plain decoding's {want!r}"
    elif isinstance(want, (list, tuple)) and isinstance(got, (list, tuple)):
        assert len(got) == len(want), f"{where}: {len(got)} entries, plain decoding's {len(want)}"
        for i, (w, g) in enumerate(zip(want, got)):
            assert_close(w, g, tol, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r}, plain decoding's {want!r}"


def assert_same_response(want: dict, got: dict, where: str = "", tol: float = LOGPROB_TOL) -> None:
    """``got`` (a /generate response of one of our algorithms) is plain decoding's ``want``."""
    assert got["output_ids"] == want["output_ids"], (
        f"{where}: output_ids differ from plain decoding's at {first_difference(want['output_ids'], got['output_ids'])}"
        f"\n  plain: {want['text']!r}\n  got:   {got['text']!r}")
    assert got["text"] == want["text"], f"{where}: text {got['text']!r}, plain decoding's {want['text']!r}"
    wm, gm = want["meta_info"], got["meta_info"]
    for key in SAME_META:
        assert gm.get(key) == wm.get(key), \
            f"{where}: meta_info[{key!r}] {gm.get(key)!r}, plain decoding's {wm.get(key)!r}"
    for key in LOGPROB_KEYS:
        if key in wm or key in gm:
            assert key in wm and key in gm, f"{where}: meta_info[{key!r}] in only one of the responses"
            assert_close(wm[key], gm[key], tol, f"{where}: meta_info[{key!r}]")


def first_difference(a: list, b: list) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"token {i} ({y} instead of {x})"
    return f"length ({len(b)} tokens instead of {len(a)})"


def max_logprob_gap(want: dict, got: dict) -> float:
    """The largest difference between the two responses' output token logprobs."""
    pairs = zip(want["meta_info"]["output_token_logprobs"], got["meta_info"]["output_token_logprobs"])
    return max((abs(w[0] - g[0]) for w, g in pairs), default=0.0)


DISPATCH = {"json_schema": "dispatch_json", "regex": "dispatch_regex", "ebnf": "dispatch_ebnf"}


class Grammars:
    """SGLang's llguidance grammar backend over the tiny model's tokenizer, in this process: the
    grammar objects the server builds for a request's ``json_schema`` / ``regex`` / ``ebnf``."""

    def __init__(self, model_path: str, vocab_size: int, eos: int):
        from sglang.srt.constrained.llguidance_backend import GuidanceBackend
        from sglang.srt.utils.hf_transformers_utils import get_tokenizer

        self.eos = eos
        self.backend = GuidanceBackend(get_tokenizer(model_path), n_vocab=vocab_size, eos_token_ids=[eos])

    def check(self, kind: str, constraint: str, response: dict, where: str = "") -> None:
        """The output satisfies the constraint: the grammar accepts every token; a request that
        stopped (not cut by ``max_new_tokens``) ended with the end-of-text token where the grammar
        may end, and nothing after it."""
        grammar = getattr(self.backend, DISPATCH[kind])(constraint)
        ids = response["output_ids"]
        finish = response["meta_info"]["finish_reason"]
        for i, token in enumerate(ids):
            try:
                grammar.accept_token(token)
            except ValueError as e:
                raise AssertionError(f"{where}: token {i} ({token}) of {response['text']!r} breaks the "
                                     f"{kind} constraint: {e}") from None
        assert self.eos not in ids[:-1], f"{where}: tokens after the end of text: {ids}"
        if finish["type"] == "stop":
            assert ids and ids[-1] == self.eos and finish.get("matched") == self.eos, \
                f"{where}: stopped ({finish}) without the grammar's end: {response['text']!r}"
        else:
            assert finish["type"] == "length", f"{where}: finish {finish}"


def regex_holds(pattern: str, text: str) -> bool:
    """The kits' own check of a finished output (``regex_constrained_kit.regex_match``)."""
    return re.match(pattern, text.strip()) is not None
