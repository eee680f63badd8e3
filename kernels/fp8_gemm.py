"""Triton kernel: ``x @ W.T`` for an e4m3 matrix ``W`` with one float32 scale per row, weight-only.

The drafters multiply a few rows (beam rows: 1 to 64, mostly 16 or fewer) by large matrices
(4096 x 14336 up to a 128K-row head), GEMMs bound by reading the matrix. cuBLAS's fp8 GEMM needs
both operands in fp8, so the activations would be quantized first (about eight small kernels per
GEMM), and its kernels are built for many rows. Here the activations stay in their dtype and only
the matrix is fp8, read at one byte per entry:

* one program per (``BLOCK_N`` rows of ``W``, K split, ``BLOCK_M`` rows of ``x``) loads its tile of
  ``W`` as e4m3, converts it in registers to ``x``'s dtype (exact: e4m3 values are bf16 and fp16
  values) and accumulates ``W_tile @ x_tile.T`` in float32. ``W``'s rows are the product's rows
  (the tensor cores' wide side) and ``x``'s few rows its columns, padded to 16 by masked loads, so
  ``x`` is never copied;
* with ``f16_dot`` (bf16 activations only; the table's choice), the tile of ``W`` becomes fp16 and
  the product runs in fp16, ``x``'s tile (a quarter of ``W``'s or less) converted instead and clamped
  to fp16's range: exact for bf16 values of magnitude 2^-14 to 65504; beyond, the drafts change,
  never the verified output. Hopper converts a pair of e4m3 to fp16 in one instruction, to bf16
  in more, so the fp16 product reads the matrix faster (figures in docs/performance.md);
* a row's scale multiplies its float32 sum once, after the K loop (``sum_k q[n, k] x[m, k]`` times
  ``scale[n]``: the same value as dequantizing first, one multiply per output instead of per entry);
* with ``tma`` (the table's choice up to 16 rows of ``x`` on compute capability 9.0+, for a
  16-byte aligned matrix), each tile of ``W`` is one tensor-memory-accelerator copy from a
  descriptor of the matrix (rows past ``N`` and columns past ``K`` read as zeros) instead of
  per-entry addresses and masks, the same sums in the same order, and faster than the address
  reads at these row counts (docs/performance.md);
* with few row blocks (a 4096-row matrix is 64 blocks for 132 SMs) K is split: each split writes
  float32 partial sums to a workspace and :func:`_split_sum_kernel` adds them in split order,
  scales and casts (no atomics: the same bits on every call).

Tiles come from a small fixed table keyed by the row count, the split from the grid's size against
the SM count: every shape follows from the operands' shapes and nothing is read back, so the
kernel is captured in the drafters' CUDA graphs (the workspace is an ordinary allocation, which a
capture takes from its graph pool). The PyTorch twin is
:func:`sgl_longgen.core.fp8.reference_linear` (dequantize, then ``F.linear``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .triton_common import interpreting, upcast_dots

E4M3 = torch.float8_e4m3fn
MAX_SPLIT_K = 16
MIN_SPLIT_STEPS = 4  # a K split runs at least this many BLOCK_K steps (each split adds a partial row to the workspace)
REDUCE_BLOCK = 1024


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int  # rows of x per program (x's rows are padded to it by masks)
    block_n: int  # rows of W per program
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int
    f16_dot: bool = False  # bf16 activations: the product in fp16 (W converted to fp16, x clamped to it)
    tma: bool = False  # W's tiles through a tensor descriptor (where the GPU and the matrix allow it)


# (largest row count, block_m, block_n, block_k, num_warps, num_stages). Per stage the pipeline
# holds block_n x block_k bytes of W and block_m x block_k entries of x: 24-32 KB, so 3-4 stages
# stay within shared memory with two programs per SM.
_TILES = (
    (16, 16, 64, 256, 4, 4),
    (32, 32, 64, 256, 4, 3),
    (None, 64, 64, 128, 4, 4),
)

# Up to TMA_ROWS rows of x, where W can be read through a descriptor (tma_possible), the table
# has tiles of its own, (block_n, block_k, num_warps, num_stages): the wide one where its grid
# fills the GPU unsplit (the MLP's 28672 rows, the heads), else the narrow one with its K split
# (the 4096- and 6144-row matrices). Chosen by a sweep of tiles and splits over LongSpec's
# matrices, each read by addresses and through a descriptor (``bench.kernels --mode fp8-gemm
# --tune``; figures in docs/performance.md).
TMA_ROWS = 16
_TMA_WIDE = (128, 256, 8, 3)
_TMA_NARROW = (64, 256, 4, 3)

_SMS: dict[int, int] = {}  # CUDA device index -> SM count
_CAPABILITY: dict[int, tuple[int, int]] = {}  # CUDA device index -> compute capability
# What the table gives: bf16 activations' product in fp16, W read through a descriptor where it can be
_TABLE = {"f16_dot": True, "tma": True, "inline_sums": True}


@contextmanager
def table_choice(f16_dot: bool | None = None, tma: bool | None = None, inline_sums: bool | None = None
                 ) -> Iterator[None]:
    """Within the block, configs taken from the table (:func:`fp8_gemm_config` without the
    argument) run the product in fp16 or bf16 (``f16_dot``) and read ``W`` through a descriptor
    or by addresses with the address tiles (``tma``), and a compiled step adds a split GEMM's
    sums in the kernel that reads its product or with the split-sum kernel (``inline_sums``,
    read while the step is traced: :func:`inline_sums`); ``None`` keeps the table's own choice
    (fp16, descriptors, sums inline). How a benchmark times a whole drafter step, its CUDA graph
    captured (and traced) inside the block, either way. Not thread-safe, not for the product."""
    before = dict(_TABLE)
    _TABLE.update({k: v for k, v in (("f16_dot", f16_dot), ("tma", tma), ("inline_sums", inline_sums))
                   if v is not None})
    try:
        yield
    finally:
        _TABLE.update(before)


def inline_sums() -> bool:
    """Whether a traced step takes a split GEMM's partial sums (``fp8_gemm(..., parts=True)``) and
    adds them itself, where inductor folds them into the next kernel (the table's choice)."""
    return _TABLE["inline_sums"]


def tma_possible(q: torch.Tensor) -> bool:
    """Whether ``q`` can be read through a tensor descriptor: a Hopper-or-newer GPU (or the
    interpreter) and the descriptor's 16-byte alignment of the base and the row stride."""
    if q.data_ptr() % 16 or q.stride(0) % 16:
        return False
    return tma_possible_on(q.device)


def tma_possible_on(device: torch.device) -> bool:
    """Whether ``device`` reads tensor descriptors: a Hopper-or-newer GPU, or the interpreter."""
    if device.type != "cuda":
        return interpreting(_fp8_gemm_kernel)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY[index] >= (9, 0)


def num_sms(device: torch.device) -> int:
    """SMs of ``device`` (a CPU, for the interpreter, counts as 8)."""
    if device.type != "cuda":
        return 8
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def fp8_gemm_config(m: int, n: int, k: int, sms: int, split_k: int | None = None,
                    tile: tuple[int, int, int, int] | None = None, f16_dot: bool | None = None,
                    tma: bool | None = None) -> Fp8GemmConfig:
    """The tiles for ``m`` rows of ``x`` and an ``n x k`` matrix, and the K split: doubled while the
    grid has fewer than 1.5 programs per SM and each split keeps :data:`MIN_SPLIT_STEPS` K steps
    (a 4096 x 14336 matrix: 64 row blocks, 4 splits; 14336 or more rows: no split). ``split_k``
    overrides the split; ``tile`` (``block_n, block_k, num_warps, num_stages``) the table's tile
    for ``W`` (the split then follows from it); ``f16_dot`` the product's dtype (module docstring;
    ``None``: the table's, the fp16 product unless :func:`table_choice` says otherwise), ``tma``
    how ``W`` is read (``None``: the table's, through a descriptor with the descriptor tiles up to
    :data:`TMA_ROWS` rows unless :func:`table_choice` says otherwise; the caller says ``False``
    where the matrix cannot be read so, :func:`tma_possible`)."""
    if f16_dot is None:
        f16_dot = _TABLE["f16_dot"]
    if tma is None:
        tma = _TABLE["tma"] and m <= TMA_ROWS
    for limit, bm, bn, bk, warps, stages in _TILES:
        if limit is None or m <= limit:
            break
    if tile is None and tma and m <= TMA_ROWS:
        wide = _TMA_WIDE
        unsplit = _split(triton.cdiv(n, wide[0]) * triton.cdiv(m, bm), k, wide[1], sms) == 1
        bn, bk, warps, stages = wide if unsplit else _TMA_NARROW
    if tile is not None:
        bn, bk, warps, stages = tile
    if split_k is None:
        split_k = _split(triton.cdiv(n, bn) * triton.cdiv(m, bm), k, bk, sms)
    if split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")
    return Fp8GemmConfig(bm, bn, bk, warps, stages, split_k, f16_dot, tma)


def _split(tiles: int, k: int, block_k: int, sms: int) -> int:
    """K splits for a grid of ``tiles`` programs: doubled while the grid has fewer than 1.5
    programs per SM and each split keeps :data:`MIN_SPLIT_STEPS` steps of ``block_k``."""
    split = 1
    while split * 2 <= MAX_SPLIT_K and 2 * tiles * split < 3 * sms and k >= 2 * split * MIN_SPLIT_STEPS * block_k:
        split *= 2
    return split


@triton.jit
def _fp8_gemm_kernel(X, W, Scale, Out, Part, M, N, K, stride_xm, stride_wn, k_per_split,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                     F16_DOT: tl.constexpr, TMA: tl.constexpr, SPLIT_OUT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    k_start = pid_k * k_per_split
    if not TMA:  # W is a pointer (else a tensor descriptor of the whole matrix)
        w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + (k_start + offs_k)[None, :]
    x_ptrs = X + offs_m[:, None].to(tl.int64) * stride_xm + (k_start + offs_k)[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        if TMA:  # out-of-range rows and columns read as zeros
            w = W.load([pid_n * BLOCK_N, k_start + k0])
        elif EVEN_K:
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = (k_start + k0 + offs_k) < K
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        else:
            k_ok = (k_start + k0 + offs_k) < K
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if F16_DOT:  # then w converts to fp16 below
            x = tl.minimum(tl.maximum(x.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
        if UPCAST:
            acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc)
        elif IEEE:
            acc = tl.dot(w.to(tl.float32), tl.trans(x), acc, input_precision="ieee")
        else:
            acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
        if not TMA:
            w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    keep = n_ok[:, None] & m_ok[None, :]
    if SPLIT == 1 and not SPLIT_OUT:  # (SPLIT_OUT: the caller takes the splits' sums, even of one split)
        scale = tl.load(Scale + offs_n, mask=n_ok, other=0.0)
        y = acc * scale[:, None]
        tl.store(Out + offs_m[None, :].to(tl.int64) * N + offs_n[:, None], y.to(Out.dtype.element_ty), mask=keep)
    else:
        rows = (pid_k * M + offs_m[None, :]).to(tl.int64)
        tl.store(Part + rows * N + offs_n[:, None], acc, mask=keep)


@triton.jit
def _split_sum_kernel(Part, Scale, Out, M, N, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(Part + (s * M + m).to(tl.int64) * N + offs, mask=ok, other=0.0)
    scale = tl.load(Scale + offs, mask=ok, other=0.0)
    tl.store(Out + m.to(tl.int64) * N + offs, (acc * scale).to(Out.dtype.element_ty), mask=ok)


def partial_splits(m: int, n: int, k: int, device: torch.device) -> int:
    """The K splits of the table's config for ``m`` rows of ``x`` and an ``n x k`` matrix on
    ``device``, from the shapes alone: how many partial sums ``fp8_gemm(..., parts=True)`` returns
    (what a trace's shape-only fake of it promises, before any matrix exists)."""
    tma = None if device.type == "cuda" and tma_possible_on(device) else False
    return fp8_gemm_config(m, n, k, num_sms(device), tma=tma).split_k


def fp8_gemm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, split_k: int | None = None,
             config: Fp8GemmConfig | None = None, parts: bool = False) -> torch.Tensor:
    """``x @ (q * scale[:, None]).T`` for ``x`` ``[..., K]`` (bf16, fp16 or fp32), ``q`` e4m3
    ``[N, K]`` and ``scale`` float32 ``[N]``: ``[..., N]`` in ``x``'s dtype, summed in float32.
    ``split_k`` (or a whole ``config``) overrides the heuristic of :func:`fp8_gemm_config`.

    ``parts``: the K splits' float32 sums, unscaled, ``[S, ..., N]`` (``S`` = ``split_k``, else
    :func:`partial_splits`; a split with nothing of K left to read is zeros), without the kernel
    that adds them: ``(parts.sum(0) * scale).to(x.dtype)`` is the product. A compiled drafter step
    takes them so that inductor adds them inside the kernel that reads the product anyway (the
    residual add and norm after a projection), one launch fewer a split GEMM."""
    if q.dtype != E4M3 or q.dim() != 2 or scale.dtype != torch.float32 or scale.shape != q.shape[:1]:
        raise ValueError(f"fp8_gemm takes an e4m3 [N, K] matrix and float32 [N] scales, got {q.dtype} "
                         f"{tuple(q.shape)} and {scale.dtype} {tuple(scale.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"fp8_gemm takes bf16, fp16 or fp32 activations, got {x.dtype}")
    n, k = q.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} columns, the matrix {k}")
    lead = x.shape[:-1]
    if parts and split_k is None:
        split_k = partial_splits(x.numel() // max(k, 1), n, k, x.device)
    if k == 0 or parts and (x.numel() == 0 or n == 0):
        shape = (split_k, *lead, n) if parts else (*lead, n)
        return torch.zeros(shape, dtype=torch.float32 if parts else x.dtype, device=x.device)
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if q.stride(-1) != 1:
        q = q.contiguous()
    scale = scale.contiguous()
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*lead, n)
    possible = tma_possible(q)
    cfg = config or fp8_gemm_config(m, n, k, num_sms(x.device), split_k, tma=None if possible else False)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)  # never a split with nothing of K to read
    if parts:  # the splits' sums are the result, with a zero partial for each split past K
        part = torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=x.device)
        part[split:].zero_()
    else:
        part = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    upcast = upcast_dots(_fp8_gemm_kernel)
    grid = (triton.cdiv(n, cfg.block_n), split, triton.cdiv(m, cfg.block_m))
    tma = cfg.tma and possible
    w = TensorDescriptor.from_tensor(q, [cfg.block_n, cfg.block_k]) if tma else q
    _fp8_gemm_kernel[grid](rows, w, scale, out, part, m, n, k, rows.stride(0), q.stride(0), k_per_split,
                           BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=split,
                           EVEN_K=k == split * k_per_split, UPCAST=upcast,
                           IEEE=x.dtype == torch.float32 and not upcast,
                           F16_DOT=cfg.f16_dot and x.dtype == torch.bfloat16, TMA=tma,
                           num_warps=cfg.num_warps, num_stages=cfg.num_stages, SPLIT_OUT=parts)
    if parts:
        return part.view(cfg.split_k, *lead, n)
    if split > 1:
        block = min(REDUCE_BLOCK, triton.next_power_of_2(n))
        _split_sum_kernel[(m, triton.cdiv(n, block))](part, scale, out, m, n, SPLIT=split, BLOCK=block,
                                                      num_warps=4)
    return out.view(*lead, n)

