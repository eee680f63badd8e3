"""Structured output (SGLang's grammar backends) along a draft tree.

Under a grammar, plain decoding samples each token from the model's distribution with every token
the grammar forbids at that point masked out. A draft node's target distribution is therefore the
model's row at that node masked by the grammar's state *after the node's path*: the committed
tokens (which SGLang's scheduler has already fed to the grammar) followed by the draft tokens from
the root down to the node. :func:`tree_masks` walks the tree depth first, feeding each draft token
to the request's own grammar object and rolling it back on the way up, and fills one packed mask
per node, exactly as SGLang's EAGLE verify does over its draft trees.

Why this is lossless: every node is drawn from the distribution plain decoding would draw from at
that position, so the walk commits exactly what plain decoding would. A child whose token the
grammar forbids at its parent is never entered (its row keeps the all-allowed mask): the parent's
draw can never produce that token, so no walk reaches it. A node at which the grammar has ended
keeps the all-allowed mask too, as plain decoding's mask does for a terminated grammar (SGLang's
``update_regex_vocab_mask`` skips those rows; the request ends there on its stop token).

The grammar object is left as it was found: each accepted draft token is rolled back.
"""

from __future__ import annotations

import torch

from ..core.tree import DraftTree


def active_grammar(req):
    """The request's grammar while it still constrains tokens (None: no grammar, or it has ended)."""
    grammar = getattr(req, "grammar", None)
    if grammar is None or grammar.finished or grammar.is_terminated():
        return None
    return grammar


def _allowed(row: torch.Tensor, token: int) -> bool:
    """Whether a mask row allows ``token``: SGLang's backends use packed 32-bit words whose bits
    are set where allowed (xgrammar, llguidance) or one bool a token set where forbidden (outlines)."""
    if row.dtype == torch.bool:
        return not bool(row[token])
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def _tokens_in(masks: torch.Tensor) -> int:
    """How many token ids a mask row covers (ids past it are never allowed)."""
    return masks.shape[1] if masks.dtype == torch.bool else masks.shape[1] * 32


def tree_masks(grammar, tree: DraftTree, vocab_size: int) -> torch.Tensor:
    """The grammar's masks of the tree's walkable nodes, in its backend's format, on the host
    (``[num_walkable, ...]``): row ``i`` is its mask after node ``i``'s path."""
    walkable = tree.num_walkable
    masks = grammar.allocate_vocab_mask(vocab_size=vocab_size, batch_size=walkable, device="cpu")
    children: list[list[int]] = [[] for _ in range(walkable)]
    for node in range(1, walkable):
        children[tree.parents[node]].append(node)
    limit = min(vocab_size, _tokens_in(masks))

    def visit(node: int) -> None:
        if grammar.is_terminated():
            return  # all allowed, as plain decoding's mask for an ended grammar
        grammar.fill_vocab_mask(masks, node)
        row = masks[node]
        for child in children[node]:
            token = tree.tokens[child]
            if not (0 <= token < limit and _allowed(row, token)):
                continue  # the parent's draw can never produce it: no walk enters this subtree
            grammar.accept_token(token)
            try:
                visit(child)
            finally:
                grammar.rollback(1)

    visit(0)
    return masks


def apply_masks(grammar, rows: torch.Tensor, masks: torch.Tensor) -> None:
    """Forbidden tokens of each row to -inf, in place (``rows``: ``[k, V]`` logits, ``masks``: the
    first ``k`` rows of :func:`tree_masks`)."""
    grammar.apply_vocab_mask(rows, grammar.move_vocab_mask(masks[: rows.shape[0]], rows.device))
