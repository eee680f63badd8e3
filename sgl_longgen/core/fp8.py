"""FP8 (e4m3) drafter matrices: half the bytes a weight-bound drafter reads per beam level.

On an H100 the OWL and LongSpec drafters spend most of a draft reading their matrices: every
beam level multiplies at most a few dozen rows by them, GEMMs that run at the memory-bandwidth
floor. Stored as e4m3 values with one float32 scale per output row (``scale = row amax / 448``),
a matrix is half the bytes of bf16, and so, roughly, is that time.

Weight-only: the activations stay in their dtype (bf16 in a drafter). At a few rows the time is
the matrix's bytes, so quantizing the activations as well would save nothing and costs kernels of
its own (cuBLAS's fp8 GEMM takes both operands in fp8, and its kernels are built for many rows).
Only the matrix's rounding then changes what the drafter computes.

Lossless by construction: the drafter only proposes. Every committed token is drawn from the
target by the verifier's per-node walk (:mod:`.verify`), so the rounding changes which tokens
are proposed (acceptance), never the output or its distribution.

:class:`Fp8Linear` holds one quantized matrix and computes ``x @ W.T``. On CUDA devices where
Triton has e4m3 conversions (compute capability 8.9 and up: Ada, Hopper) that is the weight-only
Triton GEMM of :mod:`sgl_longgen.kernels.fp8_gemm` (the matrix read as e4m3, converted in
registers, float32 sums scaled once per output): fixed shapes and no host reads, so it is captured
in the drafters' CUDA graphs. Everywhere else (CPU, older GPUs, float64) its twin dequantizes the
matrix and multiplies in the activation's dtype; the twin is the reference the kernel is tested
against.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite e4m3fn value; beyond it a cast gives NaN, so values are clamped
CHUNK_ROWS = 4096  # rows quantized at once: bounds the float32 transient of a 128K-row head

_CAPABILITY: dict[int, tuple[int, int]] = {}  # CUDA device index -> compute capability


def quantize(weight: torch.Tensor, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: e4m3 ``[N, K]`` and float32 ``[N]`` with ``weight ~= q * scale[:, None]``.

    ``rows``: quantize only those rows of ``weight`` (gathered a chunk at a time, so a reduced
    head never exists as a second full-precision copy). An all-zero row gets scale 1.
    """
    if weight.dim() != 2:
        raise ValueError(f"an fp8 matrix is 2-D, got shape {tuple(weight.shape)}")
    n = weight.shape[0] if rows is None else rows.numel()
    if rows is not None:
        rows = rows.to(weight.device)
    q = torch.empty(n, weight.shape[1], dtype=E4M3, device=weight.device)
    scale = torch.empty(n, dtype=torch.float32, device=weight.device)
    with torch.no_grad():
        for lo in range(0, n, CHUNK_ROWS):
            hi = min(n, lo + CHUNK_ROWS)
            block = weight[lo:hi] if rows is None else weight.index_select(0, rows[lo:hi])
            q[lo:hi], scale[lo:hi] = _quantize_rows(block.float())
    return q, scale


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 rows -> their e4m3 values and one scale each (a row's largest magnitude maps to 448)."""
    amax = x.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return (x / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The matrix the twin multiplies by: ``q * scale`` per row, computed in float32."""
    return (q.float() * scale[:, None]).to(dtype)


def reference_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The twin: ``x @ dequantize(q, scale).T`` in ``x``'s dtype."""
    return F.linear(x, dequantize(q, scale, x.dtype))


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
    eagerly a kernel of the GEMM's own adds them, one launch of some 2 us per split GEMM (25 in a
    LongSpec step). The same float32 sums in the same order, scaled and rounded once."""
    if uses_fp8_gemm(x, q):
        from ..kernels import custom_ops  # one node of a torch.compile'd drafter step
        from ..kernels.fp8_gemm import inline_sums, partial_splits

        n, k = q.shape
        if torch.compiler.is_compiling() and inline_sums() and partial_splits(x.numel() // max(k, 1), n, k, x.device) > 1:
            parts = custom_ops.fp8_gemm_parts(x, q, scale)
            return (parts.sum(0) * scale).to(x.dtype)
        return custom_ops.fp8_gemm(x, q, scale)
    return reference_linear(x, q, scale)


class Fp8Linear(nn.Module):
    """A bias-free ``nn.Linear`` whose matrix is e4m3 (``weight``, ``[out, in]``) with one float32
    scale per output row (``scale``), for a drafter's matrices (see the module docstring)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        if weight.dtype != E4M3 or scale.dtype != torch.float32 or scale.shape != weight.shape[:1]:
            raise ValueError(f"an Fp8Linear takes an e4m3 [out, in] matrix and float32 [out] scales, got "
                             f"{weight.dtype} {tuple(weight.shape)} and {scale.dtype} {tuple(scale.shape)}")
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)

    @classmethod
    def quantize(cls, weight: torch.Tensor, rows: torch.Tensor | None = None) -> Fp8Linear:
        """The layer of ``weight`` (or of its ``rows``), quantized; ``weight`` itself is left as it is."""
        return cls(*quantize(weight.detach(), rows))

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.weight, self.scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.scale)

    def _apply(self, fn, recurse=True):
        """Device moves only: a drafter-wide ``.to(dtype)`` or ``.double()`` must not turn the e4m3
        values into plain numbers of another dtype (without their scales they mean nothing)."""
        device = fn(torch.empty(0, device=self.weight.device)).device
        if device != self.weight.device:
            self.weight = self.weight.to(device)
            self.scale = self.scale.to(device)
        return self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 with row scales"


def linear(x: torch.Tensor, weight: torch.Tensor | Fp8Linear) -> torch.Tensor:
    """``x @ W.T`` for a plain matrix (``F.linear``, the kernel as ever) or a quantized one."""
    return weight(x) if isinstance(weight, Fp8Linear) else F.linear(x, weight)


def quantize_linears(module: nn.Module, names: Iterable[str]) -> None:
    """Replace the named bias-free ``nn.Linear`` submodules (dotted paths) of ``module`` by their
    :class:`Fp8Linear`, in place. Only the fp8 copy is kept: the full-precision matrices go with
    the layers they belonged to (unless something else still holds them). Layers already
    quantized are left as they are."""
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = module.get_submodule(parent_name)
        layer = getattr(parent, leaf)
        if isinstance(layer, Fp8Linear):
            continue
        if not isinstance(layer, nn.Linear) or layer.bias is not None:
            raise TypeError(f"{name} is not a bias-free nn.Linear ({type(layer).__name__})")
        setattr(parent, leaf, Fp8Linear.quantize(layer.weight))
