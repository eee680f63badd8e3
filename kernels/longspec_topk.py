"""Triton kernels: a LongSpec beam level's best children, from the head's logits in two launches.

A beam level keeps the ``width`` best (parent, token) pairs of its frontier: the score of a child
is its parent's cumulative log-probability plus ``log_softmax(logits)[token]``. In PyTorch that is
a vocabulary-wide ``log_softmax`` (one block per row: 16 rows leave the GPU mostly idle), a
per-row ``torch.topk`` (for 16 rows of 32K-128K logits, a multi-block radix select of some ten
launches) and a second ``topk`` over the rows' candidates (a sort for 256 elements): on an H200
with a 32K-token draft head, three kernels of the row top-k and two of the level's pick cost
about 24 us a level, the fifth of the whole draft step at 4K. Here:

1. one program per (row, chunk of ``CHUNK`` logits): the chunk's max and sum of exponentials (its
   row's log-sum-exp in parts) and its ``K`` best logits by repeated selection;
2. one program per request: each row's log-sum-exp from its chunks' parts, every candidate's
   score ``parent + (logit - lse)``, and the ``width`` best of them.

A child in the level's best ``width`` is in its chunk's best ``K >= width`` (under one total order
a chunk holds no more better children than the level does, and within one row the score orders
as the logit), so the result is exact. The order is total: score descending, then (row, token)
ascending, so ties are broken the same way on every call. Each selection step is one ``max``
over 64-bit keys (a float's order-preserving bits above the complement of its index), not a
value max and an index min: half the reductions of the serial part, which is what bounds the
kernel's time. Launch shapes follow from the shapes alone: CUDA-graph safe. The PyTorch twin is
:func:`level_topk_reference` (a stable sort over every child); on a CPU the beam runs
``log_softmax`` and ``torch.topk`` instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import interpreting, next_pow2

MAX_K = 64  # selections are unrolled: wider levels go through torch.topk
_LOW = tl.constexpr(0xFFFFFFFF)  # a key's low half: this minus the candidate's index (lower index, larger key)
_NONE = tl.constexpr(-(2 ** 63))  # no candidate


@triton.jit
def _order_bits(x):
    """A float32's bits as an int32 that orders as the float does (an involution on the bits)."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _key(x, index):
    return (_order_bits(x).to(tl.int64) << 32) | (_LOW - index.to(tl.int64))


@triton.jit
def _key_value(key):
    return _order_bits((key >> 32).to(tl.int32)).to(tl.float32, bitcast=True)


@triton.jit
def _key_index(key):
    return _LOW - (key & _LOW)


@triton.jit
def _chunk_topk_kernel(Logits, stride_row, vocab, Keys, Max, Sum, num_chunks,
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

    keys = tl.where(ok, _key(x, offs), _NONE)
    ks = tl.arange(0, K)
    picked = tl.full([K], _NONE, tl.int64)
    for i in tl.static_range(K):
        best = tl.max(keys, axis=0)
        picked = tl.where(ks == i, best, picked)
        keys = tl.where(keys == best, _NONE, keys)
    tl.store(Keys + part * K + ks, picked)


@triton.jit
def _level_pick_kernel(Keys, Max, Sum, Parent, OutScore, OutId, OutRow, rows, num_chunks, vocab, width,
                       HAS_PARENT: tl.constexpr, ROWS: tl.constexpr, CHUNKS: tl.constexpr, CAND: tl.constexpr,
                       K: tl.constexpr, WIDTH: tl.constexpr):
    b = tl.program_id(0)
    r = tl.arange(0, ROWS)
    r_ok = r < rows
    c = tl.arange(0, CHUNKS)
    part = (b * rows + r)[:, None] * num_chunks + c[None, :]
    part_ok = r_ok[:, None] & (c < num_chunks)[None, :]
    mx = tl.load(Max + part, mask=part_ok, other=float("-inf"))
    sm = tl.load(Sum + part, mask=part_ok, other=0.0)
    top = tl.max(mx, axis=1)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.where(mx > float("-inf"), sm * tl.exp(mx - top_safe[:, None]), 0.0), axis=1)
    lse = top_safe + tl.log(tl.where(total > 0.0, total, 1.0))  # [ROWS]; padding rows: 0

    j = tl.arange(0, CAND)
    j_ok = r_ok[:, None] & (j < num_chunks * K)[None, :]
    key = tl.load(Keys + (b * rows + r)[:, None] * (num_chunks * K) + j[None, :], mask=j_ok, other=_NONE)
    alive = key != _NONE
    score = _key_value(key) - lse[:, None]
    if HAS_PARENT:
        score = tl.load(Parent + b * rows + r, mask=r_ok, other=0.0)[:, None] + score
    flat = r[:, None].to(tl.int64) * vocab + _key_index(key)
    cand = tl.where(alive, _key(score, flat), _NONE)
    ws = tl.arange(0, WIDTH)
    picked = tl.full([WIDTH], _NONE, tl.int64)
    for i in tl.static_range(WIDTH):
        best = tl.max(tl.max(cand, axis=1), axis=0)
        picked = tl.where(ws == i, best, picked)
        cand = tl.where(cand == best, _NONE, cand)
    found = picked != _NONE
    f = _key_index(picked)
    keep = ws < width
    out = b * width + ws
    tl.store(OutScore + out, tl.where(found, _key_value(picked), float("-inf")), mask=keep)
    tl.store(OutId + out, tl.where(found, f % vocab, -1), mask=keep)
    tl.store(OutRow + out, tl.where(found, f // vocab, -1), mask=keep)


def chunk_size(vocab: int) -> int:
    """Logits per first-stage program: whole rows up to 2K, else 2K-wide chunks (many programs
    for few rows; the interpreter, which pays per operation, takes whole rows up to 16K)."""
    limit = 16384 if interpreting(_chunk_topk_kernel) else 2048
    return min(next_pow2(vocab), limit)


def level_topk(logits: torch.Tensor, parent_scores: torch.Tensor | None, width: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``width`` best children of each request's frontier: ``logits`` ``[B, n, V]`` (row ``i``:
    the next-token logits after frontier node ``i``), ``parent_scores`` ``[B, n]`` float32 (the
    nodes' cumulative log-probabilities; None: zeros, a root level). Returns float32 scores
    ``parent + log_softmax(logits)[token]`` and int64 tokens and rows, ``[B, width]``, best first
    (equal scores: lower row, then lower token first). Fewer than ``width`` children (``n * V <
    width``) leave ``-inf`` / ``-1`` at the end."""
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, n, V], got {tuple(logits.shape)}")
    B, n, vocab = logits.shape
    if not 1 <= width <= MAX_K:
        raise ValueError(f"width must be in [1, {MAX_K}], got {width}")
    if n * vocab >= 2 ** 31:
        raise ValueError(f"a level of {n} x {vocab} children is past the kernel's 31-bit candidate index")
    if parent_scores is not None and (parent_scores.shape != (B, n) or parent_scores.dtype != torch.float32):
        raise ValueError(f"parent_scores must be float32 [{B}, {n}], got {parent_scores.dtype} "
                         f"{tuple(parent_scores.shape)}")
    rows = logits.reshape(B * n, vocab)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    chunk = chunk_size(vocab)
    num_chunks = triton.cdiv(vocab, chunk)
    K = next_pow2(min(width, vocab))
    dev = logits.device
    keys = torch.empty(B * n, num_chunks, K, dtype=torch.int64, device=dev)
    mx = torch.empty(B * n, num_chunks, dtype=torch.float32, device=dev)
    sm = torch.empty(B * n, num_chunks, dtype=torch.float32, device=dev)
    _chunk_topk_kernel[(B * n, num_chunks)](rows, rows.stride(0), vocab, keys, mx, sm, num_chunks,
                                            CHUNK=chunk, K=K, num_warps=4 if chunk <= 2048 else 8)
    score = torch.empty(B, width, dtype=torch.float32, device=dev)
    token = torch.empty(B, width, dtype=torch.int64, device=dev)
    row = torch.empty(B, width, dtype=torch.int64, device=dev)
    parents = parent_scores.contiguous() if parent_scores is not None else score  # unread without parents
    cand = next_pow2(num_chunks * K)
    _level_pick_kernel[(B,)](keys, mx, sm, parents, score, token, row, n, num_chunks, vocab, width,
                             HAS_PARENT=parent_scores is not None, ROWS=next_pow2(n), CHUNKS=next_pow2(num_chunks),
                             CAND=cand, K=K, WIDTH=next_pow2(width), num_warps=8 if n * cand >= 2048 else 4)
    return score, token, row


def level_topk_reference(logits: torch.Tensor, parent_scores: torch.Tensor | None, width: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The PyTorch twin: every child's score, a stable descending sort over the flattened level
    (ties: lower row, then lower token). It orders the scores where the kernel orders the logits
    within a chunk: the same order, unless subtracting the log-sum-exp rounds two distinct logits
    of one row to one value."""
    B, n, vocab = logits.shape
    scores = torch.log_softmax(logits.float(), dim=-1)
    if parent_scores is not None:
        scores = parent_scores.unsqueeze(-1) + scores
    flat = scores.flatten(1)
    width_ = min(width, flat.shape[1])
    order = torch.sort(flat, dim=1, descending=True, stable=True).indices[:, :width_]
    score, token, row = flat.gather(1, order), order % vocab, torch.div(order, vocab, rounding_mode="floor")
    if width_ < width:
        pad = width - width_
        score = torch.cat([score, score.new_full((B, pad), float("-inf"))], dim=1)
        token, row = (torch.cat([t, t.new_full((B, pad), -1)], dim=1) for t in (token, row))
    return score, token, row
