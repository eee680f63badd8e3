"""Merging attention states by their log-sum-exp, all in base 2.

An attention *state* over a set of keys is the normalised output ``o = sum_j p_j v_j`` and
``lse = log2(sum_j exp(sm_scale * q.k_j))``. Two states over disjoint key sets merge exactly into
the state over their union::

    lse = log2(2^lse_a + 2^lse_b),   o = 2^(lse_a - lse) * o_a + 2^(lse_b - lse) * o_b

FlashInfer returns base-2 LSEs (``lse_base="log2"``, its default) and so do this package's Triton
kernels; ``torch.logsumexp``, flash-attn and LongSpec's kernel use natural logs. Mixing the two
silently mis-weights the parts, so every function here takes and returns base 2, and
``lse_to_base2``/``lse_to_natural`` convert at the boundary. A state with ``lse = -inf`` (no keys)
contributes nothing; a merge of only such states gives ``o = 0``, ``lse = -inf``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .triton_common import LN_2, LOG2_E, interpreting, next_pow2


def lse_to_base2(lse_natural: torch.Tensor) -> torch.Tensor:
    return lse_natural * LOG2_E


def lse_to_natural(lse_base2: torch.Tensor) -> torch.Tensor:
    return lse_base2 * LN_2


@triton.jit
def _merge_split_states_kernel(
    PartO,
    PartLse,
    Out,
    OutLse,
    num_states,
    num_rows,
    num_heads,
    stride_po_tok,
    stride_po_head,
    stride_po_split,
    stride_pl_tok,
    stride_pl_head,
    stride_pl_split,
    stride_o_tok,
    stride_o_head,
    stride_ol_tok,
    stride_ol_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_R: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    # A program merges BLOCK_R (token, head) rows; row r is token r // H, head r % H.
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < num_rows
    tok = (r // num_heads).to(tl.int64)
    h = r % num_heads
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_states
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM

    rs_ok = r_ok[:, None] & s_ok[None, :]
    lse = tl.load(
        PartLse + (tok * stride_pl_tok + h * stride_pl_head)[:, None] + s[None, :] * stride_pl_split,
        mask=rs_ok,
        other=float("-inf"),
    )  # [BLOCK_R, BLOCK_S]
    m = tl.max(lse, 1)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_ref[:, None])
    denom = tl.sum(w, 1)
    o = tl.load(
        PartO + (tok * stride_po_tok + h * stride_po_head)[:, None, None]
        + s[None, :, None] * stride_po_split + d[None, None, :],
        mask=rs_ok[:, :, None] & d_ok[None, None, :],
        other=0.0,
    )  # [BLOCK_R, BLOCK_S, BLOCK_D]
    # Empty states carry o = 0, lse = -inf (weight 0); never multiply a weight by garbage.
    o = tl.where(w[:, :, None] > 0.0, o, 0.0)
    has_key = denom > 0.0
    merged = tl.sum(o * w[:, :, None], 1) / tl.where(has_key, denom, 1.0)[:, None]
    tl.store(
        Out + (tok * stride_o_tok + h * stride_o_head)[:, None] + d[None, :],
        merged.to(Out.dtype.element_ty),
        mask=r_ok[:, None] & d_ok[None, :],
    )
    if WRITE_LSE:
        out_lse = tl.where(has_key, m_ref + tl.log2(tl.where(has_key, denom, 1.0)), float("-inf"))
        tl.store(OutLse + tok * stride_ol_tok + h * stride_ol_head, out_lse, mask=r_ok)


def merge_split_states(
    part_o: torch.Tensor,
    part_lse: torch.Tensor,
    *,
    num_states: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
    out_lse: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Merge the states laid out along axis 2: ``part_o [N, H, S, D]``, ``part_lse [N, H, S]``.

    Only the first ``num_states`` (default ``S``) states are read. Returns ``(out [N, H, D],
    out_lse [N, H] or None)``; ``out_lse`` is written only when given.
    """
    num_tokens, num_heads, num_slots, head_dim = part_o.shape
    if num_states is None:
        num_states = num_slots
    if part_o.stride(-1) != 1:
        raise ValueError("part_o must have a contiguous last dimension")
    if out is None:
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=out_dtype or part_o.dtype, device=part_o.device)
    if out.stride(-1) != 1:
        raise ValueError("out must have a contiguous last dimension")
    num_rows = num_tokens * num_heads
    if num_rows == 0:
        return out, out_lse
    block_s = max(2, next_pow2(num_states))
    block_d = next_pow2(head_dim)
    # Rows per program: a few thousand partial elements per program on a GPU; as many as
    # possible in the interpreter, whose cost is per executed operation.
    budget = 1 << 20 if interpreting(_merge_split_states_kernel) else 4096  # the interpreter caps a tensor at 2^20
    block_r = max(1, min(next_pow2(num_rows), budget // (block_s * block_d)))
    block_r = 1 << (block_r.bit_length() - 1)
    _merge_split_states_kernel[(triton.cdiv(num_rows, block_r),)](
        part_o,
        part_lse,
        out,
        out_lse if out_lse is not None else part_lse,
        num_states,
        num_rows,
        num_heads,
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        part_lse.stride(2),
        out.stride(0),
        out.stride(1),
        out_lse.stride(0) if out_lse is not None else 0,
        out_lse.stride(1) if out_lse is not None else 0,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_S=block_s,
        BLOCK_R=block_r,
        WRITE_LSE=out_lse is not None,
        num_warps=4,
    )
    return out, out_lse


@triton.jit
def _merge_two_states_kernel(
    OA,
    LA,
    OB,
    LB,
    Out,
    OutLse,
    num_rows,
    num_heads,
    tree_size,
    # Operand addresses: token n = req*T + t, head h = kvh*G + g, each with its own strides.
    sa_req, sa_t, sa_kvh, sa_g, sla_req, sla_t, sla_kvh, sla_g,
    sb_req, sb_t, sb_kvh, sb_g, slb_req, slb_t, slb_kvh, slb_g,
    stride_o_tok,
    stride_o_head,
    stride_ol_tok,
    stride_ol_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    A_NATURAL: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < num_rows
    tok = (r // num_heads).to(tl.int64)
    head = r % num_heads
    req = tok // tree_size
    t = tok % tree_size
    kvh = head // GROUP
    g = head % GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    rd_ok = r_ok[:, None] & d_ok[None, :]

    lse_a = tl.load(LA + req * sla_req + t * sla_t + kvh * sla_kvh + g * sla_g, mask=r_ok, other=float("-inf"))
    if A_NATURAL:  # FA3's convention: natural log, +inf for a row without keys (the factor is LOG2_E:
        # a jit kernel reads no module-level float)
        lse_a = tl.where((lse_a == float("inf")) | (lse_a != lse_a), float("-inf"), lse_a * 1.4426950408889634)  # noqa: PLR0124 - NaN
    lse_b = tl.load(LB + req * slb_req + t * slb_t + kvh * slb_kvh + g * slb_g, mask=r_ok, other=float("-inf"))
    m = tl.maximum(lse_a, lse_b)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp2(lse_a - m_ref)
    w_b = tl.exp2(lse_b - m_ref)
    denom = w_a + w_b
    has_key = denom > 0.0
    off_a = req * sa_req + t * sa_t + kvh * sa_kvh + g * sa_g
    off_b = req * sb_req + t * sb_t + kvh * sb_kvh + g * sb_g
    o_a = tl.load(OA + off_a[:, None] + d[None, :], mask=rd_ok, other=0.0).to(tl.float32)
    o_b = tl.load(OB + off_b[:, None] + d[None, :], mask=rd_ok, other=0.0).to(tl.float32)
    o_a = tl.where(w_a[:, None] > 0.0, o_a, 0.0)
    o_b = tl.where(w_b[:, None] > 0.0, o_b, 0.0)
    merged = (o_a * w_a[:, None] + o_b * w_b[:, None]) / tl.where(has_key, denom, 1.0)[:, None]
    tl.store(
        Out + (tok * stride_o_tok + head * stride_o_head)[:, None] + d[None, :],
        merged.to(Out.dtype.element_ty),
        mask=rd_ok,
    )
    if WRITE_LSE:
        out_lse = tl.where(has_key, m_ref + tl.log2(tl.where(has_key, denom, 1.0)), float("-inf"))
        tl.store(OutLse + tok * stride_ol_tok + head * stride_ol_head, out_lse, mask=r_ok)


def token_head_strides(x: torch.Tensor, tree_size: int, group: int) -> Tuple[int, int, int, int]:
    """Strides (req, t, kv_head, g) of a plain ``[req*T + t, kv_head*G + g, ...]`` tensor."""
    return (tree_size * x.stride(0), x.stride(0), group * x.stride(1), x.stride(1))


def folded_strides(x: torch.Tensor, tree_size: int, group: int) -> Tuple[int, int, int, int]:
    """Strides (req, t, kv_head, g) of a GQA-folded ``[req, kv_head*(T*G) + t*G + g, ...]`` tensor."""
    return (x.stride(0), group * x.stride(1), tree_size * group * x.stride(1), x.stride(1))


def merge_two_states_strided(
    o_a: torch.Tensor,
    lse_a: torch.Tensor,
    strides_a: Tuple[Tuple[int, int, int, int], Tuple[int, int, int, int]],
    o_b: torch.Tensor,
    lse_b: torch.Tensor,
    strides_b: Tuple[Tuple[int, int, int, int], Tuple[int, int, int, int]],
    out: torch.Tensor,
    out_lse: Optional[torch.Tensor],
    tree_size: int,
    group: int,
    a_natural: bool = False,
) -> None:
    """Merge two states whose (token, head) addressing is given as (req, t, kv_head, g) strides.

    Lets a GQA-folded FlashInfer state merge with a plain one without unfolding copies.
    ``out`` is plain ``[N, Hq, D]``. ``a_natural``: ``lse_a`` is FA3's as it returns it (natural
    log, ``+inf`` for a row without keys), converted as it is read: in a verify forward that
    saves the conversion's own elementwise kernels, several per layer.
    """
    num_tokens, num_heads, head_dim = out.shape
    num_rows = num_tokens * num_heads
    if num_rows == 0:
        return
    (sa, sla), (sb, slb) = strides_a, strides_b
    block_d = next_pow2(head_dim)
    budget = 1 << 20 if interpreting(_merge_two_states_kernel) else 2048
    block_r = max(1, min(next_pow2(num_rows), budget // block_d))
    _merge_two_states_kernel[(triton.cdiv(num_rows, block_r),)](
        o_a,
        lse_a,
        o_b,
        lse_b,
        out,
        out_lse if out_lse is not None else lse_a,
        num_rows,
        num_heads,
        tree_size,
        *sa,
        *sla,
        *sb,
        *slb,
        out.stride(0),
        out.stride(1),
        out_lse.stride(0) if out_lse is not None else 0,
        out_lse.stride(1) if out_lse is not None else 0,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_R=block_r,
        WRITE_LSE=out_lse is not None,
        A_NATURAL=a_natural,
        num_warps=4,
    )


def merge_states(
    o_a: torch.Tensor,
    lse_a: torch.Tensor,
    o_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    out: Optional[torch.Tensor] = None,
    out_lse: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge two states ``[N, H, D]`` + fp32 base-2 LSE ``[N, H]`` (FlashInfer's ``merge_state``).

    ``out`` may alias ``o_a`` (in-place merge). Returns ``(out, out_lse)``.
    """
    if o_a.shape != o_b.shape or lse_a.shape != o_a.shape[:2] or lse_b.shape != o_a.shape[:2]:
        raise ValueError("states must be [N, H, D] with LSE [N, H]")
    for x in (o_a, o_b):
        if x.stride(-1) != 1:
            raise ValueError("outputs must have a contiguous last dimension")
    if out is None:
        out = torch.empty_like(o_a)
    if out_lse is None:
        out_lse = torch.empty(lse_a.shape, dtype=torch.float32, device=lse_a.device)
    plain = lambda x: token_head_strides(x, 1, 1)  # noqa: E731
    merge_two_states_strided(
        o_a, lse_a, (plain(o_a), plain(lse_a)), o_b, lse_b, (plain(o_b), plain(lse_b)),
        out, out_lse, tree_size=1, group=1,
    )
    return out, out_lse
