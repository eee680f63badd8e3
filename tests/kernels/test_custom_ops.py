"""The drafters' kernels as custom ops (``kernels/custom_ops.py``): Dynamo traces a function that
calls them as one graph (``fullgraph=True`` fails on any graph break), and the traced function
gives what the kernels give when called directly. Without a trace the wrappers are the kernels."""

from __future__ import annotations

import torch
from sgl_longgen.kernels import custom_ops
from sgl_longgen.kernels.fp8_gemm import fp8_gemm, partial_splits
from sgl_longgen.kernels.longspec_topk import log_softmax_topk
from sgl_longgen.kernels.masked_attention import masked_attention, masked_attention_into
from sgl_longgen.kernels.prefix_attention import prefix_attention

from sgl_longgen.core.fp8 import quantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def traced(fn):
    """``fn`` traced whole by Dynamo (no inductor: the trace, not code generation, is under test)."""
    torch._dynamo.reset()
    return torch.compile(fn, backend="eager", fullgraph=True)


def test_the_fp8_gemm_is_one_node_of_a_trace():
    g = torch.Generator().manual_seed(0)
    q, scale = quantize(torch.randn(48, 64, generator=g))
    x = torch.randn(2, 3, 64, generator=g)
    q, scale, x = q.to(DEVICE), scale.to(DEVICE), x.to(DEVICE)

    def step(x):
        return torch.relu(custom_ops.fp8_gemm(x * 2, q, scale)) + 1

    want = torch.relu(fp8_gemm(x * 2, q, scale)) + 1
    assert torch.equal(step(x), want)
    out = traced(step)(x)
    assert out.shape == (2, 3, 48) and torch.equal(out, want)


def test_the_fp8_gemms_partial_sums_are_one_node_of_a_trace():
    """The split GEMM's partial sums: the fake promises the table's split (from the shapes alone),
    the run gives it, and the sum traced after them is the product."""
    g = torch.Generator().manual_seed(4)
    q, scale = quantize(torch.randn(64, 4096, generator=g))
    x = torch.randn(2, 8, 4096, generator=g)
    q, scale, x = q.to(DEVICE), scale.to(DEVICE), x.to(DEVICE)

    def step(x):
        parts = custom_ops.fp8_gemm_parts(x * 2, q, scale)
        return parts, (parts.sum(0) * scale).to(x.dtype)

    splits = partial_splits(16, 64, 4096, x.device)
    assert splits > 1  # one row block, a long K: the table splits it
    parts, out = traced(step)(x)
    assert parts.shape == (splits, 2, 8, 64) and torch.equal(parts, fp8_gemm(x * 2, q, scale, parts=True))
    torch.testing.assert_close(out, fp8_gemm(x * 2, q, scale), rtol=1e-5, atol=1e-5)


def test_prefix_attention_is_one_node_of_a_trace():
    g = torch.Generator().manual_seed(1)
    k = torch.randn(40, 2, 16, generator=g).to(DEVICE)
    v = torch.randn(40, 2, 16, generator=g).to(DEVICE)
    indptr = torch.tensor([0, 7, 19], dtype=torch.int32, device=DEVICE)
    indices = torch.randperm(40, generator=g)[:19].to(torch.int32).to(DEVICE)
    q = torch.randn(2 * 3, 4, 16, generator=g).to(DEVICE)

    def attend(q):
        out, lse = custom_ops.prefix_attention(q.contiguous(), k, v, indptr, indices, 0.25)
        return out * 2, lse

    want_out, want_lse = prefix_attention(q, k, v, indptr, indices, 0.25)
    out, lse = traced(attend)(q)
    assert torch.equal(out, want_out * 2) and torch.equal(lse, want_lse)


def test_the_top_k_is_one_node_of_a_trace():
    logits = torch.randn(3, 5, 300, generator=torch.Generator().manual_seed(2)).to(DEVICE)

    def top(logits):
        values, ids = custom_ops.log_softmax_topk(logits * 0.5, 4)
        return values.exp(), ids

    want_v, want_i = log_softmax_topk(logits * 0.5, 4)
    values, ids = traced(top)(logits)
    assert ids.dtype == torch.int64 and torch.equal(ids, want_i) and torch.equal(values, want_v.exp())


def test_the_window_attention_is_one_node_of_a_trace():
    g = torch.Generator().manual_seed(3)
    qk = torch.randn(2, 4, 6, 16, generator=g).to(DEVICE)  # 4 query heads, 2 KV heads' keys after them
    keys = torch.randn(2, 2, 40, 16, generator=g).to(DEVICE)[:, :, :33]
    values = torch.randn(2, 2, 40, 16, generator=g).to(DEVICE)[:, :, :33]
    mask = (torch.rand(2, 4, 33, generator=g) < 0.5).to(DEVICE)
    mask[..., 0] = True

    def attend(qk):
        return custom_ops.masked_attention(qk[:, :, :4], keys, values, mask, 0.25) * 2

    want = masked_attention(qk[:, :, :4], keys, values, mask, 0.25) * 2
    assert torch.equal(traced(attend)(qk), want)


def test_the_level_pick_is_one_node_of_a_trace():
    from sgl_longgen.kernels.longspec_topk import best_of_rows

    g = torch.Generator().manual_seed(4)
    top = torch.randn(2, 4, 3, generator=g).to(DEVICE)
    ids = torch.randint(0, 100, (2, 4, 3), generator=g).to(DEVICE)
    parents = torch.randn(2, 4, generator=g).to(DEVICE)

    def pick(parents):
        score, token, row = custom_ops.best_of_rows(parents * 2, top, ids, 5)
        return score + 1, token, row

    want = best_of_rows(parents * 2, top, ids, 5)
    score, token, row = traced(pick)(parents)
    assert torch.equal(score, want[0] + 1) and torch.equal(token, want[1]) and torch.equal(row, want[2])


def test_the_beams_cut_is_one_node_of_a_trace():
    from sgl_longgen.kernels.longspec_topk import cut_beam

    g = torch.Generator().manual_seed(5)
    scores = -torch.rand(2, 9, generator=g).to(DEVICE)
    tokens = torch.randint(0, 100, (2, 9), generator=g).to(DEVICE)
    parents = torch.tensor([[-1, -1, 0, 0, 1, 2, 2, 3, 4]] * 2, device=DEVICE)
    depths = torch.tensor([1, 1, 2, 2, 2, 3, 3, 3, 3], device=DEVICE)

    def cut(scores):
        ints, kept = custom_ops.cut_beam(scores * 2, tokens, parents, depths, 6)
        return ints + 1, kept

    want = cut_beam(scores * 2, tokens, parents, depths, 6)
    ints, kept = traced(cut)(scores)
    assert torch.equal(ints, want[0] + 1) and torch.equal(kept, want[1])


def test_the_level_attention_writing_its_buffers_is_one_node_of_a_trace():
    """Two levels in a row, each writing its rows into the buffers the next one reads: the trace
    (its op declared as writing them) gives the direct calls' outputs and leaves the same buffers."""
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(1, 4, 8, 16, generator=g).to(DEVICE)  # 4 query heads, then 2 KV heads' keys and values
    buffers = torch.randn(2, 1, 2, 40, 16, generator=g).to(DEVICE)
    ring = (torch.rand(1, 24, generator=g) < 0.6).to(DEVICE)
    tree1 = torch.ones(1, 2, 2, dtype=torch.bool, device=DEVICE)
    tree2 = (torch.rand(1, 2, 4, generator=g) < 0.5).to(DEVICE)
    tree2[..., 2:] = True

    def levels(qkv, keys, values):
        q, k, v = qkv[:, :, :4], qkv[:, :, 4:6], qkv[:, :, 6:]
        a = custom_ops.masked_attention_into(q[:, :2], keys, values, k[:, :2], v[:, :2], 24, ring, tree1, 0.25)
        b = custom_ops.masked_attention_into(q[:, 2:] * 2, keys, values, k[:, 2:], v[:, 2:], 26, ring, tree2, 0.25)
        return a, b

    keys, values = buffers.clone()
    want = levels(qkv, keys, values)
    keys2, values2 = buffers.clone()
    got = traced(levels)(qkv, keys2, values2)
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    assert torch.equal(keys2, keys) and torch.equal(values2, values) and not torch.equal(keys, buffers[0])
