"""What the runtime's lossless tests compare against: plain decoding of the same model and prompt."""

from __future__ import annotations

import functools

import msgspec

from sgl_longgen.config import GenerateConfig
from sgl_longgen.runtime import build_decoder, load_model, resolve_model
from sgl_longgen.runtime.checkpoint import LoadedModel

PROMPT = list(b"def fibonacci(n):\n    if n < 2:\n        return n\n    return ")


@functools.lru_cache(maxsize=None)
def model(name: str) -> LoadedModel:
    return load_model(resolve_model(name), "float64")


def config(method: str, **kw) -> GenerateConfig:
    """Greedy, EOS ignored, adaptive speculation off; ``a__b=v`` sets ``[a] b = v``.

    Off, because these tests are about the method's own speculative steps (every step speculates,
    so their acceptance assertions are deterministic); the adaptive tests turn it on.
    """
    data = {"method": method, "sampling": {"temperature": 0.0}, "ignore_eos": True, "adaptive": {"enabled": False}}
    for key, value in kw.items():
        node = data
        *parents, leaf = key.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return msgspec.convert(data, GenerateConfig)


@functools.lru_cache(maxsize=None)
def ar_output(name: str, penalty: float, window: int, new_tokens: int) -> tuple[int, ...]:
    cfg = config("ar", sampling__penalty=penalty, sampling__penalty_window=window)
    return tuple(build_decoder(model(name), cfg).generate(PROMPT, new_tokens).output_ids)
