import msgspec
import torch

from sgl_longgen.config import SamplingConfig
from sgl_longgen.core.heads import TokenSwiftHeads
from sgl_longgen.core.ngram import NgramPool
from sgl_longgen.core.penalty import apply_penalty
from sgl_longgen.core.sampling import LogitsProcessor
from sgl_longgen.core.tokenswift import (
    candidate_count,
    draft_trie,
    head_candidates,
    rank_candidates,
)
from sgl_longgen.core.tree import Source


def test_head_candidates_are_the_top_logits_of_the_base_head_and_each_extra_head():
    gen = torch.Generator().manual_seed(0)
    d, vocab, padded = 16, 50, 64  # engines pad the LM head past the vocabulary
    heads = TokenSwiftHeads(d, 3)
    heads.reset_parameters(gen, std=0.5)
    weight = torch.randn(padded, d, generator=gen)
    h0 = torch.randn(2, d, generator=gen)
    normed = torch.randn(2, d, generator=gen)
    values, ids = head_candidates(heads, h0, normed, weight, 3, vocab, 8)
    assert values.shape == ids.shape == (2, 4, 8)
    full = torch.stack([normed, *heads(h0)], dim=1) @ weight[:vocab].t()
    want_v, want_i = full.topk(8, dim=-1)
    assert torch.equal(ids, want_i) and torch.allclose(values, want_v)
    assert int(ids.max()) < vocab


def test_ranking_a_short_list_matches_the_full_processor_when_the_list_covers_the_width():
    gen = torch.Generator().manual_seed(1)
    vocab = 40
    logits = torch.randn(3, vocab, generator=gen) * 3
    history = [5, 7, 9, 11, 5]
    params = SamplingConfig(temperature=0.0, penalty=1.8, penalty_window=4)
    window = set(history[-4:])
    values, ids = logits.topk(candidate_count([1, 3, 3, 3], vocab), dim=-1)
    got = rank_candidates(values, ids, params, window, 3)
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[list(window)] = True
    penalized = apply_penalty(logits, mask.expand(3, vocab), params.penalty)
    assert got == penalized.topk(3, dim=-1).indices.tolist()
    # The same as the whole-vocabulary processor the runtime's verifier uses.
    assert got == LogitsProcessor(params, vocab).process(logits, mask.expand(3, vocab)).topk(3).indices.tolist()


def test_ranking_drops_what_top_k_and_min_p_would_remove():
    values = torch.tensor([[4.0, 3.9, 1.0, 0.5, -1.0]])
    ids = torch.tensor([[10, 11, 12, 13, 14]])
    sampled = SamplingConfig(temperature=1.0, top_k=3)
    assert rank_candidates(values, ids, sampled, None, 5) == [[10, 11, 12]]
    # min_p = 0.1 keeps p >= 0.1 * p_max, i.e. logit >= 4 + ln 0.1 = 1.70.
    assert rank_candidates(values, ids, SamplingConfig(temperature=1.0, min_p=0.1), None, 5) == [[10, 11]]
    # A higher temperature flattens the distribution: more survive.
    assert rank_candidates(values, ids, SamplingConfig(temperature=2.0, min_p=0.1), None, 5) == [[10, 11, 12, 13]]
    assert rank_candidates(values, ids, SamplingConfig(temperature=0.0, min_p=0.1), None, 2) == [[10, 11]]


def test_draft_trie_merges_the_head_tree_with_ngram_continuations():
    pool = NgramPool(n=3, top_k=4)
    pool.extend([1, 2, 3, 1, 2, 4, 1, 9, 9])
    tree = draft_trie(8, [[1], [2, 5], [3]], [1, 2, 1], pool)
    paths = {tuple(tree.path_tokens(i)): tree.sources[i] for i in range(1, len(tree))}
    assert paths[(1, 2, 3)] == Source.HEADS | Source.NGRAM
    assert paths[(1, 5, 3)] == Source.HEADS
    assert paths[(1, 2, 4)] == Source.NGRAM and paths[(1, 9, 9)] == Source.NGRAM
    assert len(draft_trie(8, [[1], [2, 5], [3]], [1, 2, 1], pool, max_nodes=4)) == 4


def test_a_requests_state_adds_no_collector_tracked_objects_as_its_history_grows():
    """TokenSwift's per-request state (n-gram pool, suffix index, partial KV) after indexing a
    prompt holds as many garbage-collector-tracked objects at 20K tokens as at 2K, and the
    per-step indexing adds none: a serving process's full collections do not grow with the
    context, nor come more often, and a long prompt cannot trigger one."""
    import random

    from helpers import gc_tracked_reachable

    from sgl_longgen.config import GenerateConfig
    from sgl_longgen.methods import TokenSwift

    cfg = GenerateConfig()
    method = TokenSwift(cfg.tokenswift, cfg.suffix)
    rng = random.Random(0)
    tracked = []
    for length in (2_000, 20_000):
        history = [rng.randrange(100_000) for _ in range(length)]
        state = method.start(length)
        method.index(state, history, cfg.sampling)
        for _ in range(50):  # steps: a few committed tokens each
            history += [rng.randrange(100_000) for _ in range(3)]
            method.index(state, history, cfg.sampling)
        assert len(state.pool) > length - 10
        tracked.append(gc_tracked_reachable(state))
    assert tracked[0] == tracked[1] <= 32, tracked


def test_the_hint_is_the_histories_continuation_score_and_indexing_twice_changes_nothing():
    """Adaptive speculation's hint for TokenSwift: the score of the history's own continuation
    (part of every trie it drafts): about 0 on text that never repeats, many tokens on a loop.
    The hint indexes the history, and the draft's indexing of the same history is a no-op."""
    import random

    from sgl_longgen.config import GenerateConfig
    from sgl_longgen.methods import TokenSwift

    cfg = GenerateConfig()
    method = TokenSwift(cfg.tokenswift, cfg.suffix)
    rng = random.Random(0)
    text = [rng.randrange(100_000) for _ in range(1_000)]
    state = method.start(len(text))
    assert method.history_hint(state, text, cfg.sampling) < 1.0
    loop = [rng.randrange(100_000) for _ in range(9)]
    history = text + loop * 4
    assert method.history_hint(state, history, cfg.sampling) > 10.0
    continuation, pooled = list(state.continuation), len(state.pool)
    assert continuation[:9] == loop  # the loop goes on
    method.index(state, history, cfg.sampling)
    assert state.continuation == continuation and len(state.pool) == pooled
    no_suffix = TokenSwift(msgspec.structs.replace(cfg.tokenswift, suffix=False), cfg.suffix)
    assert no_suffix.history_hint(no_suffix.start(len(history)), history, cfg.sampling) is None


def test_a_prompt_prepared_chunk_by_chunk_indexes_what_the_first_step_would():
    """A runtime indexes a prompt during its prefill, a chunk at a time (TokenSwift.prepare);
    the request's first step starts from that state. Its n-gram pool (the penalty window left
    out, as the first step's indexing leaves it out), its suffix index, its continuation and
    its hint are those of a request whose first step indexes the whole prompt at once."""
    import random

    from sgl_longgen.config import GenerateConfig
    from sgl_longgen.methods import TokenSwift

    cfg = GenerateConfig()
    sampling = msgspec.structs.replace(cfg.sampling, penalty=1.2, penalty_window=64)
    assert sampling.penalty_active
    method = TokenSwift(cfg.tokenswift, cfg.suffix)
    rng = random.Random(1)
    period = [rng.randrange(300) for _ in range(11)]
    prompt = [rng.randrange(300) for _ in range(2500)] + period * 30
    history = [*prompt, period[0]]  # the loop goes on

    whole = method.start(len(prompt))
    hint = method.history_hint(whole, history, sampling)
    state = None
    for end in (512, 1024, 2000, len(prompt)):
        state = method.prepare(state, prompt[:end], sampling)
    assert state.indexed == len(prompt)
    started = method.start(len(prompt), state)
    assert started is state and started.policy.score_range() == whole.policy.score_range()
    assert method.history_hint(started, history, sampling) == hint and hint > 10.0
    assert started.continuation == whole.continuation
    assert started.pool.counts() == whole.pool.counts() and len(started.pool) > 0
    assert started.pool.indexed_until == whole.pool.indexed_until
