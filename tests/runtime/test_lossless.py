"""TokenSwift in the reference runtime is lossless against plain decoding (the oracle).

Greedy: token-identical output under many configurations (GQA ratios, Qwen2, the contextual
penalty, partial-KV budgets small enough to force re-selections, both selection granularities).
Sampled: the emitted tokens follow the exact distribution computed from the model.
"""

from __future__ import annotations

import functools

import msgspec
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from sgl_longgen.config import SamplingConfig
from sgl_longgen.core.heads import TokenSwiftHeads
from sgl_longgen.core.penalty import window_tokens
from sgl_longgen.core.sampling import LogitsProcessor
from sgl_longgen.runtime import ARDecoder, TokenSwiftDecoder, build_decoder
from sgl_longgen.runtime.checkpoint import LoadedModel
from sgl_longgen.runtime.embedded import random_state
from sgl_longgen.runtime.model import ForwardSpec, ModelConfig, Transformer

from runtime_oracle import PROMPT, ar_output, config, model

NEW_TOKENS = 400


CASES = [
    # model, penalty, window, extra tokenswift settings
    ("tiny-random", 1.0, 1024, {}),
    ("tiny-random", 1.2, 64, {}),
    ("tiny-random", 1.0, 1024, {"tokenswift__partial_kv__budget": 48, "tokenswift__partial_kv__sinks": 4}),
    ("tiny-random", 1.2, 64, {"tokenswift__partial_kv__budget": 40, "tokenswift__partial_kv__granularity": "head"}),
    ("tiny-random", 1.3, 16, {"tokenswift__ngram__exclude_penalty_window": False, "tokenswift__tree": [1, 4, 2]}),
    ("tiny-qwen2", 1.0, 1024, {}),
    ("tiny-qwen2", 1.2, 64, {"tokenswift__partial_kv__budget": 32, "tokenswift__partial_kv__sinks": 2}),
    ("tiny-qwen2", 1.5, 8, {"tokenswift__ngram__enabled": False}),
]


@pytest.mark.parametrize("name,penalty,window,extra", CASES)
def test_greedy_tokenswift_equals_plain_decoding(name, penalty, window, extra):
    cfg = config("tokenswift", sampling__penalty=penalty, sampling__penalty_window=window, **extra)
    result = build_decoder(model(name), cfg).generate(PROMPT, NEW_TOKENS)
    assert result.finish_reason == "length" and result.error is None
    assert tuple(result.output_ids) == ar_output(name, penalty, window, NEW_TOKENS)
    # It must actually speculate, or the comparison proves nothing.
    assert result.accept_length > 1.3


@pytest.mark.parametrize(("method", "settings"), [("tokenswift", {"tokenswift__partial_kv__budget": 40}),
                                                  ("suffix", {})])
def test_kv_cache_equals_a_fresh_prefill_of_its_output(method, settings):
    """After a generation, the cache the verifies compacted holds what a prefill of the output writes."""
    lm = model("tiny-random")
    dec = build_decoder(lm, config(method, **settings))
    dec.generate(PROMPT, 120)
    seq = dec.history[: dec.length]
    cache = lm.model.new_cache(len(seq))
    lm.model(torch.tensor(seq), torch.arange(len(seq)), cache, ForwardSpec(start=0))
    assert torch.allclose(dec.cache.k[:, :, : len(seq)], cache.k, atol=1e-10)
    assert torch.allclose(dec.cache.v[:, :, : len(seq)], cache.v, atol=1e-10)


def test_eos_stops_both_methods_at_the_same_token():
    lm = model("tiny-random")
    ar = build_decoder(lm, config("ar")).generate(PROMPT, 300)
    stop = ar.output_ids[150]
    cfg = msgspec.structs.replace(config("ar"), ignore_eos=False)
    lm_eos = LoadedModel(lm.path, msgspec.structs.replace(lm.config, eos_token_id=stop), lm.model, None)
    a = ARDecoder(lm_eos, cfg).generate(PROMPT, 300)
    t = build_decoder(lm_eos, msgspec.structs.replace(config("tokenswift"), ignore_eos=False)).generate(PROMPT, 300)
    assert a.finish_reason == t.finish_reason == "stop"
    assert a.output_ids == t.output_ids and a.output_ids[-1] == stop and len(a.output_ids) <= 151


# ------------------------------------------------------------------------------------------------
# sampled: exact distribution


MICRO = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=8, hidden_size=32,
             intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, max_position_embeddings=256)
SAMPLING = SamplingConfig(temperature=0.9, min_p=0.05, penalty=1.5, penalty_window=3)
MICRO_PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
RUNS = 4000


@functools.lru_cache(maxsize=None)
def micro() -> tuple[LoadedModel, TokenSwiftHeads]:
    gen = torch.Generator().manual_seed(5)
    cfg = msgspec.convert(MICRO, ModelConfig)
    net = Transformer(cfg)
    net.load_state_dict(random_state(MICRO, gen), strict=False)
    net = net.double().eval().requires_grad_(False)
    heads = TokenSwiftHeads(32, 3)
    heads.reset_parameters(gen, std=0.5)
    return LoadedModel(None, cfg, net, None), heads.double()


def exact_pair_distribution(lm: LoadedModel) -> np.ndarray:
    """P(y2, y3) of plain decoding, summed over y1, with every context's own penalty window."""
    proc = LogitsProcessor(SAMPLING, 8)

    def dist(seq: list[int]) -> torch.Tensor:
        cache = lm.model.new_cache(len(seq))
        h = lm.model(torch.tensor(seq), torch.arange(len(seq)), cache, ForwardSpec(start=0))
        window = [window_tokens(seq, [], SAMPLING.penalty_window)]
        return proc.probs(lm.model.logits(h[-1:]), window)[0]

    out = np.zeros((8, 8))
    p1 = dist(MICRO_PROMPT)
    for y1 in range(8):
        if p1[y1] == 0:
            continue
        p2 = dist(MICRO_PROMPT + [y1])
        for y2 in range(8):
            if p2[y2] == 0:
                continue
            out[y2] += float(p1[y1] * p2[y2]) * dist(MICRO_PROMPT + [y1, y2]).numpy()
    return out


@pytest.mark.slow
def test_sampled_tokenswift_follows_the_exact_distribution():
    lm, heads = micro()
    cfg = msgspec.structs.replace(
        config("tokenswift", tokenswift__partial_kv__budget=6, tokenswift__partial_kv__sinks=2,
               tokenswift__ngram__n=3, tokenswift__ngram__exclude_penalty_window=False),
        sampling=SAMPLING,
    )
    counts = np.zeros((8, 8))
    accepted = 0
    for seed in range(RUNS):
        dec = TokenSwiftDecoder(lm, msgspec.structs.replace(cfg, seed=seed), heads)
        r = dec.generate(MICRO_PROMPT, 3)
        counts[r.output_ids[1], r.output_ids[2]] += 1
        accepted += r.stats.accepted
    assert accepted > RUNS // 4  # drafts were accepted often enough to matter
    expected = exact_pair_distribution(lm).ravel() * RUNS
    keep = expected > 0
    assert counts.ravel()[~keep].sum() == 0
    assert chisquare(counts.ravel()[keep], expected[keep]).pvalue > 1e-3


def test_the_history_drafts_past_the_head_tree_depth():
    """The proxy's greedy code repeats itself; the history's continuation is then accepted beyond
    the [1,3,3,3] tree's 4 levels (at most 5 tokens per step without it), output still identical."""
    with_suffix = build_decoder(model("tiny"), config("tokenswift")).generate(PROMPT, 512)
    without = build_decoder(model("tiny"), config("tokenswift", tokenswift__suffix=False)).generate(PROMPT, 512)
    plain = build_decoder(model("tiny"), config("ar")).generate(PROMPT, 512)
    assert with_suffix.output_ids == without.output_ids == plain.output_ids
    assert without.accept_length <= 5.0
    assert with_suffix.accept_length > 5.5


@pytest.mark.parametrize("method", ["tokenswift", "owl", "howl", "suffix"])
def test_the_token_budget_is_exact(method):
    """Steps that accept several tokens never overrun ``max_new_tokens``, whatever it is."""
    dec = build_decoder(model("tiny-random"), config(method))
    for n in (1, 2, 7, 1023):
        result = dec.generate(PROMPT, n)
        assert result.finish_reason == "length" and result.num_new_tokens == n
        assert tuple(result.output_ids) == ar_output("tiny-random", 1.0, 1024, n)


@pytest.mark.parametrize("method", ["tokenswift", "howl", "suffix"])
def test_a_prompt_indexed_in_bulk_keeps_the_output_identical(method, monkeypatch):
    """A 1.5K-token prompt: the n-gram pool and the suffix index count it with numpy in one go
    (their packed layers), then grow a step at a time; greedy output is still plain decoding's,
    and the prompt's repeats are drafted and accepted."""
    from sgl_longgen.core.ngram import NgramPool
    from sgl_longgen.core.suffix import SuffixIndex

    bulk: list[str] = []
    for cls, name in ((NgramPool, "_extend_packed"), (SuffixIndex, "_merge")):
        real = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda self, *a, _real=real, _name=name: (bulk.append(_name), _real(self, *a))[1])
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(2, 256, 700)] * 2 + PROMPT
    out = build_decoder(model("tiny"), config(method)).generate(prompt, 96)
    plain = build_decoder(model("tiny"), config("ar")).generate(prompt, 96)
    assert out.output_ids == plain.output_ids
    assert set(bulk) == ({"_extend_packed", "_merge"} if method == "tokenswift" else {"_merge"})
    assert out.accept_length > 1.3
