"""GPU benchmark: hybrid tree attention vs SGLang's FlashInfer verify path vs an AR decode step.

Two tables, one run, Llama-3.1-8B attention shape (32 query heads, 8 KV heads, head dim 128, bf16):

* ``attention``: one layer's attention for ``T`` draft tokens over a ``ctx``-token prefix, each path
  replayed from a CUDA graph with L2 flushed before each replay:
  FlashInfer's tensor-core decode for one token (an AR step's attention), SGLang's TARGET_VERIFY
  path (FlashInfer FA2 prefill over prefix + tree with the custom mask), and the hybrid path with
  each prefix backend. ``err`` is ``max|hybrid - SGLang|`` on the same inputs.
* ``step``: a whole forward step of a synthetic Llama-3.1-8B (32 layers, random bf16 weights, a KV
  pool of its own per layer) captured in a CUDA graph: AR decode (1 token) vs verify of ``T``
  tokens with SGLang's attention vs with the hybrid attention. This is the model forward only;
  SGLang's scheduler adds a fixed ~4 ms per step to every variant.

A third table, ``cascade``, times one layer's verify attention of ``--cascade-batch`` requests
that share a ``--cascade-shared``-token prompt (the same pool slots, as SGLang's radix cache gives
them), each with ``--cascade-own`` tokens of its own, per prefix path: the whole batch without
and with the cascade (the shared prefix read once for the batch), against one request alone.

``fa3-splits`` (only on request) times FA3's prefix pass (the verify's largest part on Hopper),
graphed, for each KV split count and GQA packing it can be given, against its own heuristic's
choice (``num_splits=0``, ``pack_gqa=None``, what the hybrid verify and SGLang's FA3 decode use):
whether a measured choice per shape would beat the heuristic, and by how much.

A fifth, ``fp8-gemm`` (only on request), times the drafters' matrices (``FP8_SHAPES``) times 1-64
rows: bf16 ``F.linear`` against the weight-only fp8 GEMM of ``kernels/fp8_gemm.py``, with the GB/s
of the matrix each reads.

Both tables also time the hybrid verify with the verification-guided selection scores
(``run(scores=...)``, TOKENSWIFT's ``partial_kv.policy = "verify"``) on the Triton and FA3 prefix
paths: ``scores`` lines give the time with them and the overhead over the same path without.

Usage (GPU host)::

    python -m sgl_longgen.bench.kernels                      # both tables, default shapes
    python -m sgl_longgen.bench.kernels --json out.json      # also write every number
    python -m sgl_longgen.bench.kernels --mode attention --tune   # + a sweep of Triton tiles
    python -m sgl_longgen.bench.kernels --mode cascade       # 8 requests sharing a 32K prompt, T=64
    python -m sgl_longgen.bench.kernels --mode fp8-gemm      # the drafters' fp8 GEMMs vs bf16, 1-64 rows
    python -m sgl_longgen.bench.kernels --mode fp8-gemm --tune --fp8-rows 4,16   # + its tiles per LongSpec matrix
    python -m sgl_longgen.bench.kernels --mode fa3-splits --batches 1,4   # FA3's split counts and GQA packing

The first run compiles FlashInfer's kernels (about two minutes); later runs reuse its cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..core.verify_scores import score_rows
from ..kernels.fa3_prefix import Fa3Prefix, fa3_supported
from ..kernels.folded_decode import fold_supported
from ..kernels.hybrid import HybridTreeAttention
from ..kernels.prefix_attention import PrefixKernelConfig, prefix_kernel_config
from ..kernels.reference import random_tree_mask
from .kernel_trace import profile

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16


def _i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def time_us(fn: Callable[[], object], rep_ms: int = 60) -> float:
    """Median time in microseconds (CUDA events, L2 flushed between runs)."""
    import triton.testing

    return 1e3 * triton.testing.do_bench(fn, warmup=15, rep=rep_ms, return_mode="median")


def _graphed(fn: Callable[[], object]) -> Tuple[Callable[[], object], str]:
    """``fn`` captured in a CUDA graph after two warm-up calls on a side stream: (its replay,
    "graph"), or (``fn``, "eager") where capture fails."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception:  # pragma: no cover - depends on the wrappers' capture support
        torch.cuda.synchronize()
        return fn, "eager"
    return graph.replay, "graph"


@functools.cache
def _l2_flush_buffer() -> torch.Tensor:
    return torch.empty(256 << 20, dtype=torch.uint8, device="cuda")


def _flush_l2() -> None:
    """Overwrite a buffer larger than any Hopper L2 (50-60 MB), so the next timed call reads its
    operands from HBM as each layer of a real step does (one layer's 4K-token cache, 16 MB, would
    otherwise stay in L2 from one replay to the next)."""
    _l2_flush_buffer().zero_()


def _median_ms(run: Callable[[], object], reps: int, flush_l2: bool = False) -> float:
    """Median of ``reps`` CUDA-event timings of ``run`` (after three untimed calls); with
    ``flush_l2``, L2 is overwritten before each timed call, outside the events."""
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if flush_l2:
            _flush_l2()
        a.record()
        run()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def time_graph_us(fn: Callable[[], object], reps: int = 50, flush_l2: bool = False) -> Tuple[float, str]:
    """Median replay time in microseconds of ``fn`` captured in a CUDA graph (what a captured
    verify pays: the GPU's time without host launch gaps), and "graph"; where capture fails,
    :func:`time_us` of the eager calls and "eager"."""
    run, mode = _graphed(fn)
    if mode == "eager":
        return time_us(fn), mode
    return _median_ms(run, reps, flush_l2) * 1e3, mode


def time_chain_us(make_call: Callable[[object], Callable[[], object]], operands: list, reps: int = 15) -> float:
    """Median microseconds per call of one CUDA graph holding ``make_call(o)()`` for each of
    ``operands`` back to back: with operands (weights) that together exceed L2, each call finds
    none of its own there and pays its launch gap inside a graph, as a drafter step's GEMMs do."""
    calls = [make_call(o) for o in operands]
    run, mode = _graphed(lambda: [c() for c in calls])
    if mode == "eager":
        return time_us(run) / len(calls)
    return _median_ms(run, reps, False) * 1e3 / len(calls)


def full_verify_mask(prefix_len: int, tree: torch.Tensor) -> torch.Tensor:
    """SGLang's per-request verify mask ``[T, prefix + T]``: whole prefix, then the tree."""
    T = tree.shape[0]
    return torch.cat([torch.ones(T, prefix_len, dtype=torch.bool, device=tree.device), tree], dim=1)


class FlashInferVerify:
    """SGLang's TARGET_VERIFY attention: FA2 paged prefill over prefix + tree with a custom mask."""

    def __init__(self, workspace, prefix_len, tree, device):
        import flashinfer

        T = tree.shape[0]
        n = prefix_len + T
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
        self.wrapper.plan(
            _i32([0, T], device), _i32([0, n], device), torch.arange(n, dtype=torch.int32, device=device),
            _i32([1], device), NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, 1,
            custom_mask=full_verify_mask(prefix_len, tree).flatten(), q_data_type=DTYPE, kv_data_type=DTYPE,
        )

    def __call__(self, q, k_pool, v_pool, k_tree=None, v_tree=None):
        return self.wrapper.run(q, (k_pool, v_pool))


class FlashInferDecode:
    """An AR decode step's attention: one query over prefix + itself, tensor-core decode."""

    def __init__(self, workspace, prefix_len, device):
        import flashinfer

        n = prefix_len + 1
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
        self.wrapper.plan(
            _i32([0, n], device), torch.arange(n, dtype=torch.int32, device=device), _i32([1], device),
            NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, 1, q_data_type=DTYPE, kv_data_type=DTYPE,
        )

    def __call__(self, q, k_pool, v_pool, k_tree=None, v_tree=None):
        return self.wrapper.run(q, (k_pool, v_pool))


class Hybrid:
    """The hybrid path with a given prefix backend; the tree's K/V are the pool rows after the prefix.

    ``score_rows`` > 0: every call also writes the selection scores of the prefix keys (one buffer,
    rewritten by every layer of a step: the cost is the same).
    """

    def __init__(self, prefix_len, tree, device, backend, config: Optional[PrefixKernelConfig] = None,
                 score_rows: int = 0):
        self.attn = HybridTreeAttention(NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, device, prefix_backend=backend)
        self.path = self.attn.plan(
            _i32([0, prefix_len], device), torch.arange(prefix_len, dtype=torch.int32, device=device),
            tree[None], q_dtype=DTYPE, prefix_lens_host=[prefix_len], prefix_config=config, score_rows=score_rows,
        )
        self.prefix_len = prefix_len
        self.tree_size = tree.shape[0]
        self.score_rows = score_rows
        self.scores = (torch.zeros(1, NUM_KV_HEADS, max(prefix_len, 1), dtype=torch.float32, device=device)
                       if score_rows else None)

    def __call__(self, q, k_pool, v_pool, k_tree=None, v_tree=None):
        if k_tree is None:
            rows = slice(self.prefix_len, self.prefix_len + self.tree_size)
            k_tree, v_tree = k_pool[rows], v_pool[rows]
        if self.scores is None:
            return self.attn.run(q, k_pool, v_pool, k_tree, v_tree)
        return self.attn.run(q, k_pool, v_pool, k_tree, v_tree, scores=self.scores, score_rows=self.score_rows)


SCORE_PATHS = ("triton", "fa3")  # prefix paths timed with the selection scores


def print_scores(r, unit: str, flush=False) -> None:
    parts = []
    for p in SCORE_PATHS:
        if f"{p}_scores_{unit}" in r:
            with_scores, without = r[f"{p}_scores_{unit}"], r[f"{p}_{unit}"]
            parts.append(f"{p} {with_scores:7.2f} {unit} (+{100 * (with_scores / without - 1):4.1f}%)")
    if parts:
        print(f"    scores ctx {r['ctx']:6d} T {r['T']:3d} | " + " | ".join(parts), flush=flush)


# --------------------------------------------------------------------------- FA3 split counts
FA3_SPLITS = (0, 1, 2, 4, 8, 16, 32, 64, 128)  # 0: FA3's heuristic
FA3_PACKING = (None, True, False)  # None: FA3's heuristic


def fa3_split_table(contexts, trees, batches, device, rows: list[dict]) -> None:
    """FA3's prefix pass (non-causal over the cache, page size 1, LSE returned: the hybrid
    verify's call) per split count and GQA packing, each with its own tile schedule, graphed."""
    from ..kernels.fa3_prefix import _flash_attn_with_kvcache, _get_scheduler_metadata

    fa3, schedule = _flash_attn_with_kvcache(), _get_scheduler_metadata()
    if fa3 is None or schedule is None or not fa3_supported(HEAD_DIM, DTYPE, DTYPE, torch.device(device)):
        print("fa3-splits: FA3 is not available here", flush=True)
        return
    hq, hkv, d = NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM
    for bs in batches:
        for ctx in contexts:
            k = torch.randn(bs * ctx, 1, hkv, d, dtype=DTYPE, device=device)
            v = torch.randn_like(k)
            table = torch.arange(bs * ctx, dtype=torch.int32, device=device).view(bs, ctx)
            lens = torch.full((bs,), ctx, dtype=torch.int32, device=device)
            for T in trees:
                q = torch.randn(bs, T, hq, d, dtype=DTYPE, device=device)
                row = {"table": "fa3-splits", "bs": bs, "ctx": ctx, "T": T, "us": {}}
                for pack in FA3_PACKING:
                    for splits in FA3_SPLITS:
                        key = f"{splits}/{pack}"
                        try:
                            meta = schedule(batch_size=bs, max_seqlen_q=T, max_seqlen_k=ctx, num_heads=hq,
                                            num_heads_k=hkv, headdim=d, cache_seqlens=lens, qkv_dtype=DTYPE,
                                            page_size=1, causal=False, num_splits=splits, pack_gqa=pack)
                            call = functools.partial(
                                fa3, q=q, k_cache=k, v_cache=v, page_table=table, cache_seqlens=lens,
                                softmax_scale=d**-0.5, causal=False, return_softmax_lse=True,
                                scheduler_metadata=meta, num_splits=splits, pack_gqa=pack)
                            row["us"][key] = round(time_graph_us(call)[0], 2)
                        except Exception as exc:  # noqa: BLE001 - a combination FA3 refuses
                            row["us"][key] = f"{type(exc).__name__}"
                timed = {key: us for key, us in row["us"].items() if isinstance(us, float)}
                auto = timed.get("0/None")
                best = min(timed, key=timed.get) if timed else None
                row["auto_us"], row["best"], row["best_us"] = auto, best, timed.get(best)
                rows.append(row)
                gain = f"{auto / timed[best]:.3f}x" if auto and best else "n/a"
                ranked = sorted(timed, key=timed.get)[:4]
                print(f"bs {bs} ctx {ctx:6d} T {T:3d} | FA3 heuristic {auto} us | best {best} ({gain} faster) | "
                      + " ".join(f"{key}={timed[key]}" for key in ranked), flush=True)


# --------------------------------------------------------------------------- attention table
TUNE_CONFIGS = [  # (block_m, block_n, num_warps, num_stages); num_splits from the heuristic, x0.5, x2
    (64, 64, 4, 3), (64, 128, 4, 3), (64, 64, 4, 4), (128, 64, 8, 3), (128, 64, 8, 2),
    (128, 128, 8, 2), (128, 32, 4, 3), (256, 32, 8, 2),
]


def attention_table(contexts, trees, device, tune: bool, rows: List[Dict]) -> None:
    """Each path timed as the engine runs it, replayed from a CUDA graph with L2 flushed before
    each replay: eager timings of a hybrid call (plan buffers, prefix pass, tree part, merge) are
    the host's launch gaps at short contexts, not the kernels. A row's ``modes`` says where a
    capture failed and the eager time stands instead."""
    g = torch.Generator().manual_seed(0)

    def timed(row: Dict, name: str, fn: Callable[[], object]) -> float:
        us, row["modes"][name] = time_graph_us(fn, flush_l2=True)
        return us

    workspace = torch.zeros(512 << 20, dtype=torch.uint8, device=device)
    max_n = max(contexts) + max(trees)
    k_pool = torch.randn(max_n, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    v_pool = torch.randn_like(k_pool)
    for ctx in contexts:
        q1 = torch.randn(1, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
        decode = FlashInferDecodeCache.get(workspace, ctx, device)
        t_ar, ar_mode = time_graph_us(lambda: decode(q1, k_pool, v_pool), flush_l2=True)
        for T in trees:
            q = torch.randn(T, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
            tree = random_tree_mask(1, T, generator=g)[0].to(device)
            sglang = FlashInferVerify(workspace, ctx, tree, device)
            ref = sglang(q, k_pool, v_pool).float()
            row = dict(table="attention", ctx=ctx, T=T, ar_us=t_ar, modes={"ar": ar_mode})
            row["sglang_us"] = timed(row, "sglang", lambda: sglang(q, k_pool, v_pool))
            backends = ["triton"]
            if fold_supported(NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, T, DTYPE, DTYPE, torch.device(device)):
                backends.append("flashinfer_fold")
            if fa3_supported(HEAD_DIM, DTYPE, DTYPE, torch.device(device)):
                backends.append("fa3")
                # FA3's own decode step (SGLang's default on Hopper), next to FlashInfer's.
                fa3_ar = Fa3Prefix(NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, device)
                fa3_ar.plan(_i32([0, ctx], device), torch.arange(ctx, dtype=torch.int32, device=device), 1)
                row["fa3_decode_us"] = timed(row, "fa3_decode", lambda: fa3_ar.run(q1, k_pool, v_pool, HEAD_DIM**-0.5))
            for backend in backends:
                hyb = Hybrid(ctx, tree, device, backend)
                err = (hyb(q, k_pool, v_pool).float() - ref).abs().max().item()
                row[f"{backend}_us"] = timed(row, backend, lambda: hyb(q, k_pool, v_pool))
                row[f"{backend}_err"] = err
                if backend == "triton":
                    row["triton_config"] = dataclasses.asdict(hyb.attn.prefix_config)
                if backend in SCORE_PATHS:
                    scored = Hybrid(ctx, tree, device, backend, score_rows=score_rows(T))
                    row[f"{backend}_scores_us"] = timed(row, f"{backend}_scores", lambda: scored(q, k_pool, v_pool))
            auto = Hybrid(ctx, tree, device, "auto")
            row["auto_path"] = auto.path
            if tune:
                row["tune"] = tune_prefix(ctx, tree, q, k_pool, v_pool, ref, device)
            rows.append(row)
            print_attention_row(row, flush=True)
            print_scores(row, "us", flush=True)


class FlashInferDecodeCache:
    _cache: Dict = {}

    @classmethod
    def get(cls, workspace, ctx, device):
        key = (ctx, str(device))
        if key not in cls._cache:
            cls._cache[key] = FlashInferDecode(workspace, ctx, device)
        return cls._cache[key]


def tune_prefix(ctx, tree, q, k_pool, v_pool, ref, device) -> List[Dict]:
    results = []
    T = tree.shape[0]
    rows = T * (NUM_Q_HEADS // NUM_KV_HEADS)
    for bm, bn, warps, stages in TUNE_CONFIGS:
        base = prefix_kernel_config(1, NUM_KV_HEADS, rows, HEAD_DIM, torch.device(device), block_m=bm,
                                    block_n=bn, num_warps=warps, num_stages=stages, max_prefix_len=ctx)
        for factor in (0.5, 1, 2):
            splits = max(1, int(round(base.num_splits * factor)))
            cfg = PrefixKernelConfig(bm, bn, warps, stages, min(splits, 64))
            try:
                hyb = Hybrid(ctx, tree, device, "triton", config=cfg)
                err = (hyb(q, k_pool, v_pool).float() - ref).abs().max().item()
                us = time_us(lambda: hyb(q, k_pool, v_pool), rep_ms=30)
            except Exception as exc:  # a tile that does not fit (registers, shared memory)
                results.append(dict(config=str(cfg), error=type(exc).__name__))
                continue
            results.append(dict(config=str(cfg), us=us, err=err))
    ok = [r for r in results if "us" in r]
    if ok:
        best = min(ok, key=lambda r: r["us"])
        print(f"    tune ctx={ctx} T={T}: best {best['us']:.1f} us err {best['err']:.2g} {best['config']}", flush=True)
    return results


def print_attention_row(r, flush=False) -> None:
    ar = r["ar_us"]
    fold = (f"{r['flashinfer_fold_us']:7.1f} ({r['flashinfer_fold_us'] / ar:4.2f}x) err {r['flashinfer_fold_err']:.1e}"
            if "flashinfer_fold_us" in r else f"{'n/a':>27}")
    fa3 = (f" | FA3 decode {r['fa3_decode_us']:6.1f} us, fa3 {r['fa3_us']:7.1f} ({r['fa3_us'] / r['fa3_decode_us']:4.2f}x"
           f" FA3 decode) err {r['fa3_err']:.1e}" if "fa3_us" in r else "")
    print(
        f"ctx {r['ctx']:6d} T {r['T']:3d} | AR {ar:6.1f} us | SGLang {r['sglang_us']:7.1f} ({r['sglang_us'] / ar:4.2f}x) | "
        f"triton {r['triton_us']:7.1f} ({r['triton_us'] / ar:4.2f}x) err {r['triton_err']:.1e} | fold {fold}{fa3}"
        f" | auto={r['auto_path']}"
        + "".join(f" | {name} eager" for name, mode in r["modes"].items() if mode != "graph"),
        flush=flush,
    )


# --------------------------------------------------------------------------- cascade table
class SharedBatch:
    """``bs`` requests over one shared prompt of ``shared`` slots, then ``own`` slots each, and a
    tree of ``T`` tokens per request; one layer's inputs."""

    def __init__(self, bs, shared, own, T, device, g):
        self.bs, self.shared, self.own, self.T = bs, shared, own, T
        n = shared + bs * own
        self.k_pool = torch.randn(max(n, 1), NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
        self.v_pool = torch.randn_like(self.k_pool)
        prompt = torch.arange(shared, dtype=torch.int32)
        rows = [torch.cat([prompt, torch.arange(shared + b * own, shared + (b + 1) * own, dtype=torch.int32)])
                for b in range(bs)]
        self.kv_indptr = _i32([0] + [(shared + own) * (b + 1) for b in range(bs)], device)
        self.kv_indices = torch.cat(rows).to(device)
        self.tree = random_tree_mask(bs, T, generator=g).to(device)
        self.q = torch.randn(bs * T, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
        self.k_tree = torch.randn(bs * T, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
        self.v_tree = torch.randn_like(self.k_tree)

    def attention(self, backend, device, shared_prefix_len=None, requests=None):
        """A planned ``HybridTreeAttention`` over the first ``requests`` (default all) and its run."""
        bs = requests or self.bs
        attn = HybridTreeAttention(NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, device, prefix_backend=backend)
        attn.plan(self.kv_indptr[: bs + 1], self.kv_indices, self.tree[:bs], q_dtype=DTYPE,
                  prefix_lens_host=[self.shared + self.own] * bs, shared_prefix_len=shared_prefix_len)
        rows = bs * self.T
        q, k_tree, v_tree = self.q[:rows], self.k_tree[:rows], self.v_tree[:rows]
        return attn, lambda: attn.run(q, self.k_pool, self.v_pool, k_tree, v_tree)


def cascade_table(bs, shared, own, trees, device, rows: list[dict]) -> None:
    """Each variant replayed as a CUDA graph (as the verify graphs run it): one layer's GPU time,
    without the host's launch gaps, which at T=1 would be most of an eager call's time."""
    g = torch.Generator().manual_seed(2)
    backends = ["triton"] + (["fa3"] if fa3_supported(HEAD_DIM, DTYPE, DTYPE, torch.device(device)) else [])
    for T in trees:
        batch = SharedBatch(bs, shared, own, T, device, g)
        for backend in backends:
            _, one = batch.attention(backend, device, requests=1)
            _, plain = batch.attention(backend, device)
            _, cascade = batch.attention(backend, device, shared_prefix_len=shared)
            ref = plain().float()
            err = (cascade().float() - ref).abs().max().item()
            (one_us, m1), (batch_us, m2), (cascade_us, m3) = (time_graph_us(f) for f in (one, plain, cascade))
            row = {"table": "cascade", "bs": bs, "shared": shared, "own": own, "T": T, "path": backend,
                   "one_request_us": one_us, "batch_us": batch_us, "cascade_us": cascade_us, "cascade_err": err,
                   "timing": f"{m1}/{m2}/{m3}"}
            rows.append(row)
            print(f"bs {bs} shared {shared:6d} own {own:5d} T {T:3d} {backend:6s} | one request {one_us:7.1f} us | "
                  f"batch {batch_us:7.1f} us ({batch_us / one_us:4.2f}x) | cascade "
                  f"{cascade_us:7.1f} us ({cascade_us / one_us:4.2f}x) err {err:.1e} | {row['timing']}",
                  flush=True)


# ----------------------------------------------------------------------------- step table
def _layer_ops():
    """RMSNorm, residual-add + RMSNorm and SiLU-and-mul as SGLang's Llama runs them on a GPU
    (sgl_kernel's fused kernels, so the step's non-attention work costs what it costs in the
    engine), torch's where sgl_kernel cannot load."""
    try:
        from sgl_kernel import fused_add_rmsnorm, rmsnorm, silu_and_mul
    except Exception:  # noqa: BLE001 - no sgl_kernel (CPU): the same arithmetic in torch
        def rmsnorm(x, w, eps):
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps)

        def fused_add_rmsnorm(x, residual, w, eps):
            residual.add_(x)
            x.copy_(rmsnorm(residual, w, eps))

        def silu_and_mul(gu):
            half = gu.shape[-1] // 2
            return torch.nn.functional.silu(gu[..., :half]) * gu[..., half:]
    return rmsnorm, fused_add_rmsnorm, silu_and_mul


class SyntheticLlama:
    """Llama-3.1-8B-shaped decoder (random weights) whose attention is pluggable, for step timing;
    the rest of each layer as SGLang's ``LlamaForCausalLM`` runs it (fused residual norms)."""

    EPS = 1e-5

    def __init__(self, num_layers, max_slots, device, hidden=4096, inter=14336, vocab=128256):
        self.num_layers = num_layers
        self.hidden, self.inter = hidden, inter
        qkv = (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
        w = lambda *shape: torch.randn(*shape, dtype=DTYPE, device=device) * 0.02  # noqa: E731
        self.layers = [
            dict(qkv=w(qkv, hidden), o=w(hidden, NUM_Q_HEADS * HEAD_DIM), gate_up=w(2 * inter, hidden), down=w(hidden, inter))
            for _ in range(num_layers)
        ]
        self.norm_weight = torch.ones(hidden, dtype=DTYPE, device=device)
        self.lm_head = w(vocab, hidden)
        self.k_pool = torch.randn(num_layers, max_slots, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
        self.v_pool = torch.randn_like(self.k_pool)
        self.rmsnorm, self.add_rmsnorm, self.silu_and_mul = _layer_ops()

    def forward(self, x, out_loc, attn):
        """``x [T, hidden]``; the step's K/V go to pool rows ``out_loc``; returns logits."""
        T = x.shape[0]
        q_end, k_end = NUM_Q_HEADS * HEAD_DIM, (NUM_Q_HEADS + NUM_KV_HEADS) * HEAD_DIM
        residual = x.clone()
        h = self.rmsnorm(residual, self.norm_weight, self.EPS)
        for i, lw in enumerate(self.layers):
            qkv = h @ lw["qkv"].t()
            q = qkv[:, :q_end].view(T, NUM_Q_HEADS, HEAD_DIM)
            k = qkv[:, q_end:k_end].reshape(T, NUM_KV_HEADS, HEAD_DIM)
            v = qkv[:, k_end:].reshape(T, NUM_KV_HEADS, HEAD_DIM)
            self.k_pool[i].index_copy_(0, out_loc, k)
            self.v_pool[i].index_copy_(0, out_loc, v)
            o = attn(q, self.k_pool[i], self.v_pool[i], k, v)
            h = o.reshape(T, -1) @ lw["o"].t()
            self.add_rmsnorm(h, residual, self.norm_weight, self.EPS)  # residual += h; h = norm(residual)
            h = self.silu_and_mul(h @ lw["gate_up"].t()) @ lw["down"].t()
            self.add_rmsnorm(h, residual, self.norm_weight, self.EPS)  # the next layer's input (or the final) norm
        return h @ self.lm_head.t()


def time_step_ms(model, T, prefix_len, attn, device, profile_to: Optional[Path] = None) -> Tuple[float, str]:
    """Median replay time of one forward step in a CUDA graph (eager timing if capture fails).
    ``profile_to``: also ten replays under torch's profiler, their trace there and its per-kernel
    summary beside it (``.md``)."""
    x = torch.randn(T, model.hidden, dtype=DTYPE, device=device)
    out_loc = torch.arange(prefix_len, prefix_len + T, device=device)
    run, mode = _graphed(lambda: model.forward(x, out_loc, attn))
    ms = _median_ms(run, 10)
    if profile_to is not None:
        profile(run, profile_to)
    return ms, mode


def step_table(contexts, trees, device, num_layers, rows: List[Dict], profile_dir: Optional[Path] = None) -> None:
    g = torch.Generator().manual_seed(1)
    traced = (lambda name: profile_dir / name) if profile_dir is not None else (lambda name: None)  # noqa: E731
    workspace = torch.zeros(512 << 20, dtype=torch.uint8, device=device)
    model = SyntheticLlama(num_layers, max(contexts) + max(trees) + 1, device)
    for ctx in contexts:
        t_ar, m_ar = time_step_ms(model, 1, ctx, FlashInferDecode(workspace, ctx, device), device,
                                  traced(f"step-ar-{ctx}"))
        for T in trees:
            tree = random_tree_mask(1, T, generator=g)[0].to(device)
            t_sg, m_sg = time_step_ms(model, T, ctx, FlashInferVerify(workspace, ctx, tree, device), device)
            hyb = Hybrid(ctx, tree, device, "auto")
            t_hy, m_hy = time_step_ms(model, T, ctx, hyb, device, traced(f"step-hybrid-{ctx}-T{T}"))
            row = dict(table="step", ctx=ctx, T=T, ar_ms=t_ar, sglang_ms=t_sg, hybrid_ms=t_hy,
                       hybrid_path=hyb.path, timing=f"{m_ar}/{m_sg}/{m_hy}", layers=num_layers)
            other = ""
            if hyb.path != "triton":  # the portable path, for comparison
                row["hybrid_triton_ms"], _ = time_step_ms(model, T, ctx, Hybrid(ctx, tree, device, "triton"), device)
                other = f" | triton prefix {row['hybrid_triton_ms']:6.2f} ms ({row['hybrid_triton_ms'] / t_ar:4.2f}x)"
            # With the selection scores, per prefix path (the step without them: the same path's time).
            row["triton_ms"] = row.get("hybrid_triton_ms", t_hy)
            if hyb.path == "fa3":
                row["fa3_ms"] = t_hy
            for path in SCORE_PATHS:
                if f"{path}_ms" in row:
                    scored = Hybrid(ctx, tree, device, path, score_rows=score_rows(T))
                    row[f"{path}_scores_ms"], _ = time_step_ms(model, T, ctx, scored, device)
            rows.append(row)
            print(
                f"ctx {ctx:6d} T {T:3d} | AR step {t_ar:6.2f} ms | SGLang verify {t_sg:6.2f} ms ({t_sg / t_ar:4.2f}x) | "
                f"hybrid verify {t_hy:6.2f} ms ({t_hy / t_ar:4.2f}x, {hyb.path}){other} | {row['timing']}",
                flush=True,
            )
            print_scores(row, "ms", flush=True)
    del model
    torch.cuda.empty_cache()


# -------------------------------------------------------------------------- fp8 GEMM table
# The drafters' matrices (N x K): LSTM projections, LongSpec's block (MLP up/gate, down), the
# reduced and the full head.
FP8_SHAPES = ((16384, 8192), (32768, 4096), (14336, 4096), (4096, 14336), (128256, 4096))


def relative_error(out: torch.Tensor, twin: torch.Tensor) -> float:
    """``|out - twin| / |twin|`` (Frobenius), in float32: an fp8 GEMM against its float32 twin."""
    return ((out.float() - twin).norm() / twin.norm()).item()


def fp8_gemm_table(row_counts, device, rows: list[dict]) -> None:
    """Each drafter matrix times ``m`` rows: bf16 ``F.linear`` against the weight-only fp8 GEMM,
    both replayed from CUDA graphs (as the drafters run them); GB/s is the matrix's bytes (bf16:
    2 per entry, fp8: 1 plus its scales) over the time, ``err`` the fp8 GEMM's relative error
    against its float32 twin."""
    import torch.nn.functional as F

    from ..core.fp8 import quantize, reference_linear
    from ..kernels.fp8_gemm import fp8_gemm, fp8_gemm_config, num_sms

    g = torch.Generator(device=device).manual_seed(4)
    for n, k in FP8_SHAPES:
        w = torch.randn(n, k, device=device, dtype=DTYPE, generator=g) * 0.02
        q, scale = quantize(w)
        for m in row_counts:
            x = torch.randn(m, k, device=device, dtype=DTYPE, generator=g)
            bf16_us, m1 = time_graph_us(lambda x=x, w=w: F.linear(x, w))
            fp8_us, m2 = time_graph_us(lambda x=x, q=q, scale=scale: fp8_gemm(x, q, scale))
            twin = reference_linear(x.float(), q, scale)
            err = relative_error(fp8_gemm(x, q, scale), twin)
            cfg = fp8_gemm_config(m, n, k, num_sms(x.device))
            bf16_gbs, fp8_gbs = 2 * n * k / bf16_us / 1e3, (n * k + 4 * n) / fp8_us / 1e3
            row = {"table": "fp8_gemm", "m": m, "n": n, "k": k, "bf16_us": bf16_us, "fp8_us": fp8_us,
                   "bf16_GBps": bf16_gbs, "fp8_GBps": fp8_gbs, "fp8_err": err, "config": dataclasses.asdict(cfg),
                   "timing": f"{m1}/{m2}"}
            rows.append(row)
            print(f"{n:6d} x {k:5d} m {m:3d} | bf16 {bf16_us:8.1f} us {bf16_gbs:6.0f} GB/s | fp8 {fp8_us:8.1f} us "
                  f"{fp8_gbs:6.0f} GB/s ({bf16_us / fp8_us:4.2f}x) split {cfg.split_k} err {err:.1e} | "
                  f"{row['timing']}", flush=True)
        del w, q, scale
        torch.cuda.empty_cache()


# LongSpec's matrices as a beam level multiplies them (fused q/k/v, the attention outputs and the
# cross-attention's query, fused gate/up, down, the 32K-row head), and the tiles tried for each:
# (block_n, block_k, num_warps, num_stages), each with the split the heuristic gives that tile and
# twice it, read by addresses with the product in bf16 and in fp16 (``f16_dot``) and read through
# a descriptor (``tma``) with the fp16 product.
FP8_TUNE_SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (32768, 4096))
FP8_TUNE_TILES = (
    (64, 256, 4, 4), (64, 256, 4, 3), (64, 256, 4, 6), (64, 512, 4, 3), (64, 128, 4, 4), (64, 128, 4, 6),
    (32, 256, 4, 4), (32, 512, 4, 4), (128, 128, 4, 4), (128, 256, 4, 4), (128, 256, 8, 3), (128, 256, 8, 4),
    (128, 128, 8, 6),
)
FP8_TUNE_READS = ((False, False), (True, False), (True, True))  # (f16_dot, tma)
FP8_TUNE_BYTES = 120e6  # weight copies per matrix: at least this many bytes, more than an H100's or H200's L2


def fp8_tune(row_counts, device, rows: list[dict]) -> None:
    """Each LongSpec matrix times ``m`` rows through the fp8 GEMM at every tile of
    :data:`FP8_TUNE_TILES` and read of :data:`FP8_TUNE_READS` (:func:`time_chain_us` over copies
    of the matrix: a beam level finds none of its matrix in L2 and launches its GEMMs back to
    back), against the fixed table's choice: whether, and by how much, a tile measured per shape
    on this GPU would beat it. The best of each shape is printed with its GB/s; every try is in
    ``rows``."""
    from ..core.fp8 import quantize, reference_linear
    from ..kernels.fp8_gemm import MAX_SPLIT_K, fp8_gemm, fp8_gemm_config, num_sms

    g = torch.Generator(device=device).manual_seed(5)
    sms = num_sms(torch.device(device))
    for n, k in FP8_TUNE_SHAPES:
        w = torch.randn(n, k, device=device, dtype=DTYPE, generator=g) * 0.02
        q, scale = quantize(w)
        copies = max(3, int(FP8_TUNE_BYTES // (n * k)) + 1)
        qs = [q] + [q.clone() for _ in range(copies - 1)]
        ws = [w] + [w.clone() for _ in range(max(1, copies // 2) - 1)]
        read = (n * k + 4 * n) / 1e3  # bytes / 1e3: GB/s from microseconds
        for m in row_counts:
            x = torch.randn(m, k, device=device, dtype=DTYPE, generator=g)
            twin = reference_linear(x.float(), q, scale)
            bf16_us = time_chain_us(lambda w, x=x: lambda: torch.nn.functional.linear(x, w), ws)
            bf16_gbs = 2 * n * k / 1e3 / bf16_us
            rows.append({"table": "fp8_tune", "m": m, "n": n, "k": k, "bf16_us": bf16_us, "bf16_GBps": bf16_gbs})
            default = fp8_gemm_config(m, n, k, sms)
            tries = [default]
            for tile in FP8_TUNE_TILES:
                split = fp8_gemm_config(m, n, k, sms, tile=tile).split_k  # the heuristic's split for this tile
                for s in sorted({split, min(MAX_SPLIT_K, 2 * split)}):
                    for f16_dot, tma in FP8_TUNE_READS:
                        cfg = fp8_gemm_config(m, n, k, sms, split_k=s, tile=tile, f16_dot=f16_dot, tma=tma)
                        if cfg not in tries:
                            tries.append(cfg)
            results = []
            for cfg in tries:
                try:
                    err = relative_error(fp8_gemm(x, q, scale, config=cfg), twin)
                    us = time_chain_us(lambda q, cfg=cfg: lambda: fp8_gemm(x, q, scale, config=cfg), qs)
                except Exception as exc:  # noqa: BLE001 - a tile that does not fit (shared memory, registers)
                    rows.append({"table": "fp8_tune", "m": m, "n": n, "k": k, "config": dataclasses.asdict(cfg),
                                 "error": f"{type(exc).__name__}: {exc}"[:200]})
                    continue
                row = {"table": "fp8_tune", "m": m, "n": n, "k": k, "config": dataclasses.asdict(cfg), "us": us,
                       "GBps": read / us, "err": err, "timing": "chain", "default": cfg == default}
                rows.append(row)
                results.append(row)
            if not results:
                print(f"{n:6d} x {k:5d} m {m:3d} | no tile ran", flush=True)
                continue
            best = min(results, key=lambda r: r["us"])
            base_row = next((r for r in results if r["default"]), None)
            base_txt = f"{base_row['us']:7.1f} us {base_row['GBps']:5.0f} GB/s" if base_row else "failed"
            c = best["config"]
            print(f"{n:6d} x {k:5d} m {m:3d} | bf16 {bf16_us:7.1f} us {bf16_gbs:5.0f} GB/s "
                  f"| table {base_txt} | best {best['us']:7.1f} us {best['GBps']:5.0f} GB/s "
                  f"(n {c['block_n']} k {c['block_k']} w {c['num_warps']} s {c['num_stages']} split {c['split_k']}"
                  f"{' f16' if c['f16_dot'] else ''}{' tma' if c['tma'] else ''}) "
                  f"err {best['err']:.1e} | {len(results)} tiles", flush=True)
        del w, q, scale, qs, ws
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    global NUM_Q_HEADS, NUM_KV_HEADS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="4096,32768,98304", help="prefix lengths")
    parser.add_argument("--trees", default="16,64,121", help="draft tree sizes T")
    parser.add_argument("--mode", choices=("all", "attention", "step", "cascade", "fp8-gemm", "fa3-splits"), default="all",
                        help="all: the attention, cascade and step tables; fp8-gemm: the drafters' fp8 GEMMs alone; "
                             "fa3-splits: FA3's prefix pass per split count and GQA packing")
    parser.add_argument("--batches", default="1", help="batch sizes (fa3-splits table)")
    parser.add_argument("--cascade-batch", type=int, default=8, help="requests sharing the prompt (cascade table)")
    parser.add_argument("--cascade-shared", type=int, default=32768, help="shared prompt tokens (cascade table)")
    parser.add_argument("--cascade-own", type=int, default=0, help="tokens of each request's own (cascade table)")
    parser.add_argument("--cascade-trees", default="64", help="draft tree sizes T of the cascade table")
    parser.add_argument("--layers", type=int, default=32, help="layers of the synthetic model (step table)")
    parser.add_argument("--tune", action="store_true",
                        help="sweep tiles: the Triton prefix kernel's (attention table), the fp8 GEMM's per "
                             "LongSpec matrix (fp8-gemm table)")
    parser.add_argument("--fp8-rows", default="1,4,16,64", help="rows of the activations (fp8-gemm table)")
    parser.add_argument("--json", help="write all numbers to this file")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="step table: per-kernel totals of the AR and hybrid steps' graph replays into DIR")
    parser.add_argument("--heads", default=f"{NUM_Q_HEADS}/{NUM_KV_HEADS}",
                        help="query/KV heads of the attention shape, e.g. 28/4 (Qwen2.5-7B, GQA group 7)")
    args = parser.parse_args(argv)
    try:
        NUM_Q_HEADS, NUM_KV_HEADS = (int(x) for x in args.heads.split("/"))
    except ValueError:
        parser.error(f"--heads takes Q/KV, e.g. 28/4, not {args.heads!r}")
    if NUM_Q_HEADS % NUM_KV_HEADS:
        parser.error(f"--heads {args.heads}: query heads must be a multiple of KV heads")
    if args.cascade_batch < 1 or args.cascade_shared < 0 or args.cascade_own < 0:
        parser.error("--cascade-batch must be >= 1, --cascade-shared and --cascade-own >= 0")
    try:
        cascade_trees = [int(x) for x in args.cascade_trees.split(",")]
    except ValueError:
        parser.error(f"--cascade-trees takes sizes like 16,64, not {args.cascade_trees!r}")
    if not torch.cuda.is_available():
        print("bench needs a CUDA GPU", file=sys.stderr)
        return 2
    device = "cuda"
    contexts = [int(x) for x in args.contexts.split(",")]
    trees = [int(x) for x in args.trees.split(",")]
    rows: List[Dict] = []
    t0 = time.time()
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | heads {NUM_Q_HEADS}/{NUM_KV_HEADS} x {HEAD_DIM}, bf16", flush=True)
    if args.mode in ("all", "attention"):
        print("# attention, one layer (us; x = over AR decode attention; err = max|hybrid - SGLang|)", flush=True)
        attention_table(contexts, trees, device, args.tune, rows)
    if args.mode in ("all", "cascade"):
        print(f"# cascade: {args.cascade_batch} requests sharing a {args.cascade_shared}-token prompt, one layer "
              "(us; x = over one request alone; err = max|cascade - no cascade|)", flush=True)
        cascade_table(args.cascade_batch, args.cascade_shared, args.cascade_own, cascade_trees, device, rows)
    if args.mode == "fp8-gemm":
        print("# weight-only fp8 GEMM vs bf16 F.linear, the drafters' matrices, CUDA graphs "
              "(us; GB/s of the matrix read)", flush=True)
        fp8_gemm_table([int(x) for x in args.fp8_rows.split(",")], device, rows)
        if args.tune:
            print("# fp8 GEMM tiles and reads per LongSpec matrix, graphed back to back over more weights than L2 "
                  "holds (us per call; GB/s of the matrix read)", flush=True)
            fp8_tune([int(x) for x in args.fp8_rows.split(",")], device, rows)
    if args.mode == "fa3-splits":
        print("# FA3 prefix pass, one layer, CUDA graphs (us per split count/GQA packing; 0/None: FA3's heuristic)",
              flush=True)
        fa3_split_table(contexts, trees, [int(x) for x in args.batches.split(",")], device, rows)
    if args.mode in ("all", "step"):
        print(f"# whole forward step, synthetic Llama-3.1-8B, {args.layers} layers, CUDA graphs (ms)", flush=True)
        if args.profile is not None:
            args.profile.mkdir(parents=True, exist_ok=True)
        step_table(contexts, trees, device, args.layers, rows, args.profile)
    print(f"# done in {time.time() - t0:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), heads=args.heads, rows=rows), f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
