"""From SGLang's TARGET_VERIFY batch to the hybrid attention's metadata, with torch ops only.

SGLang describes a verification step by ``seq_lens`` (committed tokens per request), the
``req_to_token`` rows of the requests, and ``spec_info.custom_mask``: per request a flat bool
``[N, seq_len + N]`` (row-major, all draft rows see the whole prefix), concatenated over the
batch ("full" layout). Some CPU paths of SGLang pass only the ``[N, N]`` tree blocks ("qlen"
layout). Verify inputs may also carry the blocks directly as ``spec_info.tree_mask``
(``[bs, N, N]``, as this project's TreeVerifyInput does). The hybrid attention needs the prefix
slots as ``kv_indptr``/``kv_indices`` and the tree blocks as ``[bs, N, N]``.

Everything here runs on the device without host synchronisation, so it can feed CUDA-graph
replays; out-of-range reads (a CUDA-graph batch padded beyond the real requests) are clamped and
padded rows get an all-visible tree block.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

MASK_LAYOUTS = ("full", "qlen")


def custom_mask_layout(numel: int, batch_size: int, tree_size: int, seq_lens_sum: Optional[int]) -> str:
    """Which layout a custom mask of ``numel`` entries has (``"full"`` unless it is ``bs*N*N``).

    With ``seq_lens_sum`` known, a size matching neither layout is an error.
    """
    qlen = batch_size * tree_size * tree_size
    if seq_lens_sum is not None:
        full = tree_size * seq_lens_sum + qlen
        if numel == full:
            return "full"
        if numel == qlen:
            return "qlen"
        raise ValueError(
            f"custom_mask has {numel} entries; expected {full} (full layout) or {qlen} (tree blocks)"
        )
    return "qlen" if numel == qlen else "full"


def tree_mask_from_custom_mask(
    custom_mask: torch.Tensor,
    seq_lens: torch.Tensor,
    tree_size: int,
    *,
    layout: str = "full",
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Extract the ``[bs, N, N]`` tree blocks of SGLang's flat verify mask.

    Args:
        custom_mask: flat bool mask (``layout="full"``: ``[N, seq_len+N]`` per request;
            ``"qlen"``: ``[N, N]`` per request).
        seq_lens: ``[bs]`` committed lengths (device tensor).
        tree_size: ``N``, draft tokens per request.
        out: optional ``[bs, N, N]`` bool/uint8 destination (e.g. a CUDA-graph buffer).
    """
    if layout not in MASK_LAYOUTS:
        raise ValueError(f"layout must be one of {MASK_LAYOUTS}")
    bs = seq_lens.numel()
    device = custom_mask.device
    flat = custom_mask.reshape(-1)
    n = flat.numel()
    ar = torch.arange(tree_size, device=device, dtype=torch.int64)
    if layout == "full":
        lens = seq_lens.to(device=device, dtype=torch.int64)
        row_len = lens + tree_size
        per_req = row_len * tree_size
        start = torch.cumsum(per_req, 0) - per_req
        idx = start[:, None, None] + ar[None, :, None] * row_len[:, None, None] + lens[:, None, None] + ar[None, None, :]
    else:
        base = torch.arange(bs, device=device, dtype=torch.int64) * (tree_size * tree_size)
        idx = base[:, None, None] + ar[None, :, None] * tree_size + ar[None, None, :]
    in_range = idx < n
    if n == 0:
        vals = torch.ones(idx.shape, dtype=torch.bool, device=device)
    else:
        vals = flat[idx.clamp(max=n - 1)].to(torch.bool)
        vals = torch.where(in_range, vals, torch.ones_like(vals))
    if out is None:
        return vals
    out.copy_(vals.to(out.dtype))
    return out


def copy_tree_blocks(tree_mask: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Copy ready-made ``[bs', N, N]`` tree blocks into ``out [bs, N, N]`` (``bs >= bs'``).

    Rows of padded requests (``bs' <= b < bs``) become all-visible.
    """
    real = tree_mask.shape[0]
    if real > out.shape[0] or tuple(tree_mask.shape[1:]) != tuple(out.shape[1:]):
        raise ValueError(f"tree_mask {tuple(tree_mask.shape)} does not fit {tuple(out.shape)}")
    out[:real].copy_(tree_mask.to(out.dtype))
    if real < out.shape[0]:
        out[real:].fill_(1)
    return out


def prefix_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    total: int,
    *,
    kv_indptr: Optional[torch.Tensor] = None,
    kv_indices: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``kv_indptr [bs+1]`` and ``kv_indices [total]`` (int32) of the committed prefixes.

    ``kv_indices[kv_indptr[b] + p] = req_to_token[req_pool_indices[b], p]`` for ``p < seq_lens[b]``;
    ``total`` is ``sum(seq_lens)`` known on the host. Optional outputs may be larger buffers.
    Torch reference of :func:`sgl_longgen.kernels.prefix_slots.prefix_slots`.
    """
    bs = seq_lens.numel()
    device = req_to_token.device
    if kv_indptr is None:
        kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=device)
    kv_indptr[:1].zero_()
    kv_indptr[1 : bs + 1] = torch.cumsum(seq_lens.to(torch.int64), 0).to(torch.int32)
    if kv_indices is None:
        kv_indices = torch.empty(total, dtype=torch.int32, device=device)
    if total > 0:
        pos = torch.arange(total, device=device, dtype=torch.int64)
        req = torch.searchsorted(kv_indptr[1 : bs + 1].to(torch.int64), pos, right=True)
        offset = pos - kv_indptr[req].to(torch.int64)
        rows = req_pool_indices.to(torch.int64)[req]
        kv_indices[:total] = req_to_token[rows, offset].to(torch.int32)
    return kv_indptr[: bs + 1], kv_indices


def page_table_from_indices(
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    out: torch.Tensor,
    seq_lens_out: Optional[torch.Tensor] = None,
    skip: torch.Tensor | None = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The prefixes as a dense page table (page size 1) and their lengths, for FA3's paged kernel.

    ``out [bs, W]`` receives ``kv_indices[kv_indptr[b] + j]`` at ``[b, j]`` for ``j <
    len_b``; the entries past a prefix hold a valid slot (the gather is clamped) that the kernel
    never reads, since it stops at the row's length. ``W`` must cover the longest prefix (a wide
    persistent buffer may be passed as a column slice). Sync free, so a CUDA-graph replay's plan
    can fill persistent buffers with it.

    ``skip`` (one-element int32 device tensor): each prefix without its first ``skip`` slots (a
    cascade's own part; a prefix no longer than ``skip`` becomes empty).
    """
    bs, width = out.shape
    starts, ends = kv_indptr[:bs], kv_indptr[1 : bs + 1]
    if skip is not None:
        starts = torch.minimum(starts + skip, ends)
    lens = ends - starts
    if seq_lens_out is None:
        seq_lens_out = torch.empty(bs, dtype=torch.int32, device=out.device)
    seq_lens_out[:bs].copy_(lens)
    if kv_indices.numel() == 0:
        out.zero_()
        return out, seq_lens_out[:bs]
    pos = starts[:, None].to(torch.int64) + torch.arange(width, device=out.device)[None, :]
    out.copy_(kv_indices[pos.clamp_(max=kv_indices.numel() - 1)])
    return out, seq_lens_out[:bs]


def shared_prefix_length(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    width: int,
    *,
    min_shared: int = 1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """How many leading committed slots every request of the batch shares (a one-element int32
    device tensor, sync free): the radix cache gives requests with a common prompt the same
    slots over it, so the longest common prefix of their ``req_to_token`` rows is the prefix a
    cascade may attend once.

    Only the first ``width`` slots are compared (a host bound, at most the shortest committed
    length; a fixed width keeps the shape constant for CUDA graphs), and never past the shortest
    ``seq_lens``. A common prefix shorter than ``min_shared`` counts as none (0). One request
    shares its whole prefix (up to ``width``) with itself.
    """
    device = req_to_token.device
    if out is None:
        out = torch.empty(1, dtype=torch.int32, device=device)
    if width <= 0 or req_pool_indices.numel() == 0:
        return out.zero_()
    rows = req_to_token[req_pool_indices.to(torch.int64), :width]  # [bs, width]
    pos = torch.arange(rows.shape[1], device=device)
    differs = (rows != rows[:1]).any(0) | (pos >= seq_lens.min().to(device))
    common = torch.where(differs, pos, rows.shape[1]).min()
    out.copy_(torch.where(common >= min_shared, common, 0).view(1))
    return out
