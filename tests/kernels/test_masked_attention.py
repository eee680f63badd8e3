"""LongSpec's window self-attention (compiled on a GPU, interpreted on a CPU) against its PyTorch
twin: strided queries, key/value slices of larger buffers, sparse bool masks, GQA folded into rows,
zeros for a row that sees nothing."""

from __future__ import annotations

import pytest
import torch

from sgl_longgen.kernels.masked_attention import (
    MAX_NEW_ROWS,
    masked_attention,
    masked_attention_into,
    masked_attention_into_reference,
    masked_attention_reference,
)

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


def level_inputs(B, Hkv, group, W, lo, T, D, dtype, seed):
    """A LongSpec level's operands: buffers of W ring columns, ``lo`` earlier tree columns and room
    for more; the level's T rows (queries a slice of a fused projection, keys/values token-major
    slices); a ring mask per request and a tree mask with each row's own column visible."""
    g = torch.Generator().manual_seed(seed)
    H = Hkv * group
    qkv = torch.randn(B, T, H + 2 * Hkv, D, generator=g)
    keys, values = torch.randn(2, B, Hkv, W + lo + T + 9, D, generator=g)
    ring = torch.rand(B, W, generator=g) < 0.7
    tree = torch.rand(B, T, lo + T, generator=g) < 0.4
    tree[:, torch.arange(T), lo + torch.arange(T)] = True
    qkv, keys, values = (x.to(dtype).to(DEVICE) for x in (qkv, keys, values))
    return (qkv[:, :, :H], keys, values, qkv[:, :, H : H + Hkv], qkv[:, :, H + Hkv :], W + lo, ring.to(DEVICE),
            tree.to(DEVICE), D ** -0.5)


@pytest.mark.parametrize("B,Hkv,group,W,lo,T,D,dtype", [
    (1, 1, 4, 64, 0, 4, 64, torch.float32),  # the first level after the root: no earlier tree rows
    (2, 2, 2, 40, 4, 16, 32, torch.float32),  # a ring that is no whole number of key tiles
    (1, 2, 4, 128, 20, 16, 128, torch.bfloat16),
    (2, 8, 4, 512, 36, 16, 128, torch.bfloat16),  # production: a 512 ring, the fourth level
])
def test_writing_into_the_buffer_and_attending_is_its_twin(B, Hkv, group, W, lo, T, D, dtype):
    """The kernel's attention is the twin's (rows written, mask concatenated, SDPA); after it the
    buffers hold the new rows at ``at .. at + T`` and nothing else changed."""
    q, keys, values, new_k, new_v, at, ring, tree, scale = level_inputs(B, Hkv, group, W, lo, T, D, dtype, W + lo)
    k2, v2 = keys.clone(), values.clone()
    out = masked_attention_into(q, keys, values, new_k, new_v, at, ring, tree, scale)
    want = masked_attention_into_reference(q, k2, v2, new_k, new_v, at, ring, tree, scale)
    assert out.shape == (B, T, q.shape[2] * D) and close(out, want, dtype), (out.float() - want.float()).abs().max()
    assert torch.equal(keys, k2) and torch.equal(values, v2)
    assert torch.equal(keys[:, :, at : at + T], new_k.transpose(1, 2))


@pytest.mark.parametrize("ring_splits", [1, 2, 3, 16])
def test_a_ring_cut_among_programs_is_the_ring_walked_whole(ring_splits):
    """The ring's columns cut among programs (partial states merged by log-sum-exp) give the
    twin's attention and write the rows once, also where a whole split sees nothing (its first
    half hidden from every row) and where more splits are asked for than the ring has tiles."""
    q, keys, values, new_k, new_v, at, ring, tree, scale = level_inputs(2, 2, 4, 300, 12, 8, 32, torch.float32, 5)
    ring[0, :160] = False
    k2, v2 = keys.clone(), values.clone()
    out = masked_attention_into(q, keys, values, new_k, new_v, at, ring, tree, scale, ring_splits=ring_splits)
    want = masked_attention_into_reference(q, k2, v2, new_k, new_v, at, ring, tree, scale)
    assert close(out, want, torch.float32), (out - want).abs().max()
    assert torch.equal(keys, k2) and torch.equal(values, v2)
    wrong = ring.clone()
    wrong[1, (~wrong[1]).nonzero()[0, 0]] = True  # one hidden ring key, in the first split, made visible
    bad = masked_attention_into_reference(q, keys.clone(), values.clone(), new_k, new_v, at, wrong, tree, scale)
    assert (out - bad).abs().max() > 100 * TOL[torch.float32]


def test_the_next_level_reads_the_rows_the_last_one_wrote():
    """Two levels in a row: the second's keys before ``at`` include the first's rows, written by the
    first call (the twin does the same through its own writes)."""
    q, keys, values, new_k, new_v, at, ring, tree, scale = level_inputs(1, 2, 2, 32, 0, 4, 32, torch.float32, 1)
    q2, _, _, new_k2, new_v2, _, _, tree2, _ = level_inputs(1, 2, 2, 32, 4, 8, 32, torch.float32, 2)
    k2, v2 = keys.clone(), values.clone()
    masked_attention_into(q, keys, values, new_k, new_v, at, ring, tree, scale)
    masked_attention_into_reference(q, k2, v2, new_k, new_v, at, ring, tree, scale)
    out = masked_attention_into(q2, keys, values, new_k2, new_v2, at + 4, ring, tree2, scale)
    want = masked_attention_into_reference(q2, k2, v2, new_k2, new_v2, at + 4, ring, tree2, scale)
    assert close(out, want, torch.float32) and torch.equal(keys, k2)


def test_a_flipped_ring_or_tree_entry_is_caught():
    """The mask is read where each walk belongs: one hidden key made visible, in the ring, among the
    tree's earlier rows or among the level's new rows, moves the output well past the tolerance."""
    lo, T = 4, 4
    q, keys, values, new_k, new_v, at, ring, tree, scale = level_inputs(1, 1, 4, 48, lo, T, 32, torch.float32, 3)
    out = masked_attention_into(q, keys.clone(), values.clone(), new_k, new_v, at, ring, tree, scale)
    for piece, columns in (("ring", None), ("earlier rows", range(lo)), ("new rows", range(lo, lo + T))):
        r, t = ring.clone(), tree.clone()
        if columns is None:
            r[0, (~r[0]).nonzero()[0, 0]] = True
        else:
            row, col = next((i, c) for i in range(T) for c in columns if not t[0, i, c])
            t[0, row, col] = True
        wrong = masked_attention_into_reference(q, keys.clone(), values.clone(), new_k, new_v, at, r, t, scale)
        assert (out - wrong).abs().max() > 100 * TOL[torch.float32], piece


def test_bad_level_inputs_are_refused():
    q, keys, values, new_k, new_v, at, ring, tree, scale = level_inputs(1, 2, 2, 16, 4, 4, 16, torch.float32, 4)
    bad = [
        ((q, keys, values, new_k[:, :2], new_v, at, ring, tree), "new_k/new_v must be"),
        ((q, keys, values, new_k, new_v, at, ring[:, :8], tree), "ring_mask"),
        ((q, keys, values, new_k, new_v, at + 1, ring, tree), "ring_mask"),
        ((q, keys[:, :, :22], values[:, :, :22], new_k, new_v, at, ring, tree), "fewer than at"),
        ((q, keys, values, new_k, new_v, at, ring.float(), tree), "masks bool"),
    ]
    wide = level_inputs(1, 1, 1, 8, 0, MAX_NEW_ROWS + 1, 16, torch.float32, 5)
    bad.append((wide[:-1], "new rows a call"))
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            masked_attention_into(*args, scale)


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor's Triton code needs a GPU")
def test_compiled_levels_write_the_buffers_they_read():
    """Two levels compiled by inductor, the buffers a concatenation inside the step (as LongSpec's
    are): the op declared as writing them, the compiled step gives the eager step's outputs."""
    from sgl_longgen.kernels import custom_ops

    q1, keys, values, k1, v1, at, ring, tree1, scale = level_inputs(1, 8, 4, 512, 0, 4, 128, torch.bfloat16, 8)
    q2, _, _, k2, v2, _, _, tree2, _ = level_inputs(1, 8, 4, 512, 4, 16, 128, torch.bfloat16, 9)
    ring_kv = keys[:, :, :512].clone(), values[:, :, :512].clone()
    pad = torch.zeros(1, 8, 20, 128, device=DEVICE, dtype=torch.bfloat16)

    def step(ring_k, ring_v, q1, q2):
        keys, values = torch.cat([ring_k, pad], dim=2), torch.cat([ring_v, pad], dim=2)
        a = custom_ops.masked_attention_into(q1 * 1.5, keys, values, k1, v1, 512, ring, tree1, scale)
        b = custom_ops.masked_attention_into(q2, keys, values, k2 * 0.5, v2, 516, ring, tree2, scale)
        return a, b, keys[:, :, 512:].clone()

    want = step(*ring_kv, q1, q2)
    torch._dynamo.reset()
    got = torch.compile(step, dynamic=False, fullgraph=True)(*ring_kv, q1, q2)
    for x, y in zip(got, want):
        assert close(x, y, torch.bfloat16)
    torch._dynamo.reset()
