"""OWL's tree expansion with fused Triton kernels: six launches per level instead of about fifty.

:func:`sgl_longgen.core.owl.expand` is a few hundred small PyTorch ops (the LSTM cell's norms
and activations, a log-softmax and top-k per level, the frontier's bookkeeping, the final
selection). At batch 1 on an 8B-sized drafter that is launch-bound: even as one CUDA graph the
beam took several times what reading its weights takes (docs/performance.md). Here each level is

1. ``pre = proj(state)`` (cuBLAS; with ``weights = "fp8"`` the fp8 GEMM of :mod:`.fp8_linear`),
2. :func:`_lstm_cell_kernel`: token embedding, gates, both norms and GELUs, one program per row;
   a row reads its parent's projection and cell through an index, so the frontier is never copied,
3. ``logits = head(state)`` (the same call as the eager beam),
4. :func:`_chunk_topk_kernel`: per (row, vocabulary chunk) the chunk's max, sum of exponentials
   and its top ``K`` logits,
5. :func:`_row_merge_kernel`: per row the log-sum-exp and top ``K`` over the chunks, written to
   the candidate pool as cumulative scores (mapped to target ids for a reduced head),
6. :func:`_frontier_kernel`: per request the ``K`` best candidates of the level become the next
   frontier,

and :func:`_final_select_kernel` keeps the ``tree_size`` best nodes of the pool in creation order.
The result is :func:`expand`'s :class:`DraftBeam`, with the same tie rule (ties to the earlier
node). Elementwise steps round to the drafter's dtype where the eager beam does, so the two agree
up to the last bit of transcendental functions; a different tree would only change what gets
verified, never the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.owl import DraftBeam, OwlDrafter, pool_size
from . import fp8_linear  # noqa: F401 (installs the fp8 GEMM of the device: the fp8 drafter's projections take it)

_INT_MAX = tl.constexpr(2**31 - 1)
_CHUNK = 2048  # vocabulary slice of one top-k program


@triton.jit
def _rnd(x, DT: tl.constexpr):
    """Round an fp32 value through the storage dtype, as the eager op would have stored it."""
    return x.to(DT).to(tl.float32)


@triton.jit
def _top_k(x, keys, valid, K: tl.constexpr, KP: tl.constexpr):
    """The ``K`` largest of ``x`` (ties: the smaller key) as ``(values, keys)``, ``[KP]`` each.

    ``keys`` (int32) name the entries and are unique where ``valid``; a picked entry is removed
    by its key. ``K`` passes of max and argmin over the block: ``K`` is the beam's top-k.
    """
    kk = tl.arange(0, KP)
    vals = tl.full([KP], float("-inf"), tl.float32)
    picks = tl.zeros([KP], tl.int32)
    for k in range(K):
        v = tl.max(x, 0)
        i = tl.min(tl.where(valid & (x == v), keys, _INT_MAX), 0)
        vals = tl.where(kk == k, v, vals)
        picks = tl.where(kk == k, i, picks)
        x = tl.where(keys == i, float("-inf"), x)
    return vals, picks


@triton.jit
def _gelu(x):
    return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))


@triton.jit
def _rms_scale(x, mask, n, eps, DT: tl.constexpr):
    """:func:`sgl_longgen.core.owl.rms_scale` of one row held in fp32."""
    xs = tl.where(mask, x, 0.0)
    h = x * tl.rsqrt(tl.sum(xs * xs, 0) / n + eps)
    return (h / 1.4142135623730951).to(DT)


@triton.jit
def _first_input_kernel(h_ptr, s_ptr, has_ptr, null_ptr, out_ptr, D0, eps,
                        SPEC: tl.constexpr, BLOCK: tl.constexpr):
    """``[scale(h_last); scale(h_S) or null]`` for one request."""
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < D0
    DT = out_ptr.dtype.element_ty
    width = 2 * D0 if SPEC else D0
    h = tl.load(h_ptr + b * D0 + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + b * width + offs, _rms_scale(h, m, D0, eps, DT), mask=m)
    if SPEC:
        s = tl.load(s_ptr + b * D0 + offs, mask=m, other=0.0).to(tl.float32)
        scaled = _rms_scale(s, m, D0, eps, DT)
        null = tl.load(null_ptr + offs, mask=m, other=0.0).to(DT)
        has = tl.load(has_ptr + b) != 0
        tl.store(out_ptr + b * width + D0 + offs, tl.where(has, scaled, null), mask=m)


@triton.jit
def _bias_rms_norm(x, mask, w, bias, n, eps, DT: tl.constexpr):
    """:class:`sgl_longgen.core.owl.BiasRMSNorm` of one fp32 row, rounded like the eager op."""
    xs = tl.where(mask, x, 0.0)
    h = _rnd(x * tl.rsqrt(tl.sum(xs * xs, 0) / n + eps), DT)
    return _rnd(_rnd(h * w, DT) + bias, DT)


@triton.jit
def _lstm_cell_kernel(pre_ptr, src_ptr, tok_ptr, emb_ptr, alpha, cell_ptr,
                      cw_ptr, cb_ptr, sw_ptr, sb_ptr, state_out, cell_out, D, eps,
                      FIRST: tl.constexpr, BLOCK: tl.constexpr):
    """One drafter step for row ``r``: reads ``pre[src[r]]`` (its parent's projection) and, after
    the first step, the parent's cell ``cell[src[r]]``."""
    r = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < D
    DT = state_out.dtype.element_ty
    src = tl.load(src_ptr + r).to(tl.int64)
    tok = tl.load(tok_ptr + r).to(tl.int64)
    e = _rnd(alpha * tl.load(emb_ptr + tok * D + offs, mask=m, other=0.0).to(tl.float32), DT)
    row = pre_ptr + src * 4 * D
    pf = _rnd(tl.load(row + offs, mask=m, other=0.0).to(tl.float32) + e, DT)
    pi = _rnd(tl.load(row + D + offs, mask=m, other=0.0).to(tl.float32) + e, DT)
    po = _rnd(tl.load(row + 2 * D + offs, mask=m, other=0.0).to(tl.float32) + e, DT)
    pc = _rnd(tl.load(row + 3 * D + offs, mask=m, other=0.0).to(tl.float32) + e, DT)
    f = _rnd(tl.sigmoid(pf), DT)
    i = _rnd(tl.sigmoid(pi), DT)
    o = _rnd(tl.sigmoid(po), DT)
    cw = tl.load(cw_ptr + offs, mask=m, other=0.0).to(tl.float32)
    cb = tl.load(cb_ptr + offs, mask=m, other=0.0).to(tl.float32)
    cand = _rnd(_rnd(_gelu(_bias_rms_norm(pc, m, cw, cb, D, eps, DT)), DT) * i, DT)
    if FIRST:
        cell = cand
    else:
        prev = tl.load(cell_ptr + src * D + offs, mask=m, other=0.0).to(tl.float32)
        cell = _rnd(_rnd(prev * f, DT) + cand, DT)
    sw = tl.load(sw_ptr + offs, mask=m, other=0.0).to(tl.float32)
    sb = tl.load(sb_ptr + offs, mask=m, other=0.0).to(tl.float32)
    state = _rnd(_gelu(_bias_rms_norm(cell, m, sw, sb, D, eps, DT)), DT) * o
    tl.store(state_out + r * D + offs, state.to(DT), mask=m)
    tl.store(cell_out + r * D + offs, cell.to(DT), mask=m)


@triton.jit
def _chunk_topk_kernel(logits_ptr, V, part_max, part_sum, part_val, part_idx, n_chunks,
                       K: tl.constexpr, KP: tl.constexpr, CHUNK: tl.constexpr):
    """Max, sum of exp(x - max) and the top ``K`` (ties: lower id) of one vocabulary chunk of one row."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    m = offs < V
    x = tl.load(logits_ptr + r.to(tl.int64) * V + offs, mask=m, other=float("-inf")).to(tl.float32)
    mx = tl.max(x, 0)
    tl.store(part_max + r * n_chunks + c, mx)
    tl.store(part_sum + r * n_chunks + c, tl.sum(tl.where(m, tl.exp(x - mx), 0.0), 0))
    vals, ids = _top_k(x, offs, m, K, KP)
    kk = tl.arange(0, KP)
    out = (r * n_chunks + c) * K + kk
    tl.store(part_val + out, vals, mask=kk < K)
    tl.store(part_idx + out, ids, mask=kk < K)


@triton.jit
def _row_merge_kernel(part_max, part_sum, part_val, part_idx, n_chunks, front_s, front_idx, token_map,
                      pool_s, pool_t, pool_p, pool_d, P, offset, level,
                      ROWS: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, NCP: tl.constexpr,
                      CP: tl.constexpr, FIRST: tl.constexpr, REDUCED: tl.constexpr):
    """Row ``r``'s log-softmax top ``K``, added to its frontier score, into the pool.

    Row ``r`` is request ``r // ROWS``'s ``(r % ROWS)``-th frontier node; its children take pool
    slots ``offset + (r % ROWS) * K + k``, the eager beam's ``reshape(B, K * K)`` order.
    """
    r = tl.program_id(0)
    b = r // ROWS
    j = r % ROWS
    cs = tl.arange(0, NCP)
    cm = cs < n_chunks
    mxs = tl.load(part_max + r * n_chunks + cs, mask=cm, other=float("-inf"))
    big = tl.max(mxs, 0)
    sums = tl.load(part_sum + r * n_chunks + cs, mask=cm, other=0.0)
    lse = big + tl.log(tl.sum(tl.where(cm, sums * tl.exp(mxs - big), 0.0), 0))
    ps = tl.arange(0, CP)
    pm = ps < n_chunks * K
    x = tl.load(part_val + r * n_chunks * K + ps, mask=pm, other=float("-inf"))
    ids = tl.load(part_idx + r * n_chunks * K + ps, mask=pm, other=_INT_MAX)
    if FIRST:
        base = 0.0
        parent = -1
    else:
        base = tl.load(front_s + r)
        parent = tl.load(front_idx + r)
    vals, picked = _top_k(x, ids, pm, K, KP)
    toks = picked.to(tl.int64)
    kk = tl.arange(0, KP)
    if REDUCED:
        toks = tl.load(token_map + toks, mask=kk < K, other=0)
    slot = b.to(tl.int64) * P + offset + j * K + kk
    km = kk < K
    tl.store(pool_s + slot, base + (vals - lse), mask=km)
    tl.store(pool_t + slot, toks, mask=km)
    tl.store(pool_p + slot, tl.zeros([KP], tl.int64) + parent, mask=km)
    tl.store(pool_d + slot, tl.zeros([KP], tl.int64) + level, mask=km)


@triton.jit
def _frontier_kernel(pool_s, pool_t, P, offset, front_s, front_t, front_idx, src,
                     ROWS: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, LP: tl.constexpr):
    """Request ``b``'s ``K`` best candidates of this level (ties: earlier slot) become its frontier;
    ``src`` names the row of this level each one hangs from."""
    b = tl.program_id(0)
    ls = tl.arange(0, LP)
    lm = ls < ROWS * K
    base = b.to(tl.int64) * P + offset
    x = tl.load(pool_s + base + ls, mask=lm, other=float("-inf"))
    vals, picks = _top_k(x, ls, lm, K, KP)
    kk = tl.arange(0, KP)
    km = kk < K
    toks = tl.load(pool_t + base + picks, mask=km, other=0)
    out = b * K + kk
    tl.store(front_s + out, vals, mask=km)
    tl.store(front_t + out, toks, mask=km)
    tl.store(front_idx + out, (offset + picks).to(tl.int64), mask=km)
    tl.store(src + out, (b * ROWS + picks // K).to(tl.int64), mask=km)


@triton.jit
def _final_select_kernel(pool_s, pool_t, pool_p, pool_d, P, N, slot_buf,
                         out_t, out_p, out_d, out_s, PP: tl.constexpr):
    """The ``N`` best pool nodes of request ``b`` (stable descending order), in creation order,
    with parents renumbered among them."""
    b = tl.program_id(0)
    offs = tl.arange(0, PP)
    m = offs < P
    base = b.to(tl.int64) * P
    s = tl.load(pool_s + base + offs, mask=m, other=float("-inf"))
    x = s
    sel = offs < 0
    for _ in range(N):
        v = tl.max(x, 0)
        i = tl.min(tl.where(m & ~sel & (x == v), offs, _INT_MAX), 0)
        sel = sel | (offs == i)
        x = tl.where(offs == i, float("-inf"), x)
    pos = tl.cumsum(sel.to(tl.int32), 0) - 1
    slots = slot_buf + b.to(tl.int64) * PP
    tl.store(slots + offs, tl.where(sel, pos, -1))
    tl.debug_barrier()
    parent = tl.load(pool_p + base + offs, mask=m, other=-1)
    new_parent = tl.load(slots + tl.maximum(parent, 0), mask=sel & (parent >= 0), other=-1)
    new_parent = tl.where(parent >= 0, new_parent, -1).to(tl.int64)
    dst = b.to(tl.int64) * N + pos
    tl.store(out_t + dst, tl.load(pool_t + base + offs, mask=m, other=0), mask=sel)
    tl.store(out_p + dst, new_parent, mask=sel)
    tl.store(out_d + dst, tl.load(pool_d + base + offs, mask=m, other=0), mask=sel)
    tl.store(out_s + dst, s, mask=sel)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _warps(block: int) -> int:
    return max(1, min(16, block // 256))


@torch.no_grad()
def fused_expand(
    drafter: OwlDrafter,
    h_last: torch.Tensor,
    roots,
    h_spec: torch.Tensor | None = None,
    has_spec: torch.Tensor | None = None,
    *,
    top_k: int = 10,
    depth: int = 8,
    tree_size: int = 30,
) -> DraftBeam:
    """:func:`sgl_longgen.core.owl.expand` (same arguments, same result) in fused kernels.

    Scores accumulate in fp32 whatever the drafter's dtype (the engines run bf16/fp16/fp32).
    """
    w = drafter.embedding.weight  # the drafter's device and dtype (its matrices may be fp8)
    dev, dt = w.device, w.dtype
    h_last = h_last.to(device=dev, dtype=dt).contiguous()
    B, d0 = h_last.shape
    d = drafter.width
    V = drafter.draft_vocab_size
    K = min(top_k, V)
    KP = _pow2(K)
    eps = float(drafter.norm_eps)
    roots = torch.as_tensor(roots, dtype=torch.long, device=dev).reshape(B)

    # step 1's input and cell
    x = torch.empty(B, d0 * (2 if drafter.spec else 1), device=dev, dtype=dt)
    s = torch.zeros_like(h_last) if h_spec is None else h_spec.to(device=dev, dtype=dt).contiguous()
    if h_spec is None:  # no [SPEC] states: every row reads the null vector
        has = torch.zeros(B, dtype=torch.bool, device=dev)
    elif has_spec is None:
        has = torch.ones(B, dtype=torch.bool, device=dev)
    else:
        has = torch.as_tensor(has_spec, dtype=torch.bool, device=dev).reshape(B)
    null = drafter.null_spec if drafter.spec else h_last  # unused without spec
    block0 = _pow2(d0)
    _first_input_kernel[(B,)](h_last, s, has, null, x, d0, eps, SPEC=drafter.spec, BLOCK=block0,
                              num_warps=_warps(block0))
    block = _pow2(d)
    cell_args = (drafter.embedding.weight, float(drafter.alpha))
    norms = (drafter.cell_norm.weight, drafter.cell_norm.bias, drafter.state_norm.weight, drafter.state_norm.bias)
    pre = drafter.proj0(x)
    state = torch.empty(B, d, device=dev, dtype=dt)
    cell = torch.empty(B, d, device=dev, dtype=dt)
    rows = torch.arange(B, device=dev)
    _lstm_cell_kernel[(B,)](pre, rows, roots, *cell_args, cell, *norms, state, cell, d, eps,
                            FIRST=True, BLOCK=block, num_warps=_warps(block))

    P = pool_size(K, depth)
    pool_s = torch.empty(B, P, device=dev, dtype=torch.float32)
    pool_t = torch.empty(B, P, device=dev, dtype=torch.long)
    pool_p = torch.empty(B, P, device=dev, dtype=torch.long)
    pool_d = torch.empty(B, P, device=dev, dtype=torch.long)
    chunk = min(_CHUNK, _pow2(V))
    n_chunks = triton.cdiv(V, chunk)
    part_max = torch.empty(B * K, n_chunks, device=dev, dtype=torch.float32)
    part_sum = torch.empty_like(part_max)
    part_val = torch.empty(B * K, n_chunks, K, device=dev, dtype=torch.float32)
    part_idx = torch.empty(B * K, n_chunks, K, device=dev, dtype=torch.int32)
    token_map = drafter.token_map if drafter.reduced else roots
    front_s = torch.zeros(B * K, device=dev, dtype=torch.float32)
    front_t = torch.empty(B * K, device=dev, dtype=torch.long)
    front_idx = torch.zeros(B * K, device=dev, dtype=torch.long)
    src = torch.empty(B * K, device=dev, dtype=torch.long)
    offset = 0
    for level in range(1, depth + 1):
        per_req = 1 if level == 1 else K  # frontier rows of each request at this level
        R = B * per_req
        logits = drafter.head(state)  # [R, V], the eager beam's head call
        _chunk_topk_kernel[(R, n_chunks)](logits, V, part_max, part_sum, part_val, part_idx, n_chunks,
                                          K=K, KP=KP, CHUNK=chunk, num_warps=_warps(chunk))
        _row_merge_kernel[(R,)](part_max, part_sum, part_val, part_idx, n_chunks, front_s, front_idx, token_map,
                                pool_s, pool_t, pool_p, pool_d, P, offset, level,
                                ROWS=per_req, K=K, KP=KP, NCP=_pow2(n_chunks), CP=_pow2(n_chunks * K),
                                FIRST=level == 1, REDUCED=drafter.reduced)
        if level == depth:
            break
        _frontier_kernel[(B,)](pool_s, pool_t, P, offset, front_s, front_t, front_idx, src,
                               ROWS=per_req, K=K, KP=KP, LP=_pow2(per_req * K))
        pre = drafter.proj1(state)  # [R, 4d]: each frontier node reads its parent's row
        new_state = torch.empty(B * K, d, device=dev, dtype=dt)
        new_cell = torch.empty(B * K, d, device=dev, dtype=dt)
        _lstm_cell_kernel[(B * K,)](pre, src, front_t, *cell_args, cell, *norms, new_state, new_cell, d, eps,
                                    FIRST=False, BLOCK=block, num_warps=_warps(block))
        state, cell = new_state, new_cell
        offset += per_req * K

    N = min(tree_size, P)
    PP = _pow2(P)
    slot_buf = torch.empty(B, PP, device=dev, dtype=torch.int32)
    out_t = torch.empty(B, N, device=dev, dtype=torch.long)
    out_p = torch.empty(B, N, device=dev, dtype=torch.long)
    out_d = torch.empty(B, N, device=dev, dtype=torch.long)
    out_s = torch.empty(B, N, device=dev, dtype=torch.float32)
    _final_select_kernel[(B,)](pool_s, pool_t, pool_p, pool_d, P, N, slot_buf, out_t, out_p, out_d, out_s,
                               PP=PP, num_warps=_warps(PP))
    return DraftBeam(out_t, out_p, out_d, out_s)

