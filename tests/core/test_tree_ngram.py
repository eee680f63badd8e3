import random

import numpy as np
import pytest
import torch
from helpers import loop_sequence, path_nodes

from sgl_longgen.core import ngram
from sgl_longgen.core.ngram import _BULK, _BULK_SHARE, NgramPool
from sgl_longgen.core.tree import DraftTree, Source, add_beam, add_beam_nodes, bits_to_rows, cartesian_rows


def test_paths_merge_into_one_node_per_distinct_prefix():
    tree = DraftTree(root_token=9)
    a = tree.add_path([1, 2, 3], Source.HEADS)
    b = tree.add_path([1, 2, 4], Source.NGRAM)
    c = tree.add_path([5], Source.NGRAM)
    assert len(tree) == 1 + 4 + 1
    assert a[:2] == b[:2] and a[2] != b[2]
    assert tree.sources[a[0]] == Source.HEADS | Source.NGRAM
    assert tree.sources[a[2]] == Source.HEADS and tree.sources[c[0]] == Source.NGRAM
    assert tree.depths == [0, 1, 2, 3, 3, 1]
    assert tree.path_tokens(b[2]) == [1, 2, 4]
    assert path_nodes(tree, b[2]) == [0, *b]


def test_parents_precede_children_and_positions_follow_depth():
    tree = DraftTree(0)
    for path in ([3, 1], [2], [3, 2, 7]):
        tree.add_path(path)
    assert all(p < i for i, p in enumerate(tree.parents) if p >= 0)
    assert tree.positions(100).tolist() == [100 + d for d in tree.depths]


def test_ancestor_mask_is_ancestor_or_self():
    tree = DraftTree(0)
    tree.add_path([1, 2])
    tree.add_path([1, 3])
    tree.add_path([4])
    m = tree.ancestor_mask()
    expect = torch.zeros(len(tree), len(tree), dtype=torch.bool)
    for i in range(len(tree)):
        for j in path_nodes(tree, i):
            expect[i, j] = True
    assert torch.equal(m, expect)
    assert torch.equal(m, m.tril())


def test_max_nodes_truncates_paths():
    tree = DraftTree(0)
    tree.add_path([1, 2, 3])
    got = tree.add_path([1, 5, 6], max_nodes=5)
    assert len(tree) == 5 and len(got) == 2


def test_cartesian_tree_is_tokenswifts_1_3_3_3():
    cands = [[10, 11], [20, 21, 22, 23], [30, 31, 32], [40, 41, 42]]
    tree = DraftTree(0)
    tree.add_cartesian(cartesian_rows(cands, [1, 3, 3, 3]), Source.HEADS)
    assert len(tree) == 1 + 1 + 3 + 9 + 27
    leaves = {tuple(tree.path_tokens(i)) for i in range(len(tree)) if tree.depths[i] == 4}
    assert leaves == {(10, a, b, c) for a in (20, 21, 22) for b in (30, 31, 32) for c in (40, 41, 42)}
    assert all(s == Source.HEADS for s in tree.sources[1:])
    # The same trie as inserting every combination as a path.
    paths = DraftTree(0)
    for p in sorted(leaves):
        paths.add_path(p)
    assert sorted(map(tuple, map(tree.path_tokens, range(len(tree))))) == \
        sorted(map(tuple, map(paths.path_tokens, range(len(paths)))))


def test_cartesian_tree_is_cut_deepest_level_first_and_stops_above_an_empty_row():
    tree = DraftTree(0)
    tree.add_cartesian([[1], [2, 3], [4, 5]], max_nodes=5)
    assert [tree.path_tokens(i) for i in range(1, 5)] == [[1], [1, 2], [1, 3], [1, 2, 4]]
    tree = DraftTree(0)
    tree.add_cartesian([[1], [2, 3], [], [4]])
    assert len(tree) == 4 and tree.max_depth == 2
    # Merges into what is there: an n-gram path first, then the heads.
    tree = DraftTree(0)
    tree.add_path([1, 3], Source.NGRAM)
    tree.add_cartesian([[1], [2, 3]], Source.HEADS)
    assert len(tree) == 4 and tree.sources[tree.child(tree.child(0, 1), 3)] == Source.HEADS | Source.NGRAM


def test_ancestor_rows_match_the_parent_walk_on_random_tries():
    rng = random.Random(0)
    for size in (8, 64, 70):
        tree = DraftTree(0)
        while len(tree) < size - 3:
            tree.add_path([rng.randrange(4) for _ in range(rng.randrange(1, 6))], max_nodes=size - 3)
        expect = np.zeros((size, size), dtype=np.bool_)
        for i in range(len(tree)):
            expect[i, path_nodes(tree, i)] = True
        assert np.array_equal(tree.ancestor_array(size), expect)
        out = np.ones((size, size), dtype=np.bool_)
        bits_to_rows(tree.ancestor_bits(), size, out)
        assert np.array_equal(out, expect)


def test_leaves_added_together_are_the_leaves_added_one_by_one():
    """``add_leaves`` (OWL's [SPEC] leaves of a whole trie) is the fast path of ``add_leaf``."""
    rng = random.Random(3)
    one, bulk = DraftTree(5), DraftTree(5)
    for tree in (one, bulk):
        for _ in range(12):
            tree.add_path([rng.randrange(9) for _ in range(rng.randrange(1, 5))], Source.LSTM)
        rng.seed(3)
    assert one.tokens == bulk.tokens
    parents = [0, 3, 3, len(one) - 1]
    got = bulk.add_leaves(parents, 7, Source.SPEC)
    want = [one.add_leaf(p, 7, Source.SPEC) for p in parents]
    assert got == want
    assert (bulk.tokens, bulk.parents, bulk.depths, bulk.sources, bulk.num_walkable) == (
        one.tokens, one.parents, one.depths, one.sources, one.num_walkable)
    assert all(bulk.child(p, 7) is None or bulk.child(p, 7) < bulk.num_walkable for p in parents)  # never walked into


def tree_fields(tree: DraftTree) -> tuple:
    return (tree.tokens, tree.parents, tree.depths, tree.sources, tree._child, tree._parented, tree.num_walkable)


@pytest.mark.parametrize("seed", range(12))
def test_a_beam_in_one_go_is_the_beam_inserted_node_by_node(seed):
    """The bulk insertion of a beam into a root-only tree builds what the node-by-node one does,
    every cut included; beams with two siblings of one token (merged by the trie) fall back to
    it, and so do trees that already hold nodes."""
    rng = random.Random(seed)
    n = rng.randrange(1, 40)
    parents = [rng.randrange(-1, i) for i in range(n)]
    unique = seed % 2 == 0
    tokens = []
    for i, p in enumerate(parents):
        taken = {t for t, q in zip(tokens, parents) if q == p} if unique else set()
        tokens.append(rng.choice([t for t in range(60) if t not in taken] if unique else range(3)))
    for max_nodes in (None, 0, 1, 2, n // 2, n, n + 1, n + 5):
        fast = add_beam(DraftTree(9), tokens, parents, Source.LONGSPEC, max_nodes)
        slow = add_beam_nodes(DraftTree(9), tokens, parents, Source.LONGSPEC, max_nodes)
        assert tree_fields(fast) == tree_fields(slow), max_nodes
    held = [DraftTree(9), DraftTree(9)]
    for tree in held:
        tree.add_path(tokens[:1], Source.NGRAM)
    assert tree_fields(add_beam(held[0], tokens, parents, Source.LSTM)) == tree_fields(
        add_beam_nodes(held[1], tokens, parents, Source.LSTM))


def test_a_beam_with_a_child_before_its_parent_is_refused_either_way():
    for fn in (add_beam, add_beam_nodes):
        with pytest.raises(ValueError, match="draft node 2 of request 3 comes before its parent 2"):
            fn(DraftTree(1), [5, 6, 7], [-1, 0, 2], Source.LSTM, 2, 3)


def test_ngram_pool_counts_and_ranks_by_frequency_then_recency():
    pool = NgramPool(n=3, top_k=5)
    seq = [1, 2, 3, 1, 2, 3, 1, 4, 5, 1, 2, 3, 1, 4, 6]
    pool.extend(seq)
    # continuations of 1: (2,3) x3, (4,5) x1, (4,6) x1 (more recent than (4,5))
    assert pool.lookup(1) == [(2, 3), (4, 6), (4, 5)]
    assert pool.lookup(1, k=1) == [(2, 3)]
    assert pool.lookup(99) == []


def test_ngram_pool_extends_incrementally_and_honours_the_limit():
    seq = [1, 2, 3, 4, 1, 2, 3, 5]
    whole = NgramPool(n=3)
    whole.extend(seq)
    step = NgramPool(n=3)
    for end in range(len(seq) + 1):
        step.extend(seq[:end])
    assert step.counts() == whole.counts()
    limited = NgramPool(n=3)
    limited.extend(seq, limit=5)  # only n-grams inside seq[:5]
    assert limited.lookup(1) == [(2, 3)]
    assert limited.lookup(3) == [(4, 1)]
    assert limited.lookup(4) == []
    limited.extend(seq)
    assert limited.counts() == whole.counts()


def test_ngram_pool_kept_best_list_matches_a_full_ranking():
    """The incrementally kept top-k equals ranking every continuation from scratch, at all times."""
    import heapq
    import random

    rng = random.Random(0)
    # A small alphabet makes frequent first tokens with many distinct continuations.
    seq = [rng.choice(range(6)) if rng.random() < 0.8 else rng.randrange(40) for _ in range(3000)]
    pool = NgramPool(n=3, top_k=4)
    for end in range(0, len(seq) + 1, 7):
        pool.extend(seq, limit=end)
        for first, conts in pool.counts().items():
            want = [c for c, _ in heapq.nlargest(4, conts.items(), key=lambda kv: kv[1])]
            assert pool.lookup(first) == want
            assert pool.lookup(first, k=2) == want[:2]
    assert pool.lookup(0, k=10) == [c for c, _ in heapq.nlargest(
        10, pool.counts()[0].items(), key=lambda kv: (kv[1][0], kv[1][1]))]
    assert NgramPool(n=3, top_k=0).lookup(0) == []
    bulk = NgramPool(n=3, top_k=4)  # a prompt-sized extend ranks each first token once
    bulk.extend(seq[:1000])
    bulk.extend(seq[:1010])
    bulk.extend(seq)
    for first, conts in bulk.counts().items():
        assert bulk.lookup(first) == [c for c, _ in heapq.nlargest(4, conts.items(), key=lambda kv: kv[1])]


def test_ngram_pool_packs_its_ngrams_into_ints_the_collector_never_tracks():
    """A 20K-token history of a large vocabulary leaves the pool's few containers as the only
    objects the garbage collector tracks (tuples and one dict per first token would be thousands),
    and packing keeps every continuation, count and lookup exact, large token ids included."""
    import gc

    from helpers import gc_tracked_reachable

    rng = random.Random(0)
    seq = [rng.randrange(1 << 31) if rng.random() < 0.01 else rng.randrange(50_000) for _ in range(20_000)]
    gc.disable()  # no full collection may untrack anything while the pool is built
    try:
        pool = NgramPool(n=4, top_k=20)
        pool.extend(seq[:5_000])
        for end in range(5_000, len(seq) + 1, 3):  # the per-step path too
            pool.extend(seq, limit=end)
            pool.lookup(seq[end - 20_000])  # first tokens still packed: their ranked rows are kept
    finally:
        gc.enable()
    assert len(pool) > 15_000
    assert gc_tracked_reachable(pool) <= 8
    want: dict = {}
    for i in range(len(seq) - 3):
        count, _ = want.setdefault(seq[i], {}).get(tuple(seq[i + 1 : i + 4]), (0, 0))
        want[seq[i]][tuple(seq[i + 1 : i + 4])] = (count + 1, i)
    assert pool.counts() == want
    big = next(t for t in seq if t >= 1 << 30)
    assert pool.lookup(big) == [c for c, _ in sorted(want[big].items(), key=lambda kv: kv[1], reverse=True)][:20]
    with pytest.raises(ValueError, match="n-gram tokens"):
        NgramPool(n=3).extend([1, -2, 3, 4])


def per_ngram(seq: list[int], ends: list[int], n: int, top_k: int) -> NgramPool:
    """The pool the per-token path builds: one n-gram per extend, up to each of ``ends`` in turn."""
    pool = NgramPool(n, top_k)
    for end in ends:
        for e in range(min(pool.indexed_until, end), end + 1):
            pool.extend(seq, limit=e)
    return pool


def assert_same_pool(got: NgramPool, want: NgramPool, seq: list[int]) -> None:
    """Same n-grams, counts and last positions, size, indexed prefix, and the same lookups (the kept
    top_k and beyond it, ties included) for every first token and for one never seen."""
    assert got.counts() == want.counts()
    assert len(got) == len(want) and got.indexed_until == want.indexed_until
    for first in [*set(seq), max(seq) + 1]:
        for k in (None, 1, 3, got.top_k + 4):
            assert got.lookup(first, k) == want.lookup(first, k), (first, k)


def sequence(kind: str, rng: random.Random, length: int) -> list[int]:
    if kind == "random":
        return [rng.randrange(100_000) for _ in range(length)]
    if kind == "loop":
        return loop_sequence(rng, length, 30)
    return [rng.choice(range(6)) if rng.random() < 0.8 else rng.randrange(40) for _ in range(length)]  # few firsts


@pytest.mark.parametrize("kind", ["random", "loop", "skewed"])
@pytest.mark.parametrize("ngrams", [_BULK, _BULK + 1, 3 * _BULK + 7])
@pytest.mark.parametrize("n, top_k", [(4, 20), (3, 4), (2, 1)])
def test_a_long_extend_counts_exactly_what_the_per_token_path_counts(kind, ngrams, n, top_k):
    """One extend of more than ``_BULK`` n-grams (counted with numpy into the packed layer) gives
    the same counts, ranks and lookups as indexing the n-grams one by one."""
    rng = random.Random(ngrams * n)
    seq = sequence(kind, rng, ngrams + n - 1)
    pool = NgramPool(n, top_k)
    pool.extend(seq)
    assert (pool._packed_counts.size > 0) == (ngrams > _BULK)  # the bulk path was taken, or not
    assert_same_pool(pool, per_ngram(seq, [len(seq)], n, top_k), seq)


@pytest.mark.parametrize("kind", ["random", "loop", "skewed"])
@pytest.mark.parametrize("n, top_k", [(4, 20), (3, 2), (3, 0)])
def test_packed_then_per_step_then_packed_again_equals_the_per_token_path(kind, n, top_k):
    """A packed prompt, per-step extends (each first token they touch is unpacked into its dict),
    long extends that fold into the packed layer (touched first tokens get their counts in their
    dicts) or not (too short beside it), and extends under a limit (a penalty window left out):
    every stage equals the per-token pool, and lookups between stages do not change it."""
    rng = random.Random(n * 10 + top_k)
    seq = sequence(kind, rng, 40 * _BULK)
    pool = NgramPool(n, top_k)
    ends: list[int] = []
    end = 2 * _BULK
    pool.extend(seq, limit=end)
    ends.append(end)
    assert pool._packed_counts.size
    for _ in range(40):  # decode steps
        end += rng.randint(0, 3)
        pool.extend(seq, limit=end)
        pool.lookup(seq[rng.randrange(end)])
    ends.append(end)
    assert pool._table and pool._packed_pending
    assert_same_pool(pool, per_ngram(seq, ends, n, top_k), seq[:end])
    counted = []
    bulk = pool._extend_packed
    pool._extend_packed = lambda window, start: (counted.append(start), bulk(window, start))
    for step in (_BULK + 40, 5, 2 * _BULK, 30 * _BULK, _BULK + 1, 2 * _BULK):
        ngrams = end + step - pool.indexed_until  # the n-grams this extend indexes
        folds = ngrams > _BULK and ngrams * _BULK_SHARE >= len(pool._packed_counts)
        end += step
        pool.extend(seq, limit=end)
        ends.append(end)
        assert len(counted) == folds
        counted.clear()
        assert_same_pool(pool, per_ngram(seq, ends, n, top_k), seq[:end])


def test_a_long_extend_whose_continuation_hashes_collide_is_still_exact(monkeypatch):
    """Continuations of one first token that share a hash are grouped by their tokens instead."""
    rng = random.Random(1)
    seq = sequence("skewed", rng, 4 * _BULK)
    few = lambda conts: conts[0].astype(np.uint64) % np.uint64(3)  # three hash values
    one = lambda conts: np.zeros(conts[0].shape[0], dtype=np.uint64)  # every hash equal
    for hashed in (few, one):
        monkeypatch.setattr(ngram, "_cont_hash", hashed)
        pool = NgramPool(4, 3)
        pool.extend(seq[: 2 * _BULK])
        pool.extend(seq[: 2 * _BULK + 9])
        pool.extend(seq)  # folded into the packed layer
        assert_same_pool(pool, per_ngram(seq, [2 * _BULK, 2 * _BULK + 9, len(seq)], 4, 3), seq)


@pytest.mark.parametrize("bad", [-2, 1 << 32, 1 << 70])
def test_a_long_extend_with_a_token_out_of_range_is_refused_and_indexes_nothing(bad):
    seq = list(range(3 * _BULK))
    pool = NgramPool(n=3)
    pool.extend(seq, limit=_BULK * 2)
    with pytest.raises(ValueError, match="n-gram tokens"):
        pool.extend(seq[:-5] + [bad] + seq[-4:])
    assert pool.indexed_until == 2 * _BULK and len(pool) == 2 * _BULK - 2
    assert pool.lookup(7) == [(8, 9)]
