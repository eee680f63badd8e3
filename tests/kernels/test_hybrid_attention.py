"""The whole hybrid path (prefix + tree + merge) against one fp32 softmax over prefix + tree."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import DEVICE, TOL, make_batch, max_err, nan_like, run_attention, with_own_slots
from sgl_longgen.kernels.hybrid import HybridTreeAttention, hybrid_tree_attention
from sgl_longgen.kernels.reference import lse_natural_to_base2

CASES = [  # (prefix lens, tree size, group, dtype)
    ([0, 1, 4095], 16, 4, torch.bfloat16),
    ([4095, 0], 1, 8, torch.float16),
    ([1, 2047], 64, 1, torch.float16),
    ([6000], 64, 8, torch.bfloat16),
    ([0, 1, 4095], 121, 4, torch.float16),
    ([129], 121, 8, torch.bfloat16),
]


@pytest.mark.parametrize("prefix_lens,tree_size,group,dtype", CASES)
def test_matches_one_pass_reference(prefix_lens, tree_size, group, dtype):
    batch = make_batch(prefix_lens, tree_size, 2 * group, 2, 32, dtype, seed=tree_size * 7 + group)
    attn = HybridTreeAttention(2 * group, 2, 32, DEVICE, prefix_backend="triton")
    attn.plan(batch.kv_indptr, batch.kv_indices, batch.tree_mask, sm_scale=batch.sm_scale,
              q_dtype=dtype, prefix_lens_host=prefix_lens)
    out, lse = run_attention(attn, batch)
    ref_o, ref_lse = batch.reference()
    assert max_err(out, ref_o) <= TOL[dtype] / 2
    assert max_err(lse, lse_natural_to_base2(ref_lse)) <= 1e-3
    # A transposed tree mask is detected: the check is sensitive to the mask orientation.
    wrong_o, _ = batch.reference(batch.tree_mask.transpose(1, 2))
    if tree_size > 1:
        assert max_err(out, wrong_o) > 10 * TOL[dtype]


@pytest.mark.parametrize("prefix_lens,tree_size,num_q_heads,num_kv_heads,head_dim", [
    ([37, 0, 5, 300, 1, 64, 2, 9], 16, 28, 4, 64),  # Qwen2.5-7B's heads (group 7), batch 8, head_dim 64
    ([300], 64, 28, 4, 128),  # group 7 at head_dim 128
    ([257, 3], 16, 16, 2, 128),  # group 8
])
def test_the_shapes_users_run(prefix_lens, tree_size, num_q_heads, num_kv_heads, head_dim):
    """GQA groups 4/7/8 (Llama-3.1-8B, Qwen2.5-7B, others), head_dim 64 and 128, batches up to 8."""
    dtype = torch.bfloat16
    batch = make_batch(prefix_lens, tree_size, num_q_heads, num_kv_heads, head_dim, dtype, seed=num_q_heads + head_dim)
    attn = HybridTreeAttention(num_q_heads, num_kv_heads, head_dim, DEVICE, prefix_backend="triton")
    attn.plan(batch.kv_indptr, batch.kv_indices, batch.tree_mask, sm_scale=batch.sm_scale,
              q_dtype=dtype, prefix_lens_host=prefix_lens)
    out = nan_like(batch.q, torch.float32)
    attn.run(batch.q, batch.k_buffer, batch.v_buffer, batch.k_tree, batch.v_tree, out=out)
    assert max_err(out, batch.reference()[0]) <= TOL[dtype] / 2


def test_output_in_input_dtype():
    batch = make_batch([1000, 3], 8, 8, 2, 16, torch.bfloat16, seed=1)
    o, lse = hybrid_tree_attention(batch.q, batch.k_buffer, batch.v_buffer, batch.kv_indptr, batch.kv_indices,
                                   batch.k_tree, batch.v_tree, batch.tree_mask, batch.sm_scale,
                                   prefix_backend="triton", return_lse=True)
    assert o.dtype == torch.bfloat16 and o.shape == batch.q.shape
    ref_o, ref_lse = batch.reference()
    assert max_err(o, ref_o) <= TOL[torch.bfloat16]
    assert max_err(lse, lse_natural_to_base2(ref_lse)) <= 1e-3


def test_one_plan_serves_many_layers():
    """plan once per step, run per layer with each layer's own q/k/v and pool."""
    first = make_batch([500, 20], 6, 8, 2, 16, torch.float16, seed=2)
    attn = HybridTreeAttention(8, 2, 16, DEVICE, prefix_backend="triton", use_cuda_graph=True)
    attn.plan(first.kv_indptr, first.kv_indices, first.tree_mask, sm_scale=first.sm_scale, q_dtype=torch.float16)
    for seed in (3, 4):
        layer = make_batch([500, 20], 6, 8, 2, 16, torch.float16, seed=seed)
        # same prefix slots and tree as the planned step, new activations
        layer.kv_indptr, layer.kv_indices, layer.tree_mask = first.kv_indptr, first.kv_indices, first.tree_mask
        out = nan_like(layer.q, torch.float32)
        attn.run(layer.q, layer.k_buffer, layer.v_buffer, layer.k_tree, layer.v_tree, out=out)
        assert max_err(out, layer.reference()[0]) <= TOL[torch.float16]


def test_graph_mode_launch_does_not_depend_on_lengths():
    batch = make_batch([10, 3000], 4, 4, 1, 16, torch.float16, seed=5)
    attn = HybridTreeAttention(4, 1, 16, DEVICE, prefix_backend="triton", use_cuda_graph=True)
    attn.plan(batch.kv_indptr, batch.kv_indices, batch.tree_mask, q_dtype=torch.float16, prefix_lens_host=[10, 3000])
    cfg_long = attn.prefix_config
    attn.plan(batch.kv_indptr, batch.kv_indices, batch.tree_mask, q_dtype=torch.float16, prefix_lens_host=[1, 1])
    assert attn.prefix_config == cfg_long


def test_plan_validation():
    batch = make_batch([5], 4, 4, 2, 16, torch.float16)
    attn = HybridTreeAttention(4, 2, 16, DEVICE, prefix_backend="triton")
    with pytest.raises(RuntimeError):
        attn.run(batch.q, batch.k_buffer, batch.v_buffer, batch.k_tree, batch.v_tree)
    with pytest.raises(ValueError):
        attn.plan(batch.kv_indptr.long(), batch.kv_indices, batch.tree_mask)
    with pytest.raises(ValueError):
        attn.plan(batch.kv_indptr, batch.kv_indices, batch.tree_mask[:, :, :3])
    with pytest.raises(ValueError):
        HybridTreeAttention(4, 2, 16, DEVICE, prefix_backend="nope")
    if DEVICE.type == "cpu":
        forced = HybridTreeAttention(4, 2, 16, DEVICE, prefix_backend="flashinfer_fold")
        with pytest.raises(ValueError):
            forced.plan(batch.kv_indptr, batch.kv_indices, batch.tree_mask, q_dtype=torch.float16)
        auto = HybridTreeAttention(4, 2, 16, DEVICE, prefix_backend="auto")
        assert auto.plan(batch.kv_indptr, batch.kv_indices, batch.tree_mask, q_dtype=torch.float16) == "triton"


@pytest.mark.parametrize("prefix_lens,group,dtype", [([0, 1, 4095], 4, torch.bfloat16), ([300, 7], 7, torch.float16)])
def test_width_one_verify_with_its_own_key_in_the_prefix_is_a_decode_step(prefix_lens, group, dtype):
    """A plain step (width-1 verify) planned with the token's own slot at the end of its prefix:
    one prefix pass, no tree part, the same output and LSE as prefix + tree merged; a prefix
    that lacked the own slot would be caught (that row would miss its own key)."""
    batch = make_batch(prefix_lens, 1, 2 * group, 2, 32, dtype, seed=11 + group)
    indptr, indices, lens = with_own_slots(batch)
    ref_o, ref_lse = batch.reference()
    attn = HybridTreeAttention(2 * group, 2, 32, DEVICE, prefix_backend="triton")
    attn.plan(indptr, indices, batch.tree_mask, sm_scale=batch.sm_scale, q_dtype=dtype,
              prefix_lens_host=lens, own_kv_in_prefix=True)
    out, lse = run_attention(attn, batch)
    assert max_err(out, ref_o) <= TOL[dtype] / 2
    assert max_err(lse, lse_natural_to_base2(ref_lse)) <= 1e-3
    # The same plan over the prefix alone misses each row's own key: far off.
    attn.plan(batch.kv_indptr, batch.kv_indices, batch.tree_mask, sm_scale=batch.sm_scale, q_dtype=dtype,
              prefix_lens_host=prefix_lens, own_kv_in_prefix=True)
    wrong = nan_like(batch.q, torch.float32)
    attn.run(batch.q, batch.k_buffer, batch.v_buffer, batch.k_tree, batch.v_tree, out=wrong)
    assert max_err(wrong[1:], ref_o[1:]) > 10 * TOL[dtype]


def test_own_kv_in_prefix_is_refused_for_trees():
    batch = make_batch([10], 4, 8, 2, 32, torch.float16, seed=5)
    attn = HybridTreeAttention(8, 2, 32, DEVICE, prefix_backend="triton")
    with pytest.raises(ValueError, match="width-1"):
        attn.plan(batch.kv_indptr, batch.kv_indices, batch.tree_mask, q_dtype=torch.float16, own_kv_in_prefix=True)
