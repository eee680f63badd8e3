"""PyTorch stand-ins for the ``sgl_kernel`` CPU ops a speculative run touches.

SGLang's CPU engine expects ``sgl_kernel``'s CPU build; the PyPI wheel is CUDA-only. Where the
CPU op is missing, these few equivalents (installed through SGLang's hook registry, on CPU only)
let the real scheduler run our algorithms on a machine without a GPU.
"""

from __future__ import annotations

import os

import torch


def has_sgl_kernel_op(name: str) -> bool:
    try:
        getattr(torch.ops.sgl_kernel, name)
        return True
    except (AttributeError, RuntimeError):
        return False


def assign_req_to_token_pool(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, batch_size):
    """Write each request's newly allocated slots into its ``req_to_token`` row."""
    pos = 0
    starts, ends, rows = start_offset.tolist(), end_offset.tolist(), req_pool_indices.tolist()
    for i in range(batch_size):
        s, e = int(starts[i]), int(ends[i])
        req_to_token[int(rows[i]), s:e] = out_cache_loc[pos : pos + e - s].to(req_to_token.dtype)
        pos += e - s


def skip_kv_copy_warmup(self) -> None:
    """The tiled KV copy kernel is CUDA/sgl_kernel only; moves go through the native path."""
    self._kv_copy_config = None


def no_nccl_library() -> str:
    """Tensor parallelism on the CPU engine all-reduces through gloo. SGLang still builds an NCCL
    communicator per group when ``libnccl`` loads (a CUDA build of PyTorch ships it), which fails on
    a CPU device; without the library (a CPU build of PyTorch) the communicator stays disabled."""
    raise RuntimeError("no NCCL on SGLang's CPU engine")


def hooks(tree_backends: tuple[str, ...]) -> dict:
    """The stand-ins by :data:`sgl_longgen.sglang.compat.CPU_HOOKS` name (call only on SGLang's CPU engine)."""
    # KV moves (speculative commit) through plain tensor indexing.
    os.environ.setdefault("SGLANG_NATIVE_MOVE_KV_CACHE", "1")
    out = {"kv_copy_warmup": skip_kv_copy_warmup, "no_nccl": no_nccl_library}
    if not has_sgl_kernel_op("assign_req_to_token_pool_cpu"):
        out["assign_req_to_token_pool"] = assign_req_to_token_pool
    # Our torch backends must not be sent down SGLang's Triton helper kernels on CPU.
    no_triton = ("torch_native", "intel_amx", *tree_backends)
    out["support_triton"] = lambda backend: backend not in no_triton
    return out
