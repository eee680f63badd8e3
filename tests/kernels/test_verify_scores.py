"""Verification-guided selection scores (SpecAttn) from the verify kernels against the fp32 reference.

The fused output of the Triton prefix pass, the stand-alone key-only kernel, and the hybrid
verify's ``run(scores=...)`` must all equal :func:`prefix_logit_scores_reference`, leave the
entries past each prefix alone, and leave the attention output bit-identical.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, make_batch, max_err, nan_like
from sgl_longgen.kernels.hybrid import HybridTreeAttention
from sgl_longgen.kernels.prefix_attention import (
    prefix_attention,
    prefix_attention_partials,
    prefix_kernel_config,
)
from sgl_longgen.kernels.reference import prefix_logit_scores_reference
from sgl_longgen.kernels.verify_scores import prefix_logit_scores

SENTINEL = 1234.5  # what the kernels must leave past a request's prefix
TOL = 1e-4  # fp32 logits of exactly representable inputs: accumulation order only


def sentinel_scores(batch, extra: int = 7) -> torch.Tensor:
    n = max(batch.prefix_lens) + extra
    return torch.full((len(batch.prefix_lens), batch.k_buffer.shape[1], n), SENTINEL, device=DEVICE)


def check(scores: torch.Tensor, batch, score_rows: int) -> None:
    ref = prefix_logit_scores_reference(batch.q, batch.k_buffer, batch.kv_indptr, batch.kv_indices,
                                        score_rows, batch.sm_scale)
    for b, n in enumerate(batch.prefix_lens):
        assert max_err(scores[b, :, :n], ref[b, :, :n]) <= TOL
        assert (scores[b, :, n:] == SENTINEL).all()


CASES = [  # (prefix lens, tree size, group, kv heads, head dim, dtype, score rows)
    ([0, 1, 700], 5, 4, 2, 32, torch.bfloat16, 2),
    ([513], 2, 1, 1, 16, torch.float16, 2),
    ([300, 45], 9, 8, 2, 24, torch.float32, 2),  # head dim padded to 32
    ([1000], 1, 4, 2, 32, torch.bfloat16, 1),  # a root-only tree scores with its one row
    ([257, 90], 6, 2, 3, 32, torch.float16, 3),
]


@pytest.mark.parametrize("prefix_lens,tree_size,group,kv_heads,head_dim,dtype,score_rows", CASES)
def test_fused_prefix_scores_match_the_reference(prefix_lens, tree_size, group, kv_heads, head_dim, dtype, score_rows):
    batch = make_batch(prefix_lens, tree_size, group * kv_heads, kv_heads, head_dim, dtype, seed=len(CASES) + tree_size)
    scores = sentinel_scores(batch)
    out = nan_like(batch.q, torch.float32)
    lse = nan_like(batch.q[..., 0], torch.float32)
    prefix_attention(batch.q, batch.k_buffer, batch.v_buffer, batch.kv_indptr, batch.kv_indices, batch.sm_scale,
                     out=out, lse=lse, scores=scores, score_rows=score_rows)
    check(scores, batch, score_rows)
    # The attention itself is unchanged by the extra output.
    out0, lse0 = prefix_attention(batch.q, batch.k_buffer, batch.v_buffer, batch.kv_indptr, batch.kv_indices,
                                  batch.sm_scale, out=nan_like(out), lse=nan_like(lse))
    assert torch.equal(out, out0) and torch.equal(lse, lse0)


@pytest.mark.parametrize("num_splits,block_m", [(1, 16), (5, 16), (3, 32)])
def test_fused_scores_with_split_chunks_and_several_row_tiles(num_splits, block_m):
    """Every key is in one chunk; the score rows sit in the first of several row tiles."""
    batch = make_batch([611, 64, 3], 7, 8, 2, 16, torch.float16, seed=num_splits)  # 7*4 = 28 rows per KV head
    cfg = prefix_kernel_config(3, 2, 28, 16, DEVICE, num_splits=num_splits, block_m=block_m, block_n=64)
    part_o = torch.empty(21, 8, num_splits, 16, device=DEVICE)
    part_lse = torch.empty(21, 8, num_splits, device=DEVICE)
    scores = sentinel_scores(batch)
    prefix_attention_partials(batch.q, batch.k_buffer, batch.v_buffer, batch.kv_indptr, batch.kv_indices, 7,
                              part_o, part_lse, batch.sm_scale, cfg, scores=scores, score_rows=2)
    check(scores, batch, 2)


def test_score_rows_must_fit_the_first_row_tile():
    batch = make_batch([40], 3, 16, 1, 16, torch.float16, seed=3)
    cfg = prefix_kernel_config(1, 1, 48, 16, DEVICE, block_m=16, num_splits=1)
    with pytest.raises(ValueError, match="do not fit one row tile"):
        prefix_attention_partials(batch.q, batch.k_buffer, batch.v_buffer, batch.kv_indptr, batch.kv_indices, 3,
                                  torch.empty(3, 16, 1, 16), torch.empty(3, 16, 1), batch.sm_scale, cfg,
                                  scores=sentinel_scores(batch), score_rows=2)
    assert prefix_kernel_config(1, 1, 48, 16, DEVICE, min_block_m=32).block_m >= 32


@pytest.mark.parametrize("prefix_lens,tree_size,group,kv_heads,head_dim,dtype,score_rows", CASES)
def test_stand_alone_kernel_matches_the_reference(prefix_lens, tree_size, group, kv_heads, head_dim, dtype,
                                                  score_rows):
    batch = make_batch(prefix_lens, tree_size, group * kv_heads, kv_heads, head_dim, dtype, seed=tree_size)
    scores = sentinel_scores(batch)
    prefix_logit_scores(batch.q, batch.k_buffer, batch.kv_indptr, batch.kv_indices, scores, batch.sm_scale,
                        score_rows=score_rows, block_n=64, num_programs=3)
    check(scores, batch, score_rows)


def test_the_reference_averages_each_rows_logits_over_rows_and_the_kv_heads_queries():
    """The oracle itself, on one key by hand: row 0 and row 1, query heads 2 and 3 of KV head 1."""
    batch = make_batch([5], 3, 4, 2, 16, torch.float32, seed=9)
    ref = prefix_logit_scores_reference(batch.q, batch.k_buffer, batch.kv_indptr, batch.kv_indices, 2, batch.sm_scale)
    k = batch.k_buffer[batch.kv_indices[4].long(), 1]
    want = sum(float(batch.q[t, h] @ k) for t in (0, 1) for h in (2, 3)) / 4 * batch.sm_scale
    assert abs(float(ref[0, 1, 4]) - want) < 1e-5


def test_hybrid_verify_writes_scores_without_changing_its_output():
    batch = make_batch([333, 0, 129], 6, 8, 2, 32, torch.bfloat16, seed=21)
    attn = HybridTreeAttention(8, 2, 32, DEVICE, prefix_backend="triton")
    attn.plan(batch.kv_indptr, batch.kv_indices, batch.tree_mask, sm_scale=batch.sm_scale, q_dtype=batch.q.dtype,
              score_rows=2)
    scores = sentinel_scores(batch)
    out = attn.run(batch.q, batch.k_buffer, batch.v_buffer, batch.k_tree, batch.v_tree, scores=scores)
    check(scores, batch, 2)
    plain = attn.run(batch.q, batch.k_buffer, batch.v_buffer, batch.k_tree, batch.v_tree)
    assert torch.equal(out, plain)
