"""Triton split-KV prefix attention (all T*G rows per KV head, paged prefix) against fp32 references."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import DEVICE, TOL, make_batch, max_err, nan_like
from sgl_longgen.kernels.merge import merge_split_states
from sgl_longgen.kernels.prefix_attention import (
    PrefixKernelConfig,
    prefix_attention,
    prefix_attention_partials,
    prefix_kernel_config,
)
from sgl_longgen.kernels.reference import lse_natural_to_base2, masked_attention_reference


def prefix_only_reference(batch):
    T = batch.tree_size
    outs, lses = [], []
    indptr = batch.kv_indptr.tolist()
    for b, n in enumerate(batch.prefix_lens):
        slots = batch.kv_indices[indptr[b] : indptr[b + 1]].long()
        rows = slice(b * T, (b + 1) * T)
        visible = torch.ones(T, n, dtype=torch.bool, device=DEVICE)
        o, lse = masked_attention_reference(batch.q[rows], batch.k_buffer[slots], batch.v_buffer[slots], visible, batch.sm_scale)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


CASES = [  # (prefix lens, tree size, group, dtype)
    ([0, 1, 4095], 16, 4, torch.bfloat16),
    ([4095], 1, 1, torch.float16),
    ([1, 0], 121, 8, torch.bfloat16),
    ([8192], 64, 4, torch.float16),
    ([300, 4095], 121, 1, torch.float16),
    ([2500], 64, 8, torch.bfloat16),
]


@pytest.mark.parametrize("prefix_lens,tree_size,group,dtype", CASES)
def test_matches_reference(prefix_lens, tree_size, group, dtype):
    batch = make_batch(prefix_lens, tree_size, 2 * group, 2, 32, dtype, seed=sum(prefix_lens) + tree_size)
    out = nan_like(batch.q, torch.float32)
    lse = nan_like(batch.q[..., 0], torch.float32)
    prefix_attention(batch.q, batch.k_buffer, batch.v_buffer, batch.kv_indptr, batch.kv_indices,
                     batch.sm_scale, out=out, lse=lse)
    ref_o, ref_lse = prefix_only_reference(batch)
    assert max_err(out, ref_o) <= TOL[dtype] / 2
    assert max_err(lse, lse_natural_to_base2(ref_lse)) <= 1e-3
    # requests with an empty prefix: no contribution
    T = tree_size
    for b, n in enumerate(prefix_lens):
        if n == 0:
            assert torch.isneginf(lse[b * T : (b + 1) * T]).all()
            assert torch.equal(out[b * T : (b + 1) * T], torch.zeros_like(out[b * T : (b + 1) * T]))


@pytest.mark.parametrize("num_splits", [1, 3, 16])
def test_split_count_does_not_change_the_result(num_splits):
    """Uneven and empty chunks (more splits than key tiles) merge back to the one-pass result."""
    batch = make_batch([777, 5, 1200], 3, 8, 2, 16, torch.float16, seed=num_splits)
    cfg = prefix_kernel_config(3, 2, 12, 16, DEVICE, num_splits=num_splits, block_m=16, block_n=64)
    assert cfg.num_splits == num_splits
    part_o = torch.full((9, 8, num_splits, 16), float("nan"), device=DEVICE)
    part_lse = torch.full((9, 8, num_splits), float("nan"), device=DEVICE)
    prefix_attention_partials(batch.q, batch.k_buffer, batch.v_buffer, batch.kv_indptr, batch.kv_indices,
                              3, part_o, part_lse, batch.sm_scale, cfg)
    assert not torch.isnan(part_o).any() and not torch.isnan(part_lse).any()
    out, lse = merge_split_states(part_o, part_lse, out_lse=torch.empty(9, 8, device=DEVICE))
    ref_o, ref_lse = prefix_only_reference(batch)
    assert max_err(out, ref_o) <= TOL[torch.float16]
    assert max_err(lse, lse_natural_to_base2(ref_lse)) <= 1e-3


def test_row_tiles_smaller_than_rows():
    """T*G rows spread over several row tiles of one KV chunk."""
    batch = make_batch([1500, 64], 10, 8, 1, 32, torch.bfloat16, seed=11)
    cfg = PrefixKernelConfig(block_m=16, block_n=64, num_warps=4, num_stages=2, num_splits=2)
    out = nan_like(batch.q, torch.float32)
    prefix_attention(batch.q, batch.k_buffer, batch.v_buffer, batch.kv_indptr, batch.kv_indices,
                     batch.sm_scale, config=cfg, out=out)
    ref_o, _ = prefix_only_reference(batch)
    assert max_err(out, ref_o) <= TOL[torch.bfloat16] / 2


def test_head_dim_not_power_of_two():
    batch = make_batch([333], 4, 4, 2, 24, torch.float16, seed=12)
    out = nan_like(batch.q, torch.float32)
    prefix_attention(batch.q, batch.k_buffer, batch.v_buffer, batch.kv_indptr, batch.kv_indices,
                     batch.sm_scale, out=out)
    ref_o, _ = prefix_only_reference(batch)
    assert max_err(out, ref_o) <= TOL[torch.float16]


def test_split_heuristic_bounds():
    cfg = prefix_kernel_config(1, 8, 256, 128, torch.device("cpu"), max_prefix_len=100)
    assert cfg.num_splits == 1
    cfg = prefix_kernel_config(1, 8, 64, 128, torch.device("cpu"), num_splits=1000)
    assert 1 <= cfg.num_splits <= 64
