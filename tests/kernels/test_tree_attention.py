"""Triton tree-masked attention (draft tokens over draft tokens) against an fp32 one-pass reference."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import DEVICE, TOL, make_batch, max_err, nan_like
from sgl_longgen.kernels.reference import lse_natural_to_base2, masked_attention_reference
from sgl_longgen.kernels.tree_attention import tree_attention


def tree_only_reference(batch, tree_mask=None, kv_head_of=None):
    """One softmax over each request's T x T masked scores, fp32; natural-log LSE."""
    tree_mask = batch.tree_mask if tree_mask is None else tree_mask
    T = batch.tree_size
    outs, lses = [], []
    for b in range(tree_mask.shape[0]):
        rows = slice(b * T, (b + 1) * T)
        k, v = batch.k_tree[rows], batch.v_tree[rows]
        if kv_head_of is not None:  # an alternative GQA mapping, expanded to one KV head per q head
            k, v = k[:, kv_head_of], v[:, kv_head_of]
        o, lse = masked_attention_reference(batch.q[rows], k, v, tree_mask[b], batch.sm_scale)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


CASES = [  # (group, tree size, dtype)
    (1, 1, torch.bfloat16),
    (4, 1, torch.float16),
    (8, 16, torch.bfloat16),
    (1, 16, torch.float16),
    (4, 64, torch.bfloat16),
    (8, 64, torch.float16),
    (1, 121, torch.bfloat16),
    (4, 121, torch.float16),
    (8, 121, torch.bfloat16),
]


@pytest.mark.parametrize("group,tree_size,dtype", CASES)
def test_matches_reference(group, tree_size, dtype):
    num_kv_heads = 2
    batch = make_batch([0, 0], tree_size, group * num_kv_heads, num_kv_heads, 32, dtype, seed=tree_size + group)
    out = nan_like(batch.q, torch.float32)
    lse = nan_like(batch.q[..., 0], torch.float32)
    tree_attention(batch.q, batch.k_tree, batch.v_tree, batch.tree_mask, batch.sm_scale, out=out, lse=lse)
    ref_o, ref_lse = tree_only_reference(batch)
    assert max_err(out, ref_o) <= TOL[dtype] / 2
    assert max_err(lse, lse_natural_to_base2(ref_lse)) <= 1e-3


def test_default_output_dtype_and_strided_destination():
    batch = make_batch([0, 0, 0], 13, 8, 2, 16, torch.bfloat16, seed=3)
    o, lse = tree_attention(batch.q, batch.k_tree, batch.v_tree, batch.tree_mask, batch.sm_scale)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref_o, ref_lse = tree_only_reference(batch)
    assert max_err(o, ref_o) <= TOL[torch.bfloat16]
    # Writing into one slot of a larger partial-state buffer, as the hybrid path does.
    big = torch.full((batch.q.shape[0], 8, 3, 16), float("nan"), device=DEVICE)
    big_lse = torch.full((batch.q.shape[0], 8, 3), float("nan"), device=DEVICE)
    tree_attention(batch.q, batch.k_tree, batch.v_tree, batch.tree_mask, batch.sm_scale,
                   out=big[:, :, 1], lse=big_lse[:, :, 1])
    assert max_err(big[:, :, 1], ref_o) <= TOL[torch.bfloat16] / 2
    assert torch.isnan(big[:, :, 0]).all() and torch.isnan(big[:, :, 2]).all()
    assert max_err(big_lse[:, :, 1], lse_natural_to_base2(ref_lse)) <= 1e-3


def test_mask_orientation_is_checked():
    """The tolerance separates the right mask from its transpose and from no mask at all."""
    batch = make_batch([0, 0], 16, 4, 1, 32, torch.float16, seed=5)
    out, _ = tree_attention(batch.q, batch.k_tree, batch.v_tree, batch.tree_mask, batch.sm_scale,
                            out=nan_like(batch.q, torch.float32))
    right, _ = tree_only_reference(batch)
    transposed, _ = tree_only_reference(batch, batch.tree_mask.transpose(1, 2))
    unmasked, _ = tree_only_reference(batch, torch.ones_like(batch.tree_mask))
    assert max_err(out, right) <= TOL[torch.float16]
    assert max_err(out, transposed) > 50 * TOL[torch.float16]
    assert max_err(out, unmasked) > 50 * TOL[torch.float16]


def test_gqa_mapping_is_checked():
    """Query head h reads KV head h // G; the interleaved mapping h % Hkv is far off."""
    group, num_kv_heads = 4, 2
    batch = make_batch([0], 8, group * num_kv_heads, num_kv_heads, 32, torch.float16, seed=6)
    out, _ = tree_attention(batch.q, batch.k_tree, batch.v_tree, batch.tree_mask, batch.sm_scale,
                            out=nan_like(batch.q, torch.float32))
    heads = torch.arange(group * num_kv_heads, device=DEVICE)
    right, _ = tree_only_reference(batch, kv_head_of=heads // group)
    interleaved, _ = tree_only_reference(batch, kv_head_of=heads % num_kv_heads)
    assert max_err(out, right) <= TOL[torch.float16]
    assert max_err(out, interleaved) > 50 * TOL[torch.float16]


def test_row_without_visible_key_contributes_nothing():
    batch = make_batch([0], 4, 2, 1, 16, torch.float16, seed=7)
    mask = batch.tree_mask.clone()
    mask[0, 2, :] = False
    o, lse = tree_attention(batch.q, batch.k_tree, batch.v_tree, mask, batch.sm_scale,
                            out=nan_like(batch.q, torch.float32))
    assert torch.equal(o[2], torch.zeros_like(o[2]))
    assert torch.isneginf(lse[2]).all()
    ref_o, _ = tree_only_reference(batch, mask)
    assert max_err(o, ref_o) <= TOL[torch.float16]


def test_rejects_bad_shapes():
    batch = make_batch([0, 0], 4, 4, 2, 16, torch.float16)
    with pytest.raises(ValueError):
        tree_attention(batch.q[:-1], batch.k_tree[:-1], batch.v_tree[:-1], batch.tree_mask)
    with pytest.raises(ValueError):
        tree_attention(batch.q, batch.k_tree, batch.v_tree, batch.tree_mask[:, :, :3])
