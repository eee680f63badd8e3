"""Triton kernel: all draft-token queries of a request against its long committed prefix, KV read once.

Verifying a draft tree of ``T`` tokens at long context is bound by reading the prefix KV, the same
bytes an AR decode step reads. SGLang's masked prefill reads it once per query tile and FlashInfer's
non-causal prefill does not split the KV for few queries, so both leave most of the GPU idle
(see ``docs/kernels.md``). Here every program owns one (request, KV head, KV chunk) and
computes **all** ``T*G`` query rows of that KV head against the chunk on tensor cores: the rows of
the ``G`` query heads sharing the KV head are folded into the row dimension (row ``r`` = draft
token ``r // G``, query head ``kv_head*G + r % G``), so each K/V tile is fetched from memory once.
When ``T*G`` exceeds one row tile, the row tiles of a chunk are adjacent in the grid and run
together, so the chunk is read from HBM once and from L2 by the siblings.

The prefix is paged: request ``b`` attends to pool slots ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``
of ``k_buffer``/``v_buffer`` (``[num_slots, Hkv, D]``), SGLang's layout at page size 1. The number
of chunks per request is fixed at launch and each request's chunk length is derived in the kernel
from its own prefix length, so the grid does not depend on the lengths (CUDA-graph safe).

Each chunk writes a partial state (normalised output, base-2 LSE) into ``[num_tokens, Hq, S, D]``
and ``[num_tokens, Hq, S]`` fp32 buffers; ``merge.merge_split_states`` reduces them (and any extra
state such as the tree part written into the same buffers).

Optionally the kernel also writes verification-guided selection scores (SpecAttn, see
:mod:`sgl_longgen.kernels.verify_scores`): for each prefix key, the pre-softmax logit
``q.k * sm_scale`` of the first ``score_rows`` draft tokens of the request, averaged over those
rows and the ``G`` query heads of the key's KV head, into ``scores[b, kv_head, j]`` (fp32). The
logits are already in registers, every key belongs to exactly one chunk, and the score rows lie in
the first row tile, so the output costs one masked row sum per tile and one store per key, no
extra read of the KV.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .merge import merge_split_states
from .triton_common import (
    LN_2,
    LOG2_E,
    check_head_dim,
    interpreting,
    next_pow2,
    upcast_dots,
)
from .verify_scores import check_scores

MAX_SPLITS = 64


@triton.jit
def _attend_prefix_tile(
    acc,
    m_i,
    l_i,
    q,
    K_buf,
    V_buf,
    slot_ptr,
    start_n,
    end_n,
    kv_head,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    d,
    d_ok,
    qk_scale,
    score_ptr,
    score_on,
    score_w,
    BLOCK_N: tl.constexpr,
    TAIL: tl.constexpr,
    EVEN_D: tl.constexpr,
    UPCAST: tl.constexpr,
    SCORE_ROWS: tl.constexpr,
):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_ok = offs_n < end_n
    if TAIL:
        slots = tl.load(slot_ptr + offs_n, mask=n_ok, other=0)
        kv_mask = n_ok[:, None] & d_ok[None, :]
    else:
        slots = tl.load(slot_ptr + offs_n)
        kv_mask = (offs_n >= 0)[:, None] & d_ok[None, :]
    slots = slots.to(tl.int64)
    k_ptrs = K_buf + slots[:, None] * stride_k_slot + kv_head * stride_k_head + d[None, :]
    v_ptrs = V_buf + slots[:, None] * stride_v_slot + kv_head * stride_v_head + d[None, :]
    if TAIL:
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    elif EVEN_D:
        k = tl.load(k_ptrs)
    else:
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    if UPCAST:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) * qk_scale
    else:
        s = tl.dot(q, tl.trans(k)) * qk_scale
    if SCORE_ROWS > 0:  # noqa: SIM102 - compile-time branch around a run-time one
        if score_on:
            # score_w: 1 / (rows * G) * ln(2) on the score rows, 0 elsewhere; s is in base 2.
            tl.store(score_ptr + offs_n, tl.sum(s * score_w[:, None], 0), mask=n_ok)
    if TAIL:
        s = tl.where(n_ok[None, :], s, float("-inf"))
    # Every tile holds at least one key, so m_new is finite.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if TAIL:
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    elif EVEN_D:
        v = tl.load(v_ptrs)
    else:
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    if UPCAST:
        acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc * alpha[:, None])
    else:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _prefix_split_kernel(
    Q,
    K_buf,
    V_buf,
    KvIndptr,
    KvIndices,
    PartO,
    PartLse,
    Scores,
    KvSkip,
    stride_q_tok,
    stride_q_head,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    stride_po_tok,
    stride_po_head,
    stride_po_split,
    stride_pl_tok,
    stride_pl_head,
    stride_pl_split,
    stride_s_req,
    stride_s_head,
    qk_scale,  # sm_scale * log2(e)
    score_scale,  # ln(2) / (SCORE_ROWS * GROUP): base-2 logit sums to natural-log means
    tree_size,
    num_kv_heads,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    EVEN_D: tl.constexpr,
    UPCAST: tl.constexpr,
    SCORE_ROWS: tl.constexpr,
    HAS_SKIP: tl.constexpr,
):
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    pid_bh = tl.program_id(2)
    req = pid_bh // num_kv_heads
    kv_head = pid_bh % num_kv_heads

    kv_lo = tl.load(KvIndptr + req)
    kv_hi = tl.load(KvIndptr + req + 1)
    if HAS_SKIP:  # the request's own part of a cascade: its prefix past the shared slots
        kv_lo = tl.minimum(kv_lo + tl.load(KvSkip), kv_hi)
    kv_len = kv_hi - kv_lo
    chunk = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, kv_len)
    num_full = tl.maximum(end - start, 0) // BLOCK_N
    full_end = start + num_full * BLOCK_N

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
    slot_ptr = KvIndices + kv_lo
    # The score rows (draft tokens t < SCORE_ROWS, all G heads) are rows [0, SCORE_ROWS*G) of the
    # first row tile (the launcher checks they fit): only pid_m == 0 writes scores.
    score_on = pid_m == 0
    score_w = tl.where(rows < SCORE_ROWS * GROUP, score_scale, 0.0)
    score_ptr = Scores + req.to(tl.int64) * stride_s_req + kv_head * stride_s_head

    for start_n in range(start, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_prefix_tile(
            acc, m_i, l_i, q, K_buf, V_buf, slot_ptr, start_n, end, kv_head,
            stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, d, d_ok, qk_scale,
            score_ptr, score_on, score_w,
            BLOCK_N=BLOCK_N, TAIL=False, EVEN_D=EVEN_D, UPCAST=UPCAST, SCORE_ROWS=SCORE_ROWS,
        )
    if full_end < end:
        acc, m_i, l_i = _attend_prefix_tile(
            acc, m_i, l_i, q, K_buf, V_buf, slot_ptr, full_end, end, kv_head,
            stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, d, d_ok, qk_scale,
            score_ptr, score_on, score_w,
            BLOCK_N=BLOCK_N, TAIL=True, EVEN_D=EVEN_D, UPCAST=UPCAST, SCORE_ROWS=SCORE_ROWS,
        )

    # An empty chunk (short prefix) contributes nothing: o = 0, lse = -inf.
    has_key = l_i > 0.0
    o = acc / tl.where(has_key, l_i, 1.0)[:, None]
    lse = tl.where(has_key, m_i + tl.log2(tl.where(has_key, l_i, 1.0)), float("-inf"))
    tl.store(
        PartO + q_tok[:, None] * stride_po_tok + q_head[:, None] * stride_po_head
        + split * stride_po_split + d[None, :],
        o.to(PartO.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )
    tl.store(
        PartLse + q_tok * stride_pl_tok + q_head * stride_pl_head + split * stride_pl_split,
        lse,
        mask=row_ok,
    )


@dataclass(frozen=True)
class PrefixKernelConfig:
    """Launch shape of the split-KV prefix kernel. ``num_splits`` chunks per (request, KV head)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def prefix_kernel_config(
    batch_size: int,
    num_kv_heads: int,
    rows_per_kv_head: int,
    head_dim: int,
    device: torch.device,
    max_prefix_len: Optional[int] = None,
    num_splits: Optional[int] = None,
    block_m: Optional[int] = None,
    block_n: Optional[int] = None,
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
    min_block_m: int = 0,
) -> PrefixKernelConfig:
    """Tile sizes and split count for ``T*G = rows_per_kv_head`` query rows per KV head.

    ``min_block_m``: rows the first row tile must hold (``score_rows * G`` when the launch also
    writes selection scores, see :func:`prefix_attention_partials`).

    Row tiles up to 128 (two warpgroups of MMA rows on Hopper); the number of KV chunks fills the
    GPU with about one wave of programs: 128-row tiles keep one program per SM (registers and
    shared memory), smaller tiles two. ``max_prefix_len`` (when known) caps the split count so
    that chunks stay long enough for their partial states to cost little; leave it ``None``
    under CUDA graphs, where the launch must not depend on the lengths. Explicit arguments
    override the heuristics.
    """
    if interpreting(_prefix_split_kernel):
        # The CPU interpreter pays per executed operation: few, large tiles.
        block_m = block_m or max(16, next_pow2(rows_per_kv_head))
        block_n = block_n or 256
    if block_m is None:
        block_m = min(128, max(16, next_pow2(rows_per_kv_head)))
    block_m = max(block_m, next_pow2(min_block_m))
    if block_n is None:
        block_n = 64 if head_dim <= 128 else 32
    if num_warps is None:
        num_warps = 8 if block_m >= 128 else 4
    if num_stages is None:
        num_stages = 3 if head_dim <= 128 else 2
    if num_splits is None:
        m_tiles = triton.cdiv(rows_per_kv_head, block_m)
        programs_per_sm = 1 if block_m >= 128 else 2
        base = max(1, batch_size * num_kv_heads * m_tiles)
        num_splits = max(1, (_num_sms(device) * programs_per_sm) // base)
        if max_prefix_len is not None:
            # Each chunk writes and re-reads fp32 partial rows (8*rows bytes per key dim) against
            # 4 bytes per key per key dim of bf16 K/V: keep chunks >= 4*rows keys, >= 2 tiles.
            min_chunk = max(2 * block_n, 4 * rows_per_kv_head)
            num_splits = min(num_splits, max(1, max_prefix_len // min_chunk))
    num_splits = max(1, min(int(num_splits), MAX_SPLITS))
    return PrefixKernelConfig(block_m, block_n, num_warps, num_stages, num_splits)


def prefix_attention_partials(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    tree_size: int,
    part_o: torch.Tensor,
    part_lse: torch.Tensor,
    sm_scale: float,
    config: PrefixKernelConfig,
    scores: torch.Tensor | None = None,
    score_rows: int = 2,
    kv_skip: torch.Tensor | None = None,
) -> None:
    """Write the ``config.num_splits`` partial states of the prefix into ``part_o[:, :, :S]`` and
    ``part_lse[:, :, :S]`` (``part_lse`` fp32, ``part_o`` fp32 or a 16-bit float, its last dim
    contiguous).

    ``scores`` (fp32 ``[bs, Hkv, >= longest prefix]``, last dim contiguous), when given, receives
    for each request's prefix key ``j`` the logit ``q.k_j * sm_scale`` averaged over the request's
    first ``score_rows`` draft tokens and the query heads of the KV head (the fused twin of
    :func:`sgl_longgen.kernels.verify_scores.prefix_logit_scores`); entries past a request's
    prefix are left as they are. Needs ``score_rows * G <= config.block_m``.

    ``kv_skip`` (int32 device tensor, one element), when given, drops that many leading slots
    of every request's prefix (a cascade's own part, the shared slots being attended apart);
    read on the device, so a CUDA-graph replay may change it. No selection scores with it
    (they would be indexed from the skipped slot).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    bs = kv_indptr.numel() - 1
    group = num_q_heads // num_kv_heads
    if num_tokens != bs * tree_size:
        raise ValueError(f"q has {num_tokens} rows, expected bs*T = {bs}*{tree_size}")
    if scores is not None:
        check_scores(scores, bs, num_kv_heads, tree_size, score_rows)
        if score_rows * group > config.block_m:
            raise ValueError(f"score rows ({score_rows} x {group} heads) do not fit one row tile of {config.block_m}")
    if scores is not None and kv_skip is not None:
        raise ValueError("selection scores cover whole prefixes: not with kv_skip")
    if kv_skip is not None and (kv_skip.dtype != torch.int32 or kv_skip.numel() != 1):
        raise ValueError("kv_skip must be a one-element int32 tensor")
    if k_buffer.dtype != q.dtype or v_buffer.dtype != q.dtype:
        raise ValueError(f"the KV pool ({k_buffer.dtype}) must have the query dtype ({q.dtype})")
    if part_o.shape[2] < config.num_splits or part_lse.shape[2] < config.num_splits:
        raise ValueError("partial buffers hold fewer states than num_splits")
    if num_tokens == 0:
        return
    rows = tree_size * group
    grid = (triton.cdiv(rows, config.block_m), config.num_splits, bs * num_kv_heads)
    _prefix_split_kernel[grid](
        q,
        k_buffer,
        v_buffer,
        kv_indptr,
        kv_indices,
        part_o,
        part_lse,
        part_lse if scores is None else scores,
        kv_indptr if kv_skip is None else kv_skip,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        part_lse.stride(2),
        0 if scores is None else scores.stride(0),
        0 if scores is None else scores.stride(1),
        sm_scale * LOG2_E,
        0.0 if scores is None else LN_2 / (score_rows * group),
        tree_size,
        num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_pow2(head_dim)),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        NUM_SPLITS=config.num_splits,
        EVEN_D=max(16, next_pow2(head_dim)) == head_dim,
        UPCAST=upcast_dots(_prefix_split_kernel),
        SCORE_ROWS=0 if scores is None else score_rows,
        HAS_SKIP=kv_skip is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def prefix_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: Optional[float] = None,
    *,
    config: Optional[PrefixKernelConfig] = None,
    out: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
    scores: torch.Tensor | None = None,
    score_rows: int = 2,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention of each request's ``T`` queries over its paged prefix.

    Args:
        q: ``[bs*T, Hq, D]``; ``T`` is ``q.shape[0] // bs`` with ``bs = kv_indptr.numel() - 1``.
        k_buffer, v_buffer: KV pool ``[num_slots, Hkv, D]``.
        kv_indptr: ``[bs+1]`` int32; kv_indices: int32 pool slots of the prefixes.
        config: launch shape (``prefix_kernel_config`` by default).
        out, lse: optional outputs ``[bs*T, Hq, D]`` and fp32 ``[bs*T, Hq]``.
        scores, score_rows: optional selection scores (see :func:`prefix_attention_partials`).

    Returns:
        ``(out, lse)`` with the base-2 LSE; a request with an empty prefix gets ``0`` and ``-inf``.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    check_head_dim(head_dim)
    bs = kv_indptr.numel() - 1
    if bs <= 0 or num_tokens % bs:
        raise ValueError("q rows must be a multiple of the batch size")
    tree_size = num_tokens // bs
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    if config is None:
        group = num_q_heads // k_buffer.shape[1]
        config = prefix_kernel_config(
            bs, k_buffer.shape[1], tree_size * group, head_dim, q.device,
            min_block_m=score_rows * group if scores is not None else 0,
        )
    # 16-bit inputs: the partial outputs in their dtype (the LSEs stay float32). That halves what each
    # split writes and the merge reads (at 4K and 16 rows, 8.6 MB of float32 against the prefix's
    # 16.8 MB of K/V) at one more rounding of each split's normalised output, in the precision the
    # output is delivered in: the LongSpec drafter's cross-attention. The verify path (hybrid.py)
    # keeps float32 partials: they feed the target.
    part_dtype = q.dtype if q.dtype in (torch.float16, torch.bfloat16) else torch.float32
    part_o = torch.empty(num_tokens, num_q_heads, config.num_splits, head_dim, dtype=part_dtype, device=q.device)
    part_lse = torch.empty(num_tokens, num_q_heads, config.num_splits, dtype=torch.float32, device=q.device)
    prefix_attention_partials(
        q, k_buffer, v_buffer, kv_indptr, kv_indices, tree_size, part_o, part_lse, sm_scale, config,
        scores=scores, score_rows=score_rows,
    )
    if out is None:
        out = torch.empty_like(q)
    if lse is None:
        lse = torch.empty(num_tokens, num_q_heads, dtype=torch.float32, device=q.device)
    return merge_split_states(part_o, part_lse, out=out, out_lse=lse)
