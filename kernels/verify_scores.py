"""Triton kernel: verification-guided selection scores of a request's prefix keys (SpecAttn).

SpecAttn picks the draft forward's partial KV from the verify forward, which reads every prefix key
anyway: for each key ``j`` of request ``b``'s prefix, the pre-softmax logit ``q.k_j * sm_scale``
of two verify rows (the tree's root and its first draft token, the request's rows 0 and 1 in
SGLang's topological layout), averaged over those rows and over the query heads that read the
key's KV head::

    scores[b, kv_head, j] = mean over t < score_rows, g < G of  q[b*T + t, kv_head*G + g] . k_j * sm_scale

Per KV head, so a selection can be per (layer, KV head); the mean over all query heads (one set per
layer) is ``scores.mean(1)``: the groups have equal sizes. Logits rather than softmax weights:
no LSE is needed, so the scores are ready as soon as the keys are read, and SpecAttn measured them
slightly better (6.11 vs 5.89 tokens per step at gamma 7).

The hybrid verify's Triton prefix path writes these in the same pass as the attention
(:func:`sgl_longgen.kernels.prefix_attention.prefix_attention_partials`, ``scores=``). This
kernel is the stand-alone pass for prefix paths that cannot (FA3, FlashInfer's folded decode): it
reads the keys once more but not the values. Because the mean is linear, it averages the
``score_rows * G`` queries first (fp32) and takes one dot product per key.

The grid is ``(num_programs, bs * Hkv)`` and each program strides over its request's key tiles,
so the launch does not depend on the prefix lengths (CUDA-graph safe). Entries past a request's
prefix are left as they are.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .triton_common import check_head_dim, interpreting, next_pow2


@triton.jit
def _prefix_logit_scores_kernel(
    Q,
    K_buf,
    KvIndptr,
    KvIndices,
    Scores,
    stride_q_tok,
    stride_q_head,
    stride_k_slot,
    stride_k_head,
    stride_s_req,
    stride_s_head,
    sm_scale,
    tree_size,
    num_kv_heads,
    GROUP: tl.constexpr,
    SCORE_ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_bh = tl.program_id(1)
    req = pid_bh // num_kv_heads
    kv_head = pid_bh % num_kv_heads
    kv_lo = tl.load(KvIndptr + req)
    kv_len = tl.load(KvIndptr + req + 1) - kv_lo

    # The mean query of the score rows: row r is draft token r // G, query head kv_head*G + r % G.
    r = tl.arange(0, BLOCK_R)
    r_ok = r < SCORE_ROWS * GROUP
    q_tok = (req * tree_size + r // GROUP).to(tl.int64)
    q_head = kv_head * GROUP + r % GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(
        Q + q_tok[:, None] * stride_q_tok + q_head[:, None] * stride_q_head + d[None, :],
        mask=r_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    q_mean = tl.sum(q, 0) * (sm_scale / (SCORE_ROWS * GROUP))  # [BLOCK_D]

    out = Scores + req.to(tl.int64) * stride_s_req + kv_head * stride_s_head
    for start_n in range(pid * BLOCK_N, kv_len, NUM_PROGRAMS * BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_len
        slots = tl.load(KvIndices + kv_lo + offs_n, mask=n_ok, other=0).to(tl.int64)
        k = tl.load(
            K_buf + slots[:, None] * stride_k_slot + kv_head * stride_k_head + d[None, :],
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        tl.store(out + offs_n, tl.sum(k * q_mean[None, :], 1), mask=n_ok)


def scores_buffer(batch_size: int, num_kv_heads: int, max_prefix_len: int, device) -> torch.Tensor:
    """An fp32 ``[bs, Hkv, max_prefix_len]`` output buffer (filled with -inf: no score)."""
    return torch.full((batch_size, num_kv_heads, max_prefix_len), float("-inf"), dtype=torch.float32, device=device)


def check_scores(scores: torch.Tensor, batch_size: int, num_kv_heads: int, tree_size: int, score_rows: int) -> None:
    if not 1 <= score_rows <= tree_size:
        raise ValueError(f"score_rows must be in [1, T = {tree_size}], got {score_rows}")
    if scores.dtype != torch.float32 or scores.dim() != 3 or tuple(scores.shape[:2]) != (batch_size, num_kv_heads):
        raise ValueError(
            f"scores must be fp32 [{batch_size}, {num_kv_heads}, max_len], got {scores.dtype} {tuple(scores.shape)}"
        )
    if scores.stride(2) != 1:
        raise ValueError("scores must be contiguous in its last dimension")


def prefix_logit_scores(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scores: torch.Tensor,
    sm_scale: float | None = None,
    *,
    score_rows: int = 2,
    num_programs: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Write the selection scores of every request's prefix keys into ``scores`` and return it.

    Args:
        q: ``[bs*T, Hq, D]``, the verify's queries (``T`` rows per request, root first).
        k_buffer: key pool ``[num_slots, Hkv, D]``; kv_indptr ``[bs+1]`` / kv_indices: int32
            pool slots of the prefixes (SGLang's layout at page size 1).
        scores: fp32 ``[bs, Hkv, >= longest prefix]``, last dim contiguous.
        score_rows: the first ``score_rows`` draft tokens of each request score (SpecAttn: 2).
        num_programs: programs per (request, KV head); fixed, so the grid suits CUDA graphs.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    check_head_dim(head_dim)
    num_kv_heads = k_buffer.shape[1]
    bs = kv_indptr.numel() - 1
    if bs <= 0 or num_tokens % bs:
        raise ValueError("q rows must be a multiple of the batch size")
    if num_q_heads % num_kv_heads:
        raise ValueError("num_q_heads must be a multiple of num_kv_heads")
    tree_size = num_tokens // bs
    group = num_q_heads // num_kv_heads
    check_scores(scores, bs, num_kv_heads, tree_size, score_rows)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    slow = interpreting(_prefix_logit_scores_kernel)
    if block_n is None:
        block_n = 256 if slow else 128
    if num_programs is None:
        num_programs = 1 if slow else 32
    grid = (num_programs, bs * num_kv_heads)
    _prefix_logit_scores_kernel[grid](
        q,
        k_buffer,
        kv_indptr,
        kv_indices,
        scores,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        scores.stride(0),
        scores.stride(1),
        sm_scale,
        tree_size,
        num_kv_heads,
        GROUP=group,
        SCORE_ROWS=score_rows,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_pow2(head_dim)),
        BLOCK_R=max(16, next_pow2(score_rows * group)),
        BLOCK_N=block_n,
        NUM_PROGRAMS=num_programs,
        num_warps=4,
    )
    return scores
