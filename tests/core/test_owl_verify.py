"""OWL trees with [SPEC] leaves keep the verifier exact.

The chi-square harness of ``test_verify_distribution.py`` (a synthetic target with its own random
distribution per context; the joint law of the first two emitted tokens against the exact one)
run on trees the OWL drafter proposes, batched, with one [SPEC] leaf after every node. The rows of
the [SPEC] leaves carry a strongly biased distribution, so a verifier that ever drew from a leaf
would be caught; the [SPEC] id is either outside the vocabulary (the reference runtime's choice)
or a real token the target can sample (an engine reusing a reserved vocabulary id). The same
harness shows that registering the leaves as ordinary children, so the walk can enter them, is
biased.
"""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from sgl_longgen.config import SamplingConfig
from sgl_longgen.core.owl import OwlDrafter, attach_spec_leaves, beam_trees, expand
from sgl_longgen.core.sampling import LogitsProcessor
from sgl_longgen.core.tree import DraftTree, Source
from sgl_longgen.core.verify import verify_tree

torch.set_num_threads(1)

V = 5
CONTEXT = (3, 1)
TRIALS = 6_000
SPEC_ROW = np.log(np.array([0.96, 0.01, 0.01, 0.01, 0.01]))  # what a [SPEC] row "predicts"


@functools.lru_cache(maxsize=None)
def _target(key: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng([*key, 7])
    return rng.dirichlet(np.full(V, 0.8))


def target(context: tuple[int, ...]) -> np.ndarray:
    return _target(context[-2:])


class TreeSupply:
    """OWL trees, drafted in large batches (the batched API) and handed out per root token."""

    def __init__(self, seed: int, per_root: int = 2_000):
        gen = torch.Generator().manual_seed(seed)
        d = OwlDrafter(8, V, 8, n_steps=3, spec=True).double()
        d.reset_parameters(gen)
        roots = torch.arange(V).repeat_interleave(per_root)
        B = roots.numel()
        h = torch.randn(B, 8, generator=gen, dtype=torch.float64) * 3
        hs = torch.randn(B, 8, generator=gen, dtype=torch.float64)
        has = torch.rand(B, generator=gen) < 0.5
        self.trees: dict[int, list[DraftTree]] = {r: [] for r in range(V)}
        sizes = (2, 5, 9)
        for i, n in enumerate(sizes):  # a few tree sizes, each one batched call
            part = slice(i * B // len(sizes), (i + 1) * B // len(sizes))
            beam = expand(d, h[part], roots[part], hs[part], has[part], top_k=3, depth=3, tree_size=n)
            for tree in beam_trees(beam, roots[part]):
                self.trees[tree.tokens[0]].append(tree)
        for r in range(V):
            random.Random(seed + r).shuffle(self.trees[r])
        self.used = {r: 0 for r in range(V)}

    def take(self, root: int) -> DraftTree:
        tree = self.trees[root][self.used[root] % len(self.trees[root])]
        self.used[root] += 1
        copy = DraftTree(root)
        for node in range(1, len(tree)):
            copy.add_child(tree.parents[node], tree.tokens[node], tree.sources[node])
        return copy


def with_spec(tree: DraftTree, spec_token: int, as_children: bool) -> list[int]:
    if not as_children:
        return attach_spec_leaves(tree, spec_token)
    # The bug this guards against: [SPEC] nodes registered as children (where no real child has that token).
    n = len(tree)
    return [tree.add_child(node, spec_token, Source.SPEC) for node in range(n)]


def node_logits(tree: DraftTree, history: tuple[int, ...]) -> torch.Tensor:
    rows = []
    for i in range(len(tree)):
        if tree.sources[i] & Source.SPEC:
            rows.append(SPEC_ROW)
        else:
            rows.append(np.log(target(history + tuple(tree.path_tokens(i)))))
    return torch.tensor(np.stack(rows), dtype=torch.float64)


PROCESSOR = LogitsProcessor(SamplingConfig(temperature=1.0), V)


def joint_counts(seed: int, spec_token: int, as_children: bool = False) -> tuple[np.ndarray, int]:
    gen = torch.Generator().manual_seed(seed)
    supply = TreeSupply(seed)
    counts = np.zeros((V, V))
    accepted = 0
    for _ in range(TRIALS):
        history, out = CONTEXT, []
        while len(out) < 2:
            tree = supply.take(history[-1])
            with_spec(tree, spec_token, as_children)
            verdict = verify_tree(tree, node_logits(tree, history), PROCESSOR, history, gen)
            accepted += verdict.accepted
            out += verdict.tokens
            history = history + tuple(verdict.tokens)
        counts[out[0], out[1]] += 1
    return counts, accepted


def chi2_pvalue(counts: np.ndarray) -> float:
    p1 = target(CONTEXT)
    exact = np.stack([p1[a] * target(CONTEXT + (a,)) for a in range(V)])
    return float(chisquare(counts.ravel(), exact.ravel() * counts.sum()).pvalue)


@pytest.mark.parametrize("spec_token", [V, 0], ids=["spec-outside-vocab", "spec-collides-with-token-0"])
def test_owl_trees_with_spec_leaves_preserve_the_target_distribution(spec_token):
    counts, accepted = joint_counts(seed=31 + spec_token, spec_token=spec_token)
    assert accepted > TRIALS // 2  # drafts were accepted often enough to matter
    assert chi2_pvalue(counts) > 1e-3


def test_spec_nodes_registered_as_children_are_caught():
    # The [SPEC] id is the target's likeliest first token, so walks often enter a [SPEC] node.
    counts, _ = joint_counts(seed=41, spec_token=int(np.argmax(target(CONTEXT))), as_children=True)
    assert chi2_pvalue(counts) < 1e-6


def test_greedy_walk_never_enters_a_spec_leaf():
    """Greedy: the emitted chain is the argmax chain even when the [SPEC] id is that argmax."""
    greedy = LogitsProcessor(SamplingConfig(temperature=0.0), V)
    history = CONTEXT
    chain, ctx = [], history
    for _ in range(3):
        chain.append(int(np.argmax(target(ctx))))
        ctx = ctx + (chain[-1],)
    tree = DraftTree(history[-1])
    tree.add_path(chain[:2], Source.LSTM)  # the third argmax token is left out of the tree
    leaves = attach_spec_leaves(tree, chain[2])
    verdict = verify_tree(tree, node_logits(tree, history), greedy, history)
    assert verdict.tokens == chain  # the third token is the bonus, drawn at the real node
    assert verdict.nodes == [0, 1, 2] and not set(verdict.nodes) & set(leaves)
