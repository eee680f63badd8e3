"""Verification-guided selection scores (SpecAttn's Collect-2-Query), engine-agnostic.

With ``[tokenswift.partial_kv] policy = "verify"`` the verify forward of every step also scores
the committed keys: for each layer, key ``j`` gets the pre-softmax logit ``q.k_j * scale`` of
:data:`SCORE_ROWS` verify rows, averaged over those rows and over the query heads that read the
key's KV head (``[layers, kv_heads, n]``). :meth:`~sgl_longgen.core.partial_kv.PartialKVPolicy.select_verified`
turns them into the next draft's partial KV.

Which rows: SpecAttn takes two rows as far apart as possible along the draft, because the keys a
draft position needs drift with its distance from the committed prefix, and two rows score about
as well as all of them. In a TokenSwift trie (nodes in topological order, SGLang's layout too)
those are row 0, the root (the token the next draft forward starts from, once committed) and row
1, the first draft token (the base head's top-1, the likeliest next root). A trie of the root
alone scores with row 0.

Logits rather than softmax weights: they need no normaliser, so an attention kernel can write them
as it reads the keys (``sgl_longgen.kernels.verify_scores``), and SpecAttn measured them slightly
better. Because the mean is linear, the mean logit is the logit of the mean query: one dot per key.

Lossless: the scores only decide which positions the *draft* forward reads; the verify forward
attends to every committed key whatever they are, and every committed token is drawn from its
output.
"""

from __future__ import annotations

import torch

SCORE_ROWS = 2


def score_rows(tree_size: int) -> int:
    """How many of a verify's first rows score: :data:`SCORE_ROWS`, fewer for a smaller trie."""
    return max(1, min(SCORE_ROWS, tree_size))


def mean_logits(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """``[R, Hq, D]`` score-row queries and ``[Hkv, n, D]`` keys -> ``[Hkv, n]`` mean logits.

    Entry ``[h, j]`` is the mean of ``q[r, g] . k[h, j] * scale`` over the ``R`` rows and the
    ``Hq / Hkv`` query heads ``g`` of KV head ``h`` (query head ``g`` reads KV head
    ``g // (Hq / Hkv)``). The mean over all query heads is ``.mean(0)`` of the result.
    """
    rows, hq, d = q.shape
    hkv = k.shape[0]
    q_mean = q.reshape(rows, hkv, hq // hkv, d).mean(dim=(0, 2))
    return torch.einsum("hd,hnd->hn", q_mean.to(k.dtype), k) * scale
