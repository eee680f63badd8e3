"""Triton kernel: a few query rows over a small masked key set (LongSpec's window self-attention,
the tree half of hybrid attention).

Each LongSpec drafter step attends ``T`` (1 to 16) query rows per request over the ``S`` (some 512 to 575)
keys of its ring window and draft tree, under a boolean mask. ``F.scaled_dot_product_attention``
spends a call this small on setup and latency, plus kernels to expand and convert the mask. Here
it is one launch reading the ``bool`` mask as it is. Its tiles are what a sweep of tile, warp and
stage settings found fastest (figures in docs/performance.md): 16 rows a program (more programs,
each a short serial walk, beat fewer programs with longer walks), 128 keys a tile, three stages.

The verify's tree half (:mod:`.tree_attention`: each draft token over the tree's tokens under
the ancestor mask) is the same computation on views of its token-major operands, with tiles of its
own and the base-2 log-sum-exp stored for the merge with the prefix's partial states (``-inf``,
no contribution, for a row that sees nothing).

GQA is folded into the rows: a program owns one (request, KV head) pair and ``BLOCK_M`` of its
``T * GROUP`` query rows, row ``r`` being token ``r // GROUP`` and query head
``kv_head * GROUP + r % GROUP``, so each key/value tile is loaded once for the query heads that
share it. Keys go by in tiles of ``BLOCK_N`` with an online softmax in base 2. Keys and values may
be slices of a larger buffer (their strides are passed), so a growing ``S`` needs no copy. Launch
shapes follow from the tensor shapes alone, with no host synchronisation: CUDA-graph capturable.

A row that sees no key at all (never in LongSpec, where every row sees at least itself) gets a
zero output rather than SDPA's NaN; :func:`masked_attention_reference`, the PyTorch twin, does
the same so that the two agree everywhere.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .merge import merge_split_states
from .triton_common import LOG2_E, check_head_dim, interpreting, next_pow2, upcast_dots

BLOCK_M = 16  # query rows (tokens x folded heads) a program
BLOCK_N = 128  # keys a tile, at most (fewer where the stages would not fit in shared memory)
NUM_STAGES = 3
_SMEM: dict[int, int] = {}  # CUDA device index -> shared memory a block may opt into


def key_tiles(device: torch.device, block_d: int, itemsize: int) -> tuple[int, int]:
    """``(BLOCK_N, num_stages)``: the sweep's 128 keys and three stages, keys halved (then stages
    cut to two) until the staged key and value tiles (``stages * 2 * BLOCK_N * block_d`` entries)
    fit the GPU's shared memory: fp32 operands or a 256-wide head on a Hopper, smaller GPUs."""
    limit = 96 * 1024
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in _SMEM:
            _SMEM[index] = torch.cuda.get_device_properties(index).shared_memory_per_block_optin
        limit = int(_SMEM[index] * 0.85)
    block_n, stages = BLOCK_N, NUM_STAGES
    while stages * 2 * block_n * block_d * itemsize > limit and block_n > 16:
        block_n //= 2
    while stages * 2 * block_n * block_d * itemsize > limit and stages > 1:
        stages -= 1
    return block_n, stages


MAX_NEW_ROWS = 64  # masked_attention_into's new rows, held as one tile
# masked_attention_into's programs a block of rows over the ring (one a 128-key tile of 512): more
# programs share a level's walk over the ring; four was the fastest split measured
# (docs/performance.md)
RING_SPLITS = 4
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # float64 goes through the twin


@triton.jit
def _attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One key tile of the online softmax (base 2): the running max, sum and output after it. The
    probabilities are rounded to the values' dtype before the second product, as SDPA does."""
    p_dtype = v.dtype
    if UPCAST:
        k, v = k.to(tl.float32), v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    s = tl.where(visible != 0, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no visible key yet: shift by 0, not -inf
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(p_dtype)
    if UPCAST:
        p = p.to(tl.float32)
    acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _masked_attention_kernel(
    Q, K, V, Mask, O, Lse,
    NewK, NewV, Mask2,  # SEGMENTS: the new rows' K/V [B, T, Hkv, D] and the mask past mask_split
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_mb, stride_mt, stride_ms,
    stride_ob, stride_ot, stride_oh, stride_os,  # stride_os, stride_ls: a ring split's partial state
    stride_lb, stride_lt, stride_lh, stride_ls,
    stride_nkb, stride_nkt, stride_nkh,
    stride_nvb, stride_nvt, stride_nvh,
    stride_m2b, stride_m2t, stride_m2s,
    qk_scale,  # scale * log2(e)
    num_rows,  # T
    num_keys,  # S (SEGMENTS: the buffer's columns before the new rows, the first new row's column)
    num_kv_heads,
    mask_split,  # SEGMENTS: columns below it read Mask, the rest Mask2 (at column - mask_split)
    ring_chunk,  # SPLITS: the ring's columns a split walks, a multiple of BLOCK_N
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    STORE_LSE: tl.constexpr,
    SEGMENTS: tl.constexpr,
    BLOCK_T: tl.constexpr,  # SEGMENTS: the new rows, padded to a power of two
    SPLITS: tl.constexpr,  # SEGMENTS: the ring's columns cut among this many programs a row block
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)  # SPLITS > 1: the last split also walks the tree and the new rows
    last = pid_s == SPLITS - 1
    b = (pid_bh // num_kv_heads).to(tl.int64)
    kv_head = pid_bh % num_kv_heads

    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    t = r // GROUP
    head = kv_head * GROUP + r % GROUP
    row_ok = t < num_rows
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM

    q = tl.load(Q + b * stride_qb + t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + b * stride_kb + kv_head * stride_kh
    v_base = V + b * stride_vb + kv_head * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if SEGMENTS:  # the ring's columns: one mask row shared by every query row, loaded once a tile
        ring = Mask + b * stride_mb
        ring_lo = pid_s * ring_chunk
        ring_hi = tl.minimum(ring_lo + ring_chunk, mask_split)
        for start in range(ring_lo, ring_hi, BLOCK_N):
            s_idx = start + tl.arange(0, BLOCK_N)
            s_ok = s_idx < ring_hi
            kv_ok = s_ok[:, None] & d_ok[None, :]
            k = tl.load(k_base + s_idx[:, None] * stride_ks + d[None, :], mask=kv_ok, other=0.0)
            v = tl.load(v_base + s_idx[:, None] * stride_vs + d[None, :], mask=kv_ok, other=0.0)
            seen = tl.load(ring + s_idx * stride_ms, mask=s_ok, other=0) != 0
            visible = row_ok[:, None] & seen[None, :]
            m_i, l_i, acc = _attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, UPCAST, PRECISION)
        first = mask_split  # then the tree's columns already in the buffer, under the tree's mask
        rows = Mask2 + b * stride_m2b + t[:, None] * stride_m2t
        col_stride = stride_m2s
    else:
        first = 0
        rows = Mask + b * stride_mb + t[:, None] * stride_mt
        col_stride = stride_ms
    if SPLITS > 1:  # (one split: the loop's bound as it was, no select on the verify path's tree half)
        tree_end = tl.where(last, num_keys, first)  # the tree's columns: the last split's
    else:
        tree_end = num_keys
    for start in range(first, tree_end, BLOCK_N):
        s_idx = start + tl.arange(0, BLOCK_N)
        s_ok = s_idx < num_keys
        kv_ok = s_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + s_idx[:, None] * stride_ks + d[None, :], mask=kv_ok, other=0.0)
        v = tl.load(v_base + s_idx[:, None] * stride_vs + d[None, :], mask=kv_ok, other=0.0)
        visible = tl.load(rows + (s_idx - first)[None, :] * col_stride, mask=row_ok[:, None] & s_ok[None, :], other=0)
        m_i, l_i, acc = _attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, UPCAST, PRECISION)
    if SEGMENTS:  # the new rows, one tile from NewK/NewV; then into the buffer for later calls
        j = tl.arange(0, BLOCK_T)
        j_ok = j < num_rows
        jd_ok = j_ok[:, None] & d_ok[None, :]
        nk_base = NewK + b * stride_nkb + kv_head * stride_nkh
        nv_base = NewV + b * stride_nvb + kv_head * stride_nvh
        k = tl.load(nk_base + j[:, None] * stride_nkt + d[None, :], mask=jd_ok, other=0.0)
        v = tl.load(nv_base + j[:, None] * stride_nvt + d[None, :], mask=jd_ok, other=0.0)
        visible = tl.load(rows + (num_keys - first + j)[None, :] * col_stride,
                          mask=row_ok[:, None] & j_ok[None, :] & last, other=0)
        m_i, l_i, acc = _attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, UPCAST, PRECISION)
        if (pid_m == 0) & last:  # one program a KV head writes; none reads these columns from the buffer
            tl.store(k_base + (num_keys + j)[:, None] * stride_ks + d[None, :], k, mask=jd_ok)
            tl.store(v_base + (num_keys + j)[:, None] * stride_vs + d[None, :], v, mask=jd_ok)

    has_key = l_i > 0.0
    o = acc / tl.where(has_key, l_i, 1.0)[:, None]  # a row with no visible key: acc = 0, o = 0
    tl.store(O + b * stride_ob + pid_s * stride_os + t[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             o.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if STORE_LSE:  # base 2; -inf (no contribution to a merge) for a row with no visible key
        lse = tl.where(has_key, m_i + tl.log2(tl.where(has_key, l_i, 1.0)), float("-inf"))
        tl.store(Lse + b * stride_lb + pid_s * stride_ls + t * stride_lt + head * stride_lh, lse, mask=row_ok)


def _tiles(q: torch.Tensor, keys: torch.Tensor) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_stages)`` for ``q`` ``[B, T, H, D]`` over ``keys`` ``[B, Hkv, S, D]``:
    the sweep's rows a program (in the interpreter, which pays per operation, all of a KV head's
    rows up to 64) and :func:`key_tiles`."""
    _, T, H, D = q.shape
    group = H // keys.shape[1]
    block_m = BLOCK_M if not interpreting(_masked_attention_kernel) else min(64, max(16, next_pow2(T * group)))
    return (block_m, *key_tiles(q.device, max(16, next_pow2(D)), q.element_size()))


def masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Rows ``q`` ``[B, T, H, D]`` over ``keys``/``values`` ``[B, Hkv, S, D]`` where the bool
    ``mask`` ``[B, T, S]`` is True; ``[B, T, H * D]`` in ``q``'s dtype.

    Any strides with a contiguous last dimension. ``H`` must be a multiple of ``Hkv`` (query head
    ``h`` uses KV head ``h // (H // Hkv)``). A row with no True in its mask gets zeros. float64, and
    CPU tensors outside the Triton interpreter, go through :func:`masked_attention_reference`.
    """
    _check_inputs(q, keys, values, mask)
    B, T, H, D = q.shape
    if q.dtype == torch.float64 or (not q.is_cuda and not interpreting(_masked_attention_kernel)):
        return masked_attention_reference(q, keys, values, mask, scale)
    out = torch.empty(B, T, H, D, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out.flatten(-2)
    block_m, block_n, stages = _tiles(q, keys)
    launch(q, keys, values, mask, out, None, scale, block_m, block_n, 4, stages)
    return out.flatten(-2)


def launch(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, out: torch.Tensor,
           lse: torch.Tensor | None, scale: float, block_m: int, block_n: int, num_warps: int, num_stages: int,
           segments: Segments | None = None, splits: int = 1, ring_chunk: int = 0) -> None:
    """The kernel on checked operands (``q``/``out`` ``[B, T, H, D]``, ``keys``/``values``
    ``[B, Hkv, S, D]``, ``mask`` ``[B, T, S]`` bool or uint8, ``lse`` float32 ``[B, T, H]`` or
    None; any strides with a contiguous last dimension) and the caller's tiles: the tree half of
    hybrid attention (:mod:`.tree_attention`, its keys the draft tokens themselves) runs it too.
    ``segments``: :func:`masked_attention_into`'s new rows and split mask (``keys``/``values`` are
    then the whole buffers and ``mask`` the first piece). ``splits`` > 1 (with ``segments``): the
    ring's columns cut into chunks of ``ring_chunk``, one program each, ``out`` and ``lse`` then
    ``[splits, B, T, H, D]`` and ``[splits, B, T, H]``, one partial state a split."""
    B, T, H, D = q.shape
    Hkv = keys.shape[1]
    upcast = upcast_dots(_masked_attention_kernel)
    mask_u8 = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    if splits > 1:  # the split's stride first
        out_strides = (out.stride(1), out.stride(2), out.stride(3), out.stride(0))
        lse_strides = (lse.stride(1), lse.stride(2), lse.stride(3), lse.stride(0))
    else:
        out_strides = (*out.stride()[:3], 0)
        lse_strides = (*lse.stride(), 0) if lse is not None else (0, 0, 0, 0)
    if segments is None:
        S, split, new_k, new_v, mask2 = keys.shape[2], 0, keys, values, mask_u8
        new_strides = (0,) * 9
    else:  # the kernel walks the buffer's columns before `at`, then the new rows
        new_k, new_v, S, mask2, split = segments
        mask2 = mask2.view(torch.uint8)
        new_strides = (new_k.stride(0), new_k.stride(1), new_k.stride(2), new_v.stride(0), new_v.stride(1),
                       new_v.stride(2), *mask2.stride())
    grid = (triton.cdiv(T * (H // Hkv), block_m), B * Hkv, splits)
    _masked_attention_kernel[grid](
        q, keys, values, mask_u8, out, lse if lse is not None else out, new_k, new_v, mask2,
        q.stride(0), q.stride(1), q.stride(2),
        keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        mask_u8.stride(0), mask_u8.stride(1), mask_u8.stride(2),
        *out_strides, *lse_strides, *new_strides,
        scale * LOG2_E, T, S, Hkv, split, ring_chunk if splits > 1 else split,
        GROUP=H // Hkv, HEAD_DIM=D, BLOCK_D=max(16, next_pow2(D)), BLOCK_M=block_m, BLOCK_N=block_n,
        UPCAST=upcast, PRECISION="ieee" if upcast or q.dtype == torch.float32 else "tf32",
        STORE_LSE=lse is not None, SEGMENTS=segments is not None, BLOCK_T=max(16, next_pow2(T)), SPLITS=splits,
        num_warps=num_warps, num_stages=num_stages,
    )


class Segments(NamedTuple):
    """:func:`masked_attention_into`'s operands beside the usual ones."""

    new_k: torch.Tensor  # [B, T, Hkv, D]
    new_v: torch.Tensor
    at: int
    mask2: torch.Tensor  # [B, T, at + T - split] bool
    split: int


def masked_attention_into(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, new_k: torch.Tensor,
                          new_v: torch.Tensor, at: int, ring_mask: torch.Tensor, tree_mask: torch.Tensor,
                          scale: float, ring_splits: int | None = None) -> torch.Tensor:
    """The ``T`` rows' K/V ``new_k``/``new_v`` ``[B, T, Hkv, D]`` written into the buffers
    ``keys``/``values`` ``[B, Hkv, S_max, D]`` at columns ``at .. at + T``, then :func:`masked_attention`
    of ``q`` ``[B, T, H, D]`` over columns ``0 .. at + T`` under the mask ``[ring_mask, tree_mask]``:
    ``ring_mask`` ``[B, W]`` (the columns below ``W``, the same for every row) and ``tree_mask``
    ``[B, T, at + T - W]`` (the rest, the new rows' own columns last).

    A LongSpec level's self-attention over its ring and the tree so far, its rows joining the tree:
    one launch, where writing the rows into the buffer, the mask's concatenation and (in a compiled
    step, the buffer being written between calls) a copy of the buffers before each call took
    kernels of their own. The kernel walks the ring's columns under one mask row a tile, then the
    tree's columns already in the buffer, then the new rows as one tile read from ``new_k``/``new_v``
    (so ``T`` is at most :data:`MAX_NEW_ROWS`), which one program per KV head writes to the buffer:
    no program reads a column another writes. The three walks, rather than one whose tiles pick
    each column's source, keep one load an operand a pipeline stage: picking per column (a pointer
    chosen by column, the new rows stored from the tile) was measured far slower than the three
    walks, and the three walks about as fast as the unfused kernel's one walk plus the
    launches this one saves (docs/performance.md).

    ``ring_splits`` (default :data:`RING_SPLITS`, at most one a key tile of the ring): the ring's
    columns cut among that many programs a block of rows, the last of them also walking the tree
    and the new rows, their partial states merged by log-sum-exp (:func:`.merge.merge_split_states`)
    in a second launch. A level's few rows leave most of the GPU idle (32 programs for 16 rows of
    32 heads over 8 KV heads), each walking the whole ring in turn."""
    _check_qkv(q, keys, values)
    for x in (new_k, new_v, ring_mask, tree_mask):
        if x.device != q.device:
            raise ValueError("every operand must be on q's device")
    if new_k.dtype != q.dtype or new_v.dtype != q.dtype or ring_mask.dtype != torch.bool or tree_mask.dtype != torch.bool:
        raise ValueError("new_k/new_v must be in q's dtype and the masks bool")
    B, T, H, D = q.shape
    W = ring_mask.shape[1]
    if new_k.shape != (B, T, keys.shape[1], D) or new_v.shape != new_k.shape:
        raise ValueError(f"new_k/new_v must be [B, T, Hkv, D] = {(B, T, keys.shape[1], D)}, "
                         f"got {tuple(new_k.shape)} and {tuple(new_v.shape)}")
    if ring_mask.shape != (B, W) or tree_mask.shape != (B, T, at + T - W) or not 0 <= W <= at:
        raise ValueError(f"ring_mask [B, W] and tree_mask [B, T, at + T - W] with W <= at = {at}, got "
                         f"{tuple(ring_mask.shape)} and {tuple(tree_mask.shape)}")
    if T > MAX_NEW_ROWS:
        raise ValueError(f"at most {MAX_NEW_ROWS} new rows a call (they are one tile), got {T}")
    if keys.shape[2] < at + T:
        raise ValueError(f"the buffers hold {keys.shape[2]} columns, fewer than at + T = {at + T}")
    if q.dtype == torch.float64 or (not q.is_cuda and not interpreting(_masked_attention_kernel)):
        return masked_attention_into_reference(q, keys, values, new_k, new_v, at, ring_mask, tree_mask, scale)
    if new_k.stride(-1) != 1 or new_v.stride(-1) != 1:
        raise ValueError("new_k and new_v must have a contiguous last dimension")
    out = torch.empty(B, T, H, D, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out.flatten(-2)
    block_m, block_n, stages = _tiles(q, keys)
    tiles = triton.cdiv(W, block_n)
    splits = max(1, min(RING_SPLITS if ring_splits is None else ring_splits, tiles))
    segments = Segments(new_k, new_v, at, tree_mask, W)
    ring = ring_mask[:, None, :].expand(B, T, W)
    if splits == 1:
        launch(q, keys, values, ring, out, None, scale, block_m, block_n, 4, stages, segments)
        return out.flatten(-2)
    chunk = triton.cdiv(tiles, splits) * block_n
    splits = triton.cdiv(W, chunk)  # none empty
    part_o = torch.empty(splits, B, T, H, D, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(splits, B, T, H, dtype=torch.float32, device=q.device)
    launch(q, keys, values, ring, part_o, part_lse, scale, block_m, block_n, 4, stages, segments, splits, chunk)
    merge_split_states(part_o.permute(1, 2, 3, 0, 4).flatten(0, 1), part_lse.permute(1, 2, 3, 0).flatten(0, 1),
                       out=out.view(B * T, H, D))
    return out.flatten(-2)


def masked_attention_into_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                                    new_k: torch.Tensor, new_v: torch.Tensor, at: int, ring_mask: torch.Tensor,
                                    tree_mask: torch.Tensor, scale: float) -> torch.Tensor:
    """The PyTorch twin of :func:`masked_attention_into`: :func:`join_rows`, then SDPA."""
    T = q.shape[1]
    mask = join_rows(keys, values, new_k, new_v, at, ring_mask, tree_mask)
    return masked_attention_reference(q, keys[:, :, : at + T], values[:, :, : at + T], mask, scale)


def join_rows(keys: torch.Tensor, values: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor, at: int,
              ring_mask: torch.Tensor, tree_mask: torch.Tensor) -> torch.Tensor:
    """:func:`masked_attention_into`'s first half as torch ops: the rows written into the buffers,
    and the whole ``[B, T, at + T]`` mask (the ring's row for every query row, then the tree's)."""
    T = new_k.shape[1]
    keys[:, :, at : at + T] = new_k.transpose(1, 2)
    values[:, :, at : at + T] = new_v.transpose(1, 2)
    return torch.cat([ring_mask[:, None, :].expand(-1, T, -1), tree_mask], dim=2)


def masked_attention_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                               mask: torch.Tensor, scale: float) -> torch.Tensor:
    """The PyTorch twin (SDPA), with zeros instead of NaN for a row whose mask has no True."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask.unsqueeze(1),
                                         scale=scale, enable_gqa=keys.shape[1] != q.shape[2])
    out = torch.where(mask.any(-1)[:, :, None, None], out.transpose(1, 2), 0.0)
    return out.flatten(-2)


def _check_inputs(q, keys, values, mask) -> None:
    if mask.dim() != 3:
        raise ValueError(f"expected q [B, T, H, D], keys/values [B, Hkv, S, D] and mask [B, T, S], got "
                         f"{tuple(q.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}, {tuple(mask.shape)}")
    _check_qkv(q, keys, values)
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool, got {mask.dtype}")
    B, T = q.shape[:2]
    if mask.shape != (B, T, keys.shape[2]):
        raise ValueError(f"mask must be [B, T, S] = {(B, T, keys.shape[2])}, got {tuple(mask.shape)}")
    if mask.device != q.device:
        raise ValueError("q, keys, values and mask must be on one device")


def _check_qkv(q, keys, values) -> None:
    if q.dim() != 4 or keys.dim() != 4 or values.dim() != 4:
        raise ValueError(f"expected q [B, T, H, D] and keys/values [B, Hkv, S, D], got "
                         f"{tuple(q.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}")
    if q.dtype not in KERNEL_DTYPES + (torch.float64,):
        raise ValueError(f"q must be float16, bfloat16, float32 or float64, got {q.dtype}")
    if keys.dtype != q.dtype or values.dtype != q.dtype:
        raise ValueError(f"q, keys and values must share one dtype, got {q.dtype}, {keys.dtype}, {values.dtype}")
    B, T, H, D = q.shape
    if keys.shape != values.shape or keys.shape[0] != B or keys.shape[3] != D:
        raise ValueError(f"keys and values must both be [B={B}, Hkv, S, D={D}], "
                         f"got {tuple(keys.shape)} and {tuple(values.shape)}")
    if keys.shape[1] == 0 or H % keys.shape[1] != 0:
        raise ValueError(f"the {H} query heads must be a multiple of the {keys.shape[1]} KV heads")
    if any(x.device != q.device for x in (keys, values)):
        raise ValueError("q, keys, values and mask must be on one device")
    for name, x in (("q", q), ("keys", keys), ("values", values)):
        if x.stride(-1) != 1 and x.shape[-1] > 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    check_head_dim(D)
