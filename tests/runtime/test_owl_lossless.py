"""OWL and HOWL in the reference runtime are lossless against plain decoding (the oracle).

Greedy: token-identical output on Llama (GQA 4, Llama-3.1 RoPE) and Qwen2 (qkv bias, tied
embeddings), with and without the contextual penalty, for OWL trees with [SPEC] leaves, without
[SPEC], without the prefill [SPEC], and for HOWL. A random-init drafter rarely gets a token
accepted, which would leave the interesting paths (deep acceptance, the [SPEC] state hand-off,
compaction past [SPEC] slots) untested; so most cases use a drafter fitted in a few seconds to the
target's own greedy continuations of the test prompt. The tests assert that drafts were accepted.
A drafter with a reduced head (the 32 most frequent tokens) must be just as lossless while the
output also holds tokens it can never draft, and so must a drafter whose projections and head are
fp8 (``owl.weights = "fp8"``: other drafts, the same output).
Sampled: the emitted tokens follow the exact distribution computed from a micro model.
"""

from __future__ import annotations

import functools
import random
import tempfile
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from sgl_longgen.config import SamplingConfig
from sgl_longgen.core.fp8 import Fp8Linear
from sgl_longgen.core.owl import FP8_LAYERS, OwlDrafter
from sgl_longgen.errors import LonggenError
from sgl_longgen.runtime import HowlDecoder, OwlDecoder, build_decoder, resolve_model
from sgl_longgen.runtime.checkpoint import LoadedModel
from sgl_longgen.runtime.embedded import random_state
from sgl_longgen.runtime.model import ForwardSpec, ModelConfig, Transformer
from sgl_longgen.core.penalty import window_tokens
from sgl_longgen.core.sampling import LogitsProcessor

from runtime_oracle import PROMPT, ar_output, config, model
from helpers import fit_drafter

torch.set_num_threads(1)

NEW_TOKENS = 160
SETTINGS = {"tiny-random": [(1.0, 1024), (1.2, 64)], "tiny-qwen2": [(1.0, 1024), (2.0, 16)]}
FIT_STEPS = 12  # enough for tau of about 2-4 here: accepted paths end inside the tree as well as at its leaves
DRAFT_VOCAB = 32  # of 258: the outputs below use 40-120 distinct tokens
_TMP = tempfile.TemporaryDirectory(prefix="owl-test-")


@functools.lru_cache(maxsize=None)
def fitted_drafter(name: str, draft_vocab: int = 0) -> Path:
    """A drafter fitted (training loss of ``train owl``) to the target's greedy continuations of PROMPT;
    with ``draft_vocab``, its head covers only their most frequent tokens."""
    ids = torch.tensor([PROMPT + list(ar_output(name, *s, NEW_TOKENS)) for s in SETTINGS[name]])
    drafter = fit_drafter(model(name).model, ids, FIT_STEPS, draft_vocab=draft_vocab)
    return drafter.save(Path(_TMP.name) / f"{name}-{draft_vocab or 'full'}")


def drafter_dir(name: str, kind: str) -> Path | None:
    if kind == "random":
        return None  # the model's random-init owl-drafter/
    return fitted_drafter(name, DRAFT_VOCAB if kind == "reduced" else 0)


CASES = [
    # method, model, setting index, drafter, extra config, minimum tau, HOWL must mix both branches
    ("owl", "tiny-random", 0, "fitted", {}, 1.5, False),
    ("owl", "tiny-random", 1, "fitted", {}, 1.5, False),
    ("owl", "tiny-qwen2", 0, "fitted", {}, 1.5, False),
    ("owl", "tiny-qwen2", 1, "fitted", {"owl__tree_size": 12, "owl__top_k": 3, "owl__depth": 5}, 1.3, False),
    ("owl", "tiny-random", 0, "fitted", {"owl__spec": False, "owl__tree_size": 60}, 1.5, False),
    ("owl", "tiny-random", 1, "fitted", {"owl__prefill_spec": False}, 1.5, False),
    ("owl", "tiny-random", 0, "random", {}, 1.0, False),
    ("howl", "tiny-random", 0, "fitted", {}, 1.5, False),
    ("howl", "tiny-random", 1, "fitted", {"howl__threshold": 2.0}, 1.5, False),
    ("howl", "tiny-qwen2", 0, "fitted", {}, 2.0, True),
    ("howl", "tiny-qwen2", 0, "random", {}, 2.0, True),
    ("howl", "tiny-qwen2", 1, "fitted", {"suffix__max_spec_factor": 1.0, "owl__spec": False}, 1.5, False),
    ("owl", "tiny-random", 0, "reduced", {}, 1.5, False),
    ("owl", "tiny-qwen2", 1, "reduced", {"owl__prefill_spec": False}, 1.5, False),
    ("howl", "tiny-qwen2", 1, "reduced", {}, 1.5, True),
    ("owl", "tiny-random", 0, "fitted", {"owl__weights": "fp8"}, 1.5, False),
    ("howl", "tiny-qwen2", 1, "reduced", {"owl__weights": "fp8"}, 1.5, True),
]


@pytest.mark.parametrize("method,name,setting,kind,extra,min_tau,mixed", CASES)
def test_greedy_owl_and_howl_equal_plain_decoding(method, name, setting, kind, extra, min_tau, mixed):
    penalty, window = SETTINGS[name][setting]
    cfg = config(method, sampling__penalty=penalty, sampling__penalty_window=window, **extra)
    decoder = build_decoder(model(name), cfg, drafter_dir=drafter_dir(name, kind))
    assert isinstance(decoder, HowlDecoder if method == "howl" else OwlDecoder)
    result = decoder.generate(PROMPT, NEW_TOKENS)
    assert result.finish_reason == "length" and result.error is None
    assert tuple(result.output_ids) == ar_output(name, penalty, window, NEW_TOKENS)
    s = result.stats
    # It must actually speculate, or the comparison proves nothing.
    assert s.accepted > 0 and result.accept_length > min_tau
    assert 0 < result.acceptance_rate <= 1
    if method == "owl":
        assert s.linear_steps == 0
        spec = cfg.owl.spec
        width = 2 * cfg.owl.tree_size + 2 if spec else cfg.owl.tree_size + 1
        assert s.verify_tokens <= s.steps * width
    if mixed:  # the repetitive output goes to the suffix path, the rest to OWL trees
        assert 0 < s.linear_steps < s.steps
    if kind == "reduced":  # some committed tokens (next rounds' roots) lie outside the draft vocabulary
        assert decoder.drafter.reduced
        assert set(result.output_ids) - set(decoder.drafter.token_map.tolist())
    if cfg.owl.weights == "fp8":  # the drafts came from the fp8 matrices
        assert all(isinstance(getattr(decoder.drafter, name), Fp8Linear) for name in FP8_LAYERS)


def test_owl_kv_cache_equals_a_fresh_prefill_of_its_output():
    """No [SPEC] key or value survives compaction: the cache is exactly the emitted sequence's."""
    lm = model("tiny-random")
    dec = build_decoder(lm, config("owl"), drafter_dir=fitted_drafter("tiny-random"))
    dec.generate(PROMPT, 100)
    assert dec.stats.accepted > 0
    seq = dec.history[: dec.length]
    cache = lm.model.new_cache(len(seq))
    h = lm.model(torch.tensor(seq), torch.arange(len(seq)), cache, ForwardSpec(start=0))
    assert torch.allclose(dec.cache.k[:, :, : len(seq)], cache.k, atol=1e-10)
    assert torch.allclose(dec.cache.v[:, :, : len(seq)], cache.v, atol=1e-10)
    # ... and the drafter's next input is the last committed token's post-norm state.
    assert torch.allclose(dec.state.h_last, lm.model.model.norm(h[-1]), atol=1e-10)


def test_howl_verifies_a_loop_seen_twice_as_full_width_chains():
    """The shipped proxy's greedy output of this prompt loops with a short period from its 22nd
    token. Once two copies of the period are committed, every step verifies a chain as long as
    ``suffix.max_spec_tokens`` and accepts all of it, bonus token included: the chain reads past
    the history's end and the loop's budget does not wait for the match to grow."""
    lm = model("tiny")
    rng = random.Random(24)
    prompt = [rng.randrange(lm.config.vocab_size) for _ in range(64)]
    new_tokens = 256
    plain = build_decoder(lm, config("ar")).generate(prompt, new_tokens).output_ids
    period = next(q for q in range(1, 32) if plain[-128:] == plain[-128 - q : len(plain) - q])
    start = next(i for i in range(len(plain)) if plain[i:] == plain[i + period :] + plain[len(plain) - period :][: period])
    assert period <= 8 and start < 64, (period, start)  # the workload this test is about

    cfg = config("howl")
    decoder = build_decoder(lm, cfg)
    done: list[int] = []
    result = decoder.generate(prompt, new_tokens, lambda tokens, stats: done.append(len(tokens)))
    assert result.output_ids == plain
    committed = [b - a for a, b in zip([0] + done, done)]
    chain = cfg.suffix.max_spec_tokens
    seen_twice = start + 2 * period
    after = [c for a, c, b in zip([0] + done, committed, done) if a >= seen_twice and b < new_tokens]
    assert after and all(c == chain + 1 for c in after), (seen_twice, list(zip([0] + done, committed)))
    assert result.stats.linear_steps >= len(after)


def test_spec_token_embeds_as_the_checkpoint_vector():
    lm = model("tiny-qwen2")
    V = lm.config.vocab_size
    vec = torch.randn(1, lm.config.hidden_size, dtype=torch.float64)
    emb = lm.model.embed(torch.tensor([3, V, 5]), vec)
    assert torch.equal(emb[1], vec[0])
    assert torch.equal(emb[0], lm.model.model.embed_tokens.weight[3])
    assert torch.equal(lm.model.embed(torch.tensor([3, 5])), lm.model.model.embed_tokens.weight[[3, 5]])


def test_drafter_for_another_model_is_one_clear_error():
    lm = model("tiny-random")
    other = resolve_model("tiny-qwen2") / "owl-drafter"
    with pytest.raises(LonggenError, match="owl.json"):
        build_decoder(lm, config("owl"), drafter_dir=other)
    with pytest.raises(LonggenError, match="not found"):
        build_decoder(lm, config("howl"), drafter_dir=Path(_TMP.name) / "missing")
    nospec = OwlDrafter(lm.config.hidden_size, lm.config.vocab_size, 16, spec=False)
    nospec.reset_parameters()
    path = nospec.save(Path(_TMP.name) / "nospec")
    with pytest.raises(LonggenError, match="owl.spec = false"):
        build_decoder(lm, config("owl"), drafter_dir=path)
    assert isinstance(build_decoder(lm, config("owl", owl__spec=False), drafter_dir=path), OwlDecoder)


# ------------------------------------------------------------------------------------------------
# sampled: exact distribution


MICRO = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=8, hidden_size=32,
             intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, max_position_embeddings=256)
SAMPLING = SamplingConfig(temperature=0.9, min_p=0.05, penalty=1.5, penalty_window=3)
MICRO_PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
RUNS = 2500


@functools.lru_cache(maxsize=None)
def micro() -> tuple[LoadedModel, OwlDrafter]:
    gen = torch.Generator().manual_seed(5)
    cfg = msgspec.convert(MICRO, ModelConfig)
    net = Transformer(cfg)
    net.load_state_dict(random_state(MICRO, gen), strict=False)
    net = net.double().eval().requires_grad_(False)
    drafter = OwlDrafter(32, 8, 16, n_steps=3, spec=True)
    drafter.reset_parameters(gen, net.model.embed_tokens.weight)
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


@pytest.mark.slow
@pytest.mark.parametrize("method", ["owl", "howl"])
def test_sampled_owl_and_howl_follow_the_exact_distribution(method):
    lm, drafter = micro()
    cfg = msgspec.structs.replace(
        config(method, owl__top_k=3, owl__depth=3, owl__tree_size=6, howl__threshold=0.5,
               suffix__max_spec_factor=2.0, suffix__min_token_prob=0.0),
        sampling=SAMPLING,
    )
    cls = HowlDecoder if method == "howl" else OwlDecoder
    counts = np.zeros((8, 8))
    accepted = linear = 0
    for seed in range(RUNS):
        dec = cls(lm, msgspec.structs.replace(cfg, seed=seed), drafter)
        r = dec.generate(MICRO_PROMPT, 3)
        counts[r.output_ids[1], r.output_ids[2]] += 1
        accepted += r.stats.accepted
        linear += r.stats.linear_steps
    assert accepted > RUNS // 4  # drafts were accepted often enough to matter
    if method == "howl":
        assert linear > RUNS // 10  # and both branches ran
    expected = exact_pair_distribution(lm).ravel() * RUNS
    keep = expected > 0
    assert counts.ravel()[~keep].sum() == 0
    assert chisquare(counts.ravel()[keep], expected[keep]).pvalue > 1e-3
