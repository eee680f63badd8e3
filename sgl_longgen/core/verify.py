"""Lossless verification of drafts.

Every method's drafts (top-k heads, n-grams, suffix matches, OWL's beam) are deterministic given
the step, and :func:`walk_tree` verifies them exactly: starting at the root, draw *one* token
from the current node's processed target distribution; if a child holds that token move there,
otherwise emit it as the bonus and stop. Every emitted token is an honest draw from the target
conditional on what was emitted before, whatever the tree held. (Drawing once per *path* and
keeping the longest match, as upstream TokenSwift does, gives the draft many chances per node and
is biased toward it.) Both runtimes draw at every node at once (:func:`draw_tree`) and then
walk: the draws are independent, and the walk reads only those on its path, each drawn from its
node's distribution, so the result is the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .penalty import tree_window_mask
from .sampling import LogitsProcessor
from .tree import DraftTree


@dataclass
class Verdict:
    """What one verification step commits."""

    tokens: list[int]  # accepted draft tokens, then the bonus token
    nodes: list[int]  # the root and the accepted draft nodes: their KV is kept

    @property
    def accepted(self) -> int:
        """Accepted draft tokens (the bonus excluded)."""
        return len(self.nodes) - 1


def walk_tree(tree: DraftTree, draw: Callable[[int], int]) -> Verdict:
    """The per-node walk. ``draw(node)`` returns one token from that node's target distribution.

    ``draw`` is called at most once per node and only on the walked path (a lookup into
    :func:`draw_tree`'s draws, or a lazy draw).
    """
    node, nodes, tokens = 0, [0], []
    while True:
        tok = int(draw(node))
        tokens.append(tok)
        nxt = tree.child(node, tok)
        if nxt is None:
            return Verdict(tokens, nodes)
        nodes.append(nxt)
        node = nxt


@dataclass
class TreeWalks:
    """:func:`walk_tree` of a batch of padded tries, as tensors (see :func:`walk_trees`)."""

    count: torch.Tensor  # [bs] committed tokens: the root's and accepted nodes' draws
    last: torch.Tensor  # [bs] the bonus token (the next root)
    order: torch.Tensor  # [bs, N] accepted nodes by depth, then the others ascending


def walk_trees(draws: torch.Tensor, parents: torch.Tensor, walk_tokens: torch.Tensor,
               ancestors: torch.Tensor) -> TreeWalks:
    """The per-node walk of every request at once, on the tensors' device, without a host sync.

    ``draws[b, i]``: the token drawn at node i; ``parents[b, i]``: node i's parent (any valid
    index for the root); ``walk_tokens[b, i]``: node i's token where a walk may enter it, else
    -1 (the root, padding, leaves); ``ancestors[b, i, j]``: j is an ancestor of i or i itself.
    A node is on the walked path iff every node on its root path holds the token drawn at its
    parent: the same path :func:`walk_tree` finds (children of a trie node hold distinct
    tokens, so one node per depth qualifies). An engine can commit the path and start the next
    draft from these before the host has read a single draw.
    """
    n = draws.shape[1]
    entered = draws.gather(1, parents.clamp(min=0)) == walk_tokens
    entered[:, 0] = True
    on_path = ~(ancestors & ~entered[:, None, :]).any(dim=-1)
    index = torch.arange(n, device=draws.device)
    key = torch.where(on_path, index, index + n)  # path nodes first: parents precede children
    order = key.argsort(dim=1)
    count = on_path.sum(dim=1)
    deepest = order.gather(1, (count - 1)[:, None])
    last = draws.gather(1, deepest).squeeze(1)
    return TreeWalks(count, last, order)


def draw_tree(
    rows: torch.Tensor,
    tree: DraftTree,
    processor: LogitsProcessor,
    history: Sequence[int],
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token per walkable node, each from that node's exact target distribution: ``[W]``.

    ``rows``: the target's logits after each walkable node (``[W, V]``, ``W = tree.num_walkable``;
    leaves are never drawn from). ``history`` is the committed context *including the root
    token*; each node's penalty window extends it with the node's own path, exactly as plain
    decoding would see it. Both runtimes verify through this and :func:`walk_tree`.
    """
    mask = None
    if processor.params.penalty_active:
        paths = [tree.path_tokens(i) for i in range(rows.shape[0])]
        mask = tree_window_mask(history, paths, processor.params.penalty_window, processor.vocab_size, rows.device)
    return processor.sample(rows, mask, generator)


def verify_tree(
    tree: DraftTree,
    logits: torch.Tensor,
    processor: LogitsProcessor,
    history: Sequence[int],
    generator: torch.Generator | None = None,
) -> Verdict:
    """Draw at every node of ``tree`` (``logits``: ``[len(tree), V]``, row i = after node i) and walk."""
    draws = draw_tree(logits[: tree.num_walkable], tree, processor, history, generator).tolist()
    return walk_tree(tree, draws.__getitem__)
