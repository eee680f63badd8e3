"""The drafters' kernels as PyTorch custom ops while ``torch.compile`` traces them.

Dynamo cannot trace the host side of these wrappers (tile tables, SM counts, workspaces), so
each call in a compiled step would be a graph break, and every break compiles the code after it
once per shape: a LongSpec step's seven matrices at three row counts pass Dynamo's limit of 8
shapes per frame, past which it runs those frames as plain PyTorch (seen on an H200 with
``bench.gpu_check --phase longspec --longspec-compile``). As custom ops with a shape-only fake
they are single nodes of one graph: inductor fuses the small kernels around them and calls the
wrapper as it is, at run time (so a CUDA graph captured from the compiled step holds the same
kernel launches).

Outside a trace the wrappers are called directly: an eager caller pays no op dispatch.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps

import torch

from . import fp8_gemm as _fp8
from . import longspec_topk as _topk
from . import masked_attention as _masked
from . import prefix_attention as _prefix


def _when_compiling(op, fn: Callable) -> Callable:
    """``fn``, or ``op`` while Dynamo traces (same arguments, same results)."""

    @wraps(fn)
    def call(*args):
        return op(*args) if torch.compiler.is_compiling() else fn(*args)

    return call


@torch.library.custom_op("sgl_longgen::fp8_gemm", mutates_args=())
def _fp8_gemm_op(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return _fp8.fp8_gemm(x, q, scale)


@_fp8_gemm_op.register_fake
def _(x, q, scale):
    return x.new_empty((*x.shape[:-1], q.shape[0]))


@torch.library.custom_op("sgl_longgen::fp8_gemm_parts", mutates_args=())
def _fp8_gemm_parts_op(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return _fp8.fp8_gemm(x, q, scale, parts=True)


@_fp8_gemm_parts_op.register_fake
def _(x, q, scale):
    n, k = q.shape
    splits = _fp8.partial_splits(x.numel() // max(k, 1), n, k, x.device)
    return x.new_empty((splits, *x.shape[:-1], n), dtype=torch.float32)


@torch.library.custom_op("sgl_longgen::prefix_attention", mutates_args=())
def _prefix_attention_op(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, kv_indptr: torch.Tensor,
                         kv_indices: torch.Tensor, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _prefix.prefix_attention(q, k_buffer, v_buffer, kv_indptr, kv_indices, sm_scale)


@_prefix_attention_op.register_fake
def _(q, k_buffer, v_buffer, kv_indptr, kv_indices, sm_scale):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.custom_op("sgl_longgen::log_softmax_topk", mutates_args=())
def _log_softmax_topk_op(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _topk.log_softmax_topk(logits, k)


@_log_softmax_topk_op.register_fake
def _(logits, k):
    shape = (*logits.shape[:-1], k)
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int64)


@torch.library.custom_op("sgl_longgen::best_of_rows", mutates_args=())
def _best_of_rows_op(parent_scores: torch.Tensor, top: torch.Tensor, ids: torch.Tensor, width: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _topk.best_of_rows(parent_scores, top, ids, width)


@_best_of_rows_op.register_fake
def _(parent_scores, top, ids, width):
    shape = (top.shape[0], width)
    return top.new_empty(shape), ids.new_empty(shape), ids.new_empty(shape, dtype=torch.int64)


@torch.library.custom_op("sgl_longgen::cut_beam", mutates_args=())
def _cut_beam_op(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, n: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    return _topk.cut_beam(scores, tokens, parents, depths, n)


@_cut_beam_op.register_fake
def _(scores, tokens, parents, depths, n):
    B, n = scores.shape[0], min(n, scores.shape[1])
    return scores.new_empty((B, 3 * n + 1), dtype=torch.int64), scores.new_empty((B, n))


@torch.library.custom_op("sgl_longgen::masked_attention", mutates_args=())
def _masked_attention_op(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                         scale: float) -> torch.Tensor:
    return _masked.masked_attention(q, keys, values, mask, scale)


@_masked_attention_op.register_fake
def _(q, keys, values, mask, scale):
    return q.new_empty((*q.shape[:2], q.shape[2] * q.shape[3]))


@torch.library.custom_op("sgl_longgen::masked_attention_into", mutates_args=("keys", "values"))
def _masked_attention_into_op(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, new_k: torch.Tensor,
                              new_v: torch.Tensor, at: int, ring_mask: torch.Tensor, tree_mask: torch.Tensor,
                              scale: float) -> torch.Tensor:
    return _masked.masked_attention_into(q, keys, values, new_k, new_v, at, ring_mask, tree_mask, scale)


@_masked_attention_into_op.register_fake
def _(q, keys, values, new_k, new_v, at, ring_mask, tree_mask, scale):
    return q.new_empty((*q.shape[:2], q.shape[2] * q.shape[3]))


# Each takes its op's arguments, positionally: the kernels' defaults (table config, no outputs given).
fp8_gemm = _when_compiling(_fp8_gemm_op, _fp8.fp8_gemm)
fp8_gemm_parts = _when_compiling(_fp8_gemm_parts_op, lambda x, q, scale: _fp8.fp8_gemm(x, q, scale, parts=True))
prefix_attention = _when_compiling(_prefix_attention_op, _prefix.prefix_attention)
log_softmax_topk = _when_compiling(_log_softmax_topk_op, _topk.log_softmax_topk)
best_of_rows = _when_compiling(_best_of_rows_op, _topk.best_of_rows)
cut_beam = _when_compiling(_cut_beam_op, _topk.cut_beam)
masked_attention = _when_compiling(_masked_attention_op, _masked.masked_attention)
# writes its keys/values arguments in place: inductor then passes the step's buffers as they are
masked_attention_into = _when_compiling(_masked_attention_into_op, _masked.masked_attention_into)
