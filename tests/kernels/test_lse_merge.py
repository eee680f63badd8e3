"""LSE merges: two parts over disjoint keys must equal one pass, in base 2 only."""

from __future__ import annotations

import torch

from kernel_cases import DEVICE, TOL, make_batch, max_err, nan_like
from sgl_longgen.kernels.folded_decode import fold_queries
from sgl_longgen.kernels.merge import (
    folded_strides,
    lse_to_base2,
    lse_to_natural,
    merge_split_states,
    merge_states,
    merge_two_states_strided,
    token_head_strides,
)
from sgl_longgen.kernels.prefix_attention import prefix_attention
from sgl_longgen.kernels.reference import lse_natural_to_base2, masked_attention_reference
from sgl_longgen.kernels.tree_attention import tree_attention


def two_key_sets(seed=0, m=12, n=300, hq=4, hkv=2, d=32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(m, hq, d, generator=g).to(DEVICE)
    k = torch.randn(n, hkv, d, generator=g).to(DEVICE)
    v = torch.randn(n, hkv, d, generator=g).to(DEVICE)
    in_a = (torch.rand(m, n, generator=g) < 0.7).to(DEVICE)
    scale = 2.0 / d**0.5
    full = masked_attention_reference(q, k, v, torch.ones(m, n, dtype=torch.bool, device=DEVICE), scale)
    part_a = masked_attention_reference(q, k, v, in_a, scale)
    part_b = masked_attention_reference(q, k, v, ~in_a, scale)
    return full, part_a, part_b


def test_two_parts_equal_one_pass_in_base2():
    (o, lse), (o_a, lse_a), (o_b, lse_b) = two_key_sets()
    out, out_lse = merge_states(o_a, lse_to_base2(lse_a), o_b, lse_to_base2(lse_b))
    assert max_err(out, o) <= 1e-4
    assert max_err(lse_to_natural(out_lse), lse) <= 1e-4


def test_natural_log_lse_is_caught():
    """Feeding natural-log LSEs to the base-2 merge mis-weights the parts far beyond tolerance."""
    (o, _), (o_a, lse_a), (o_b, lse_b) = two_key_sets(seed=1)
    out, _ = merge_states(o_a, lse_a, o_b, lse_b)
    assert max_err(out, o) > 1e-2


def test_kernel_parts_merge_to_the_full_attention():
    """Prefix kernel + tree kernel, merged, against the single fp32 softmax over prefix + tree."""
    batch = make_batch([700, 1, 0], 9, 8, 2, 32, torch.float16, seed=2)
    o_p, lse_p = prefix_attention(batch.q, batch.k_buffer, batch.v_buffer, batch.kv_indptr, batch.kv_indices,
                                  batch.sm_scale, out=nan_like(batch.q, torch.float32))
    o_t, lse_t = tree_attention(batch.q, batch.k_tree, batch.v_tree, batch.tree_mask, batch.sm_scale,
                                out=nan_like(batch.q, torch.float32))
    out, out_lse = merge_states(o_p, lse_p, o_t, lse_t, out=nan_like(batch.q, torch.float32))
    ref_o, ref_lse = batch.reference()
    assert max_err(out, ref_o) <= TOL[torch.float16]
    assert max_err(out_lse, lse_natural_to_base2(ref_lse)) <= 1e-3


def test_in_place_merge():
    (o, _), (o_a, lse_a), (o_b, lse_b) = two_key_sets(seed=3)
    v, s = o_a.clone(), lse_to_base2(lse_a)
    merge_states(v, s, o_b, lse_to_base2(lse_b), out=v, out_lse=s)
    assert max_err(v, o) <= 1e-4


def test_split_states_with_empty_parts():
    g = torch.Generator().manual_seed(4)
    n, h, s, d = 5, 3, 6, 16
    part_o = torch.randn(n, h, s, d, generator=g).to(DEVICE)
    part_lse = (3 * torch.randn(n, h, s, generator=g)).to(DEVICE)
    part_lse[:, :, 2] = float("-inf")
    part_o[:, :, 2] = float("nan")  # an empty part's output must never be read
    part_lse[0, 0, :] = float("-inf")  # a row without any key
    out, out_lse = merge_split_states(part_o, part_lse, out_lse=torch.empty(n, h, device=DEVICE))
    w = torch.softmax(part_lse * torch.log(torch.tensor(2.0)), dim=-1)
    w = torch.nan_to_num(w, nan=0.0)
    expect = torch.einsum("nhs,nhsd->nhd", w, torch.nan_to_num(part_o, nan=0.0))
    assert torch.equal(out[0, 0], torch.zeros(d, device=DEVICE))
    assert torch.isneginf(out_lse[0, 0])
    assert max_err(out, expect) <= 1e-5
    lse_expect = torch.logsumexp(part_lse * torch.log(torch.tensor(2.0)), -1) / torch.log(torch.tensor(2.0))
    assert max_err(out_lse, lse_expect) <= 1e-5
    # only the first num_states parts count
    out3, _ = merge_split_states(part_o, part_lse, num_states=2)
    expect3 = merge_split_states(part_o[:, :, :2].contiguous(), part_lse[:, :, :2].contiguous())[0]
    assert max_err(out3, expect3) == 0.0


def test_folded_state_merges_in_place():
    """A GQA-folded state (FlashInfer's layout for the folded decode) merges without unfolding."""
    bs, T, hkv, G, d = 2, 5, 2, 4, 16
    g = torch.Generator().manual_seed(5)
    o_plain = torch.randn(bs * T, hkv * G, d, generator=g).to(DEVICE)
    lse_plain = torch.randn(bs * T, hkv * G, generator=g).to(DEVICE)
    o_other = torch.randn(bs * T, hkv * G, d, generator=g).to(DEVICE)
    lse_other = torch.randn(bs * T, hkv * G, generator=g).to(DEVICE)
    o_fold = fold_queries(o_plain, bs, T, hkv)
    lse_fold = fold_queries(lse_plain[..., None], bs, T, hkv)[..., 0]
    out = torch.empty_like(o_plain)
    merge_two_states_strided(
        o_fold, lse_fold, (folded_strides(o_fold, T, G), folded_strides(lse_fold, T, G)),
        o_other, lse_other, (token_head_strides(o_other, T, G), token_head_strides(lse_other, T, G)),
        out, None, T, G,
    )
    expect, _ = merge_states(o_plain, lse_plain, o_other, lse_other)
    assert max_err(out, expect) <= 1e-6
