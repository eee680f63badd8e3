"""The batched tensor walk and the steady partial-KV slots agree with their host versions."""

import random

import numpy as np
import pytest
import torch

from sgl_longgen.config import PartialKVConfig
from sgl_longgen.core.partial_kv import PartialKVPolicy, steady_visible_slots
from sgl_longgen.core.tree import DraftTree, Source
from sgl_longgen.core.verify import walk_tree, walk_trees


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


@pytest.mark.parametrize("seed", range(5))
def test_tensor_walk_matches_the_host_walk(seed):
    rng = random.Random(seed)
    n, vocab, bs = 24, 5, 6  # a small vocabulary: draws often match a child, and padding's root token
    trees = [random_trie(rng, n, vocab) for _ in range(bs)]
    draws = torch.randint(0, vocab, (bs, n), generator=torch.Generator().manual_seed(seed))
    for b, tree in enumerate(trees):  # steer some draws down a path so walks go deep
        node = 0
        while tree.children[node] and rng.random() < 0.8:
            token, child = rng.choice(sorted(tree.children[node].items()))
            draws[b, node] = token
            node = child
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
