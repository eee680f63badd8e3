"""Draft trees as tries: one node per distinct token prefix.

Candidate paths from different drafters (TokenSwift's head tree, n-gram continuations, an OWL
beam, a suffix match) often share prefixes. Merging them into a trie makes verification lossless
with one target draw per node (two nodes with the same prefix would share a context and must not
draw twice) and shrinks the verify batch.

Node 0 is the root: the last sampled token, whose KV is not cached yet. Nodes are stored in
creation order, so every parent precedes its children (the verify mask is lower-triangular).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from enum import IntFlag

import numpy as np
import torch


class Source(IntFlag):
    """Which drafter proposed a node (a node may come from several)."""

    NONE = 0
    HEADS = 1
    NGRAM = 2
    LSTM = 4
    SUFFIX = 8
    SPEC = 16  # OWL's [SPEC] leaves: never accepted, only read for their hidden state


class DraftTree:
    def __init__(self, root_token: int):
        self.tokens: list[int] = [int(root_token)]
        self.parents: list[int] = [-1]
        self.depths: list[int] = [0]
        # Source flags as plain ints (``== Source.X`` and ``& Source.X`` work): IntFlag arithmetic
        # costs microseconds per operation, and a trie takes a few hundred per step.
        self.sources: list[int] = [0]
        self.children: list[dict[int, int]] = [{}]
        self.num_walkable = 1  # nodes before the first leaf added with add_leaf

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def add_child(self, parent: int, token: int, source: Source = Source.NONE) -> int:
        """The node for ``token`` under ``parent``, created if new."""
        token = int(token)
        node = self.children[parent].get(token)
        if node is None:
            if self.num_walkable != len(self.tokens):
                raise ValueError("walkable nodes must be added before leaves")
            node = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(parent)
            self.depths.append(self.depths[parent] + 1)
            self.sources.append(int(source))
            self.children.append({})
            self.children[parent][token] = node
            self.num_walkable += 1
        else:
            self.sources[node] |= int(source)
        return node

    def add_leaf(self, parent: int, token: int, source: Source) -> int:
        """A node that is never merged with a sibling of the same token (e.g. a [SPEC] leaf).

        It is not registered as a child, so the verification walk can never move into it. Leaves
        come after every walkable node: nodes ``[0, num_walkable)`` are the ones a walk can visit.
        """
        node = len(self.tokens)
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.sources.append(int(source))
        self.children.append({})
        return node

    def add_path(self, tokens: Iterable[int], source: Source = Source.NONE, max_nodes: int | None = None) -> list[int]:
        """Insert a path below the root; returns its node ids (shorter if ``max_nodes`` is hit).

        Paths share long prefixes (a cartesian head tree, n-grams of one first token), so an
        existing prefix is followed through the child maps without :meth:`add_child`'s checks.
        """
        node, out = 0, []
        children, sources = self.children, self.sources
        source = int(source)
        for tok in tokens:
            tok = int(tok)
            nxt = children[node].get(tok)
            if nxt is None:
                if max_nodes is not None and len(self.tokens) >= max_nodes:
                    break
                nxt = self.add_child(node, tok, source)
            elif source and not sources[nxt] & source:
                sources[nxt] |= source
            node = nxt
            out.append(node)
        return out

    def child(self, node: int, token: int) -> int | None:
        return self.children[node].get(int(token))

    def path_tokens(self, node: int) -> list[int]:
        """Tokens from the root's first child down to ``node`` (the root itself excluded)."""
        out = []
        while node > 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        out.reverse()
        return out

    def path_nodes(self, node: int) -> list[int]:
        """Node ids from the root (included) down to ``node``."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        out.reverse()
        return out

    def ancestor_array(self, size: int | None = None) -> np.ndarray:
        """``mask[i, j]``: node j is an ancestor of node i or i itself, as a numpy array.

        ``size`` pads to a ``[size, size]`` block for engines that verify a fixed width.
        """
        n = len(self)
        size = n if size is None else size
        mask = np.zeros((size, size), dtype=np.bool_)
        for i, p in enumerate(self.parents):
            if p >= 0:
                mask[i] = mask[p]
            mask[i, i] = True
        return mask

    def ancestor_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``mask[i, j]``: node j is an ancestor of node i or i itself (tree attention)."""
        return torch.from_numpy(self.ancestor_array()).to(device)

    def positions(self, start: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Absolute position of every node: the root sits at ``start``."""
        return torch.tensor(self.depths, dtype=torch.long, device=device) + start

    def token_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.tensor(self.tokens, dtype=torch.long, device=device)


def cartesian_paths(candidates: Sequence[Sequence[int]], branching: Sequence[int]) -> list[tuple[int, ...]]:
    """TokenSwift's head tree: depth i takes the top ``branching[i]`` of row i, in every combination.

    A node's token depends only on its depth and sibling rank (Medusa-style), so the depth-2
    candidates reappear under every depth-1 node and so on.
    """
    per_depth = [list(c[:b]) for c, b in zip(candidates, branching)]
    if any(not c for c in per_depth):
        # A row whose filters left nothing: the tree stops above it.
        per_depth = per_depth[: next(i for i, c in enumerate(per_depth) if not c)]
    if not per_depth:
        return []
    return list(itertools.product(*per_depth))
