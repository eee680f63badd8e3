"""TokenSwift's draft trie: the heads' top candidates in the Medusa shape, plus n-gram continuations.

The device part (:func:`head_candidates`) is fixed-shape and never syncs, so an engine can run it
inside the draft forward's CUDA graph. It hands the host a short list of raw candidates per head
(:func:`candidate_count`: a few more than the tree's widest level), and the host part
(:func:`rank_candidates`) applies the request's contextual penalty and filters to those few
before :func:`draft_trie` builds the trie. Ranking a short list instead of the whole vocabulary
only changes which tokens get verified, never the output: verification draws every committed
token from the target distribution whatever the trie holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence

import torch

from ..config import SamplingConfig
from .ngram import NgramPool
from .tree import DraftTree, Source, cartesian_rows


def candidate_count(tree: Sequence[int], vocab_size: int) -> int:
    """Raw candidates kept per head: room for the penalty to demote a few of the widest level's."""
    return min(vocab_size, max(16, 4 * max(tree)))


def head_candidates(
    heads,
    h0: torch.Tensor,
    normed: torch.Tensor,
    lm_head_weight: torch.Tensor,
    num_heads: int,
    vocab_size: int,
    k: int,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` raw logits and token ids of the base head and each extra head: ``[bs, 1 + H, k]``.

    ``h0``: ``[bs, d]`` pre-final-norm states of the root tokens; ``normed``: the final norm's
    output for them (what the LM head reads). All ``1 + H`` rows share one GEMM with the LM head
    weight: one read of a 128K-row head instead of two. ``gather``: where ``lm_head_weight`` is
    this rank's shard of a vocabulary-parallel head, joins the shards' logits along the last
    dimension (in rank order), so every rank ranks the whole vocabulary alike.
    """
    states = torch.stack([normed, *heads(h0)[:num_heads]], dim=-2)  # [bs, 1 + H, d]
    logits = torch.matmul(states.to(lm_head_weight.dtype), lm_head_weight.t())
    if gather is not None:
        logits = gather(logits.contiguous())
    logits = logits[..., :vocab_size]
    values, ids = logits.topk(k, dim=-1)  # in the head's dtype: widening first would copy every row
    return values.float(), ids


def rank_candidates(
    values: torch.Tensor | Sequence[Sequence[float]],
    ids: torch.Tensor | Sequence[Sequence[float]],
    params: SamplingConfig,
    window: Collection[int] | None,
    width: int,
) -> list[list[int]]:
    """Up to ``width`` proposals per row from raw ``(values, ids)`` (``[rows, k]``, best first as
    :func:`head_candidates` gives them; host tensors or nested lists, ids may be floats).

    The contextual penalty re-ranks them (``window``: the penalized tokens; :func:`.penalty.apply_penalty`'s
    rule); top-k and min-p drop what the verifier could never accept. Top-p needs the whole
    distribution's mass and is left to the verifier. A few dozen numbers per step: plain Python
    lists, which cost less than one small tensor op each.
    """
    if isinstance(values, torch.Tensor):
        values, ids = values.tolist(), ids.tolist()
    penalize = bool(window) and params.penalty_active
    theta = params.penalty
    limit = width if params.greedy or params.top_k <= 0 else min(width, params.top_k)
    min_logit_gap = math.log(params.min_p) * params.temperature if not params.greedy and params.min_p > 0 else None
    out = []
    for row_values, row_ids in zip(values, ids):
        if penalize:
            row_values = [(v / theta if v > 0 else v * theta) if int(t) in window else v
                          for v, t in zip(row_values, row_ids)]
            order = sorted(range(len(row_values)), key=row_values.__getitem__, reverse=True)[:limit]
        else:
            order = range(min(limit, len(row_values)))
        keep = []
        top = row_values[order[0]] if order else 0.0
        for i in order:
            value = row_values[i]
            if value == float("-inf"):
                break
            if min_logit_gap is not None and value - top < min_logit_gap:
                break
            keep.append(int(row_ids[i]))
        out.append(keep)
    return out


def draft_trie(
    root: int,
    candidates: Sequence[Sequence[int]],
    branching: Sequence[int],
    pool: NgramPool | None,
    max_nodes: int | None = None,
    continuation: Sequence[int] = (),
) -> DraftTree:
    """The heads' cartesian tree, the history's continuation (a suffix match), then the n-gram
    pool's continuations of the top depth-1 token; ``max_nodes`` drops the last ones first."""
    tree = DraftTree(root)
    tree.add_cartesian(cartesian_rows(candidates, branching), Source.HEADS, max_nodes)
    if continuation:
        tree.add_path(continuation, Source.SUFFIX, max_nodes=max_nodes)
    if pool is not None and candidates and candidates[0]:
        conts = pool.lookup(candidates[0][0])
        first = tree.add_path(candidates[0][:1], Source.NGRAM, max_nodes=max_nodes) if conts else []
        for cont in conts if first else ():
            tree.add_path(cont, Source.NGRAM, max_nodes=max_nodes, below=first[0])
    return tree
