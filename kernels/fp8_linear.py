"""Which GEMM an fp8 drafter matrix takes on a device: the Triton kernel where it runs, else the twin.

:class:`sgl_longgen.core.fp8.Fp8Linear` holds the e4m3 matrix and its row scales and multiplies
through the GEMM installed in :mod:`sgl_longgen.core.fp8` (its PyTorch twin until one is: the core
imports no kernels). Importing this module installs :func:`fp8_linear`: on CUDA devices where
Triton has e4m3 conversions (compute capability 8.9 and up: Ada, Hopper) the weight-only GEMM of
:mod:`sgl_longgen.kernels.fp8_gemm` (the matrix read as e4m3, converted in registers, float32 sums
scaled once per output), with fixed shapes and no host reads, so it is captured in the drafters'
CUDA graphs; everywhere else (CPU, older GPUs, float64) the twin, which dequantizes the matrix
and multiplies in the activation's dtype. Every engine that runs fp8 drafters imports it (the
reference runtime's and the SGLang worker's OWL and LongSpec drafters, the device steps of
:mod:`.longspec_step` and :mod:`.owl_beam`, the GPU tools).
"""

from __future__ import annotations

import torch

from ..core import fp8 as _core_fp8
from ..core.fp8 import reference_linear

_CAPABILITY: dict[int, tuple[int, int]] = {}  # CUDA device index -> compute capability


def fp8_gemm_supported(device: torch.device) -> bool:
    """Triton compiles e4m3 conversions for this device (CUDA, compute capability >= 8.9)."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    cap = _CAPABILITY.get(index)
    if cap is None:
        cap = _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return cap >= (8, 9)


def uses_fp8_gemm(x: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether :func:`fp8_linear` takes the Triton GEMM for these operands (else the twin)."""
    return (x.is_cuda and q.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and fp8_gemm_supported(x.device))


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` for ``W = q * scale`` (per row): the Triton GEMM where it runs, else the twin.

    While ``torch.compile`` traces a step, a GEMM whose K is split returns its splits' partial sums
    and the sum, scale and cast are traced here as plain ops: inductor unrolls a sum of a few
    splits into the kernel that reads the product (a projection's residual add and norm), where
    eagerly a kernel of the GEMM's own adds them, one launch per split GEMM (25 in a LongSpec
    step). The same float32 sums in the same order, scaled and rounded once."""
    if uses_fp8_gemm(x, q):
        from . import custom_ops  # one node of a torch.compile'd drafter step
        from .fp8_gemm import inline_sums, partial_splits

        n, k = q.shape
        if torch.compiler.is_compiling() and inline_sums() and partial_splits(x.numel() // max(k, 1), n, k, x.device) > 1:
            parts = custom_ops.fp8_gemm_parts(x, q, scale)
            return (parts.sum(0) * scale).to(x.dtype)
        return custom_ops.fp8_gemm(x, q, scale)
    return reference_linear(x, q, scale)


_core_fp8.use_gemm(fp8_linear)
