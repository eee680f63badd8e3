"""GPU acceptance: bf16 hybrid verify attention at Llama-3.1-8B heads vs an fp32 one-pass reference.

Max abs error must stay within 2e-2 for every tree size and prefix path, including prefixes of
0, 1, 4095 and 32768 tokens; FlashInfer's base-2 LSE convention is checked against ours.
"""

from __future__ import annotations

import pytest
import torch

from kernel_cases import make_batch, max_err, nan_like
from sgl_longgen.kernels.folded_decode import flashinfer_available, fold_supported
from sgl_longgen.kernels.hybrid import HybridTreeAttention
from sgl_longgen.kernels.merge import merge_states
from sgl_longgen.kernels.prefix_attention import prefix_attention
from sgl_longgen.kernels.reference import lse_natural_to_base2

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ACCEPT = 2e-2
HQ, HKV, D = 32, 8, 128


@pytest.mark.parametrize("tree_size", [1, 16, 64, 121])
@pytest.mark.parametrize("prefix_backend", ["triton", "flashinfer_fold"])
def test_bf16_matches_fp32_reference(tree_size, prefix_backend):
    if prefix_backend == "flashinfer_fold" and not (
        flashinfer_available() and fold_supported(HQ, HKV, D, tree_size, torch.bfloat16, torch.bfloat16, torch.device("cuda"))
    ):
        pytest.skip("the folded path does not serve this tree size")
    lens = [32768, 4095] if prefix_backend == "triton" else [32768, 1]
    if prefix_backend == "triton" and tree_size == 16:
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
