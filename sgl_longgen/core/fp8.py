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

:class:`Fp8Linear` holds one quantized matrix and computes ``x @ W.T`` through the GEMM installed
with :func:`use_gemm`. The core imports no kernels: until a device layer installs its GEMM that is
the twin, which dequantizes the matrix and multiplies in the activation's dtype.
:mod:`sgl_longgen.kernels.fp8_linear` installs, when imported, the dispatch that takes the
weight-only Triton GEMM of :mod:`sgl_longgen.kernels.fp8_gemm` on CUDA devices where Triton has
e4m3 conversions (compute capability 8.9 and up: Ada, Hopper; the matrix read as e4m3, converted
in registers, float32 sums scaled once per output; fixed shapes and no host reads, so it is
captured in the drafters' CUDA graphs) and the twin everywhere else (CPU, older GPUs, float64);
the twin is the reference the kernel is tested against.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite e4m3fn value; beyond it a cast gives NaN, so values are clamped
CHUNK_ROWS = 4096  # rows quantized at once: bounds the float32 transient of a 128K-row head


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


# ``gemm(x, q, scale)``: ``x @ W.T`` for ``W = q * scale`` (per row), what every Fp8Linear multiplies by
_gemm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = reference_linear


def use_gemm(gemm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """Make ``gemm(x, q, scale)`` the product of every :class:`Fp8Linear` (the twin until then):
    how a device layer (:mod:`sgl_longgen.kernels.fp8_linear`) brings its kernel without the core
    importing it. ``gemm`` must be :func:`reference_linear` wherever it has no kernel of its own."""
    global _gemm
    _gemm = gemm


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
        return _gemm(x, self.weight, self.scale)

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
