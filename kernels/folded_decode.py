"""FlashInfer path for the prefix half when the draft tree is small: T queries folded into GQA.

FlashInfer's tensor-core decode kernel packs the ``G`` query heads of a KV head into MMA rows and
splits the KV across CTAs, reading each KV tile once per KV head. Presenting the ``T`` draft tokens
of a request as ``T*G`` query heads of one decode query, ``q'[kvh*(T*G) + t*G + g] = q[t, kvh*G+g]``,
turns the unmasked prefix half of tree verification into exactly that kernel, which reads each KV
tile once per KV head: for small trees the prefix half costs about what an AR decode step does.

Limits (FlashInfer 0.6.15): the folded group ``T*G`` is kept at most 96 rows, the largest measured
to work (it fails from 128 rows on), the KV dtype must equal the query dtype here, and the split-KV scratch space FlashInfer
plans for grows as ``Hkv*T*G x tiles x 128-row tile x D`` floats (``workspace_bytes``), several
hundred MB at T=16, so the caller bounds it. Larger trees use the Triton kernel.

The output and its base-2 LSE stay in folded layout; ``merge.folded_strides`` lets the merge read
them in place.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

MAX_FOLDED_ROWS = 96  # largest T*G measured to work with FlashInfer 0.6.15 (128 fails)
_SUPPORTED_HEAD_DIMS = (64, 128, 256)
_INT_WORKSPACE_BYTES = 8 << 20


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:  # pragma: no cover - import errors vary with the CUDA setup
        return False
    return True


def fold_supported(
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    tree_size: int,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    device: torch.device,
) -> bool:
    """Whether the folded FlashInfer decode can serve this shape (no workspace check)."""
    group = num_qo_heads // num_kv_heads
    return (
        device.type == "cuda"
        and tree_size * group <= MAX_FOLDED_ROWS
        and head_dim in _SUPPORTED_HEAD_DIMS
        and q_dtype in (torch.float16, torch.bfloat16)
        and kv_dtype == q_dtype
        and flashinfer_available()
    )


def workspace_bytes(
    batch_size: int, num_qo_heads: int, num_kv_heads: int, head_dim: int, tree_size: int, num_sms: int
) -> int:
    """Upper bound of the float scratch space FlashInfer's plan allocates for the folded decode.

    Mirrors ``PrefillPlanImpl``/``PrefillSplitQOKVIndptr`` (scheduler.cuh) with ``qo_len = 1`` and
    group ``T*G``: ``num_qo_heads' * padded_batch * cta_tile_q * (head_dim + 1)`` floats, where the
    number of CTAs is padded up to ``2 * num_sms / Hkv`` and at least one per query tile.
    """
    rows = tree_size * (num_qo_heads // num_kv_heads)
    cta_tile_q = 128 if rows > 64 else (64 if rows > 16 else 16)
    # CUDA-graph plans pad to ceil(bs*rows/cta) + bs - 1 tiles; bound it by bs*(ceil(rows/cta)+1).
    padded_batch = max((2 * num_sms) // num_kv_heads, batch_size * (math.ceil(rows / cta_tile_q) + 1))
    folded_heads = num_kv_heads * rows
    return folded_heads * padded_batch * cta_tile_q * (head_dim + 1) * 4 + (4 << 20)


def fold_queries(q: torch.Tensor, batch_size: int, tree_size: int, num_kv_heads: int) -> torch.Tensor:
    """``[bs*T, Hkv*G, D] -> [bs, Hkv*T*G, D]`` with ``q'[b, kvh*(T*G) + t*G + g] = q[b*T+t, kvh*G+g]``."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    return (
        q.reshape(batch_size, tree_size, num_kv_heads, group, head_dim)
        .permute(0, 2, 1, 3, 4)
        .reshape(batch_size, num_kv_heads * tree_size * group, head_dim)
    )


class FoldedPrefixDecode:
    """Plan/run wrapper of FlashInfer's tensor-core decode over the prefix with T folded into GQA.

    Under CUDA graphs pass ``use_cuda_graph=True`` with the batch size and device buffers for
    ``kv_indptr`` (``[bs+1]``) and ``kv_indices`` that stay alive for the graph's lifetime, and a
    workspace of ``workspace_bytes`` for the largest tree planned; ``plan`` must run outside the
    graph before every replay, as for any FlashInfer wrapper.
    """

    def __init__(
        self,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        *,
        float_workspace: Optional[torch.Tensor] = None,
        use_cuda_graph: bool = False,
        kv_indptr_buf: Optional[torch.Tensor] = None,
        kv_indices_buf: Optional[torch.Tensor] = None,
        last_page_len_buf: Optional[torch.Tensor] = None,
    ) -> None:
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = torch.device(device)
        self.use_cuda_graph = use_cuda_graph
        self._float_workspace = float_workspace
        self._int_workspace: Optional[torch.Tensor] = None
        self._graph_bufs = (kv_indptr_buf, kv_indices_buf, last_page_len_buf)
        self._wrapper = None
        self._tree_size: Optional[int] = None
        self._batch_size: Optional[int] = None

    def _ensure_wrapper(self, needed_bytes: int):
        import flashinfer

        ws = self._float_workspace
        if ws is None or ws.numel() < needed_bytes:
            if self.use_cuda_graph and self._wrapper is not None:
                raise RuntimeError(
                    "folded decode workspace too small under CUDA graphs; size it for the largest tree"
                )
            self._float_workspace = torch.zeros(needed_bytes, dtype=torch.uint8, device=self.device)
            if self._wrapper is not None:
                self._wrapper.reset_workspace_buffer(self._float_workspace, self._int_workspace)
        if self._wrapper is None:
            indptr_buf, indices_buf, last_buf = self._graph_bufs
            if self.use_cuda_graph and last_buf is None and indptr_buf is not None:
                last_buf = torch.ones(indptr_buf.numel() - 1, dtype=torch.int32, device=self.device)
                self._graph_bufs = (indptr_buf, indices_buf, last_buf)
            self._wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._float_workspace,
                "NHD",
                use_cuda_graph=self.use_cuda_graph,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=indptr_buf if self.use_cuda_graph else None,
                paged_kv_indices_buffer=indices_buf if self.use_cuda_graph else None,
                paged_kv_last_page_len_buffer=last_buf if self.use_cuda_graph else None,
            )
            self._int_workspace = self._wrapper._int_workspace_buffer
        return self._wrapper

    def plan(
        self,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        tree_size: int,
        *,
        sm_scale: float,
        q_dtype: torch.dtype,
        kv_dtype: Optional[torch.dtype] = None,
    ) -> None:
        """Plan for ``bs = kv_indptr.numel() - 1`` requests of ``tree_size`` queries each.

        FlashInfer's plan copies ``kv_indptr`` to the host (one synchronisation per plan).
        """
        batch_size = kv_indptr.numel() - 1
        num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        needed = workspace_bytes(
            batch_size, self.num_qo_heads, self.num_kv_heads, self.head_dim, tree_size, num_sms
        )
        wrapper = self._ensure_wrapper(needed)
        group = self.num_qo_heads // self.num_kv_heads
        last_page_len = torch.ones(batch_size, dtype=torch.int32, device=self.device)
        wrapper.plan(
            kv_indptr,
            kv_indices,
            last_page_len,
            self.num_kv_heads * tree_size * group,
            self.num_kv_heads,
            self.head_dim,
            1,
            q_data_type=q_dtype,
            kv_data_type=kv_dtype or q_dtype,
            sm_scale=sm_scale,
        )
        self._tree_size = tree_size
        self._batch_size = batch_size

    def run(
        self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``q [bs*T, Hq, D]`` -> folded ``(o [bs, Hkv*T*G, D], lse [bs, Hkv*T*G])``, LSE base 2."""
        if self._wrapper is None or self._tree_size is None:
            raise RuntimeError("plan() must be called before run()")
        qf = fold_queries(q, self._batch_size, self._tree_size, self.num_kv_heads)
        return self._wrapper.run(qf, (k_buffer, v_buffer), return_lse=True)
