"""LongSpec's window self-attention (compiled on a GPU, interpreted on a CPU) against its PyTorch
twin: strided queries, key/value slices of larger buffers, sparse bool masks, GQA folded into rows,
zeros for a row that sees nothing."""

from __future__ import annotations

import pytest
import torch

from sgl_longgen.kernels.masked_attention import masked_attention, masked_attention_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def make_inputs(B, T, H, Hkv, S, D, dtype, seed, density=0.1):
    """q a head slice of a fused [B, T, H + Hkv, D] projection, keys/values the first S positions of
    [B, Hkv, S + 13, D] buffers (so their S stride is not S*D), a sparse mask with >= 1 True a row."""
    g = torch.Generator().manual_seed(seed)
    qk = torch.randn(B, T, H + Hkv, D, generator=g) * 2
    kbuf, vbuf = torch.randn(2, B, Hkv, S + 13, D, generator=g)
    mask = torch.rand(B, T, S, generator=g) < density
    mask[torch.arange(B)[:, None], torch.arange(T), torch.randint(0, S, (B, T), generator=g)] = True
    qk, kbuf, vbuf = (x.to(dtype).to(DEVICE) for x in (qk, kbuf, vbuf))
    return qk[:, :, :H], kbuf[:, :, :S], vbuf[:, :, :S], mask.to(DEVICE), D ** -0.5


def close(a, b, dtype):
    return torch.allclose(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])


CASES = [  # (B, T, H, Hkv, S, D, dtype)
    (2, 1, 2, 2, 7, 64, torch.float32),
    (1, 4, 4, 1, 64, 128, torch.float32),
    (1, 16, 4, 1, 575, 64, torch.float32),
    (2, 16, 8, 1, 100, 32, torch.float32),  # T * GROUP = 128 rows: two row blocks
    (2, 4, 8, 2, 575, 128, torch.bfloat16),
    (1, 16, 4, 1, 575, 128, torch.bfloat16),
    (3, 1, 4, 1, 64, 64, torch.bfloat16),
    (1, 16, 2, 2, 7, 64, torch.float16),
    (1, 4, 6, 2, 33, 80, torch.float32),  # GROUP 3, a head dim that is not a power of two
    (2, 16, 32, 8, 575, 128, torch.bfloat16),  # production
]


@pytest.mark.parametrize("B,T,H,Hkv,S,D,dtype", CASES)
def test_the_kernel_is_its_twin(B, T, H, Hkv, S, D, dtype):
    q, keys, values, mask, scale = make_inputs(B, T, H, Hkv, S, D, dtype, seed=S + T + D)
    assert keys.stride(2) == D and keys.stride(1) == (S + 13) * D and q.stride(1) == (H + Hkv) * D
    out = masked_attention(q, keys, values, mask, scale)
    want = masked_attention_reference(q, keys, values, mask, scale)
    assert out.shape == (B, T, H * D) and out.dtype == dtype and out.is_contiguous()
    assert close(out, want, dtype), (out.float() - want.float()).abs().max().item()


def test_a_dense_mask_and_a_strided_mask():
    """Every key visible (one long softmax over several tiles), and a mask that is a column slice."""
    q, keys, values, _, scale = make_inputs(1, 4, 4, 1, 130, 32, torch.float32, seed=1)
    dense = torch.ones(1, 4, 130, dtype=torch.bool, device=DEVICE)
    assert close(masked_attention(q, keys, values, dense, scale),
                 masked_attention_reference(q, keys, values, dense, scale), torch.float32)
    wide = torch.rand(1, 4, 200, device=DEVICE) < 0.3
    wide[..., 0] = True
    sliced = wide[:, :, :130]
    assert close(masked_attention(q, keys, values, sliced, scale),
                 masked_attention_reference(q, keys, values, sliced, scale), torch.float32)


def test_a_fully_masked_row_gives_zeros():
    q, keys, values, mask, scale = make_inputs(2, 4, 4, 2, 70, 32, torch.float32, seed=2)
    mask[1, 2] = False
    out = masked_attention(q, keys, values, mask, scale)
    want = masked_attention_reference(q, keys, values, mask, scale)
    assert torch.equal(out[1, 2], torch.zeros_like(out[1, 2])) and not out.isnan().any()
    assert torch.equal(want[1, 2], torch.zeros_like(want[1, 2]))
    assert close(out, want, torch.float32)


def test_one_wrong_mask_entry_is_caught():
    """The tolerance separates the right mask from one with a single entry flipped, so the twin test
    can fail: the hidden key that head 0 of row 0 would score highest is made visible."""
    q, keys, values, mask, scale = make_inputs(1, 4, 4, 1, 64, 32, torch.float32, seed=3)
    out = masked_attention(q, keys, values, mask, scale)
    scores = (q[0, 0, 0] @ keys[0, 0].T).masked_fill(mask[0, 0], float("-inf"))
    wrong = mask.clone()
    wrong[0, 0, scores.argmax()] = True
    assert close(out, masked_attention_reference(q, keys, values, mask, scale), torch.float32)
    assert (out - masked_attention_reference(q, keys, values, wrong, scale)).abs().max() > 100 * TOL[torch.float32]


def test_float64_goes_through_the_twin():
    q, keys, values, mask, scale = make_inputs(1, 4, 4, 2, 9, 16, torch.float64, seed=4)
    assert torch.equal(masked_attention(q, keys, values, mask, scale),
                       masked_attention_reference(q, keys, values, mask, scale))


def test_bad_inputs_are_refused():
    q, keys, values, mask, scale = make_inputs(1, 4, 4, 2, 9, 16, torch.float32, seed=5)
    bad = [
        ((q[0], keys, values, mask), "expected q"),
        ((q, keys.half(), values, mask), "share one dtype"),
        ((q.int(), keys.int(), values.int(), mask), "q must be float16"),
        ((q, keys, values, mask.float()), "mask must be bool"),
        ((q, keys, values[:, :, :8], mask), "keys and values must both be"),
        ((q[:, :, :3], keys, values, mask), "multiple of the 2 KV heads"),
        ((q, keys, values, mask[:, :, :8]), r"mask must be \[B, T, S\]"),
        ((q, keys.transpose(2, 3).contiguous().transpose(2, 3), values, mask), "keys must have a contiguous"),
    ]
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            masked_attention(*args, scale)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_sees_new_inputs():
    q, keys, values, mask, scale = make_inputs(2, 16, 32, 8, 575, 128, torch.bfloat16, seed=6)
    masked_attention(q, keys, values, mask, scale)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = masked_attention(q, keys, values, mask, scale)
    q2, keys2, values2, mask2, _ = make_inputs(2, 16, 32, 8, 575, 128, torch.bfloat16, seed=7)
    for dst, src in ((q, q2), (keys, keys2), (values, values2), (mask, mask2)):
        dst.copy_(src)
    graph.replay()
    assert close(out, masked_attention_reference(q, keys, values, mask, scale), torch.bfloat16)


def test_key_tiles_fit_the_gpus_shared_memory(monkeypatch):
    """The sweep's tiles where they fit (bf16, 128-wide heads on an H200), fewer keys a tile for
    fp32 operands or wider heads (on an H200 fp32 at 128 keys asked 276 KB of 227), and for a GPU
    with less shared memory."""
    from sgl_longgen.kernels import masked_attention as module

    gpu = torch.device("cuda", 0)
    monkeypatch.setitem(module._SMEM, 0, 232448)  # an H200's opt-in shared memory per block
    assert module.key_tiles(gpu, 128, 2) == (module.BLOCK_N, module.NUM_STAGES)
    assert module.key_tiles(gpu, 128, 4) == (64, 3) and module.key_tiles(gpu, 256, 2) == (64, 3)
    monkeypatch.setitem(module._SMEM, 0, 101376)
    block_n, stages = module.key_tiles(gpu, 128, 2)
    assert stages * 2 * block_n * 128 * 2 <= 101376 * 0.85 and block_n >= 16
