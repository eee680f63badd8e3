"""SUFFIX's drafts: a tree of the continuations the history gave its matches of the context.

SuffixDecoding's tree mode, over the occurrence index of :mod:`sgl_longgen.core.suffix` (no
suffix tree is built): for a match of the context's last p tokens, the occurrences of that
pattern are the root's evidence, and each token that followed some of them is a child whose
estimated probability is the share of the parent's occurrences it followed (``count(child) /
count(parent)``, times the parent's). The tree grows best first: the likeliest node not yet in
it joins next, until it holds the match's budget of nodes, ``min(max_spec_tokens, floor(factor *
p + offset))`` (a loop's: ``max_spec_tokens``, as for chains), or no candidate is at least
``min_token_prob`` likely. Its score, the sum of its nodes' probabilities, estimates how many
draft tokens the per-node walk will accept (a node is accepted when its whole path is). Over
the match lengths the highest score wins, ties going to the longer match, as for chains.

Nodes come in the order they joined, each after its parent, so the first ``k`` nodes are the
best tree of ``k`` nodes: one expansion serves every budget at most its own, and an engine's cut
of the trie to its first nodes (adaptive verify widths, ``max_nodes``) keeps the likeliest ones.
A request's own index reads its draft as history, as the chain walk does: an occurrence that
reaches the history's end goes on with the node's own path.

Costs: a node's children group the next tokens of its occurrences (at most ``max_occurrences``
of them: the match's occurrences are the latest that many of the context's last token) and a
candidate enters a heap; a node gets at most as many children as the tree has room left. A
query is ``O(budget * K log K)`` for K occurrences at worst, whatever the history's length; one
expansion per distinct occurrence set (:meth:`~sgl_longgen.core.suffix.SuffixIndex.match_groups`),
skipping the sets whose bound cannot beat the best tree found.

Lossless whatever it proposes: the tree only decides which tokens the verifier may accept.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np

from ..config import SuffixConfig
from .suffix import SuffixIndex, continuations
from .tree import DraftTree, Source


@dataclass
class SuffixTree:
    """A draft tree in the order its nodes joined: node i holds ``tokens[i]`` below node
    ``parents[i]`` (-1: the root), with estimated probability ``probs[i]``; ``score = sum(probs)``."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def cut(self, nodes: int) -> SuffixTree:
        """Its first ``nodes`` nodes (a tree: parents come first), the best tree of that size."""
        probs = self.probs[:nodes]
        return SuffixTree(self.tokens[:nodes], self.parents[:nodes], probs, sum(probs), self.match_len)

    @property
    def depth(self) -> int:
        depths: list[int] = []
        for p in self.parents:
            depths.append(1 if p < 0 else depths[p] + 1)
        return max(depths, default=0)

    def draft_tree(self, root: int, max_nodes: int | None = None) -> DraftTree:
        """The trie below ``root`` (node i is trie node i + 1), cut to ``max_nodes`` nodes, the root included."""
        tree = DraftTree(root)
        n = len(self.tokens) if max_nodes is None else max(0, min(len(self.tokens), max_nodes - 1))
        for tok, parent in zip(self.tokens[:n], self.parents[:n]):
            tree.add_child(parent + 1, tok, Source.SUFFIX)
        return tree


def _children(pos: np.ndarray, nxt: np.ndarray, room: int) -> list[tuple[int, int, int, np.ndarray]]:
    """The tokens that followed: ``(token, count, latest position, the positions after it)``,
    the ``room`` most frequent (ties: the latest seen first)."""
    if nxt.size == 0:
        return []
    first = nxt[0]
    if (nxt == first).all():
        return [(int(first), nxt.size, int(pos[-1]), pos + 1)]
    order = np.argsort(nxt, kind="stable")  # positions stay ascending within a token
    ranked = nxt[order]
    starts = np.concatenate([[0], np.flatnonzero(ranked[1:] != ranked[:-1]) + 1])
    stops = np.append(starts[1:], ranked.size)
    counts = stops - starts
    latest = pos[order[stops - 1]]
    best = np.lexsort((-latest, -counts))[:room]
    return [(int(ranked[starts[g]]), int(counts[g]), int(latest[g]), pos[order[starts[g]:stops[g]]] + 1)
            for g in best.tolist()]


def expand(index: SuffixIndex, ends: np.ndarray, budget: int, min_token_prob: float, own: bool = False) -> SuffixTree:
    """The best-first tree of at most ``budget`` nodes from the pattern ending at ``ends``
    (ascending; ``own``: the pattern ends the index's sequence, whose draft this continues)."""
    seq = index.sequence
    tree = SuffixTree()
    paths: list[list[int]] = []  # each node's tokens from the root's child down (own walks read them)
    heap: list[tuple[float, int, int]] = []  # (-prob, -latest position, candidate id)
    candidates: list[tuple[int, int, float, np.ndarray]] = []  # (parent, token, prob, positions after it)

    def offer(parent: int, pos: np.ndarray, prob: float) -> None:
        room = budget - len(tree.tokens)
        total = pos.size  # the node's occurrences, also those with no next token (they end the history)
        pos, nxt = continuations(seq, pos, paths[parent] if parent >= 0 else [], own)
        for tok, count, latest, after in _children(pos, nxt, room):
            p = prob * count / total
            if p < min_token_prob:
                break  # the rest are rarer still
            heapq.heappush(heap, (-p, -latest, len(candidates)))
            candidates.append((parent, tok, p, after))

    offer(-1, ends, 1.0)
    while heap and len(tree.tokens) < budget:
        _, _, c = heapq.heappop(heap)
        parent, tok, prob, after = candidates[c]
        node = len(tree.tokens)
        tree.tokens.append(tok)
        tree.parents.append(parent)
        tree.probs.append(prob)
        paths.append((paths[parent] if parent >= 0 else []) + [tok])
        if len(tree.tokens) < budget:
            offer(node, after, prob)
    tree.score = sum(tree.probs)
    return tree


def tree_draft(index: SuffixIndex, context: Sequence[int], config: SuffixConfig, max_spec_tokens: int | None = None,
               own: bool = False) -> SuffixTree:
    """The best tree continuing ``context`` (its last ``max_depth - 1`` tokens are matched) with
    ``config``'s settings; ``max_spec_tokens``: a tighter cap on its nodes (the verify width
    less the root). ``own``: ``context`` is the index's own sequence (a request's history)."""
    c = config
    limit = c.max_spec_tokens if max_spec_tokens is None else min(max_spec_tokens, c.max_spec_tokens)
    best = SuffixTree()
    if limit <= 0:
        return best
    for group in index.match_groups(context[-c.max_depth:], limit, c.max_spec_factor, c.max_spec_offset, own,
                                    c.loop_min_tokens):
        if group.bound < best.score or (group.bound == best.score and group.longest < best.match_len):
            break
        grown = expand(index, group.ends, group.top, c.min_token_prob, group.own)
        scores = list(accumulate(grown.probs))
        for p, budget in group.members:
            nodes = min(budget, len(grown))
            score = scores[nodes - 1] if nodes else 0.0
            if score > best.score or (score == best.score and p > best.match_len):
                best = grown.cut(nodes)
                best.match_len = p
    return best
