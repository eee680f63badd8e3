"""Plain fp32 (or fp64) PyTorch references for tree verification attention.

These build the full masked score matrix of each request (committed prefix, then the draft tree)
and apply one softmax over it, exactly the computation the fast paths split into parts. They are
the oracle of the kernel tests and of the GPU correctness checks, so they share no code with the
kernels: no split, no merge, no base-2 arithmetic.

Shapes follow SGLang's TARGET_VERIFY batch with ``bs`` requests of ``T`` draft tokens each:

* ``q``: ``[bs*T, Hq, D]``; ``k_buffer``/``v_buffer``: the KV pool ``[num_slots, Hkv, D]``;
* the prefix of request ``b`` is ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` (pool slots);
* ``k_tree``/``v_tree``: ``[bs*T, Hkv, D]``, the draft tokens' own keys and values;
* ``tree_mask``: ``[bs, T, T]`` bool, ``tree_mask[b, i, j]`` = draft token ``i`` sees token ``j``.

Query head ``h`` reads KV head ``h // (Hq // Hkv)``. LSE outputs are returned in both bases so
that callers compare against the convention they produce.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch


def masked_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    sm_scale: float,
    dtype: torch.dtype = torch.float32,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One softmax over a full masked score matrix.

    ``q``: ``[M, Hq, D]``, ``k``/``v``: ``[N, Hkv, D]``, ``visible``: ``[M, N]`` bool.
    Returns ``o [M, Hq, D]`` and the natural-log LSE ``[M, Hq]``; rows that see no key get
    ``o = 0`` and ``lse = -inf``.
    """
    num_q_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_q_heads // num_kv_heads
    qf = q.to(dtype)
    kf = k.to(dtype).repeat_interleave(group, dim=1)  # query head h -> kv head h // group
    vf = v.to(dtype).repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,nhd->hmn", qf, kf) * sm_scale
    scores = scores.masked_fill(~visible.to(torch.bool)[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hq, M]
    has_key = torch.isfinite(lse)
    probs = torch.exp(scores - torch.where(has_key, lse, torch.zeros_like(lse))[..., None])
    probs = torch.where(has_key[..., None], probs, torch.zeros_like(probs))
    o = torch.einsum("hmn,nhd->mhd", probs, vf)
    return o, lse.transpose(0, 1).contiguous()


def tree_attention_reference(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    k_tree: torch.Tensor,
    v_tree: torch.Tensor,
    tree_mask: torch.Tensor,
    sm_scale: Optional[float] = None,
    dtype: torch.dtype = torch.float32,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of every draft token over its request's whole prefix plus the visible tree tokens.

    Returns ``o [bs*T, Hq, D]`` in ``dtype`` and the **natural-log** LSE ``[bs*T, Hq]``.
    """
    bs, tree_size = tree_mask.shape[0], tree_mask.shape[1]
    head_dim = q.shape[-1]
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    indptr = kv_indptr.tolist()
    outs, lses = [], []
    for b in range(bs):
        slots = kv_indices[indptr[b] : indptr[b + 1]].long()
        rows = slice(b * tree_size, (b + 1) * tree_size)
        k = torch.cat([k_buffer[slots], k_tree[rows]], dim=0)
        v = torch.cat([v_buffer[slots], v_tree[rows]], dim=0)
        prefix_visible = torch.ones(tree_size, slots.numel(), dtype=torch.bool, device=q.device)
        visible = torch.cat([prefix_visible, tree_mask[b].to(torch.bool)], dim=1)
        o, lse = masked_attention_reference(q[rows], k, v, visible, sm_scale, dtype)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, dim=0), torch.cat(lses, dim=0)


def prefix_logit_scores_reference(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    score_rows: int = 2,
    sm_scale: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Verification-guided selection scores (SpecAttn): ``[bs, Hkv, max prefix len]`` in ``dtype``.

    ``scores[b, h, j]``: the logit ``q.k_j * sm_scale`` of each of request ``b``'s first
    ``score_rows`` draft tokens and each query head reading KV head ``h``, averaged over those
    ``score_rows * G`` logits. Every logit is formed on its own before the mean (the kernels use
    the mean's linearity). Entries past a request's prefix are NaN.
    """
    bs = kv_indptr.numel() - 1
    tree_size = q.shape[0] // bs
    num_q_heads, num_kv_heads = q.shape[1], k_buffer.shape[1]
    group = num_q_heads // num_kv_heads
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    indptr = kv_indptr.tolist()
    lens = [indptr[b + 1] - indptr[b] for b in range(bs)]
    out = torch.full((bs, num_kv_heads, max(lens, default=0)), float("nan"), dtype=dtype, device=q.device)
    for b in range(bs):
        slots = kv_indices[indptr[b] : indptr[b + 1]].long()
        rows = q[b * tree_size : b * tree_size + score_rows].to(dtype)  # [R, Hq, D]
        keys = k_buffer[slots].to(dtype).repeat_interleave(group, dim=1)  # [n, Hq, D]
        logits = torch.einsum("rhd,nhd->rhn", rows, keys) * sm_scale  # [R, Hq, n]
        per_kv = logits.reshape(score_rows, num_kv_heads, group, -1)
        out[b, :, : lens[b]] = per_kv.mean(dim=(0, 2))
    return out


def lse_natural_to_base2(lse: torch.Tensor) -> torch.Tensor:
    """FlashInfer and this package's kernels report ``log2(sum(exp(s)))``."""
    return lse / math.log(2.0)


def random_tree_mask(bs: int, tree_size: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Ancestor masks of random trees (each node sees itself and its ancestors), ``[bs, T, T]`` bool.

    Nodes are in topological order (a parent precedes its children), as SGLang lays out drafts.
    """
    mask = torch.zeros(bs, tree_size, tree_size, dtype=torch.bool)
    for b in range(bs):
        parent = [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, tree_size)]
        for i in range(tree_size):
            j = i
            while j >= 0:
                mask[b, i, j] = True
                j = parent[j]
    return mask


def make_paged_prefix(
    prefix_lens, num_slots: int, device="cpu", generator: Optional[torch.Generator] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Random, non-contiguous, non-overlapping pool slots for each request's prefix.

    Returns ``(kv_indptr [bs+1] int32, kv_indices [sum(prefix_lens)] int32)``.
    """
    total = int(sum(prefix_lens))
    if total > num_slots:
        raise ValueError("pool too small for the prefixes")
    perm = torch.randperm(num_slots, generator=generator)[:total].to(torch.int32)
    indptr = torch.zeros(len(prefix_lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(prefix_lens, dtype=torch.int64), 0).to(torch.int32)
    return indptr.to(device), perm.to(device)
