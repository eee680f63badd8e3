"""The verifier emits tokens with exactly the target distribution, for any draft tree.

A synthetic "model" gives each context its own random next-token distribution. For many trials
we run verification steps (random trees, built independently of the verifier's draws) from one
fixed context until two tokens are emitted, and compare the joint distribution of those two
tokens with the exact target ``p(y1|c) p(y2|c, y1)`` by a chi-square test.

The same harness shows the test has teeth: the upstream TokenSwift rule (an independent draw per
*path*, longest match wins) and a walk biased toward the draft in only 5% of steps both fail.
"""

from __future__ import annotations

import functools
import random

import numpy as np
import torch
from scipy.stats import chisquare

from sgl_longgen.config import SamplingConfig
from sgl_longgen.core.sampling import LogitsProcessor
from sgl_longgen.core.tree import DraftTree
from sgl_longgen.core.verify import verify_tree
from helpers import children, path_nodes

V = 5
CONTEXT = (3, 1)
TRIALS = 8_000


def target(context: tuple[int, ...]) -> np.ndarray:
    """A fixed random distribution per (last two tokens) context."""
    return _target(context[-2:])


@functools.lru_cache(maxsize=None)
def _target(key: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng([*key, 7])
    return rng.dirichlet(np.full(V, 0.8))


@functools.lru_cache(maxsize=None)
def _log_target(key: tuple[int, ...]) -> np.ndarray:
    return np.log(_target(key))


def random_tree(history: tuple[int, ...], rng: random.Random) -> DraftTree:
    """Up to 6 paths of depth <= 4; tokens are often the target's mode, so drafts do get accepted."""
    tree = DraftTree(history[-1])
    for _ in range(rng.randint(1, 6)):
        path, ctx = [], history
        for _ in range(rng.randint(1, 4)):
            tok = int(np.argmax(target(ctx))) if rng.random() < 0.6 else rng.randrange(V)
            path.append(tok)
            ctx = ctx + (tok,)
        tree.add_path(path)
    return tree


def node_logits(tree: DraftTree, history: tuple[int, ...]) -> torch.Tensor:
    rows = [_log_target((history + tuple(tree.path_tokens(i)))[-2:]) for i in range(len(tree))]
    return torch.tensor(np.stack(rows), dtype=torch.float64)


PROCESSOR = LogitsProcessor(SamplingConfig(temperature=1.0), V)


def walk_rule(tree, history, gen, rng) -> list[int]:
    return verify_tree(tree, node_logits(tree, history), PROCESSOR, history, gen).tokens


def biased_walk_rule(tree, history, gen, rng) -> list[int]:
    """In 5% of steps the root 'accepts' its first child without drawing. Must be caught."""
    logits = node_logits(tree, history)
    if children(tree, 0) and rng.random() < 0.05:
        first_child = next(iter(children(tree, 0).values()))
        return [tree.tokens[first_child]]
    return verify_tree(tree, logits, PROCESSOR, history, gen).tokens


def upstream_per_path_rule(tree, history, gen, rng) -> list[int]:
    """TokenSwift's released rule: each (path, position) draws its own sample; keep the longest
    match; break ties by taking the first or last tied path with probability 1/2 each."""
    leaves = [i for i in range(len(tree)) if not children(tree, i) and i > 0] or [0]
    paths = [tree.path_tokens(i) for i in leaves]
    best, results = -1, []
    for path in paths:
        drawn = []
        for j in range(len(path) + 1):
            p = target(history + tuple(path[:j]))
            drawn.append(int(torch.multinomial(torch.tensor(p), 1, generator=gen)))
        a = 0
        while a < len(path) and path[a] == drawn[a]:
            a += 1
        results.append((a, path[:a] + [drawn[a]]))
        best = max(best, a)
    tied = [r for a, r in results if a == best]
    return tied[0] if rng.random() < 0.5 else tied[-1]


def joint_counts(rule, seed: int) -> np.ndarray:
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    counts = np.zeros((V, V))
    for _ in range(TRIALS):
        history, out = CONTEXT, []
        while len(out) < 2:
            tree = random_tree(history, rng)
            new = rule(tree, history, gen, rng)
            out += new
            history = history + tuple(new)
        counts[out[0], out[1]] += 1
    return counts


def exact_joint() -> np.ndarray:
    p1 = target(CONTEXT)
    return np.stack([p1[a] * target(CONTEXT + (a,)) for a in range(V)])


def chi2_pvalue(counts: np.ndarray) -> float:
    expected = exact_joint().ravel() * counts.sum()
    return float(chisquare(counts.ravel(), expected).pvalue)


def test_per_node_walk_preserves_the_target_distribution():
    assert chi2_pvalue(joint_counts(walk_rule, seed=11)) > 1e-3


def test_upstream_per_path_sampling_is_biased():
    assert chi2_pvalue(joint_counts(upstream_per_path_rule, seed=12)) < 1e-6


def test_the_sample_size_catches_a_5_percent_bias():
    assert chi2_pvalue(joint_counts(biased_walk_rule, seed=13)) < 1e-6


def test_greedy_walk_follows_the_argmax_chain():
    history = CONTEXT
    tree = DraftTree(history[-1])
    chain, ctx = [], history
    for _ in range(3):
        chain.append(int(np.argmax(target(ctx))))
        ctx = ctx + (chain[-1],)
    tree.add_path(chain)
    tree.add_path([(chain[0] + 1) % V, 0])
    greedy = LogitsProcessor(SamplingConfig(temperature=0.0), V)
    verdict = verify_tree(tree, node_logits(tree, history), greedy, history)
    assert verdict.tokens == chain + [int(np.argmax(target(ctx)))]
    assert verdict.accepted == 3
    assert verdict.nodes == path_nodes(tree, tree.child(tree.child(tree.child(0, chain[0]), chain[1]), chain[2]))

