"""The prefix part of tree verification through FA3's paged kernel (Hopper).

FA3's ``flash_attn_with_kvcache`` is the kernel behind SGLang's default attention backend on
Hopper. Non-causal over a request's cache, it is exactly the prefix part of the hybrid verify:
all ``T`` tree rows see the whole committed prefix. It packs the ``T*G`` query rows of a KV head
onto each KV tile and splits long caches across SMs, so a 64-row verify reads the prefix about
once and costs little more than its own decode step (docs/performance.md). What it cannot do,
the tree's ancestor mask, stays with ``tree_attention``; the two states merge by LSE. FA3
reports natural-log LSEs; the merge works in base 2, so the prefix LSE is converted here, at the
boundary.

The prefix is given to FA3 as a page table with one slot per page (SGLang's page size 1),
built from ``kv_indptr``/``kv_indices`` by :func:`page_table_from_indices`.

FA3 schedules its tiles (how many KV splits each request gets) with a small kernel of its own
that, left to itself, runs before every call: once per layer, 32 extra launches in a Llama-8B
forward, most of a plain step's premium over SGLang's decode. ``plan`` runs that scheduler once
(``get_scheduler_metadata``, as SGLang's own FA3 decode does) with exactly the arguments the
kernel would give it (the page table's width as the longest prefix, so the split count is the
one the kernel picks without it), and every layer's call reuses the result. Under CUDA graphs it
lives in a persistent buffer per batch size, refilled by each plan.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch

from .triton_common import LOG2_E
from .verify_metadata import page_table_from_indices

FA3_HEAD_DIMS = (64, 96, 128, 256)


@functools.lru_cache(maxsize=None)
def _get_scheduler_metadata():
    try:
        from sgl_kernel.flash_attn import get_scheduler_metadata
    except Exception:  # pragma: no cover - absent off Hopper hosts and in older kernels
        return None
    return get_scheduler_metadata


@functools.lru_cache(maxsize=None)
def _flash_attn_with_kvcache():
    try:
        from sgl_kernel.flash_attn import flash_attn_with_kvcache
    except Exception:  # pragma: no cover - absent off Hopper hosts, import errors vary
        return None
    return flash_attn_with_kvcache


def fa3_supported(head_dim: int, q_dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device) -> bool:
    """FA3 serves this shape here: a Hopper GPU, 16-bit q and KV of one dtype, a head size it was built for."""
    device = torch.device(device)
    return (
        device.type == "cuda"
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability(device)[0] == 9
        and head_dim in FA3_HEAD_DIMS
        and q_dtype in (torch.bfloat16, torch.float16)
        and kv_dtype == q_dtype
        and _flash_attn_with_kvcache() is not None
    )


class Fa3Prefix:
    """Plan/run of the prefix part through FA3.

    ``plan`` fills the page table and lengths (persistent buffers under CUDA graphs: the
    buffer's width then fixes FA3's launch shape for every replay, and ``max_prefix_len``, a
    host bound of the prefixes, how many of its columns are refilled); ``run`` returns
    the prefix state ``o [bs*T, Hq, D]`` (q's dtype) and its base-2 LSE ``[bs, Hq, T]``.
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, device, *,
                 page_table_buf: Optional[torch.Tensor] = None, seq_lens_buf: Optional[torch.Tensor] = None):
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.device = torch.device(device)
        self._page_table_buf = page_table_buf
        self._seq_lens_buf = seq_lens_buf
        self._schedule_bufs: dict[int, torch.Tensor] = {}  # per batch size, under CUDA graphs
        self.scheduler_metadata: Optional[torch.Tensor] = None

    def plan(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, tree_size: int,
             max_prefix_len: Optional[int] = None, skip: torch.Tensor | None = None,
             dtype: Optional[torch.dtype] = None) -> None:
        """``skip``: attend each prefix without its first ``skip`` slots (see
        :func:`page_table_from_indices`); ``tree_size`` is the query rows per page-table row;
        ``dtype``: q's and the cache's, to schedule FA3's tiles here once (None: FA3 schedules
        them at every call)."""
        bs = kv_indptr.numel() - 1
        width = max(1, max_prefix_len if max_prefix_len is not None else kv_indices.numel())
        if self._page_table_buf is not None:
            # The kernel sees the whole buffer (a fixed shape for graph replays) and reads each row
            # up to its length: only the columns that can hold a prefix slot need filling.
            table, lens = self._page_table_buf[:bs], self._seq_lens_buf
            page_table_from_indices(kv_indptr, kv_indices, table[:, : min(width, table.shape[1])], lens, skip=skip)
            self.page_table, self.seq_lens = table, lens[:bs]
        else:
            table = torch.empty(bs, width, dtype=torch.int32, device=self.device)
            self.page_table, self.seq_lens = page_table_from_indices(kv_indptr, kv_indices, table, skip=skip)
        self.batch_size, self.tree_size = bs, tree_size
        self.scheduler_metadata = self._schedule(dtype)

    def _schedule(self, dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
        """FA3's tile schedule for this plan, computed as its kernel would compute it per call."""
        get = _get_scheduler_metadata()
        if get is None or dtype is None or self.page_table.device.type != "cuda":
            return None
        meta = get(batch_size=self.batch_size, max_seqlen_q=self.tree_size, max_seqlen_k=self.page_table.shape[1],
                   num_heads=self.num_qo_heads, num_heads_k=self.num_kv_heads, headdim=self.head_dim,
                   cache_seqlens=self.seq_lens, qkv_dtype=dtype, page_size=1, causal=False)
        if self._page_table_buf is None:
            return meta
        # A captured graph reads the schedule from where it was at capture: keep one buffer per
        # batch size (its size depends on nothing else) and refill it.
        buf = self._schedule_bufs.get(self.batch_size)
        if buf is None:
            buf = self._schedule_bufs[self.batch_size] = meta
        else:
            buf.copy_(meta)
        return buf

    def run(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
            sm_scale: float, return_lse: bool = True,
            natural: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``return_lse=False``: the output alone (a prefix that already holds every key a row
        sees, as in a width-1 verify, needs no merge), ``(o, None)``. ``natural``: the LSE as
        FA3 returns it (natural log, ``+inf`` for an empty prefix), for a merge that converts
        it as it reads it (``merge_two_states_strided(a_natural=True)``)."""
        bs, T, hq, d = self.batch_size, self.tree_size, self.num_qo_heads, self.head_dim
        hkv = self.num_kv_heads
        schedule = {} if self.scheduler_metadata is None else {"scheduler_metadata": self.scheduler_metadata}
        result = _flash_attn_with_kvcache()(
            q=q.view(bs, T, hq, d),
            k_cache=k_buffer.view(-1, 1, hkv, d),
            v_cache=v_buffer.view(-1, 1, hkv, d),
            page_table=self.page_table,
            cache_seqlens=self.seq_lens,
            softmax_scale=sm_scale,
            causal=False,
            return_softmax_lse=return_lse,
            **schedule,
        )
        if not return_lse:
            o = result[0] if isinstance(result, (tuple, list)) else result
            return o.view(bs * T, hq, d), None
        o, lse, *_ = result
        if natural:
            return o.view(bs * T, hq, d), lse
        # An empty prefix gets LSE +inf from FA3 (its convention for a row without keys): make it
        # the merge's "no keys" state, -inf, so the tree part alone decides the row.
        lse = lse.mul_(LOG2_E).masked_fill_((self.seq_lens == 0)[:, None, None], float("-inf"))
        return o.view(bs * T, hq, d), lse
