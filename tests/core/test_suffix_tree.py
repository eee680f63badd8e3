"""SUFFIX's draft trees: equal to a brute-force reading of SuffixDecoding's tree semantics, at
least as good as the chain, cut best-first; the method's index grows only by the new tokens and
the shared corpus stays within its bounds."""

from __future__ import annotations

import random

import numpy as np
import pytest

from sgl_longgen.config import SuffixConfig
from sgl_longgen.core.suffix import SENTINEL, SuffixCorpus, SuffixIndex
from sgl_longgen.core.suffix_tree import SuffixTree, tree_draft
from sgl_longgen.methods import Suffix

from test_suffix import random_sequence


def brute_force_tree(arr: list[int], context: list[int], config: SuffixConfig, own: bool) -> SuffixTree:
    """The best-first tree, every count read by scanning the whole array.

    A node's pattern is the match followed by its path; its occurrences are the match's whose
    next tokens spell the path (``own``: read in arr followed by the path itself, the match's own
    occurrence at the end excluded). A child's
    probability is the parent's times (occurrences followed by its token) / (the parent's
    occurrences); the likeliest candidate joins next (ties: the latest occurrence), up to the
    match's budget or min_token_prob; the best score over the match lengths wins, ties to the
    longer match.
    """
    n = len(arr)
    ctx = context[-(config.max_depth - 1):]
    best = SuffixTree()
    for p in range(1, len(ctx) + 1):
        g = ctx[-p:]
        ends = [e for e in range(p, n + 1) if arr[e - p : e] == g]
        if not ends:
            break
        budget = min(config.max_spec_tokens, int(p * config.max_spec_factor + config.max_spec_offset + 1e-6))
        mine = own and ends[-1] == n
        if (mine and config.loop_min_tokens and len(ends) > 1 and n - ends[-2] <= p
                and p + n - ends[-2] >= config.loop_min_tokens):
            budget = config.max_spec_tokens
        tree = SuffixTree()
        paths: list[list[int]] = []
        candidates = []  # (prob, latest, parent, token)

        def offer(parent: int, prob: float) -> None:
            path = paths[parent] if parent >= 0 else []
            seq = arr + path if mine else arr
            # The draft's own occurrence (ending the history) is followed by nothing: it never has a path.
            occ = [e for e in ends if (not path or e < n) and all(e + i < len(seq) and seq[e + i] == t
                                                                  for i, t in enumerate(path))]
            stats: dict[int, list[int]] = {}
            for e in occ:
                e += len(path)
                if e < len(seq) and seq[e] != SENTINEL:
                    entry = stats.setdefault(seq[e], [0, -1])
                    entry[0] += 1
                    entry[1] = max(entry[1], e)
            for tok, (count, latest) in stats.items():
                if prob * count / len(occ) >= config.min_token_prob:
                    candidates.append((prob * count / len(occ), latest, parent, tok))

        offer(-1, 1.0)
        while candidates and len(tree.tokens) < budget:
            cand = max(candidates, key=lambda c: (c[0], c[1]))
            candidates.remove(cand)
            prob, _, parent, tok = cand
            tree.tokens.append(tok)
            tree.parents.append(parent)
            tree.probs.append(prob)
            paths.append((paths[parent] if parent >= 0 else []) + [tok])
            offer(len(tree.tokens) - 1, prob)
        tree.score = sum(tree.probs)
        if tree.tokens and (tree.score > best.score or (tree.score == best.score and p > best.match_len)):
            tree.match_len = p
            best = tree
    return best


@pytest.mark.parametrize("seed", range(4))
def test_trees_match_the_brute_force_semantics(seed):
    rng = random.Random(seed)
    for _ in range(25):
        vocab = rng.randint(2, 6)
        config = SuffixConfig(max_depth=rng.choice([3, 8, 64]), max_spec_tokens=rng.choice([4, 16]),
                              max_spec_factor=rng.choice([1.0, 2.0, 4.0]), min_token_prob=rng.choice([0.0, 0.1, 0.3]),
                              loop_min_tokens=rng.choice([0, 8]))
        index = SuffixIndex(config.max_depth)
        arr: list[int] = []
        for part in range(rng.randint(1, 2)):  # several sequences: the shared corpus's layout
            if part:
                index.end_sequence()
                arr.append(SENTINEL)
            seq = random_sequence(rng, rng.randint(5, 80), vocab)
            index.extend(seq)
            arr.extend(seq)
        queries = [(random_sequence(rng, 10, vocab), False)]
        if SENTINEL not in arr[-20:]:  # the request's own index: the context is its tail
            queries.append(([t for t in arr[-20:]], True))
        for context, own in queries:
            got = tree_draft(index, context, config, own=own)
            want = brute_force_tree(arr, context, config, own)
            assert (got.tokens, got.parents) == (want.tokens, want.parents)
            assert got.score == pytest.approx(want.score)
            assert got.probs == pytest.approx(want.probs)
            if got.tokens:
                assert got.match_len == want.match_len


def test_a_tree_scores_at_least_the_chain_and_its_cut_is_best_first():
    rng = random.Random(3)
    config = SuffixConfig(max_spec_tokens=16, min_token_prob=0.0)
    for _ in range(30):
        seq = random_sequence(rng, 200, 4)
        index = SuffixIndex()
        index.extend(seq)
        tree = tree_draft(index, seq, config, own=True)
        chain = index.draft(seq, config, own=True)
        assert tree.score >= chain.score - 1e-9
        assert len(tree) <= 16 and all(p < i for i, p in enumerate(tree.parents))
        # Best first: no node is likelier than its parent, nor than a node that joined before it.
        assert all(tree.probs[i] <= tree.probs[p] for i, p in enumerate(tree.parents) if p >= 0)
        assert tree.probs == sorted(tree.probs, reverse=True)
        trie = tree.draft_tree(seq[-1], max_nodes=5)
        assert len(trie) == min(5, len(tree) + 1) and trie.tokens[1:] == tree.tokens[:4]


def test_several_continuations_become_branches():
    """Two continuations that each followed the pattern half the time are both drafted."""
    history = [1, 2, 3, 4, 5, 10, 1, 2, 3, 6, 7, 11, 1, 2, 3, 4, 5, 12, 1, 2, 3, 6, 7, 13, 1, 2, 3]
    index = SuffixIndex()
    index.extend(history)
    tree = tree_draft(index, history, SuffixConfig(min_token_prob=0.2), own=True)
    roots = {tok for tok, parent in zip(tree.tokens, tree.parents) if parent < 0}
    assert roots == {4, 6} and tree.match_len == 3
    assert tree.probs[:4] == pytest.approx([0.4] * 4)  # 2 of the pattern's 5 occurrences each, then 5 and 7
    assert len(tree) == 6 and tree.score == pytest.approx(2.0)  # the budget: 2 * p nodes
    chain = index.draft(history, SuffixConfig(min_token_prob=0.2), own=True)
    assert tree.score > chain.score


def test_a_loop_fills_the_budget_in_one_chain():
    history = [5, 6, 7] * 10
    index = SuffixIndex()
    index.extend(history)
    tree = tree_draft(index, history, SuffixConfig(max_spec_tokens=32), own=True)
    assert len(tree) == 32 and tree.depth == 32
    assert tree.tokens == ([5, 6, 7] * 11)[:32]
    capped = tree_draft(index, history, SuffixConfig(max_spec_tokens=32), max_spec_tokens=5, own=True)
    assert capped.tokens == [5, 6, 7, 5, 6]


def test_the_method_indexes_only_new_tokens_and_prepares_in_chunks():
    config = SuffixConfig(min_token_prob=0.0)
    method = Suffix(config)
    rng = random.Random(0)
    prompt = random_sequence(rng, 3000, 20)
    for lo in range(0, len(prompt), 1024):  # the prefill's chunks
        method.prepare("r", prompt[: lo + 1024])
    state = method.start("r", prompt)
    assert len(state.index) == len(prompt)
    extended: list[int] = []
    real = state.index.extend
    state.index.extend = lambda tokens: (extended.append(len(tokens)), real(tokens))[1]
    history = list(prompt)
    for step in range(5):
        history += random_sequence(rng, step + 1, 20)
        draft = method.propose(state, history, 17)
        assert len(draft.tree) <= 17 and draft.tree.tokens[0] == history[-1]
        assert method.history_hint(state, history, 17) == method.tree(state, history, 17).score
    assert extended == [1, 2, 3, 4, 5]  # each step: the tokens committed since the last
    fresh = SuffixIndex.for_config(config)
    fresh.extend(history)
    assert tree_draft(fresh, history, config, 16, own=True) == method.tree(state, history, 17)


def test_the_shared_corpus_keeps_the_latest_outputs_within_its_bounds():
    corpus = SuffixCorpus(SuffixConfig(global_requests=3, global_tokens=100))
    outputs = [[i] * 40 for i in range(1, 9)]
    for out in outputs:
        corpus.add(out)
        kept = [int(t) for t in corpus.index.sequence if t != SENTINEL]
        assert len(kept) <= 2 * 100  # lazily evicted: at most twice the bound
        assert kept[-40:] == out
    # After the last rebuild only the latest outputs that fit 100 tokens remain besides newer ones.
    seq = [int(t) for t in corpus.index.sequence if t != SENTINEL]
    assert set(seq) <= set(range(4, 9)) and 8 in seq
    corpus.add(list(range(300)))  # an output longer than the bound: its last 100 tokens
    assert list(corpus._kept[-1]) == list(range(200, 300))


def test_a_finished_request_drafts_for_the_next():
    method = Suffix(SuffixConfig(global_requests=4, min_token_prob=0.0))
    story = [11, 12, 13, 14, 15, 16, 17, 18]
    state = method.start("a", [1, 2, 3])
    method.tree(state, [1, 2, 3] + story, 9)
    method.finish("a")
    other = method.start("b", [40, 41, 11, 12])
    tree = method.tree(other, [40, 41, 11, 12], 9)
    assert tree.tokens[:4] == [13, 14, 15, 16]
    assert Suffix(SuffixConfig(min_token_prob=0.0)).corpus is None  # off by default


def test_a_query_is_bounded_on_a_long_loop():
    """A 200K-token period-2 loop: a query reads at most max_occurrences copies of the pattern."""
    history = [3, 4] * 100_000
    index = SuffixIndex(64, max_occurrences=256)
    index.extend(history)
    tree = tree_draft(index, history, SuffixConfig(max_occurrences=256), own=True)
    assert len(tree) == 64 and tree.tokens == [3, 4] * 32
    assert np.isclose(tree.probs[0], 255 / 256)
