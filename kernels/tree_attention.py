"""Triton kernel: attention of the T draft tokens of each request over those same T tokens.

This is the small, masked half of hybrid tree attention: the draft tree's ancestor mask only
concerns the draft tokens, so the long committed prefix is attended separately without any mask
(``prefix_attention``) and the two halves are merged by their log-sum-exp (``merge``).

GQA is handled by folding the ``G = Hq // Hkv`` query heads of one KV head into the row
dimension: a program owns one (request, KV head) pair and ``BLOCK_M`` of its ``T*G`` query rows,
row ``r`` being draft token ``r // G`` and query head ``kv_head*G + r % G``. Each K/V tile is then
loaded once for all the query heads that share it.

Outputs are the normalised attention output and its **base-2** log-sum-exp
``log2(sum_j exp(sm_scale * q.k_j))``, FlashInfer's convention, so that the result merges directly
with FlashInfer states and with ``prefix_attention`` partials. A query that sees no key (possible
only with a malformed mask) gets ``o = 0`` and ``lse = -inf``, which merges as "no contribution".
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .triton_common import LOG2_E, check_head_dim, interpreting, next_pow2, upcast_dots


@triton.jit
def _tree_attention_kernel(
    Q,
    K,
    V,
    Mask,
    O,
    Lse,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_m_req,
    stride_m_row,
    stride_m_col,
    stride_o_tok,
    stride_o_head,
    stride_lse_tok,
    stride_lse_head,
    qk_scale,  # sm_scale * log2(e)
    tree_size,
    num_kv_heads,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    req = pid_bh // num_kv_heads
    kv_head = pid_bh % num_kv_heads

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    t = rows // GROUP
    q_head = kv_head * GROUP + rows % GROUP
    row_ok = t < tree_size
    q_tok = (req * tree_size + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM

    q = tl.load(
        Q + q_tok[:, None] * stride_q_tok + q_head[:, None] * stride_q_head + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    for start in range(0, tree_size, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < tree_size
        kv_tok = (req * tree_size + cols).to(tl.int64)
        k = tl.load(
            K + kv_tok[:, None] * stride_k_tok + kv_head * stride_k_head + d[None, :],
            mask=col_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) * qk_scale
        else:
            s = tl.dot(q, tl.trans(k)) * qk_scale
        visible = tl.load(
            Mask + req * stride_m_req + t[:, None] * stride_m_row + cols[None, :] * stride_m_col,
            mask=row_ok[:, None] & col_ok[None, :],
            other=0,
        )
        s = tl.where(visible != 0, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows that have seen no visible key yet keep m = -inf; shift them by 0 instead.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V + kv_tok[:, None] * stride_v_tok + kv_head * stride_v_head + d[None, :],
            mask=col_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc * alpha[:, None])
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new

    has_key = l_i > 0.0
    o = acc / tl.where(has_key, l_i, 1.0)[:, None]
    lse = tl.where(has_key, m_i + tl.log2(tl.where(has_key, l_i, 1.0)), float("-inf"))
    tl.store(
        O + q_tok[:, None] * stride_o_tok + q_head[:, None] * stride_o_head + d[None, :],
        o.to(O.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )
    tl.store(Lse + q_tok * stride_lse_tok + q_head * stride_lse_head, lse, mask=row_ok)


def tree_kernel_config(rows_per_kv_head: int, tree_size: int, head_dim: int) -> dict:
    """Tile sizes: the tree is small, so one or two key tiles cover it.

    The interpreter's cost is per executed operation, so there one tile covers everything.
    """
    if interpreting(_tree_attention_kernel):
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
    mask = tree_mask.view(torch.uint8) if tree_mask.dtype == torch.bool else tree_mask
    cfg = tree_kernel_config(tree_size * group, tree_size, head_dim)
    grid = (triton.cdiv(tree_size * group, cfg["BLOCK_M"]), bs * num_kv_heads)
    _tree_attention_kernel[grid](
        q,
        k_tree,
        v_tree,
        mask,
        out,
        lse,
        q.stride(0),
        q.stride(1),
        k_tree.stride(0),
        k_tree.stride(1),
        v_tree.stride(0),
        v_tree.stride(1),
        mask.stride(0),
        mask.stride(1),
        mask.stride(2),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        lse.stride(1),
        sm_scale * LOG2_E,
        tree_size,
        num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_pow2(head_dim)),
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        UPCAST=upcast_dots(_tree_attention_kernel),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
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
