"""Triton kernels: each row's top-k of ``log_softmax(logits)``, for LongSpec's beam levels.

A beam level needs, per frontier row, its ``k`` best next tokens and their log-probabilities
(:func:`sgl_longgen.core.longspec_beam.best_children` then keeps the best ``width`` of the level). In
PyTorch that is a vocabulary-wide ``log_softmax`` (one block per row: a few rows leave most of
the GPU idle) and ``torch.topk`` (for 16 rows of 32K-128K logits, its multi-block radix select:
some ten launches of digit counts and scans per call): a level's cost is latency and launches,
not bytes. Here:

Every selection orders by one int64 key an element (:func:`_order_key`: the value's bits, then
the index), so picking the next best is one max reduction where comparing values and then
indices takes two, and on a GPU the ``k`` best come from Triton's bitonic top-k over those keys
(:func:`_best_keys`): a data-parallel network instead of ``k`` reductions in turn.

1. one program per (row, chunk of ``CHUNK_LOGITS`` logits): the chunk's max and sum of exponentials (the
   row's log-sum-exp in parts) and its ``k`` best logits (value descending, vocabulary index
   ascending among equal values);
2. one program per row: the log-sum-exp from the chunks' parts, and the row's ``k`` best among
   the chunks' candidates by the same order, as ``logit - lse``;
3. (:func:`best_of_rows`) one program per request: the level's ``width`` best of its rows'
   candidates, each scored ``parent + logp``, by the same selection (where
   ``torch.topk`` of 256 candidates takes a sort and a gather);
4. (:func:`cut_beam`) one program per request, once a step: the tree's ``n`` best nodes (a stable
   descending order: equal scores, the earlier node first) in creation order, their parents
   renumbered, written as the two rows the host reads (where PyTorch takes two sorts, a scatter,
   gathers and a concatenation: eight launches at the end of a compiled step). The nodes' keys
   sorted give the last one kept, a kept node's place is a prefix sum and its parent's new index a
   gather (sorting the keys was measured faster than ranking every node against every other).

A logit in a row's top ``k`` is in its chunk's top ``k`` (under one total order, a chunk holds
no more better elements than the whole row), so the result is exact: the row's top ``k`` with
ties taken lowest index first, deterministic from call to call. Fixed launch shapes for a given
number of rows, vocabulary and ``k``: CUDA-graph safe. The PyTorch twin is
:func:`log_softmax_topk_reference` (the same order through a stable sort); on a CPU the beam uses
``log_softmax`` and ``torch.topk`` as before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import interpreting, next_pow2

MAX_K = 64  # selections are unrolled: wider top-ks go through torch.topk
# Launch settings: a selection is a chain of reductions, so a program's latency, not the bytes,
# sets each kernel's time. Chosen by a sweep (chunks of 1K-4K logits, 1-4 warps a kernel; figures
# in docs/performance.md): 2K chunks at 4 warps (fewer warps spill), the merge and the level's pick
# at 1 warp (no barrier in their reductions), the cut at 4.
CHUNK_LOGITS = 2048
CHUNK_WARPS = 4
MERGE_WARPS = 1
PICK_WARPS = 1
CUT_WARPS = 4
# The interpreter pays per operation, not per program: whole rows, and K max reductions where a GPU
# runs the bitonic network (whose many small compare-exchange steps the interpreter pays one
# by one).
INTERPRETER_CHUNK = 16384
INTERPRETER_BITONIC = False


_NONE = tl.constexpr(-9223372036854775808)  # below every key: a dead or missing element


@triton.jit
def _order_key(x, idx, ok):
    """One int64 per element whose order is the selection's: the float32 value in the high half
    (its bits mapped so signed integers order as the floats do, -0.0 made +0.0 so the two tie as
    floats do), ``2^31 - 1 - idx`` in the low half (equal values: the lower index is larger);
    ``_NONE`` where not ``ok``. A selection is then one max reduction where comparing values, then
    indices, took two."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return tl.where(ok, (ordered.to(tl.int64) << 32) | (2147483647 - idx).to(tl.int64), _NONE)


@triton.jit
def _from_key(key):
    """The value and index a key was made from; ``-inf`` and ``-1`` for ``_NONE``."""
    ordered = (key >> 32).to(tl.int32)
    bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)
    found = key != _NONE
    value = tl.where(found, bits.to(tl.float32, bitcast=True), float("-inf"))
    idx = tl.where(found, 2147483647 - key.to(tl.int32), -1)  # the low half
    return value, idx


@triton.jit
def _best_keys(key, K: tl.constexpr, BITONIC: tl.constexpr):
    """The ``K`` largest of the keys ``key`` (a power-of-two block), largest first. ``BITONIC`` (on a
    GPU): Triton's bitonic top-k (sorted runs of ``K``, then halving by pairwise max, every step a
    data-parallel compare-exchange); else ``K``
    max reductions in turn, each picked key struck out. The keys are distinct, so both give the one
    order."""
    if BITONIC:
        return tl.topk(key, K)
    else:
        ks = tl.arange(0, K)
        picked = tl.full([K], _NONE, tl.int64)
        for i in tl.static_range(K):
            best = tl.max(key, axis=0)
            picked = tl.where(ks == i, best, picked)
            key = tl.where(key == best, _NONE, key)
        return picked


@triton.jit
def _chunk_topk_kernel(Logits, stride_row, vocab, Val, Idx, Max, Sum, num_chunks,
                       CHUNK: tl.constexpr, K: tl.constexpr, BITONIC: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = offs < vocab
    x = tl.load(Logits + row.to(tl.int64) * stride_row + offs, mask=ok, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # a chunk of -inf logits adds nothing
    s = tl.sum(tl.where(ok, tl.exp(x - m_safe), 0.0), axis=0)
    part = row * num_chunks + chunk
    tl.store(Max + part, m)
    tl.store(Sum + part, s)

    ks = tl.arange(0, K)
    vals, idxs = _from_key(_best_keys(_order_key(x, offs, ok), K, BITONIC))
    tl.store(Val + part * K + ks, vals)
    tl.store(Idx + part * K + ks, idxs)


@triton.jit
def _merge_topk_kernel(Val, Idx, Max, Sum, OutVal, OutIdx, num_chunks, k,
                       CHUNKS: tl.constexpr, CAND: tl.constexpr, K: tl.constexpr, BITONIC: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, CHUNKS)
    c_ok = c < num_chunks
    mx = tl.load(Max + row * num_chunks + c, mask=c_ok, other=float("-inf"))
    sm = tl.load(Sum + row * num_chunks + c, mask=c_ok, other=0.0)
    top = tl.max(mx, axis=0)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.where(mx > float("-inf"), sm * tl.exp(mx - top_safe), 0.0), axis=0)
    log_total = tl.log(total)  # the log-sum-exp is top_safe + log_total

    j = tl.arange(0, CAND)
    j_ok = j < num_chunks * K
    v = tl.load(Val + row * num_chunks * K + j, mask=j_ok, other=float("-inf"))
    ix = tl.load(Idx + row * num_chunks * K + j, mask=j_ok, other=-1)
    ks = tl.arange(0, K)
    best_v, out_i = _from_key(_best_keys(_order_key(v, ix, j_ok & (ix >= 0)), K, BITONIC))
    # (logit - max) - log(sum): log_softmax's order of operations, exact at any magnitude of max
    out_v = tl.where(out_i >= 0, (best_v - top_safe) - log_total, float("-inf"))
    keep = ks < k
    tl.store(OutVal + row * k + ks, out_v, mask=keep)
    tl.store(OutIdx + row * k + ks, out_i.to(tl.int64), mask=keep)


@triton.jit
def _best_of_rows_kernel(Parent, Top, Ids, OutScore, OutId, OutRow, n, k, width,
                         CAND: tl.constexpr, WIDTH: tl.constexpr, BITONIC: tl.constexpr):
    b = tl.program_id(0)
    j = tl.arange(0, CAND)
    ok = j < n * k
    row = j // k
    v = tl.load(Parent + b * n + row, mask=ok, other=0.0) + tl.load(Top + b * n * k + j, mask=ok, other=0.0)
    ws = tl.arange(0, WIDTH)
    out_v, out_j = _from_key(_best_keys(_order_key(v, j, ok), WIDTH, BITONIC))
    out_j = tl.maximum(out_j, 0)
    keep = ws < width
    tl.store(OutScore + b * width + ws, out_v, mask=keep)
    tl.store(OutId + b * width + ws, tl.load(Ids + b * n * k + out_j, mask=keep, other=0), mask=keep)
    tl.store(OutRow + b * width + ws, (out_j // k).to(tl.int64), mask=keep)


def _bitonic(kernel) -> bool:
    """Whether ``kernel``'s selections run the bitonic network: always on a GPU, in the
    interpreter only when asked (a test does, at small shapes)."""
    return INTERPRETER_BITONIC if interpreting(kernel) else True


def chunk_size(vocab: int) -> int:
    """Logits per first-stage program: whole rows up to 2K, else 2K-wide chunks (many programs
    for few rows; the interpreter, which pays per operation, takes whole rows up to 16K)."""
    limit = INTERPRETER_CHUNK if interpreting(_chunk_topk_kernel) else CHUNK_LOGITS
    return min(next_pow2(vocab), limit)


def log_softmax_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax(logits.float(), -1).topk(k)`` for ``logits`` ``[..., V]`` (ties: lowest
    index first): float32 values and int64 indices, ``[..., k]``."""
    if not 1 <= k <= min(MAX_K, logits.shape[-1]):
        raise ValueError(f"k must be in [1, {min(MAX_K, logits.shape[-1])}], got {k}")
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    rows = logits.reshape(-1, vocab)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    R = rows.shape[0]
    chunk = chunk_size(vocab)
    num_chunks = triton.cdiv(vocab, chunk)
    K = next_pow2(k)
    dev = logits.device
    val = torch.empty(R, num_chunks, K, dtype=torch.float32, device=dev)
    idx = torch.empty(R, num_chunks, K, dtype=torch.int32, device=dev)
    mx = torch.empty(R, num_chunks, dtype=torch.float32, device=dev)
    sm = torch.empty(R, num_chunks, dtype=torch.float32, device=dev)
    _chunk_topk_kernel[(R, num_chunks)](rows, rows.stride(0), vocab, val, idx, mx, sm, num_chunks,
                                        CHUNK=chunk, K=K, BITONIC=_bitonic(_chunk_topk_kernel),
                                        num_warps=CHUNK_WARPS)
    out_v = torch.empty(R, k, dtype=torch.float32, device=dev)
    out_i = torch.empty(R, k, dtype=torch.int64, device=dev)
    _merge_topk_kernel[(R,)](val, idx, mx, sm, out_v, out_i, num_chunks, k, CHUNKS=next_pow2(num_chunks),
                             CAND=next_pow2(num_chunks * K), K=K, BITONIC=_bitonic(_merge_topk_kernel),
                             num_warps=MERGE_WARPS)
    return out_v.view(*lead, k), out_i.view(*lead, k)


def log_softmax_topk_reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch twin: the same values and order (descending; equal values, lower index first).
    It orders the log-probabilities where the kernel orders the logits: the same order, unless
    subtracting the log-sum-exp rounds two distinct logits to one value."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    order = torch.sort(logp, dim=-1, descending=True, stable=True).indices[..., :k]
    return logp.gather(-1, order), order


def best_of_rows(parent_scores: torch.Tensor, top: torch.Tensor, ids: torch.Tensor, width: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The level's ``width`` best children from each frontier row's ``k`` candidates: ``top``
    ``[B, n, k]`` float32 log-probabilities, ``ids`` ``[B, n, k]`` int64 their tokens,
    ``parent_scores`` ``[B, n]`` float32 the rows' cumulative scores. Returns the scores
    ``parent + top`` (the same float32 sums), tokens and rows, ``[B, width]``, best first (equal
    scores: lower row, then the row's earlier candidate first). The PyTorch twin is
    :func:`sgl_longgen.core.longspec_beam.best_of_rows`."""
    B, n, k = top.shape
    if not 1 <= width <= min(MAX_K, n * k):
        raise ValueError(f"width must be in [1, {min(MAX_K, n * k)}], got {width}")
    if parent_scores.shape != (B, n) or top.dtype != torch.float32 or parent_scores.dtype != torch.float32 \
            or ids.shape != top.shape:
        raise ValueError(f"best_of_rows takes float32 [B, n] scores, float32 [B, n, k] candidates and their ids, got "
                         f"{parent_scores.dtype} {tuple(parent_scores.shape)}, {top.dtype} {tuple(top.shape)}, "
                         f"{tuple(ids.shape)}")
    score = torch.empty(B, width, dtype=torch.float32, device=top.device)
    token = torch.empty(B, width, dtype=ids.dtype, device=top.device)
    row = torch.empty(B, width, dtype=torch.int64, device=top.device)
    _best_of_rows_kernel[(B,)](parent_scores.contiguous(), top.contiguous(), ids.contiguous(), score, token, row,
                               n, k, width, CAND=next_pow2(n * k), WIDTH=next_pow2(width),
                               BITONIC=_bitonic(_best_of_rows_kernel), num_warps=PICK_WARPS)
    return score, token, row


@triton.jit
def _cut_beam_kernel(Scores, Tokens, Parents, Depths, OutInts, OutScores, num_nodes, n,
                     stride_s, stride_t, stride_p, stride_i, stride_o, BLOCK_P: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_P)
    ok = i < num_nodes
    s = tl.load(Scores + b * stride_s + i, mask=ok, other=float("-inf"))
    # a node ranks ahead with a higher score, or an equal one and an earlier index (one key each);
    # the keys are distinct, so the n-th of them sorted is the last one kept
    key = _order_key(s, i, ok)
    nth = tl.max(tl.where(i == n - 1, tl.sort(key, descending=True), _NONE), axis=0)
    keep = ok & (key >= nth)
    pos = tl.cumsum(keep.to(tl.int32), axis=0) - 1  # a kept node's index in creation order
    par = tl.load(Parents + b * stride_p + i, mask=ok, other=-1).to(tl.int32)
    # the parent's new index, -1 where it was cut; a root's -1 stays
    at = tl.maximum(par, 0)
    par_kept = tl.gather(keep.to(tl.int32), at, 0) != 0
    new_par = tl.where(par >= 0, tl.where(par_kept, tl.gather(pos, at, 0), -1), par)
    broken = tl.max((keep & (par >= 0) & (new_par < 0)).to(tl.int32), axis=0)
    row = OutInts + b * stride_i
    tl.store(row + pos, tl.load(Tokens + b * stride_t + i, mask=keep).to(tl.int64), mask=keep)
    tl.store(row + n + pos, new_par.to(tl.int64), mask=keep)
    tl.store(row + 2 * n + pos, tl.load(Depths + i, mask=keep).to(tl.int64), mask=keep)
    tl.store(row + 3 * n, broken.to(tl.int64))
    tl.store(OutScores + b * stride_o + pos, s, mask=keep)


MAX_CUT_NODES = 1024  # cut_beam's nodes, sorted in one program


def cut_beam(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, n: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n`` best of each row's ``P`` nodes (``scores``, ``tokens``, ``parents`` ``[B, P]``, the
    parents indices into the row or -1, ``depths`` ``[P]``) as the host reads a beam: int64 ``[B, 3n'
    + 1]`` (tokens, renumbered parents, depths, a flag set where a kept node lost its parent) and
    the scores ``[B, n']``, ``n' = min(n, P)``. The PyTorch twin is
    ``beam_rows(*select_nodes_batched(...))`` (:mod:`sgl_longgen.core.longspec_beam`)."""
    B, P = scores.shape
    if tokens.shape != (B, P) or parents.shape != (B, P) or depths.shape != (P,):
        raise ValueError(f"cut_beam takes [B, P] scores, tokens and parents and [P] depths, got {tuple(scores.shape)}, "
                         f"{tuple(tokens.shape)}, {tuple(parents.shape)}, {tuple(depths.shape)}")
    if not 1 <= P <= MAX_CUT_NODES or n < 1:
        raise ValueError(f"cut_beam keeps n >= 1 of 1 to {MAX_CUT_NODES} nodes, got n = {n} of {P}")
    n = min(n, P)
    scores, tokens, parents, depths = (t.contiguous() for t in (scores, tokens, parents, depths))
    ints = torch.empty(B, 3 * n + 1, dtype=torch.int64, device=scores.device)
    kept = torch.empty(B, n, dtype=scores.dtype, device=scores.device)
    if B:
        _cut_beam_kernel[(B,)](scores, tokens, parents, depths, ints, kept, P, n, scores.stride(0), tokens.stride(0),
                               parents.stride(0), ints.stride(0), kept.stride(0), BLOCK_P=max(16, next_pow2(P)),
                               num_warps=CUT_WARPS)
    return ints, kept
