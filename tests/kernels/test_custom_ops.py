"""The drafters' kernels as custom ops (``kernels/custom_ops.py``): Dynamo traces a function that
calls them as one graph (``fullgraph=True`` fails on any graph break), and the traced function
gives what the kernels give when called directly. Without a trace the wrappers are the kernels."""

from __future__ import annotations

import torch
from sgl_longgen.kernels import custom_ops
from sgl_longgen.kernels.fp8_gemm import fp8_gemm
from sgl_longgen.kernels.longspec_topk import level_topk
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


def test_the_level_pick_is_one_node_of_a_trace():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 5, 300, generator=g).to(DEVICE)
    parents = torch.randn(3, 5, generator=g).to(DEVICE)

    def top(logits, parents):
        score, token, row = custom_ops.level_topk(logits * 0.5, parents, 4)
        root = custom_ops.level_topk(logits[:, :1], None, 4)
        return score.exp(), token, row, root

    want = level_topk(logits * 0.5, parents, 4)
    score, token, row, root = traced(top)(logits, parents)
    assert token.dtype == row.dtype == torch.int64 and torch.equal(token, want[1]) and torch.equal(row, want[2])
    assert torch.equal(score, want[0].exp())
    assert all(torch.equal(a, b) for a, b in zip(root, level_topk(logits[:, :1], None, 4)))