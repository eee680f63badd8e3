"""The folded FlashInfer path: its query layout (CPU) and its results (GPU with FlashInfer)."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import TOL, make_batch, max_err
from sgl_longgen.kernels.folded_decode import (
    FoldedPrefixDecode,
    flashinfer_available,
    fold_queries,
    fold_supported,
    workspace_bytes,
)
from sgl_longgen.kernels.merge import lse_to_natural
from sgl_longgen.kernels.reference import masked_attention_reference


def unfold_output(o: torch.Tensor, tree_size: int, num_kv_heads: int) -> torch.Tensor:
    """Inverse of ``fold_queries`` for outputs ``[bs, Hkv*T*G, D]`` (a copy)."""
    batch_size, folded, head_dim = o.shape
    group = folded // (num_kv_heads * tree_size)
    return (
        o.reshape(batch_size, num_kv_heads, tree_size, group, head_dim)
        .permute(0, 2, 1, 3, 4)
        .reshape(batch_size * tree_size, num_kv_heads * group, head_dim)
    )


def test_fold_layout():
    bs, T, hkv, G, d = 2, 3, 2, 4, 8
    q = torch.randn(bs * T, hkv * G, d)
    qf = fold_queries(q, bs, T, hkv)
    assert qf.shape == (bs, hkv * T * G, d)
    for b in range(bs):
        for t in range(T):
            for h in range(hkv):
                for g in range(G):
                    assert torch.equal(qf[b, h * (T * G) + t * G + g], q[b * T + t, h * G + g])
    assert torch.equal(unfold_output(qf, T, hkv), q)


def test_fold_limits():
    cpu = torch.device("cpu")
    assert not fold_supported(32, 8, 128, 16, torch.bfloat16, torch.bfloat16, cpu)
    assert workspace_bytes(1, 32, 8, 128, 16, 132) < workspace_bytes(64, 32, 8, 128, 16, 132)
    assert workspace_bytes(1, 32, 8, 128, 8, 132) < workspace_bytes(1, 32, 8, 128, 24, 132)


@pytest.mark.skipif(not (torch.cuda.is_available() and flashinfer_available()), reason="needs CUDA and FlashInfer")
@pytest.mark.parametrize("tree_size", [1, 4, 16, 24])
def test_folded_prefix_matches_reference(tree_size):
    num_q, num_kv, d = 32, 8, 128
    batch = make_batch([3000, 1, 517], tree_size, num_q, num_kv, d, torch.bfloat16, seed=tree_size)
    assert fold_supported(num_q, num_kv, d, tree_size, torch.bfloat16, torch.bfloat16, batch.q.device)
    dec = FoldedPrefixDecode(num_q, num_kv, d, batch.q.device)
    dec.plan(batch.kv_indptr, batch.kv_indices, tree_size, sm_scale=batch.sm_scale, q_dtype=torch.bfloat16)
    o, lse = dec.run(batch.q, batch.k_buffer, batch.v_buffer)
    o = unfold_output(o, tree_size, num_kv)
    lse = unfold_output(lse[..., None], tree_size, num_kv)[..., 0]
    indptr = batch.kv_indptr.tolist()
    for b, n in enumerate(batch.prefix_lens):
        slots = batch.kv_indices[indptr[b] : indptr[b + 1]].long()
        rows = slice(b * tree_size, (b + 1) * tree_size)
        ref_o, ref_lse = masked_attention_reference(
            batch.q[rows], batch.k_buffer[slots], batch.v_buffer[slots],
            torch.ones(tree_size, n, dtype=torch.bool, device=batch.q.device), batch.sm_scale,
        )
        assert max_err(o[rows], ref_o) <= TOL[torch.bfloat16]
        assert max_err(lse_to_natural(lse[rows]), ref_lse) <= 1e-2  # FlashInfer's LSE is base 2
