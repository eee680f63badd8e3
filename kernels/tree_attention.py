"""Attention of the T draft tokens of each request over those same T tokens.

This is the small, masked half of hybrid tree attention: the draft tree's ancestor mask only
concerns the draft tokens, so the long committed prefix is attended separately without any mask
(``prefix_attention``) and the two halves are merged by their log-sum-exp (``merge``).

It is a case of a few query rows over a small masked key set, so it runs the Triton kernel of
:mod:`.masked_attention` (GQA folded into rows: each K/V tile loaded once for the query heads that
share it) on views of its token-major operands, with tiles of its own (a tree is one or two key
tiles) and the log-sum-exp stored.

Outputs are the normalised attention output and its **base-2** log-sum-exp
``log2(sum_j exp(sm_scale * q.k_j))``, FlashInfer's convention, so that the result merges directly
with FlashInfer states and with ``prefix_attention`` partials. A query that sees no key (possible
only with a malformed mask) gets ``o = 0`` and ``lse = -inf``, which merges as "no contribution".
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from .masked_attention import _masked_attention_kernel, launch
from .triton_common import check_head_dim, interpreting, next_pow2


def tree_kernel_config(rows_per_kv_head: int, tree_size: int, head_dim: int) -> dict:
    """Tile sizes: the tree is small, so one or two key tiles cover it.

    The interpreter's cost is per executed operation, so there one tile covers everything.
    """
    if interpreting(_masked_attention_kernel):
        block_m = max(16, next_pow2(rows_per_kv_head))
        block_n = max(16, next_pow2(tree_size))
        return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4, num_stages=1)
    block_m = min(64, max(16, next_pow2(rows_per_kv_head)))
    block_n = min(64, max(16, next_pow2(tree_size)))
    num_warps = 4 if block_m * max(head_dim, block_n) <= 64 * 128 else 8
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=1)


def tree_attention(
    q: torch.Tensor,
    k_tree: torch.Tensor,
    v_tree: torch.Tensor,
    tree_mask: torch.Tensor,
    sm_scale: Optional[float] = None,
    *,
    out: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Tree-masked attention of each request's ``T`` draft tokens over themselves.

    Args:
        q: ``[bs*T, Hq, D]`` queries (fp16/bf16/fp32), last dim contiguous.
        k_tree, v_tree: ``[bs*T, Hkv, D]`` the draft tokens' keys and values.
        tree_mask: ``[bs, T, T]``, nonzero where draft token ``i`` may see token ``j``.
        sm_scale: softmax scale, default ``1/sqrt(D)``.
        out: optional output ``[bs*T, Hq, D]`` (any dtype, any strides with a contiguous last
            dim, e.g. a slice of a larger partial-state buffer). Default: ``q``'s dtype.
        lse: optional fp32 ``[bs*T, Hq]`` output for the base-2 LSE.

    Returns:
        ``(out, lse)``: the normalised output and the base-2 log-sum-exp of the scaled scores.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_tree.shape[1]
    bs, tree_size = tree_mask.shape[0], tree_mask.shape[1]
    _check_tree_inputs(q, k_tree, v_tree, tree_mask)
    check_head_dim(head_dim)
    group = num_q_heads // num_kv_heads
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    if out is None:
        out = torch.empty_like(q)
    if lse is None:
        lse = torch.empty(num_tokens, num_q_heads, dtype=torch.float32, device=q.device)
    if out.stride(-1) != 1:
        raise ValueError("out must have a contiguous last dimension")
    if num_tokens == 0:
        return out, lse
    cfg = tree_kernel_config(tree_size * group, tree_size, head_dim)
    launch(q.unflatten(0, (bs, tree_size)), k_tree.unflatten(0, (bs, tree_size)).transpose(1, 2),
           v_tree.unflatten(0, (bs, tree_size)).transpose(1, 2), tree_mask, out.unflatten(0, (bs, tree_size)),
           lse.unflatten(0, (bs, tree_size)), sm_scale, cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"],
           cfg["num_stages"])
    return out, lse


def _check_tree_inputs(q, k_tree, v_tree, tree_mask) -> None:
    num_tokens, num_q_heads, head_dim = q.shape
    bs, tree_size = tree_mask.shape[0], tree_mask.shape[1]
    if tree_mask.dim() != 3 or tree_mask.shape[2] != tree_size:
        raise ValueError(f"tree_mask must be [bs, T, T], got {tuple(tree_mask.shape)}")
    if num_tokens != bs * tree_size:
        raise ValueError(f"q has {num_tokens} rows, expected bs*T = {bs}*{tree_size}")
    if k_tree.shape[0] != num_tokens or v_tree.shape[0] != num_tokens:
        raise ValueError("k_tree/v_tree must have one row per draft token")
    if k_tree.shape[-1] != head_dim or v_tree.shape[-1] != head_dim:
        raise ValueError("q, k and v must share the head dimension")
    if k_tree.dtype != q.dtype or v_tree.dtype != q.dtype:
        raise ValueError("q, k_tree and v_tree must share one dtype")
    if num_q_heads % k_tree.shape[1] != 0:
        raise ValueError("the number of query heads must be a multiple of the KV heads")
    for name, x in (("q", q), ("k_tree", k_tree), ("v_tree", v_tree)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
