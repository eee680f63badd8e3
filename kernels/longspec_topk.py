"""Triton kernels: each row's top-k of ``log_softmax(logits)``, for LongSpec's beam levels.

A beam level needs, per frontier row, its ``k`` best next tokens and their log-probabilities
(:func:`sgl_longgen.core.longspec.best_children` then keeps the best ``width`` of the level). In
PyTorch that is a vocabulary-wide ``log_softmax`` (one block per row: 16 rows leave an H100
mostly idle) and ``torch.topk`` (for 16 rows of 32K-128K logits, its multi-block radix select:
some ten launches of digit counts and scans per call), about 60-90 us a level on an H100. Here:

1. one program per (row, chunk of ``CHUNK`` logits): the chunk's max and sum of exponentials (the
   row's log-sum-exp in parts) and its ``k`` best logits by repeated selection (value descending,
   vocabulary index ascending among equal values);
2. one program per row: the log-sum-exp from the chunks' parts, and the row's ``k`` best among
   the chunks' candidates by the same order, as ``logit - lse``.

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


@triton.jit
def _chunk_topk_kernel(Logits, stride_row, vocab, Val, Idx, Max, Sum, num_chunks,
                       CHUNK: tl.constexpr, K: tl.constexpr):
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
    vals = tl.full([K], float("-inf"), tl.float32)
    idxs = tl.full([K], -1, tl.int32)
    alive = ok
    for i in tl.static_range(K):
        best = tl.max(tl.where(alive, x, float("-inf")), axis=0)
        pos = tl.min(tl.where(alive & (x == best), offs, 2147483647), axis=0)
        found = pos < 2147483647
        vals = tl.where(ks == i, tl.where(found, best, float("-inf")), vals)
        idxs = tl.where(ks == i, tl.where(found, pos, -1), idxs)
        alive = alive & (offs != pos)
    tl.store(Val + part * K + ks, vals)
    tl.store(Idx + part * K + ks, idxs)


@triton.jit
def _merge_topk_kernel(Val, Idx, Max, Sum, OutVal, OutIdx, num_chunks, k,
                       CHUNKS: tl.constexpr, CAND: tl.constexpr, K: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, CHUNKS)
    c_ok = c < num_chunks
    mx = tl.load(Max + row * num_chunks + c, mask=c_ok, other=float("-inf"))
    sm = tl.load(Sum + row * num_chunks + c, mask=c_ok, other=0.0)
    top = tl.max(mx, axis=0)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.where(mx > float("-inf"), sm * tl.exp(mx - top_safe), 0.0), axis=0)
    lse = top_safe + tl.log(total)

    j = tl.arange(0, CAND)
    j_ok = j < num_chunks * K
    v = tl.load(Val + row * num_chunks * K + j, mask=j_ok, other=float("-inf"))
    ix = tl.load(Idx + row * num_chunks * K + j, mask=j_ok, other=-1)
    alive = j_ok & (ix >= 0)
    ks = tl.arange(0, K)
    out_v = tl.full([K], float("-inf"), tl.float32)
    out_i = tl.full([K], -1, tl.int32)
    for i in tl.static_range(K):
        best = tl.max(tl.where(alive, v, float("-inf")), axis=0)
        pick = tl.min(tl.where(alive & (v == best), ix, 2147483647), axis=0)
        found = pick < 2147483647
        out_v = tl.where(ks == i, tl.where(found, best - lse, float("-inf")), out_v)
        out_i = tl.where(ks == i, tl.where(found, pick, -1), out_i)
        alive = alive & (ix != pick)
    keep = ks < k
    tl.store(OutVal + row * k + ks, out_v, mask=keep)
    tl.store(OutIdx + row * k + ks, out_i.to(tl.int64), mask=keep)


def chunk_size(vocab: int) -> int:
    """Logits per first-stage program: whole rows up to 2K, else 2K-wide chunks (many programs
    for few rows; the interpreter, which pays per operation, takes whole rows up to 16K)."""
    limit = 16384 if interpreting(_chunk_topk_kernel) else 2048
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
                                        CHUNK=chunk, K=K, num_warps=4 if chunk <= 2048 else 8)
    out_v = torch.empty(R, k, dtype=torch.float32, device=dev)
    out_i = torch.empty(R, k, dtype=torch.int64, device=dev)
    _merge_topk_kernel[(R,)](val, idx, mx, sm, out_v, out_i, num_chunks, k, CHUNKS=next_pow2(num_chunks),
                             CAND=next_pow2(num_chunks * K), K=K, num_warps=4)
    return out_v.view(*lead, k), out_i.view(*lead, k)


def log_softmax_topk_reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch twin: the same values and order (descending; equal values, lower index first).
    It orders the log-probabilities where the kernel orders the logits: the same order, unless
    subtracting the log-sum-exp rounds two distinct logits to one value."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    order = torch.sort(logp, dim=-1, descending=True, stable=True).indices[..., :k]
    return logp.gather(-1, order), order
