"""The committed prefixes' pool slots as ``kv_indices``, gathered by a grid over (request, chunk).

Every verify plans its prefix attention from ``kv_indices``: request ``b``'s ``req_to_token``
row up to its length, the requests one after another. SGLang's own kernel for it runs one
program per request, which walks the row alone: at 98K tokens and batch 1 that is one SM copying
98K entries, about a tenth of a millisecond on the critical path of every step, plain steps of
adaptive speculation included (SGLang's FA3 decode copies its page table with a grid-wide
gather instead). Here a program copies one ``BLOCK`` of one row, so the copy spreads over the
GPU. The grid's width needs a host bound of the lengths (a CUDA-graph replay and an eager verify
know the longest prefix; the table's row width bounds them all). :func:`sgl_longgen.kernels.verify_metadata.prefix_kv_indices` is the torch
reference (and the CPU path); the tests compare the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _prefix_slots_kernel(
    Table,  # req_to_token [rows, width]
    Rows,  # [bs] the requests' table rows
    Lens,  # [bs] prefix lengths
    Indptr,  # [bs + 1] int32: where each request's slots start in KvIndices
    KvIndices,  # out int32
    table_stride,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    start = tl.program_id(1) * BLOCK
    n = tl.load(Lens + b).to(tl.int64)
    if start < n:
        offs = start + tl.arange(0, BLOCK).to(tl.int64)
        keep = offs < n
        row = tl.load(Rows + b).to(tl.int64)
        slots = tl.load(Table + row * table_stride + offs, mask=keep, other=0)
        dst = tl.load(Indptr + b).to(tl.int64)
        tl.store(KvIndices + dst + offs, slots.to(tl.int32), mask=keep)


def prefix_slots(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                 kv_indptr: torch.Tensor, kv_indices: torch.Tensor, max_len: int) -> None:
    """Fill ``kv_indptr`` (``[bs + 1]``, cumulative ``seq_lens``) and ``kv_indices`` with the
    prefix slots; ``max_len``: a host bound of ``seq_lens`` (a shorter one drops slots)."""
    bs = seq_lens.numel()
    kv_indptr[:1].zero_()  # not ``[0] = 0``: a Python scalar is a blocking host-to-device copy
    kv_indptr[1 : bs + 1] = torch.cumsum(seq_lens, dim=0)
    if bs == 0 or max_len <= 0:
        return
    grid = (bs, triton.cdiv(max_len, BLOCK))
    _prefix_slots_kernel[grid](req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices,
                               req_to_token.stride(0), BLOCK=BLOCK)
