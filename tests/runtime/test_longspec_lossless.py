"""LongSpec in the reference runtime is lossless against plain decoding (the oracle), and its
drafter's memory does not grow with the context.

Greedy: token-identical output on Llama (GQA 4, Llama-3.1 RoPE) and Qwen2 (qkv bias, tied
embeddings), with and without the contextual penalty, for several tree shapes and windows (one
shallower than the tree), for 1, 7 and 1023 new tokens on several prompts. A random-init drafter
rarely gets a token accepted, which would leave deep acceptance and compaction untested; so the
tree cases use a drafter fitted in a second to the target's own greedy continuation of the test
prompt, and assert that drafts were accepted, ending inside the tree as well as at its leaves.
Sampled: the emitted tokens follow the exact distribution computed from a micro model, and the
same harness rejects a verifier that leans toward the draft. A drafter with a reduced draft
vocabulary (the fitted one, mapped to the most frequent half of the tokens plain decoding emits)
is still token-identical, proposes mapped ids only, and a bad map is refused naming the file. So
is a drafter whose block and head are fp8 (``longspec.weights = "fp8"``: other drafts, the same
output).
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from helpers import children, fit_longspec
from runtime_oracle import PROMPT, ar_output, config, model
from safetensors.torch import load_file, save_file
from scipy.stats import chisquare

from sgl_longgen.config import SamplingConfig
from sgl_longgen.core.fp8 import Fp8Linear
from sgl_longgen.core.longspec import WEIGHTS_FILE, LongSpecDrafter
from sgl_longgen.core.longspec_checkpoint import load_drafter
from sgl_longgen.core.penalty import window_tokens
from sgl_longgen.core.sampling import LogitsProcessor
from sgl_longgen.core.verify import Verdict, draw_tree, walk_tree
from sgl_longgen.errors import LonggenError
from sgl_longgen.methods import Draft
from sgl_longgen.runtime import LongSpecDecoder, build_decoder, resolve_model
from sgl_longgen.runtime.checkpoint import LoadedModel
from sgl_longgen.runtime.embedded import random_state
from sgl_longgen.runtime.model import ForwardSpec, ModelConfig, Transformer
from sgl_longgen.training.draft_vocab import frequent_tokens

torch.set_num_threads(1)

NEW_TOKENS = 160
SETTINGS = {"tiny-random": [(1.0, 1024), (1.2, 64)], "tiny-qwen2": [(1.0, 1024), (2.0, 16)]}
FIT_STEPS = 6  # a few steps: drafts are accepted deep, but not always to the tree's last level
PROMPTS = [PROMPT, list(b"import os\nimport sys\n\n\nclass Walker:\n    def __init__(self, root):\n        "),
           list(b"# the quick brown fox\n")]
_TMP = tempfile.TemporaryDirectory(prefix="longspec-test-")


@functools.cache
def fitted(name: str, window: int = 512) -> Path:
    """A drafter fitted (the loss of ``train longspec``) to the target's greedy continuations of PROMPT."""
    ids = torch.tensor([PROMPT + list(ar_output(name, *s, NEW_TOKENS)) for s in SETTINGS[name]])
    drafter = fit_longspec(model(name).model, ids, FIT_STEPS, window=window)
    return drafter.save(Path(_TMP.name) / f"{name}-{window}")


CASES = [
    # model, setting index, window, extra config, minimum tau, some accepted paths end inside the tree
    ("tiny-random", 0, 512, {}, 4.0, True),
    ("tiny-random", 1, 512, {}, 4.0, True),
    ("tiny-qwen2", 0, 512, {}, 4.0, False),  # a one-token loop: every step accepts the whole depth
    ("tiny-qwen2", 1, 512, {"longspec__widths": [2, 4, 4], "longspec__tree_size": 7}, 1.8, True),
    ("tiny-random", 0, 16, {"longspec__widths": [3, 6, 6, 6, 6, 6, 6], "longspec__tree_size": 30}, 5.0, True),
    ("tiny-random", 1, 3, {}, 4.0, True),  # a window shallower than the tree
    ("tiny-random", 0, 512, {"longspec__weights": "fp8"}, 4.0, True),
    ("tiny-qwen2", 1, 512, {"longspec__weights": "fp8", "longspec__widths": [2, 4, 4], "longspec__tree_size": 7},
     1.8, True),
]


@pytest.mark.parametrize("name,setting,window,extra,min_tau,partial", CASES)
def test_greedy_longspec_equals_plain_decoding(name, setting, window, extra, min_tau, partial):
    penalty, pw = SETTINGS[name][setting]
    cfg = config("longspec", sampling__penalty=penalty, sampling__penalty_window=pw, **extra)
    decoder = build_decoder(model(name), cfg, longspec_dir=fitted(name, window))
    assert isinstance(decoder, LongSpecDecoder) and decoder.drafter.window == window
    result = decoder.generate(PROMPT, NEW_TOKENS)
    assert result.finish_reason == "length" and result.error is None
    assert tuple(result.output_ids) == ar_output(name, penalty, pw, NEW_TOKENS)
    s = result.stats
    assert s.accepted > 0 and result.accept_length > min_tau  # it speculates, or the comparison proves nothing
    assert 0 < result.acceptance_rate <= 1
    width = min(cfg.longspec.tree_size, sum(cfg.longspec.widths)) + 1
    assert s.verify_tokens <= s.steps * width
    if partial:  # the walk also stops inside the tree (compaction of a path that is not a whole branch)
        assert result.accept_length < len(cfg.longspec.widths) + 1
    if cfg.longspec.weights == "fp8":  # the drafts came from the fp8 block and an fp8 copy of the head
        assert isinstance(decoder.head, Fp8Linear) and isinstance(decoder.drafter.mlp.down_proj, Fp8Linear)


@pytest.mark.parametrize("prompt", range(len(PROMPTS)))
def test_the_token_budget_is_exact_on_several_prompts(prompt):
    """1, 7 and 1023 new tokens (the ring wraps, steps that accept several tokens never overrun)
    with the model's own random-init drafter, token-identical to plain decoding."""
    lm = model("tiny-random")
    dec = build_decoder(lm, config("longspec"))
    plain = build_decoder(lm, config("ar"))
    ids = PROMPTS[prompt]
    for n in (1, 7, 1023):
        result = dec.generate(ids, n)
        assert result.finish_reason == "length" and result.num_new_tokens == n
        assert result.output_ids == plain.generate(ids, n).output_ids
    assert result.stats.accepted > 0


def test_plain_steps_between_speculative_ones_need_no_catch_up():
    """Adaptive speculation mixes in plain decode steps; the next draft feeds what they committed."""
    cfg = config("longspec", adaptive__enabled=True, adaptive__refresh_every=2)
    dec = build_decoder(model("tiny-random"), cfg, longspec_dir=fitted("tiny-random"))
    result = dec.generate(PROMPT, NEW_TOKENS)
    assert tuple(result.output_ids) == ar_output("tiny-random", 1.0, 1024, NEW_TOKENS)
    assert 0 < result.stats.plain_steps < result.stats.steps and result.stats.accepted > 0


def test_longspec_kv_cache_equals_a_fresh_prefill_of_its_output():
    lm = model("tiny-random")
    dec = build_decoder(lm, config("longspec"), longspec_dir=fitted("tiny-random"))
    dec.generate(PROMPT, 100)
    assert dec.stats.accepted > 0
    seq = dec.history[: dec.length]
    cache = lm.model.new_cache(len(seq))
    lm.model(torch.tensor(seq), torch.arange(len(seq)), cache, ForwardSpec(start=0))
    assert torch.allclose(dec.cache.k[:, :, : len(seq)], cache.k, atol=1e-10)
    assert torch.allclose(dec.cache.v[:, :, : len(seq)], cache.v, atol=1e-10)


def test_drafter_memory_is_the_same_at_two_context_lengths():
    """The drafter's only per-request memory is its window ring: equal at a 40- and a 3000-token
    context, holding exactly the last ``window`` positions; the target cache grows instead."""
    lm = model("tiny-random")
    dec = build_decoder(lm, config("longspec"))
    window = dec.drafter.window
    seen = {}
    for length in (40, 3000):
        ids = (PROMPT * (length // len(PROMPT) + 1))[:length]
        ring_before = dec.ring
        result = dec.generate(ids, 12)
        assert result.output_ids == build_decoder(lm, config("ar")).generate(ids, 12).output_ids
        assert dec.ring is ring_before  # allocated once, not per context
        fed = dec.state.fed
        held = sorted(p for p in dec.ring.pos.tolist() if p >= 0)
        assert held == list(range(max(0, fed - window), fed))  # the last window positions fed, no more
        seen[length] = (dec.drafter_bytes(), tuple(dec.ring.k.shape), dec.cache.k.shape[2])
    (small, small_shape, small_cache), (large, large_shape, large_cache) = seen[40], seen[3000]
    assert small == large and small_shape == large_shape == (2, window, 16)
    assert small == 2 * 2 * window * 16 * 8 + window * 8  # K and V in float64, plus the slot positions
    assert large_cache > 10 * small_cache  # the target's own cache is what grows


def test_a_drafter_for_another_model_is_one_clear_error():
    lm = model("tiny-random")
    other = resolve_model("tiny-qwen2") / "longspec-drafter"
    with pytest.raises(LonggenError, match="longspec.json"):
        build_decoder(lm, config("longspec"), longspec_dir=other)
    with pytest.raises(LonggenError, match="not found"):
        build_decoder(lm, config("longspec"), longspec_dir=Path(_TMP.name) / "missing")
    bare = LoadedModel(None, lm.config, lm.model, None)
    with pytest.raises(LonggenError, match="needs a LongSpec drafter"):
        build_decoder(bare, config("longspec"))
    wrong = LongSpecDrafter.for_target(model("tiny-qwen2").config)
    with pytest.raises(LonggenError, match="built for hidden_size"):
        LongSpecDecoder(lm, config("longspec"), wrong)


# ------------------------------------------------------------------------------------------------
# a reduced draft vocabulary


def reduced(name: str, setting: int) -> tuple[Path, list[int]]:
    """The fitted drafter with a map of the most frequent half of the distinct tokens plain decoding
    emits here: the output then holds tokens the drafter can never propose."""
    out = torch.tensor(ar_output(name, *SETTINGS[name][setting], NEW_TOKENS))
    token_map = frequent_tokens(out, model(name).config.vocab_size, out.unique().numel() // 2)
    drafter = load_drafter(fitted(name)).with_token_map(token_map)
    return drafter.save(Path(_TMP.name) / f"{name}-{setting}-reduced"), token_map.tolist()


@pytest.mark.parametrize("name,setting,weights", [("tiny-random", 0, "bf16"), ("tiny-qwen2", 1, "bf16"),
                                                   ("tiny-qwen2", 1, "fp8")])
def test_greedy_longspec_with_a_reduced_draft_vocabulary_equals_plain_decoding(name, setting, weights):
    penalty, pw = SETTINGS[name][setting]
    path, token_map = reduced(name, setting)
    cfg = config("longspec", sampling__penalty=penalty, sampling__penalty_window=pw, longspec__weights=weights)
    decoder = build_decoder(model(name), cfg, longspec_dir=path)
    assert decoder.drafter.reduced and decoder.head.weight.shape[0] == len(token_map)  # the gathered rows
    proposed: list[int] = []
    expand = decoder.method.expand

    def recording(*args):
        beam = expand(*args)
        proposed.extend(beam.tokens.reshape(-1).tolist())
        return beam

    decoder.method.expand = recording
    result = decoder.generate(PROMPT, NEW_TOKENS)
    want = ar_output(name, penalty, pw, NEW_TOKENS)
    assert tuple(result.output_ids) == want
    assert set(want) - set(token_map)  # the output holds tokens the drafter could not draft ...
    assert proposed and set(proposed) <= set(token_map)  # ... and it proposed mapped ids only
    assert result.stats.accepted > 0 and result.accept_length > 1.5  # it speculates


def test_a_bad_token_map_is_one_clear_error(tmp_path):
    path, token_map = reduced("tiny-random", 0)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "longspec.json").write_bytes((path / "longspec.json").read_bytes())
    state = load_file(path / WEIGHTS_FILE)
    save_file({**state, "token_map": torch.tensor([token_map[0]] + token_map[:-1])}, bad / WEIGHTS_FILE)
    with pytest.raises(LonggenError, match=rf"{bad / WEIGHTS_FILE}: tensor token_map lists target ids more than once"):
        build_decoder(model("tiny-random"), config("longspec"), longspec_dir=bad)


# ------------------------------------------------------------------------------------------------
# sampled: exact distribution


MICRO = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 8, "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 8, "max_position_embeddings": 256}
SAMPLING = SamplingConfig(temperature=0.9, min_p=0.05, penalty=1.5, penalty_window=3)
MICRO_PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
RUNS = 2500
BIAS = 0.05


@functools.cache
def micro() -> tuple[LoadedModel, LongSpecDrafter]:
    gen = torch.Generator().manual_seed(5)
    cfg = msgspec.convert(MICRO, ModelConfig)
    net = Transformer(cfg)
    net.load_state_dict(random_state(MICRO, gen), strict=False)
    net = net.double().eval().requires_grad_(False)
    drafter = LongSpecDrafter.for_target(cfg, window=4)
    drafter.reset_parameters(gen, final_norm=net.model.norm.weight, std=0.5)
    return LoadedModel(None, cfg, net, None), drafter.double()


def exact_pair_distribution(lm: LoadedModel) -> np.ndarray:
    """P(y2, y3) of plain decoding, summed over y1, with every context's own penalty window."""
    proc = LogitsProcessor(SAMPLING, 8)

    def dist(seq: list[int]) -> torch.Tensor:
        cache = lm.model.new_cache(len(seq))
        h = lm.model(torch.tensor(seq), torch.arange(len(seq)), cache, ForwardSpec(start=0))
        return proc.probs(lm.model.logits(h[-1:]), [window_tokens(seq, [], SAMPLING.penalty_window)])[0]

    out = np.zeros((8, 8))
    p1 = dist(MICRO_PROMPT)
    for y1 in range(8):
        if p1[y1] == 0:
            continue
        p2 = dist(MICRO_PROMPT + [y1])
        for y2 in range(8):
            if p2[y2] > 0:
                out[y2] += float(p1[y1] * p2[y2]) * dist(MICRO_PROMPT + [y1, y2]).numpy()
    return out


class LeaningDecoder(LongSpecDecoder):
    """A broken verifier for the harness's own test: in ``BIAS`` of its steps the root's draw is
    replaced by its first child's token (the drafter's likeliest) whenever the target could emit
    it, as if the draft had been accepted without the draw: a lean that never leaves the support."""

    def verify(self, draft: Draft) -> Verdict:
        tree, L = draft.tree, self.length
        self.cache.ensure(L + len(tree))
        h = self.model(tree.token_tensor(), tree.positions(L), self.cache, ForwardSpec(start=L, mask=tree.ancestor_mask()))
        logits = self.model.logits(h)
        draws = draw_tree(logits, tree, self.processor, self.history, self.generator).tolist()
        first = children(tree, 0)
        if first and float(torch.rand((), generator=self.generator)) < BIAS:
            token = tree.tokens[min(first.values())]
            if self.processor.probs(logits[:1], self.penalty_windows([[]]))[0, token] > 0:
                draws[0] = token
        verdict = walk_tree(tree, draws.__getitem__)
        self.cache.keep(L, verdict.nodes)
        self.length = L + len(verdict.nodes)
        self.stats.accepted += verdict.accepted
        return verdict


def pair_counts(cls) -> tuple[np.ndarray, int]:
    lm, drafter = micro()
    cfg = msgspec.structs.replace(config("longspec", longspec__widths=[4, 6, 6], longspec__tree_size=14),
                                  sampling=SAMPLING)
    counts = np.zeros((8, 8))
    accepted = 0
    for seed in range(RUNS):
        dec = cls(lm, msgspec.structs.replace(cfg, seed=seed), drafter)
        r = dec.generate(MICRO_PROMPT, 3)
        counts[r.output_ids[1], r.output_ids[2]] += 1
        accepted += r.stats.accepted
    return counts, accepted


def pvalue(counts: np.ndarray) -> float:
    expected = exact_pair_distribution(micro()[0]).ravel() * counts.sum()
    keep = expected > 0
    assert counts.ravel()[~keep].sum() == 0
    return float(chisquare(counts.ravel()[keep], expected[keep]).pvalue)


@pytest.mark.slow
def test_sampled_longspec_follows_the_exact_distribution():
    counts, accepted = pair_counts(LongSpecDecoder)
    assert accepted > RUNS // 4  # drafts were accepted often enough to matter
    assert pvalue(counts) > 1e-3


@pytest.mark.slow
def test_the_sample_size_catches_a_verifier_leaning_toward_the_draft():
    """If this passed on the honest decoder too, the test above would prove nothing (seen here:
    p about 5e-9 for a 5% lean, 5e-37 for 10%)."""
    counts, _ = pair_counts(LeaningDecoder)
    assert pvalue(counts) < 1e-6
