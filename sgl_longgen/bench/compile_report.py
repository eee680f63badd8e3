"""Compile the Triton kernels of :mod:`sgl_longgen.kernels` for Hopper (sm_90) without a GPU and
report their resources.

Triton ships ``ptxas``, so a kernel compiles to a cubin on any machine. The report shows, per
launch configuration, the registers per thread, local-memory stack (spills), shared memory, and
whether the matrix products use Hopper's ``wgmma`` and the loads are pipelined with ``cp.async``,
which answers most performance questions before any GPU time is spent. Signatures mirror real
launches: pointers and strides divisible by 16 (as the runtime specialises them for
Llama-shaped tensors), bf16 activations, head dim 128, GQA group 4.

    python -m sgl_longgen.bench.compile_report            # default configurations
    python -m sgl_longgen.bench.compile_report --prefix 128,64,8,3 --prefix 64,64,4,3
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from typing import Dict, Iterable, List, Optional, Tuple

_PTR_DTYPES = {  # kernel argument -> pointer type; everything not listed is an int32 scalar
    "Q": "*bf16", "K": "*bf16", "V": "*bf16", "K_buf": "*bf16", "V_buf": "*bf16", "Mask": "*u8",
    "O": "*fp32", "Lse": "*fp32", "PartO": "*fp32", "PartLse": "*fp32", "Out": "*bf16", "OutLse": "*fp32",
    "KvIndptr": "*i32", "KvIndices": "*i32", "OA": "*bf16", "LA": "*fp32", "OB": "*fp32", "LB": "*fp32",
}
_FLOAT_ARGS = {"qk_scale"}
# scalar arguments that are not multiples of 16 at real launches (tree sizes, split strides)
_NOT_DIVISIBLE = {"tree_size", "num_kv_heads", "num_states", "num_rows", "num_heads", "stride_pl_head",
                  "stride_pl_tok", "stride_lse_head", "stride_lse_tok", "stride_m_req", "stride_m_row",
                  "stride_m_col", "stride_ol_tok", "stride_ol_head", "stride_pl_split", "num_keys", "stride_mb",
                  "stride_mt", "stride_ms", "stride_lb", "stride_lt", "stride_lh"}


def compile_kernel(fn, constexprs: Dict[str, object], num_warps: int, num_stages: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(fn.arg_names)
    signature, attrs = {}, {}
    for i, name in enumerate(names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        signature[name] = _PTR_DTYPES.get(name, "fp32" if name in _FLOAT_ARGS else "i32")
        if name not in _FLOAT_ARGS and name not in _NOT_DIVISIBLE and not name.startswith(("sa_", "sb_", "sla_", "slb_")):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))


def resource_usage(kernel) -> Dict[str, object]:
    import triton

    ptx = kernel.asm.get("ptx", "")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
        path = f.name
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    try:
        out = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True).stdout
    finally:
        os.unlink(path)
    usage = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", out))
    return dict(
        regs=int(usage.get("REG", -1)),
        stack=int(usage.get("STACK", -1)),
        shared=int(kernel.metadata.shared),
        wgmma=ptx.count("wgmma.mma_async"),
        mma_sync=ptx.count("mma.sync"),
        cp_async=ptx.count("cp.async"),
        vec_loads=ptx.count("ld.global.v4"),
    )


def configurations(prefix_cfgs: Optional[List[Tuple[int, int, int, int]]]) -> Iterable[Tuple[str, object, Dict, int, int]]:
    from ..kernels.merge import _merge_split_states_kernel, _merge_two_states_kernel
    from ..kernels.prefix_attention import _prefix_split_kernel
    from ..kernels.masked_attention import _masked_attention_kernel

    for bm, bn, warps, stages in prefix_cfgs or [(16, 64, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 2),
                                                 (64, 128, 4, 3), (128, 128, 8, 2), (256, 32, 8, 2)]:
        yield (f"prefix BM={bm} BN={bn} w={warps} s={stages}", _prefix_split_kernel,
               dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=bm, BLOCK_N=bn, NUM_SPLITS=8, EVEN_D=True, UPCAST=False),
               warps, stages)
    for bm, bn, warps in ((64, 16, 4), (64, 64, 4), (64, 64, 8)):
        yield (f"tree BM={bm} BN={bn} w={warps}", _masked_attention_kernel,
               dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=bm, BLOCK_N=bn, UPCAST=False, PRECISION="tf32",
                    STORE_LSE=True), warps, 1)
    for bs_, br in ((16, 2), (64, 1)):
        yield (f"merge_split BLOCK_S={bs_} BLOCK_R={br}", _merge_split_states_kernel,
               dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=bs_, BLOCK_R=br, WRITE_LSE=True), 4, 1)
    yield ("merge_two BLOCK_R=16", _merge_two_states_kernel,
           dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_R=16, WRITE_LSE=False), 4, 1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix", action="append", help="BM,BN,warps,stages of the prefix kernel (repeatable)")
    args = parser.parse_args(argv)
    prefix_cfgs = [tuple(int(x) for x in p.split(",")) for p in args.prefix] if args.prefix else None
    failed = 0
    for label, fn, constexprs, warps, stages in configurations(prefix_cfgs):
        try:
            r = resource_usage(compile_kernel(fn, constexprs, warps, stages))
        except Exception as exc:  # report and continue: one bad tile must not hide the others
            failed += 1
            print(f"{label:40s} FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", flush=True)
            continue
        spill = " SPILLS" if r["stack"] > 0 else ""
        print(f"{label:40s} regs {r['regs']:3d} stack {r['stack']:4d} smem {r['shared'] // 1024:4d} KB "
              f"wgmma {r['wgmma']:3d} mma.sync {r['mma_sync']:3d} cp.async {r['cp_async']:3d} "
              f"ld.v4 {r['vec_loads']:3d}{spill}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
