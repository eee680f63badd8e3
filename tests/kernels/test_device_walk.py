"""The batched tensor walk and the steady partial-KV slots agree with their host versions, and the
fused kernels (compiled on a GPU, interpreted on a CPU) with the tensor versions."""

import random

import numpy as np
import pytest
import torch

from sgl_longgen.config import PartialKVConfig
from sgl_longgen.core.partial_kv import PartialKVPolicy, steady_visible_slots
from sgl_longgen.core.tree import DraftTree, Source
from sgl_longgen.core.verify import walk_tree, walk_trees
from sgl_longgen.kernels.tree_accept import steady_draft_inputs, walk_and_commit

from kernel_cases import DEVICE
from helpers import children


def random_trie(rng: random.Random, n: int, vocab: int) -> DraftTree:
    tree = DraftTree(rng.randrange(vocab))
    for _ in range(rng.randrange(1, 12)):
        tree.add_path([rng.randrange(vocab) for _ in range(rng.randrange(1, 6))], Source.HEADS, max_nodes=n - 2)
    for parent in rng.sample(range(len(tree)), min(2, len(tree))):  # OWL-style [SPEC] leaves
        if len(tree) < n and rng.random() < 0.5:
            tree.add_leaf(parent, rng.randrange(vocab), Source.SPEC)
    return tree


def padded(trees: list[DraftTree], n: int):
    bs = len(trees)
    parents = np.zeros((bs, n), dtype=np.int64)
    walk_tokens = np.full((bs, n), -1, dtype=np.int64)
    ancestors = np.zeros((bs, n, n), dtype=np.bool_)
    for b, tree in enumerate(trees):
        t = len(tree)
        ancestors[b] = tree.ancestor_array(n)
        ancestors[b, range(t, n), range(t, n)] = True
        ancestors[b, t:, 0] = True
        parents[b, 1:t] = tree.parents[1:]
        walk_tokens[b, 1 : tree.num_walkable] = tree.tokens[1 : tree.num_walkable]
    return torch.from_numpy(parents), torch.from_numpy(walk_tokens), torch.from_numpy(ancestors)


def random_batch(seed: int, n: int = 24, bs: int = 6):
    rng = random.Random(seed)
    vocab = 5  # a small vocabulary: draws often match a child, and padding's root token
    trees = [random_trie(rng, n, vocab) for _ in range(bs)]
    draws = torch.randint(0, vocab, (bs, n), generator=torch.Generator().manual_seed(seed))
    for b, tree in enumerate(trees):  # steer some draws down a path so walks go deep
        node = 0
        while children(tree, node) and rng.random() < 0.8:
            token, child = rng.choice(sorted(children(tree, node).items()))
            draws[b, node] = token
            node = child
    return trees, draws


@pytest.mark.parametrize("seed", range(5))
def test_tensor_walk_matches_the_host_walk(seed):
    n, bs = 24, 6
    trees, draws = random_batch(seed, n, bs)
    walks = walk_trees(draws, *padded(trees, n))
    deep = 0
    for b, tree in enumerate(trees):
        verdict = walk_tree(tree, lambda node, b=b: int(draws[b, node]))
        k = len(verdict.nodes)
        deep += k > 2
        assert int(walks.count[b]) == k
        assert int(walks.last[b]) == verdict.tokens[-1]
        rest = sorted(set(range(n)) - set(verdict.nodes))
        assert walks.order[b].tolist() == verdict.nodes + rest
    assert deep >= 2  # the test reached paths beyond the first draft node


def test_padding_nodes_are_never_entered_even_when_the_root_token_is_drawn():
    tree = DraftTree(7)
    tree.add_path([3, 4])
    n = 6
    draws = torch.full((1, n), 7)  # the root's draw equals padding nodes' token (the root's)
    walks = walk_trees(draws, *padded([tree], n))
    assert int(walks.count[0]) == 1 and int(walks.last[0]) == 7


@pytest.mark.parametrize("seed", range(4))
def test_steady_slots_are_the_policy_visible_positions(seed):
    gen = torch.Generator().manual_seed(seed)
    budget, sinks, n = 24, 4, 6
    policies, lengths = [], []
    for b in range(3):
        policy = PartialKVPolicy(PartialKVConfig(budget=budget, sinks=sinks), 1, 1)
        policy.reset(60 + 7 * b)
        lo, hi = policy.score_range()
        policy.select(torch.randn(1, 1, hi - lo, generator=gen))
        committed = policy.length + int(torch.randint(0, budget - sinks - n, (1,), generator=gen))
        policy.commit(committed)
        assert policy.pending is None and policy.selected.shape[1] == policy.capacity
        policies.append(policy)
        lengths.append(committed)
    width = 160
    table = torch.stack([torch.randperm(10_000, generator=gen)[:width] for _ in range(5)]).to(torch.int32)
    rows = torch.tensor([3, 0, 4])
    selected = torch.stack([table[r][p.selected[0]] for r, p in zip(rows.tolist(), policies)])
    slots = steady_visible_slots(table, rows, torch.tensor(lengths), torch.tensor([p.sel_len for p in policies]),
                                 selected, sinks, torch.arange(budget))
    assert slots.shape == (3, budget + 1) and slots.dtype == table.dtype
    for b, (r, p, length) in enumerate(zip(rows.tolist(), policies, lengths)):
        want = table[r][p.visible()[0]]
        assert sorted(slots[b, :-1].tolist()) == sorted(want.tolist())
        assert int(slots[b, -1]) == int(table[r, length])  # the root's own slot


@pytest.mark.parametrize("seed,n", [(0, 24), (1, 24), (2, 64), (3, 100)])
def test_fused_walk_and_commit_match_the_tensor_walk_and_the_window_permutation(seed, n):
    bs = 5
    trees, draws = random_batch(seed, n, bs)
    parents, walk_tokens, ancestors = padded(trees, n)
    want = walk_trees(draws, parents, walk_tokens, ancestors)
    gen = torch.Generator().manual_seed(seed)
    table = torch.randperm(50_000, generator=gen)[: 7 * 300].view(7, 300).to(torch.int32)
    rows = torch.tensor([6, 0, 3, 2, 5])
    seq_lens = torch.randint(0, 300 - n, (bs,), generator=gen)
    expect = table.clone()
    cols = seq_lens[:, None] + torch.arange(n)
    expect[rows[:, None], cols] = expect[rows[:, None], cols].gather(1, want.order)

    on = lambda t: t.to(DEVICE)
    got_table = on(table)
    count, last, order = walk_and_commit(on(draws), on(parents), on(walk_tokens), on(ancestors), got_table,
                                         on(rows), on(seq_lens))
    assert count.tolist() == want.count.tolist()
    assert last.tolist() == want.last.tolist()
    assert order.tolist() == want.order.tolist()
    assert torch.equal(got_table.cpu(), expect)  # only the windows moved, each by its walk's order


def test_fused_steady_inputs_match_the_tensor_slots():
    gen = torch.Generator().manual_seed(0)
    budget, sinks, bs = 40, 4, 3
    capacity = budget - sinks  # a full selection (PartialKVPolicy.capacity)
    table = torch.randperm(20_000, generator=gen)[: 5 * 400].view(5, 400).to(torch.int32)
    rows = torch.tensor([3, 0, 4])
    sel_lens = torch.tensor([200, 150, 300])
    seq_lens = sel_lens + torch.tensor([0, 3, 5])
    count = torch.tensor([1, 3, 2])
    selected = torch.stack([table[r][torch.randperm(s - sinks, generator=gen)[:capacity] + sinks]
                            for r, s in zip(rows.tolist(), sel_lens.tolist())])
    last = torch.tensor([11, 12, 13])
    lengths = seq_lens + count
    want = steady_visible_slots(table, rows, lengths, sel_lens, selected, sinks, torch.arange(budget))
    on = lambda t: t.to(DEVICE)
    kv, loc, ids, pos = steady_draft_inputs(on(table), on(rows), on(seq_lens), on(count), on(sel_lens),
                                            on(selected), on(last), sinks, budget)
    assert kv.dtype == table.dtype and kv.shape == (bs, budget + 1)
    assert torch.equal(kv.cpu(), want)
    assert loc.tolist() == want[:, -1].tolist() == [int(table[r, L]) for r, L in zip(rows.tolist(), lengths.tolist())]
    assert ids.tolist() == last.tolist() and pos.tolist() == lengths.tolist()
