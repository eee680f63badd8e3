"""GPU acceptance: bf16 hybrid verify attention at Llama-3.1-8B heads vs an fp32 one-pass reference.

Max abs error must stay within 2e-2 for every tree size and prefix path, including prefixes of
0, 1, 4095 and 32768 tokens; FlashInfer's base-2 LSE convention is checked against ours.
"""

from __future__ import annotations

import pytest
import torch

from kernel_cases import make_batch, max_err, nan_like, with_own_slots
from sgl_longgen.kernels.fa3_prefix import Fa3Prefix, fa3_supported
from sgl_longgen.kernels.folded_decode import flashinfer_available, fold_supported
from sgl_longgen.kernels.hybrid import HybridTreeAttention
from sgl_longgen.kernels.merge import merge_states
from sgl_longgen.kernels.prefix_attention import prefix_attention
from sgl_longgen.kernels.reference import lse_natural_to_base2

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ACCEPT = 2e-2
HQ, HKV, D = 32, 8, 128


@pytest.mark.parametrize("tree_size", [1, 16, 64, 121])
@pytest.mark.parametrize("prefix_backend", ["triton", "flashinfer_fold", "fa3"])
def test_bf16_matches_fp32_reference(tree_size, prefix_backend):
    if prefix_backend == "fa3" and not fa3_supported(D, torch.bfloat16, torch.bfloat16, torch.device("cuda")):
        pytest.skip("FA3 needs a Hopper GPU and sgl_kernel's flash_ops")
    if prefix_backend == "flashinfer_fold" and not (
        flashinfer_available() and fold_supported(HQ, HKV, D, tree_size, torch.bfloat16, torch.bfloat16, torch.device("cuda"))
    ):
        pytest.skip("the folded path does not serve this tree size")
    lens = [32768, 4095] if prefix_backend == "triton" else [32768, 1]
    if prefix_backend in ("triton", "fa3") and tree_size == 16:
        lens = [0, 1, 4095]
    batch = make_batch(lens, tree_size, HQ, HKV, D, torch.bfloat16, seed=tree_size)
    batch.sm_scale = D**-0.5  # the models' scale
    attn = HybridTreeAttention(HQ, HKV, D, "cuda", prefix_backend=prefix_backend)
    attn.plan(batch.kv_indptr, batch.kv_indices, batch.tree_mask, sm_scale=batch.sm_scale,
              q_dtype=torch.bfloat16, prefix_lens_host=lens)
    out = nan_like(batch.q)
    lse = nan_like(batch.q[..., 0], torch.float32)
    attn.run(batch.q, batch.k_buffer, batch.v_buffer, batch.k_tree, batch.v_tree, out=out, lse=lse)
    ref_o, ref_lse = batch.reference()
    err = max_err(out, ref_o)
    lse_err = max_err(lse, lse_natural_to_base2(ref_lse))
    print(f"GPU accuracy T={tree_size} prefixes={lens} path={attn.path}: max|o - ref| = {err:.3e}, lse {lse_err:.2e}")
    assert err <= ACCEPT
    assert lse_err <= 1e-2


@pytest.mark.parametrize("prefix_backend", ["triton", "flashinfer_fold", "fa3"])
def test_width_one_verify_with_its_own_key_in_the_prefix(prefix_backend):
    """A plain step of adaptive speculation: one prefix pass over prefix + own slot, no merge."""
    if prefix_backend == "fa3" and not fa3_supported(D, torch.bfloat16, torch.bfloat16, torch.device("cuda")):
        pytest.skip("FA3 needs a Hopper GPU and sgl_kernel's flash_ops")
    if prefix_backend == "flashinfer_fold" and not (
        flashinfer_available() and fold_supported(HQ, HKV, D, 1, torch.bfloat16, torch.bfloat16, torch.device("cuda"))
    ):
        pytest.skip("the folded path does not serve this shape")
    batch = make_batch([32768, 0, 4095], 1, HQ, HKV, D, torch.bfloat16, seed=21)
    batch.sm_scale = D**-0.5
    indptr, indices, lens = with_own_slots(batch)
    attn = HybridTreeAttention(HQ, HKV, D, "cuda", prefix_backend=prefix_backend)
    attn.plan(indptr, indices, batch.tree_mask, sm_scale=batch.sm_scale, q_dtype=torch.bfloat16,
              prefix_lens_host=lens, own_kv_in_prefix=True)
    out = nan_like(batch.q)
    lse = nan_like(batch.q[..., 0], torch.float32)
    attn.run(batch.q, batch.k_buffer, batch.v_buffer, batch.k_tree, batch.v_tree, out=out, lse=lse)
    ref_o, ref_lse = batch.reference()
    err, lse_err = max_err(out, ref_o), max_err(lse, lse_natural_to_base2(ref_lse))
    print(f"GPU accuracy width-1 own-KV path={attn.path}: max|o - ref| = {err:.3e}, lse {lse_err:.2e}")
    assert err <= ACCEPT
    assert lse_err <= 1e-2


@pytest.mark.skipif(not flashinfer_available(), reason="needs FlashInfer")
def test_lse_base_matches_flashinfer():
    """Our prefix LSE equals FlashInfer's prefill LSE, and our merge equals FlashInfer's merge_state."""
    import flashinfer
    from flashinfer.cascade import merge_state

    batch = make_batch([5000], 16, HQ, HKV, D, torch.bfloat16, seed=1)
    batch.sm_scale = D**-0.5
    n = batch.prefix_lens[0]
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    qo = torch.tensor([0, 16], dtype=torch.int32, device="cuda")
    w.plan(qo, batch.kv_indptr, batch.kv_indices, torch.ones(1, dtype=torch.int32, device="cuda"),
           HQ, HKV, D, 1, causal=False, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    fi_o, fi_lse = w.run(batch.q, (batch.k_buffer, batch.v_buffer), return_lse=True)
    o, lse = prefix_attention(batch.q, batch.k_buffer, batch.v_buffer, batch.kv_indptr, batch.kv_indices,
                              batch.sm_scale)
    assert n > 0 and max_err(lse, fi_lse) <= 1e-2
    assert max_err(o, fi_o) <= ACCEPT
    other_o = torch.randn_like(o)
    other_lse = torch.randn_like(lse) + lse
    ours, ours_lse = merge_states(o, lse, other_o, other_lse)
    theirs, theirs_lse = merge_state(o, lse, other_o, other_lse)
    assert max_err(ours, theirs) <= ACCEPT
    assert max_err(ours_lse, theirs_lse) <= 1e-3


@pytest.mark.skipif(not fa3_supported(D, torch.bfloat16, torch.bfloat16, torch.device("cuda"))
                    if torch.cuda.is_available() else True, reason="needs FA3 (Hopper)")
@pytest.mark.parametrize("group", [4, 7])
def test_fa3_path_replays_in_a_cuda_graph_with_new_prefixes(group):
    """Captured once, replayed after a re-plan with other prefixes (the engine's verify graphs):
    the page table and lengths are persistent buffers, refilled outside the graph."""
    hq, hkv, T, max_bs, width = 4 * group, 4, 64, 2, 40000
    table = torch.zeros(max_bs, width, dtype=torch.int32, device="cuda")
    lens_buf = torch.zeros(max_bs, dtype=torch.int32, device="cuda")
    first = make_batch([30000, 20], T, hq, hkv, D, torch.bfloat16, seed=7, spare_slots=64 + 39017 - 30020)
    second = make_batch([17, 39000], T, hq, hkv, D, torch.bfloat16, seed=8, spare_slots=64)
    assert second.k_buffer.shape == first.k_buffer.shape
    attn = HybridTreeAttention(hq, hkv, D, "cuda", prefix_backend="fa3", use_cuda_graph=True,
                               graph_page_table_buf=table, graph_seq_lens_buf=lens_buf)
    q, k_buf, v_buf = first.q.clone(), first.k_buffer.clone(), first.v_buffer.clone()
    k_tree, v_tree, mask = first.k_tree.clone(), first.v_tree.clone(), first.tree_mask.clone()
    out = torch.empty_like(q)
    indptr, indices = first.kv_indptr.clone(), torch.zeros(40000, dtype=torch.int32, device="cuda")
    indices[: first.kv_indices.numel()] = first.kv_indices
    assert attn.plan(indptr, indices, mask, sm_scale=first.sm_scale, q_dtype=torch.bfloat16) == "fa3"
    attn.run(q, k_buf, v_buf, k_tree, v_tree, out=out)  # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(q, k_buf, v_buf, k_tree, v_tree, out=out)
    for batch in (first, second):
        for dst, src in ((q, batch.q), (k_buf, batch.k_buffer), (v_buf, batch.v_buffer), (k_tree, batch.k_tree),
                         (v_tree, batch.v_tree), (mask, batch.tree_mask), (indptr, batch.kv_indptr)):
            dst.copy_(src)
        indices[: batch.kv_indices.numel()] = batch.kv_indices
        attn.plan(indptr, indices, mask, sm_scale=batch.sm_scale, q_dtype=torch.bfloat16,
                  max_prefix_len=max(batch.prefix_lens))
        out.fill_(float("nan"))
        graph.replay()
        err = max_err(out, batch.reference()[0])
        print(f"FA3 graph replay G={group} prefixes={batch.prefix_lens}: max|o - ref| = {err:.3e}")
        assert err <= ACCEPT


@pytest.mark.skipif(not fa3_supported(D, torch.bfloat16, torch.bfloat16, torch.device("cuda"))
                    if torch.cuda.is_available() else True, reason="needs FA3 (Hopper)")
@pytest.mark.parametrize("graph_buffers", [False, True])
@pytest.mark.parametrize("tree_size", [1, 16, 64])
def test_fa3_tile_schedule_planned_once_is_the_one_fa3_computes_per_call(tree_size, graph_buffers):
    """The fast path (FA3's scheduler run once per plan) against the slow one (FA3 scheduling at
    every call): same splits, so the same bits, for short, long and empty prefixes."""
    batch = make_batch([4095, 32768, 0, 1], tree_size, HQ, HKV, D, torch.bfloat16, seed=3)
    bufs = {}
    if graph_buffers:  # a wide persistent table, as captured graphs use
        bufs = dict(page_table_buf=torch.zeros(4, 131072, dtype=torch.int32, device="cuda"),
                    seq_lens_buf=torch.zeros(4, dtype=torch.int32, device="cuda"))
    prefix = Fa3Prefix(HQ, HKV, D, "cuda", **bufs)
    for _ in range(2):  # the second plan refills the persistent schedule
        prefix.plan(batch.kv_indptr, batch.kv_indices, tree_size, max_prefix_len=32768, dtype=torch.bfloat16)
        assert prefix.scheduler_metadata is not None
        fast_o, fast_lse = prefix.run(batch.q, batch.k_buffer, batch.v_buffer, batch.sm_scale)
    planned, prefix.scheduler_metadata = prefix.scheduler_metadata, None
    slow_o, slow_lse = prefix.run(batch.q, batch.k_buffer, batch.v_buffer, batch.sm_scale)
    assert torch.equal(fast_o, slow_o)
    rows = torch.tensor(batch.prefix_lens, device="cuda") > 0  # an empty prefix's LSE is -inf both ways
    assert torch.equal(fast_lse[rows], slow_lse[rows])
    assert planned.dtype == torch.int32


@pytest.mark.parametrize("tree_size", [1, 16, 64])
@pytest.mark.parametrize("prefix_backend", ["triton", "fa3"])
def test_cascade_over_a_shared_prompt_matches_fp32_reference(tree_size, prefix_backend):
    """8 requests sharing an 8K prompt (one with nothing of its own): the cascade, eager and with a
    device-side shared length in a CUDA graph replayed with another one, within the bf16 bound."""
    if prefix_backend == "fa3" and not fa3_supported(D, torch.bfloat16, torch.bfloat16, torch.device("cuda")):
        pytest.skip("FA3 needs a Hopper GPU and sgl_kernel's flash_ops")
    from kernel_cases import make_shared_batch

    own = [0, 1, 7, 300, 4095, 2, 64, 33]
    batch = make_shared_batch(8192, own, tree_size, HQ, HKV, D, torch.bfloat16, seed=tree_size)
    batch.sm_scale = D**-0.5
    ref_o, _ = batch.reference()
    attn = HybridTreeAttention(HQ, HKV, D, "cuda", prefix_backend=prefix_backend)
    attn.plan(batch.kv_indptr, batch.kv_indices, batch.tree_mask, sm_scale=batch.sm_scale, q_dtype=torch.bfloat16,
              prefix_lens_host=[8192 + n for n in own], shared_prefix_len=8192)
    out = nan_like(batch.q)
    attn.run(batch.q, batch.k_buffer, batch.v_buffer, batch.k_tree, batch.v_tree, out=out)
    assert attn.cascade and attn.path == prefix_backend and max_err(out, ref_o) <= ACCEPT

    shared = torch.tensor([8192], dtype=torch.int32, device="cuda")
    graph_attn = HybridTreeAttention(HQ, HKV, D, "cuda", prefix_backend=prefix_backend, use_cuda_graph=True,
                                     graph_page_table_buf=torch.zeros(8, 16384, dtype=torch.int32, device="cuda"),
                                     graph_seq_lens_buf=torch.zeros(8, dtype=torch.int32, device="cuda"))
    graph_attn.plan(batch.kv_indptr, batch.kv_indices, batch.tree_mask, sm_scale=batch.sm_scale,
                    q_dtype=torch.bfloat16, shared_prefix_len=shared, max_prefix_len=16384)
    out = torch.empty_like(batch.q)
    def run():
        graph_attn.run(batch.q, batch.k_buffer, batch.v_buffer, batch.k_tree, batch.v_tree, out=out)

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    # Replan with a shorter shared part (still a common prefix), then with none (a batch that
    # shares nothing replays the same graph), and replay.
    for length in (100, 0):
        shared.fill_(length)
        graph_attn.plan(batch.kv_indptr, batch.kv_indices, batch.tree_mask, sm_scale=batch.sm_scale,
                        q_dtype=torch.bfloat16, shared_prefix_len=shared, max_prefix_len=16384)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert max_err(out, ref_o) <= ACCEPT, length


@pytest.mark.parametrize("tree_size", [16, 64])
def test_auto_path_with_selection_scores(tree_size):
    """With scores, "auto" takes Triton (scores fused) for small trees where FA3 would add a
    separate key-only pass, FA3 above; the scores are the same on either path."""
    if not fa3_supported(D, torch.bfloat16, torch.bfloat16, torch.device("cuda")):
        pytest.skip("FA3 needs a Hopper GPU and sgl_kernel's flash_ops")
    from sgl_longgen.core.verify_scores import score_rows
    from sgl_longgen.kernels.hybrid import SCORED_TRITON_MAX_TREE

    lens = [4095, 1000]
    batch = make_batch(lens, tree_size, HQ, HKV, D, torch.bfloat16, seed=7)
    rows = score_rows(tree_size)
    results = {}
    for backend in ("auto", "fa3"):
        attn = HybridTreeAttention(HQ, HKV, D, "cuda", prefix_backend=backend)
        path = attn.plan(batch.kv_indptr, batch.kv_indices, batch.tree_mask, sm_scale=batch.sm_scale,
                         q_dtype=torch.bfloat16, prefix_lens_host=lens, score_rows=rows)
        scores = torch.zeros(len(lens), HKV, max(lens), dtype=torch.float32, device="cuda")
        out = attn.run(batch.q, batch.k_buffer, batch.v_buffer, batch.k_tree, batch.v_tree, scores=scores,
                       score_rows=rows)
        results[backend] = (path, out, scores)
    assert results["auto"][0] == ("triton" if tree_size <= SCORED_TRITON_MAX_TREE else "fa3")
    assert results["fa3"][0] == "fa3"
    assert max_err(results["auto"][1], results["fa3"][1]) <= ACCEPT
    for b, n in enumerate(lens):
        assert torch.allclose(results["auto"][2][b, :, :n], results["fa3"][2][b, :, :n], rtol=1e-3, atol=1e-3)
    # Without scores "auto" keeps FA3.
    attn = HybridTreeAttention(HQ, HKV, D, "cuda")
    assert attn.plan(batch.kv_indptr, batch.kv_indices, batch.tree_mask, q_dtype=torch.bfloat16,
                     prefix_lens_host=lens) == "fa3"


def test_auto_path_of_one_row_is_triton():
    """A one-row tree without a cascade takes Triton's path under "auto" (measured ahead of FA3's
    or within 5% of it at every context), its output FA3's within the bf16 bound."""
    if not fa3_supported(D, torch.bfloat16, torch.bfloat16, torch.device("cuda")):
        pytest.skip("FA3 needs a Hopper GPU and sgl_kernel's flash_ops")
    lens = [4095, 1000]
    batch = make_batch(lens, 1, HQ, HKV, D, torch.bfloat16, seed=11)
    outs = {}
    for backend in ("auto", "fa3"):
        attn = HybridTreeAttention(HQ, HKV, D, "cuda", prefix_backend=backend)
        path = attn.plan(batch.kv_indptr, batch.kv_indices, batch.tree_mask, sm_scale=batch.sm_scale,
                         q_dtype=torch.bfloat16, prefix_lens_host=lens)
        assert path == ("triton" if backend == "auto" else "fa3")
        outs[backend] = attn.run(batch.q, batch.k_buffer, batch.v_buffer, batch.k_tree, batch.v_tree)
    assert max_err(outs["auto"], outs["fa3"]) <= ACCEPT


@pytest.mark.parametrize("tree_size", [1, 4])
def test_auto_path_of_a_cascade(tree_size):
    """A cascade takes Triton's path at one row per request (one KV range for the batch, merged in
    the same pass), FA3's above, and either is within the bf16 bound."""
    if not fa3_supported(D, torch.bfloat16, torch.bfloat16, torch.device("cuda")):
        pytest.skip("FA3 needs a Hopper GPU and sgl_kernel's flash_ops")
    from kernel_cases import make_shared_batch
    from sgl_longgen.kernels.hybrid import ONE_ROW_TRITON_MAX_TREE

    own = [0, 5, 300, 17]
    batch = make_shared_batch(4096, own, tree_size, HQ, HKV, D, torch.bfloat16, seed=3)
    batch.sm_scale = D**-0.5
    attn = HybridTreeAttention(HQ, HKV, D, "cuda")
    path = attn.plan(batch.kv_indptr, batch.kv_indices, batch.tree_mask, sm_scale=batch.sm_scale,
                     q_dtype=torch.bfloat16, prefix_lens_host=[4096 + n for n in own], shared_prefix_len=4096)
    assert attn.cascade and path == ("triton" if tree_size <= ONE_ROW_TRITON_MAX_TREE else "fa3")
    out = nan_like(batch.q)
    attn.run(batch.q, batch.k_buffer, batch.v_buffer, batch.k_tree, batch.v_tree, out=out)
    assert max_err(out, batch.reference()[0]) <= ACCEPT
