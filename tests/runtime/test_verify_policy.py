"""TokenSwift with verification-guided partial KV (``partial_kv.policy = "verify"``) in the reference runtime.

Greedy output must be plain decoding's token for token (the selection only steers the draft), the
verify forward's scores must be exactly what its rows compute, and the runtime must really refresh
the selection from every verify, one set per layer.
"""

from __future__ import annotations

import pytest
import torch
from runtime_oracle import PROMPT, ar_output, config, model

from sgl_longgen.runtime import build_decoder
from sgl_longgen.runtime.model import ForwardSpec

NEW_TOKENS = 400

CASES = [
    # model, penalty, window, extra settings
    ("tiny-random", 1.0, 1024, {"tokenswift__partial_kv__budget": 48, "tokenswift__partial_kv__sinks": 4}),
    ("tiny-random", 1.2, 64, {"tokenswift__partial_kv__budget": 40, "tokenswift__partial_kv__granularity": "head"}),
    ("tiny-random", 1.0, 1024, {"tokenswift__partial_kv__budget": 24, "tokenswift__partial_kv__sinks": 2,
                                "tokenswift__suffix": False}),
    ("tiny-qwen2", 1.2, 64, {"tokenswift__partial_kv__budget": 32, "tokenswift__partial_kv__sinks": 2}),
    ("tiny-qwen2", 1.0, 1024, {}),  # the default budget: everything fits, all positions selected
]


@pytest.mark.parametrize("name,penalty,window,extra", CASES)
def test_greedy_output_equals_plain_decoding_and_each_verify_selects(name, penalty, window, extra):
    cfg = config("tokenswift", sampling__penalty=penalty, sampling__penalty_window=window,
                 tokenswift__partial_kv__policy="verify", **extra)
    dec = build_decoder(model(name), cfg)
    seen = []  # (committed length before the step, the selection's length after it)
    before = [len(PROMPT)]

    def progress(tokens, stats):
        seen.append((before[0], dec.state.policy.sel_len))
        before[0] = dec.length

    result = dec.generate(PROMPT, NEW_TOKENS, progress)
    assert result.finish_reason == "length" and result.error is None
    assert tuple(result.output_ids) == ar_output(name, penalty, window, NEW_TOKENS)
    assert result.accept_length > 1.3  # it speculates, or the comparison proves nothing
    # Every step's verify took the selection at the length it verified from (a step that commits
    # more than the budget holds leaves a draft-scored one to the next step instead).
    refreshed = sum(length == sel_len for length, sel_len in seen)
    assert refreshed >= 0.9 * len(seen)
    policy = dec.state.policy
    layers, kv_heads = dec.loaded.config.num_hidden_layers, dec.loaded.config.n_kv_heads
    assert policy.selected.shape[0] == layers * (kv_heads if policy.granularity == "head" else 1)
    if policy.length - policy.sinks > policy.capacity:  # a real choice was made: layers differ
        assert len({tuple(row) for row in policy.selected.tolist()}) > 1


def prefill(lm, ids):
    cache = lm.model.new_cache(len(ids) + 8)
    lm.model(torch.tensor(ids), torch.arange(len(ids)), cache, ForwardSpec(start=0))
    return cache


@pytest.mark.parametrize("name", ["tiny-random", "tiny-qwen2"])
def test_verify_scores_are_the_mean_of_each_rows_own_logits(name):
    """Scores of a two-row verify (root, first draft token) over [lo, hi) equal the mean of what
    each row scores alone when decoded one at a time; asking for them leaves the output as is;
    one row's scores are Eq. 2's group sums over the group size."""
    lm = model(name)
    ids = PROMPT[:40]
    lo, hi, L = 3, 37, len(ids)
    root, first = 17, 23
    mask = torch.ones(2, 2, dtype=torch.bool).tril()

    cache = prefill(lm, ids)
    spec = ForwardSpec(start=L, mask=mask, prefix_logits=(2, lo, hi))
    h = lm.model(torch.tensor([root, first]), torch.arange(L, L + 2), cache, spec)
    assert len(spec.prefix_scores) == lm.config.num_hidden_layers
    assert spec.prefix_scores[0].shape == (lm.config.n_kv_heads, hi - lo)
    plain = lm.model(torch.tensor([root, first]), torch.arange(L, L + 2), prefill(lm, ids),
                     ForwardSpec(start=L, mask=mask))
    assert torch.equal(h, plain)

    cache = prefill(lm, ids)
    one = ForwardSpec(start=L, prefix_logits=(1, lo, hi), score=(0, lo, hi))
    lm.model(torch.tensor([root]), torch.tensor([L]), cache, one)
    two = ForwardSpec(start=L + 1, prefix_logits=(1, lo, hi))
    lm.model(torch.tensor([first]), torch.tensor([L + 1]), cache, two)
    group = lm.config.num_attention_heads // lm.config.n_kv_heads
    for layer in range(lm.config.num_hidden_layers):
        want = (one.prefix_scores[layer] + two.prefix_scores[layer]) / 2
        assert torch.allclose(spec.prefix_scores[layer], want, atol=1e-10)
        assert torch.allclose(one.prefix_scores[layer] * group, one.scores[layer], atol=1e-10)


def test_a_draft_forward_can_read_one_position_set_per_layer():
    """``visible`` with one row per layer: layer i reads its own row (here: different prefixes give
    a different output than the shared set, and the same as the shared set when all rows agree)."""
    lm = model("tiny-random")
    ids = PROMPT[:30]
    layers = lm.config.num_hidden_layers
    cache = prefill(lm, ids)
    shared = torch.arange(0, 30, 2)[None]

    def draft(visible):
        return lm.model(torch.tensor([5]), torch.tensor([30]), cache, ForwardSpec(start=30, visible=visible))

    same = draft(shared.expand(layers, -1))
    assert torch.equal(same, draft(shared))
    per_layer = torch.stack([torch.arange(0, 30, 2) + (i % 2) for i in range(layers)])
    assert not torch.allclose(draft(per_layer), same)
    # Layer-by-layer expansion of the same sets to every KV head reads the same keys.
    kv = lm.config.n_kv_heads
    assert torch.equal(draft(per_layer), draft(per_layer.repeat_interleave(kv, dim=0)))
