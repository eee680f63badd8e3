"""The fused OWL beam proposes the PyTorch beam's tree (compiled on a GPU, interpreted on a CPU)."""

from __future__ import annotations

import pytest
import torch

from sgl_longgen.core.owl import GraphedExpand, OwlDrafter, expand, quantize_fp8
from sgl_longgen.kernels.owl_beam import fused_expand

D0, VOCAB, WIDTH = 32, 300, 48
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def make_drafter(seed: int, *, spec: bool = True, draft_vocab: int | None = None, vocab: int = VOCAB,
                 dtype=torch.float32) -> OwlDrafter:
    g = torch.Generator().manual_seed(seed)
    d = OwlDrafter(D0, vocab, WIDTH, n_steps=4, spec=spec, draft_vocab_size=draft_vocab)
    d.reset_parameters(g)
    if draft_vocab is not None:
        d.set_token_map(torch.randperm(vocab, generator=g)[:draft_vocab])
    with torch.no_grad():  # norms away from (1, 0), so a wrong norm kernel shows
        for norm in (d.cell_norm, d.state_norm):
            norm.weight.uniform_(0.5, 1.5, generator=g)
            norm.bias.normal_(0.0, 0.1, generator=g)
    return d.to(device=DEVICE, dtype=dtype).eval()


def inputs(seed: int, B: int):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, D0, generator=g).to(DEVICE)
    hs = torch.randn(B, D0, generator=g).to(DEVICE)
    roots = torch.randint(0, VOCAB, (B,), generator=g).to(DEVICE)
    has = (torch.arange(B) % 2 == 0).to(DEVICE)
    return h, hs, roots, has


def assert_same_beam(a, b):
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.parents, b.parents)
    assert torch.equal(a.depths, b.depths)
    torch.testing.assert_close(a.scores, b.scores, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("draft_vocab", [None, 150])
@pytest.mark.parametrize("spec_args", ["mixed", "none", "all"])
def test_fused_beam_matches_the_pytorch_beam(draft_vocab, spec_args):
    d = make_drafter(1, draft_vocab=draft_vocab)
    h, hs, roots, has = inputs(2, 3)
    spec = {"mixed": (hs, has), "none": (None, None), "all": (hs, None)}[spec_args]
    shape = dict(top_k=4, depth=4, tree_size=12)
    assert_same_beam(fused_expand(d, h, roots, *spec, **shape), expand(d, h, roots, *spec, **shape))


@pytest.mark.parametrize("shape", [
    dict(top_k=3, depth=1, tree_size=2),  # one level: no frontier
    dict(top_k=5, depth=3, tree_size=500),  # the whole pool
    dict(top_k=6, depth=3, tree_size=9),  # top-k wider than the 4-token draft vocabulary
])
def test_fused_beam_edge_shapes(shape):
    d = make_drafter(3, draft_vocab=4 if shape["top_k"] == 6 else None, spec=False)
    h, _, roots, _ = inputs(4, 2)
    assert_same_beam(fused_expand(d, h, roots, **shape), expand(d, h, roots, **shape))


def test_fused_beam_over_several_vocabulary_chunks():
    # 5000 rows: three top-k chunks, the last one partly filled.
    d = make_drafter(5, draft_vocab=5000, vocab=6000)
    h, hs, roots, has = inputs(6, 2)
    shape = dict(top_k=3, depth=3, tree_size=10)
    assert_same_beam(fused_expand(d, h, roots, hs, has, **shape), expand(d, h, roots, hs, has, **shape))


@pytest.mark.parametrize("draft_vocab", [None, 150])
def test_fused_beam_with_fp8_weights_matches_the_pytorch_beam(draft_vocab):
    """Both beams multiply by the same fp8 projections and head (the fp8 GEMM where the device has
    it, the twin elsewhere)."""
    d = quantize_fp8(make_drafter(12, draft_vocab=draft_vocab))
    h, hs, roots, has = inputs(13, 3)
    shape = {"top_k": 4, "depth": 4, "tree_size": 12}
    assert_same_beam(fused_expand(d, h, roots, hs, has, **shape), expand(d, h, roots, hs, has, **shape))


@gpu
def test_fused_beam_replays_as_a_cuda_graph():
    d = make_drafter(7, draft_vocab=150)
    h, hs, roots, has = inputs(8, 2)
    shape = dict(top_k=4, depth=4, tree_size=12)
    graphed = GraphedExpand(d, **shape, fast=fused_expand)
    for seed in (8, 9):  # the second call replays the graph on new inputs
        h, hs, roots, has = inputs(seed, 2)
        assert_same_beam(graphed(h, roots, hs, has), expand(d, h, roots, hs, has, **shape))


@gpu
def test_fused_bf16_beam_mostly_agrees_with_the_pytorch_beam():
    # bf16 rounding of transcendental functions may flip near-ties; most nodes must agree.
    d = make_drafter(10, draft_vocab=150, dtype=torch.bfloat16)
    h, hs, roots, has = inputs(11, 4)
    shape = dict(top_k=4, depth=4, tree_size=12)
    a, b = fused_expand(d, h, roots, hs, has, **shape), expand(d, h, roots, hs, has, **shape)
    assert (a.tokens == b.tokens).float().mean() >= 0.8
    assert (a.parents < torch.arange(a.size, device=a.parents.device)).all()  # parents come first
