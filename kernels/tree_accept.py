"""Accepting a verified trie on the device: one launch for the walk and the commit, one for the
next partial-KV draft's slots.

Between a verify forward and the next draft the device runs what the walk decides: which nodes
are accepted (:func:`sgl_longgen.core.verify.walk_trees`), their KV put at the front of the
verify window (a permutation of the request's ``req_to_token`` entries), and, for TokenSwift in
its steady state, the slots the next draft attends to
(:func:`sgl_longgen.core.partial_kv.steady_visible_slots`). As torch ops that is ~40 small
kernels, each a few microseconds of launch gap at batch 1, all of them between two forwards. Here
it is one program per request for each part. The torch functions stay the reference (and the
CPU path); the tests compare the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import next_pow2

# A program holds a request's [N, N] ancestor block in registers.
MAX_NODES = 128


@triton.jit
def _walk_commit_kernel(
    Draws,  # [bs, N] int64: the token drawn at each node
    Parents,  # [bs, N] int64 (any valid index for the root)
    WalkTokens,  # [bs, N] int64: a node's token where a walk may enter it, else -1
    Ancestors,  # [bs, N, N] uint8: j is an ancestor of i or i itself
    Table,  # req_to_token [rows, width]
    Rows,  # [bs] the requests' table rows
    SeqLens,  # [bs] committed lengths: the verify window starts there
    Count,  # out [bs] int64
    Last,  # out [bs] int64
    Order,  # out [bs, N] int64
    N,
    table_stride,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    valid = i < N
    base = b * N
    parent = tl.maximum(tl.load(Parents + base + i, mask=valid, other=0), 0)
    walk_token = tl.load(WalkTokens + base + i, mask=valid, other=-1)
    drawn_at_parent = tl.load(Draws + base + parent, mask=valid, other=-3)
    entered = (drawn_at_parent == walk_token) | (i == 0)
    anc = tl.load(Ancestors + b * N * N + i[:, None] * N + i[None, :],
                  mask=valid[:, None] & valid[None, :], other=0)
    # On the walked path iff every ancestor (and the node itself) was entered.
    blocked = tl.sum(((anc != 0) & (entered[None, :] == 0)).to(tl.int32), axis=1)
    on = ((blocked == 0) & valid).to(tl.int32)
    off = (valid & (blocked != 0)).to(tl.int32)
    count = tl.sum(on, axis=0)
    # Path nodes first (ascending: parents precede children), then the others ascending.
    position = tl.where(on != 0, tl.cumsum(on, axis=0) - on, count + tl.cumsum(off, axis=0) - off)
    tl.store(Order + base + position, i.to(tl.int64), mask=valid)
    deepest = tl.max(tl.where(on != 0, i, 0), axis=0)
    tl.store(Count + b, count.to(tl.int64))
    tl.store(Last + b, tl.load(Draws + base + deepest))
    # Commit: the window's slot at column i moves to column position[i].
    row = tl.load(Rows + b).to(tl.int64)
    start = tl.load(SeqLens + b).to(tl.int64)
    window = Table + row * table_stride + start
    slots = tl.load(window + i, mask=valid)
    tl.debug_barrier()  # every slot is read before any is overwritten
    tl.store(window + position, slots, mask=valid)


def walk_and_commit(draws: torch.Tensor, parents: torch.Tensor, walk_tokens: torch.Tensor,
                    ancestors: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
                    seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`~sgl_longgen.core.verify.walk_trees` and the window permutation of ``table``, in one launch.

    Returns ``(count, last, order)`` as ``walk_trees`` does; ``table[rows[b], seq_lens[b] + k]``
    afterwards holds the slot that was at column ``order[b, k]`` of the window (accepted nodes
    first). ``N`` must be at most :data:`MAX_NODES`.
    """
    bs, n = draws.shape
    if n > MAX_NODES:
        raise ValueError(f"walk_and_commit handles at most {MAX_NODES} nodes per request, got {n}")
    count = torch.empty(bs, dtype=torch.int64, device=draws.device)
    last = torch.empty(bs, dtype=torch.int64, device=draws.device)
    order = torch.empty(bs, n, dtype=torch.int64, device=draws.device)
    if bs:
        block = max(16, next_pow2(n))
        _walk_commit_kernel[(bs,)](
            draws, parents, walk_tokens, ancestors.view(torch.uint8), table, rows, seq_lens,
            count, last, order, n, table.stride(0), BLOCK=block, num_warps=4 if block > 64 else 2,
        )
    return count, last, order


@triton.jit
def _steady_slots_kernel(
    Table,
    Rows,
    SeqLens,  # [bs] committed lengths before the step
    Count,  # [bs] tokens the step committed
    SelLens,  # [bs] the selection's length
    Selected,  # [bs, capacity] the selection's slots, best first
    Last,  # [bs] the next roots
    KvIndices,  # out [bs, budget + 1]
    OutCacheLoc,  # out [bs] the roots' slots
    InputIds,  # out [bs]
    Positions,  # out [bs]
    table_stride,
    selected_stride,
    SINKS: tl.constexpr,
    BUDGET: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    row = tl.load(Rows + b).to(tl.int64)
    length = tl.load(SeqLens + b).to(tl.int64) + tl.load(Count + b)
    sel_len = tl.load(SelLens + b).to(tl.int64)
    n_new = length - sel_len
    table_row = Table + row * table_stride
    out = KvIndices + b * (BUDGET + 1)
    for start in range(0, BUDGET, BLOCK):
        j = start + tl.arange(0, BLOCK)
        inside = j < BUDGET
        from_table = j < SINKS + n_new
        position = tl.where(j < SINKS, j, sel_len + j - SINKS)
        slot_table = tl.load(table_row + position, mask=inside & from_table, other=0)
        slot_selected = tl.load(Selected + b * selected_stride + (j - SINKS - n_new),
                                mask=inside & (from_table == 0), other=0)
        tl.store(out + j, tl.where(from_table, slot_table, slot_selected.to(slot_table.dtype)), mask=inside)
    root = tl.load(table_row + length)
    tl.store(out + BUDGET, root)
    tl.store(OutCacheLoc + b, root.to(tl.int64))
    tl.store(Positions + b, length)
    tl.store(InputIds + b, tl.load(Last + b))


def steady_draft_inputs(table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, count: torch.Tensor,
                        sel_lens: torch.Tensor, selected: torch.Tensor, last: torch.Tensor, sinks: int,
                        budget: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The next draft's inputs after a commit, in one launch: ``(kv_indices, out_cache_loc, input_ids, positions)``.

    ``kv_indices[b]`` is :func:`~sgl_longgen.core.partial_kv.steady_visible_slots` at the new
    length ``seq_lens + count`` (``[bs, budget + 1]``, the root's slot last, in the table's
    dtype); the root's slot, token (``last``) and position come with it.
    """
    bs = rows.shape[0]
    dev = table.device
    kv_indices = torch.empty(bs, budget + 1, dtype=table.dtype, device=dev)
    out_cache_loc = torch.empty(bs, dtype=torch.int64, device=dev)
    input_ids = torch.empty(bs, dtype=torch.int64, device=dev)
    positions = torch.empty(bs, dtype=torch.int64, device=dev)
    if bs:
        _steady_slots_kernel[(bs,)](
            table, rows, seq_lens, count, sel_lens, selected, last, kv_indices, out_cache_loc, input_ids,
            positions, table.stride(0), selected.stride(0), SINKS=sinks, BUDGET=budget,
            BLOCK=min(1024, max(16, next_pow2(budget))), num_warps=4,
        )
    return kv_indices, out_cache_loc, input_ids, positions
