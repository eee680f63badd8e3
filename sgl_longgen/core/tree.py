"""Draft trees as tries: one node per distinct token prefix.

Candidate paths from different drafters (TokenSwift's head tree, n-gram continuations, an OWL
beam, a suffix match) often share prefixes. Merging them into a trie makes verification lossless
with one target draw per node (two nodes with the same prefix would share a context and must not
draw twice) and shrinks the verify batch.

Node 0 is the root: the last sampled token, whose KV is not cached yet. Nodes are stored in
creation order, so every parent precedes its children (the verify mask is lower-triangular).
"""

from __future__ import annotations

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
    LONGSPEC = 32  # LongSpec's cross-attention drafter


class DraftTree:
    def __init__(self, root_token: int):
        self.tokens: list[int] = [int(root_token)]
        self.parents: list[int] = [-1]
        self.depths: list[int] = [0]
        # Source flags as plain ints (``== Source.X`` and ``& Source.X`` work): IntFlag arithmetic
        # costs microseconds per operation, and a trie takes a few hundred per step.
        self.sources: list[int] = [0]
        # (parent, token) -> child: one map for the whole trie, so a level of new nodes goes in
        # with one update instead of one dictionary per node.
        self._child: dict[tuple[int, int], int] = {}
        self._parented: set[int] = set()  # nodes with at least one child
        self.num_walkable = 1  # nodes before the first leaf added with add_leaf

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def add_child(self, parent: int, token: int, source: Source = Source.NONE) -> int:
        """The node for ``token`` under ``parent``, created if new."""
        token = int(token)
        node = self._child.get((parent, token))
        if node is None:
            return self._new_node(parent, token, int(source))
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
        return node

    def add_leaves(self, parents: Iterable[int], token: int, source: Source) -> list[int]:
        """One leaf (:meth:`add_leaf`) of ``token`` under each of ``parents``, in one go."""
        parents = list(parents)
        start, depths = len(self.tokens), self.depths
        self.tokens.extend([int(token)] * len(parents))
        self.parents.extend(parents)
        depths.extend([depths[p] + 1 for p in parents])
        self.sources.extend([int(source)] * len(parents))
        return list(range(start, start + len(parents)))

    def add_path(self, tokens: Iterable[int], source: Source = Source.NONE, max_nodes: int | None = None,
                 below: int = 0) -> list[int]:
        """Insert a path below node ``below`` (the root by default); returns its node ids
        (shorter if ``max_nodes`` is hit).

        Paths share long prefixes (a cartesian head tree, n-grams of one first token), so an
        existing prefix is followed through the child map without :meth:`add_child`'s checks.
        """
        node, out = below, []
        child, sources = self._child, self.sources
        source = int(source)
        for tok in tokens:
            tok = int(tok)
            nxt = child.get((node, tok))
            if nxt is None:
                if max_nodes is not None and len(self.tokens) >= max_nodes:
                    break
                nxt = self._new_node(node, tok, source)
            elif source and not sources[nxt] & source:
                sources[nxt] |= source
            node = nxt
            out.append(node)
        return out

    def add_cartesian(self, rows: Sequence[Sequence[int]], source: Source = Source.NONE,
                      max_nodes: int | None = None) -> None:
        """Every combination of one token per row below the root (row i at depth i + 1).

        Built level by level, so ``max_nodes`` leaves out the deepest level's last nodes first:
        the ones least likely to be accepted. A row that is empty ends the tree above it.
        """
        frontier = [0]
        tokens, child, sources = self.tokens, self._child, self.sources
        source = int(source)
        for row in rows:
            row = [int(t) for t in row]
            if not row:
                return
            k, start = len(row), len(tokens)
            count = k * len(frontier)
            if (len(set(row)) == k and self.num_walkable == start and self._parented.isdisjoint(frontier)
                    and (max_nodes is None or start + count <= max_nodes)):
                # A whole level of new nodes: a few list operations instead of one insertion
                # per node (``frontier`` is ascending, so sorting repeats each parent k times).
                parents = sorted(frontier * k) if k > 1 else list(frontier)
                level = row * len(frontier)
                tokens.extend(level)
                self.parents.extend(parents)
                self.depths.extend([self.depths[frontier[0]] + 1] * count)
                sources.extend([source] * count)
                child.update(zip(zip(parents, level), range(start, start + count)))
                self._parented.update(frontier)
                self.num_walkable += count
                frontier = list(range(start, start + count))
                continue
            nxt_frontier = []
            for parent in frontier:
                for tok in row:
                    node = child.get((parent, tok))
                    if node is None:
                        if max_nodes is not None and len(tokens) >= max_nodes:
                            return
                        node = self._new_node(parent, tok, source)
                    elif source:
                        sources[node] |= source
                    nxt_frontier.append(node)
            frontier = nxt_frontier

    def _new_node(self, parent: int, token: int, source: int) -> int:
        if self.num_walkable != len(self.tokens):
            raise ValueError("walkable nodes must be added before leaves")
        node = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.sources.append(source)
        self._child[(parent, token)] = node
        self._parented.add(parent)
        self.num_walkable += 1
        return node

    def child(self, node: int, token: int) -> int | None:
        """The child of ``node`` holding ``token`` (never a leaf), if any."""
        return self._child.get((node, int(token)))

    def path_tokens(self, node: int) -> list[int]:
        """Tokens from the root's first child down to ``node`` (the root itself excluded)."""
        out = []
        while node > 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        out.reverse()
        return out

    def ancestor_bits(self) -> list[int]:
        """Node i's ancestors and itself as the set bits of one int (bit j: node j).

        A trie's rows share their ancestors' rows: one int operation per node, where a boolean
        row per node would cost a numpy call each.
        """
        bits: list[int] = []
        for i, p in enumerate(self.parents):
            bits.append((bits[p] if p >= 0 else 0) | (1 << i))
        return bits

    def ancestor_array(self, size: int | None = None) -> np.ndarray:
        """``mask[i, j]``: node j is an ancestor of node i or i itself, as a numpy array.

        ``size`` pads to a ``[size, size]`` block for engines that verify a fixed width.
        """
        size = len(self) if size is None else size
        return bits_to_rows(self.ancestor_bits(), size)

    def ancestor_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``mask[i, j]``: node j is an ancestor of node i or i itself (tree attention)."""
        return torch.from_numpy(self.ancestor_array()).to(device)

    def positions(self, start: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Absolute position of every node: the root sits at ``start``."""
        return torch.tensor(self.depths, dtype=torch.long, device=device) + start

    def token_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.tensor(self.tokens, dtype=torch.long, device=device)


def add_beam(tree: DraftTree, tokens: Sequence[int], parents: Sequence[int], source: Source,
             max_nodes: int | None = None, row: int = 0) -> DraftTree:
    """A beam's nodes (``parents[i]``: an earlier node's index, or -1 for the root's children)
    into ``tree``, stopping new nodes at ``max_nodes`` (a cut node's descendants go with it).

    Into a root-only tree, a beam without two siblings of one token (the drafters' beams: each
    level's picks are distinct (parent, token) pairs) goes in with a few list operations: beam
    node i becomes node i + 1 and the cut keeps the first ``max_nodes - 1``, exactly what the
    node-by-node insertion (:func:`add_beam_nodes`) builds; any other beam takes that insertion.
    """
    if len(tree) == 1 and tree.num_walkable == 1:
        late = next((i for i, p in enumerate(parents) if p >= i), None)
        if late is not None:
            raise ValueError(f"draft node {late} of request {row} comes before its parent {parents[late]}")
        n = len(tokens) if max_nodes is None else max(0, min(len(tokens), max_nodes - 1))
        kept = [int(t) for t in tokens[:n]]
        nodes = [0 if p < 0 else p + 1 for p in parents[:n]]
        child = dict(zip(zip(nodes, kept), range(1, n + 1)))
        if len(child) == n:
            depths = tree.depths
            for q in nodes:
                depths.append(depths[q] + 1)
            tree.tokens.extend(kept)
            tree.parents.extend(nodes)
            tree.sources.extend([int(source)] * n)
            tree._child.update(child)
            tree._parented.update(nodes)
            tree.num_walkable += n
            return tree
    return add_beam_nodes(tree, tokens, parents, source, max_nodes, row)


def add_beam_nodes(tree: DraftTree, tokens: Sequence[int], parents: Sequence[int], source: Source,
                   max_nodes: int | None = None, row: int = 0) -> DraftTree:
    """:func:`add_beam` one node at a time: siblings of one token merge, a node under a cut or
    merged-away parent is dropped, existing nodes of ``tree`` are reused."""
    ids: list[int | None] = []
    for tok, par in zip(tokens, parents):
        if par >= len(ids):
            raise ValueError(f"draft node {len(ids)} of request {row} comes before its parent {par}")
        parent = 0 if par < 0 else ids[par]
        if parent is None or (max_nodes is not None and len(tree) >= max_nodes and tree.child(parent, tok) is None):
            ids.append(None)
            continue
        ids.append(tree.add_child(parent, tok, source))
    return tree


def bits_to_rows(bits: Sequence[int], size: int, out: np.ndarray | None = None) -> np.ndarray:
    """``out[i, j]`` = bit j of ``bits[i]``, ``[size, size]`` booleans (rows past ``bits``: False)."""
    if out is None:
        out = np.empty((size, size), dtype=np.bool_)
    n, width = len(bits), (size + 7) // 8
    if size <= 64:
        packed = np.array(bits, dtype=np.uint64).view(np.uint8)
        width = 8
    else:
        packed = np.frombuffer(b"".join(b.to_bytes(width, "little") for b in bits), dtype=np.uint8)
    out[:n] = np.unpackbits(packed.reshape(n, width), axis=1, count=size, bitorder="little").view(np.bool_)
    out[n:] = False
    return out


def cartesian_rows(candidates: Sequence[Sequence[int]], branching: Sequence[int]) -> list[list[int]]:
    """TokenSwift's head tree as rows for :meth:`DraftTree.add_cartesian`: the top ``branching[i]``
    of candidate row i.

    A node's token depends only on its depth and sibling rank (Medusa-style), so the depth-2
    candidates reappear under every depth-1 node and so on.
    """
    return [list(c[:b]) for c, b in zip(candidates, branching)]
