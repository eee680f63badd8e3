"""Cascade across requests: a shared prefix attended once for the batch, then each request's own
part, the tree part and one LSE merge, against the non-cascade path and the fp32 reference."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import DEVICE, TOL, make_batch, make_shared_batch, max_err, nan_like, run_attention, with_own_slots
from sgl_longgen.kernels import fa3_prefix, hybrid
from sgl_longgen.kernels.hybrid import HybridTreeAttention, hybrid_tree_attention
from sgl_longgen.kernels.reference import lse_natural_to_base2, prefix_logit_scores_reference, tree_attention_reference

CASES = [  # (shared length, own lengths, tree size, query heads, kv heads, head dim)
    (0, [3, 40], 5, 8, 2, 64),  # nothing shared: the shared part is empty (LSE -inf)
    (512, [0, 7, 130], 16, 8, 2, 128),  # request 0's whole prefix is shared: its own part is empty
    (300, [0, 1, 2, 50, 0, 9, 3, 17], 5, 28, 4, 64),  # batch 8, group 7 (Qwen2.5-7B's heads)
    (257, [33, 0], 1, 7, 1, 128),  # a one-token tree, group 7
    (1000, [5, 5, 5, 5], 16, 16, 4, 64),  # equal own parts, group 4
    (700, [2, 90, 0, 11, 64, 1], 16, 28, 4, 128),  # batch 6, group 7, head_dim 128
]


def run_attn(batch, dtype, shared, *, graph=False, lens=None):
    hq, hkv, d = batch.q.shape[1], batch.k_buffer.shape[1], batch.q.shape[2]
    attn = HybridTreeAttention(hq, hkv, d, DEVICE, prefix_backend="triton", use_cuda_graph=graph)
    attn.plan(batch.kv_indptr, batch.kv_indices, batch.tree_mask, sm_scale=batch.sm_scale, q_dtype=dtype,
              prefix_lens_host=lens, shared_prefix_len=shared)
    out, lse = run_attention(attn, batch)
    return attn, out, lse


@pytest.mark.parametrize("shared_len,own_lens,tree_size,hq,hkv,head_dim", CASES)
def test_cascade_matches_the_reference_and_the_plain_path(shared_len, own_lens, tree_size, hq, hkv, head_dim):
    dtype = torch.bfloat16 if head_dim == 128 else torch.float16
    batch = make_shared_batch(shared_len, own_lens, tree_size, hq, hkv, head_dim, dtype, seed=shared_len + tree_size)
    lens = [shared_len + n for n in own_lens]
    ref_o, ref_lse = batch.reference()
    _, plain_o, plain_lse = run_attn(batch, dtype, None, lens=lens)
    # S as a host int and as a device tensor (graph-safe form, 0 allowed)
    for shared in (shared_len, torch.tensor([shared_len], dtype=torch.int32, device=DEVICE)):
        attn, out, lse = run_attn(batch, dtype, shared, lens=lens)
        assert attn.cascade == (isinstance(shared, torch.Tensor) or shared_len > 0)
        assert max_err(out, ref_o) <= TOL[dtype] / 2
        assert max_err(lse, lse_natural_to_base2(ref_lse)) <= 1e-3
        assert max_err(out, plain_o) <= TOL[dtype] / 2
        assert max_err(lse, plain_lse) <= 1e-3


def test_a_cascade_reads_the_shared_slots_from_request_zero():
    """Planned as sharing 200 slots, requests that do not share read request 0's keys instead of
    their own: far off, so the tests above see the shared part's weight."""
    batch = make_batch([260, 230, 240], 5, 8, 2, 64, torch.float16, seed=3)
    _, out, _ = run_attn(batch, torch.float16, 200, lens=batch.prefix_lens)
    ref_o, _ = batch.reference()
    assert max_err(out[:5], ref_o[:5]) <= TOL[torch.float16] / 2  # request 0 reads its own slots
    assert max_err(out[5:], ref_o[5:]) > 10 * TOL[torch.float16]


def test_graph_mode_cascade_replays_with_a_new_shared_length():
    """Under CUDA graphs: the launch shapes do not depend on S, which the plan writes into the
    object's persistent buffer; a replan with another S (a device tensor) keeps them."""
    dtype = torch.float16
    first = make_shared_batch(400, [10, 0, 30], 5, 8, 2, 64, dtype, seed=4)
    attn, out, _ = run_attn(first, dtype, torch.tensor([400], dtype=torch.int32), graph=True)
    assert max_err(out, first.reference()[0]) <= TOL[dtype] / 2
    meta, configs = attn._cascade_meta, (attn.prefix_config, attn.shared_config)

    second = make_shared_batch(37, [300, 2, 90], 5, 8, 2, 64, dtype, seed=5)
    attn.plan(second.kv_indptr, second.kv_indices, second.tree_mask, sm_scale=second.sm_scale, q_dtype=dtype,
              shared_prefix_len=torch.tensor([37], dtype=torch.int32))
    assert attn._cascade_meta is meta and (attn.prefix_config, attn.shared_config) == configs
    out = nan_like(second.q, torch.float32)
    attn.run(second.q, second.k_buffer, second.v_buffer, second.k_tree, second.v_tree, out=out)
    assert max_err(out, second.reference()[0]) <= TOL[dtype] / 2


def test_width_one_verify_with_own_keys_in_the_prefix_cascades():
    """A plain step (own slot last in each prefix) with a shared prefix: shared + own parts only."""
    dtype = torch.bfloat16
    batch = make_shared_batch(333, [0, 12, 5], 1, 14, 2, 64, dtype, seed=6)
    ref_o, ref_lse = batch.reference()
    indptr, indices, lens = with_own_slots(batch)
    attn = HybridTreeAttention(14, 2, 64, DEVICE, prefix_backend="triton")
    attn.plan(indptr, indices, batch.tree_mask, sm_scale=batch.sm_scale, q_dtype=dtype, prefix_lens_host=lens,
              own_kv_in_prefix=True, shared_prefix_len=333)
    out, lse = run_attention(attn, batch)
    assert max_err(out, ref_o) <= TOL[dtype] / 2
    assert max_err(lse, lse_natural_to_base2(ref_lse)) <= 1e-3


def test_selection_scores_cover_the_whole_prefix_under_a_cascade():
    dtype = torch.float16
    batch = make_shared_batch(150, [20, 0], 5, 8, 2, 64, dtype, seed=7)
    attn = HybridTreeAttention(8, 2, 64, DEVICE, prefix_backend="triton")
    attn.plan(batch.kv_indptr, batch.kv_indices, batch.tree_mask, sm_scale=batch.sm_scale, q_dtype=dtype,
              score_rows=2, shared_prefix_len=150)
    scores = torch.full((2, 2, 170), float("nan"), device=DEVICE)
    out = nan_like(batch.q, torch.float32)
    attn.run(batch.q, batch.k_buffer, batch.v_buffer, batch.k_tree, batch.v_tree, out=out, scores=scores, score_rows=2)
    assert max_err(out, batch.reference()[0]) <= TOL[dtype] / 2
    ref = prefix_logit_scores_reference(batch.q, batch.k_buffer, batch.kv_indptr, batch.kv_indices, 2, batch.sm_scale)
    assert max_err(scores[0], ref[0]) <= 1e-2 and max_err(scores[1, :, :150], ref[1, :, :150]) <= 1e-2


def test_cascade_plan_validation():
    batch = make_shared_batch(50, [5, 0], 4, 8, 2, 32, torch.float16)
    attn = HybridTreeAttention(8, 2, 32, DEVICE, prefix_backend="triton")
    with pytest.raises(ValueError, match="shortest prefix"):
        attn.plan(batch.kv_indptr, batch.kv_indices, batch.tree_mask, q_dtype=torch.float16,
                  prefix_lens_host=[55, 50], shared_prefix_len=51)
    with pytest.raises(ValueError, match=">= 0"):
        attn.plan(batch.kv_indptr, batch.kv_indices, batch.tree_mask, q_dtype=torch.float16, shared_prefix_len=-1)
    with pytest.raises(ValueError, match="int32"):
        attn.plan(batch.kv_indptr, batch.kv_indices, batch.tree_mask, q_dtype=torch.float16,
                  shared_prefix_len=torch.tensor([5]))
    forced = HybridTreeAttention(8, 2, 32, DEVICE, prefix_backend="flashinfer_fold")
    with pytest.raises(ValueError, match="flashinfer_fold"):
        forced.plan(batch.kv_indptr, batch.kv_indices, batch.tree_mask, q_dtype=torch.float16, shared_prefix_len=50)
    # a later plan without S runs without cascade
    attn.plan(batch.kv_indptr, batch.kv_indices, batch.tree_mask, q_dtype=torch.float16, shared_prefix_len=50)
    assert attn.cascade
    attn.plan(batch.kv_indptr, batch.kv_indices, batch.tree_mask, q_dtype=torch.float16)
    assert not attn.cascade


def test_one_shot_function_takes_the_shared_length():
    batch = make_shared_batch(90, [4, 17], 6, 8, 2, 64, torch.float16, seed=8)
    o = hybrid_tree_attention(batch.q, batch.k_buffer, batch.v_buffer, batch.kv_indptr, batch.kv_indices,
                              batch.k_tree, batch.v_tree, batch.tree_mask, batch.sm_scale,
                              prefix_backend="triton", shared_prefix_len=90)
    assert max_err(o, batch.reference()[0]) <= TOL[torch.float16]


def torch_flash_attn_with_kvcache(q, k_cache, v_cache, page_table, cache_seqlens, softmax_scale, causal=False,
                                  return_softmax_lse=False):
    """FA3's paged kernel at page size 1 in plain PyTorch, with its conventions: q ``[b, s, hq, d]``,
    the output in q's dtype, the natural-log LSE ``[b, hq, s]``, ``+inf`` for a row without keys."""
    assert not causal
    b, s, hq, _ = q.shape
    hkv = k_cache.shape[2]
    outs, lses = [], []
    for i in range(b):
        slots = page_table[i, : int(cache_seqlens[i])].long()
        k = k_cache[slots, 0].float().repeat_interleave(hq // hkv, dim=1)  # [n, hq, d]
        v = v_cache[slots, 0].float().repeat_interleave(hq // hkv, dim=1)
        logits = torch.einsum("shd,nhd->hsn", q[i].float(), k) * softmax_scale
        lse = torch.logsumexp(logits, -1) if slots.numel() else torch.full((hq, s), float("inf"))
        p = torch.softmax(logits, -1) if slots.numel() else logits.new_zeros(hq, s, 0)
        outs.append(torch.einsum("hsn,nhd->shd", p, v).to(q.dtype))
        lses.append(lse)
    o, lse = torch.stack(outs), torch.stack(lses)
    return (o, lse) if return_softmax_lse else o


@pytest.mark.skipif(DEVICE.type != "cpu", reason="on a GPU host test_kernels_gpu_accuracy runs FA3 itself")
@pytest.mark.parametrize("graph", [False, True])
def test_fa3_path_cascade_glue(monkeypatch, graph):
    """The FA3 path's page tables (the shared slots as one row, the own parts past S), strides and
    the two merges, with FA3 itself replaced by a PyTorch twin of its contract."""
    monkeypatch.setattr(fa3_prefix, "_flash_attn_with_kvcache", lambda: torch_flash_attn_with_kvcache)
    monkeypatch.setattr(hybrid, "fa3_supported", lambda *args: True)
    dtype = torch.bfloat16
    batch = make_shared_batch(120, [0, 33, 4], 5, 8, 2, 64, dtype, seed=9)
    lens = [120, 153, 124]
    bufs = {}
    if graph:
        bufs = {"graph_page_table_buf": torch.zeros(4, 256, dtype=torch.int32),
                "graph_seq_lens_buf": torch.zeros(4, dtype=torch.int32)}
    attn = HybridTreeAttention(8, 2, 64, DEVICE, prefix_backend="fa3", use_cuda_graph=graph, **bufs)
    shared = torch.tensor([120], dtype=torch.int32) if graph else 120
    assert attn.plan(batch.kv_indptr, batch.kv_indices, batch.tree_mask, sm_scale=batch.sm_scale, q_dtype=dtype,
                     prefix_lens_host=None if graph else lens, shared_prefix_len=shared) == "fa3"
    out, lse = run_attention(attn, batch)
    ref_o, ref_lse = batch.reference()
    assert max_err(out, ref_o) <= TOL[dtype] / 2
    assert max_err(lse, lse_natural_to_base2(ref_lse)) <= 1e-2
    assert attn._fa3.seq_lens.tolist()[:3] == [0, 33, 4] and attn._fa3_shared.seq_lens.tolist() == [120]

    # width-1 verify with the own slots in the prefixes: shared + own merged straight into out
    one = make_shared_batch(120, [0, 33, 4], 1, 8, 2, 64, dtype, seed=10)
    indptr, indices, own_lens = with_own_slots(one)
    attn.plan(indptr, indices, one.tree_mask, sm_scale=one.sm_scale, q_dtype=dtype,
              prefix_lens_host=None if graph else own_lens, shared_prefix_len=shared, own_kv_in_prefix=True)
    out = nan_like(one.q, torch.float32)
    attn.run(one.q, one.k_buffer, one.v_buffer, one.k_tree, one.v_tree, out=out)
    assert max_err(out, one.reference()[0]) <= TOL[dtype] / 2


@pytest.mark.skipif(DEVICE.type != "cpu", reason="on a GPU host test_kernels_gpu_accuracy runs FA3 itself")
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("group", [4, 7])
def test_fa3_path_merges_fa3s_own_lse(monkeypatch, graph, group):
    """Without a cascade, FA3's natural-log LSE (``+inf`` for an empty prefix) goes to the tree
    merge as FA3 returns it and is converted there: against the fp32 reference, an empty prefix
    included (its rows are the tree part's alone)."""
    monkeypatch.setattr(fa3_prefix, "_flash_attn_with_kvcache", lambda: torch_flash_attn_with_kvcache)
    monkeypatch.setattr(hybrid, "fa3_supported", lambda *args: True)
    dtype, hkv = torch.bfloat16, 2
    batch = make_batch([0, 57, 5], 6, group * hkv, hkv, 64, dtype, seed=group)
    bufs = {}
    if graph:
        bufs = {"graph_page_table_buf": torch.zeros(4, 128, dtype=torch.int32),
                "graph_seq_lens_buf": torch.zeros(4, dtype=torch.int32)}
    attn = HybridTreeAttention(group * hkv, hkv, 64, DEVICE, prefix_backend="fa3", use_cuda_graph=graph, **bufs)
    assert attn.plan(batch.kv_indptr, batch.kv_indices, batch.tree_mask, sm_scale=batch.sm_scale, q_dtype=dtype,
                     prefix_lens_host=None if graph else [0, 57, 5]) == "fa3"
    out, lse = run_attention(attn, batch)
    ref_o, ref_lse = batch.reference()
    assert max_err(out, ref_o) <= TOL[dtype] / 2
    assert max_err(lse, lse_natural_to_base2(ref_lse)) <= 1e-2


def test_the_benchmark_batch_shares_its_prompt():
    """The GPU benchmark's cascade table builds requests over one prompt's slots: its plain and
    cascade attentions agree with the reference (CPU, Triton path)."""
    from sgl_longgen.bench.kernels import SharedBatch

    batch = SharedBatch(3, 300, 7, 4, DEVICE, torch.Generator().manual_seed(0))
    assert torch.equal(batch.kv_indices[307:607][:300], batch.kv_indices[:300])
    _, plain = batch.attention("triton", DEVICE)
    attn, cascade = batch.attention("triton", DEVICE, shared_prefix_len=300)
    assert attn.cascade
    ref, _ = tree_attention_reference(batch.q, batch.k_pool, batch.v_pool, batch.kv_indptr, batch.kv_indices,
                                             batch.k_tree, batch.v_tree, batch.tree, batch.q.shape[-1] ** -0.5)
    assert max_err(cascade(), ref) <= TOL[torch.bfloat16] and max_err(plain(), ref) <= TOL[torch.bfloat16]
