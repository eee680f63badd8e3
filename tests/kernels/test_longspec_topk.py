"""A LongSpec beam level's pick (compiled on a GPU, interpreted on a CPU) against its PyTorch twin:
the same children (tokens and rows) in the same order, ties lower row then lower token first, the
same scores; and the same level as the PyTorch beam's per-row top-k then best-of-rows."""

from __future__ import annotations

import pytest
import torch

from sgl_longgen.kernels.longspec_topk import chunk_size, level_topk, level_topk_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("B,n,vocab,width", [(1, 1, 50, 4), (2, 16, 300, 16), (1, 3, 5000, 16), (2, 4, 20000, 13),
                                             (1, 2, 8, 16), (1, 16, 33000, 16)])
@pytest.mark.parametrize("parents", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_is_its_twin(B, n, vocab, width, parents, dtype):
    g = torch.Generator().manual_seed(vocab + width)
    logits = (torch.randn(B, n, vocab, generator=g) * 3).to(dtype).to(DEVICE)
    parent = (-torch.rand(B, n, generator=g) * 4).to(DEVICE) if parents else None
    score, token, row = level_topk(logits, parent, width)
    want = level_topk_reference(logits, parent, width)
    assert score.dtype == torch.float32 and token.dtype == row.dtype == torch.int64
    assert score.shape == token.shape == row.shape == (B, width)
    if dtype == torch.float32:  # bf16 logits repeat: tie order is checked below
        assert torch.equal(token, want[1]) and torch.equal(row, want[2])
    assert torch.allclose(score, want[0], atol=1e-5, rtol=1e-5)
    found = token >= 0  # the children's own scores, wherever they rank
    logp = torch.log_softmax(logits.float(), -1)
    own = logp[torch.arange(B, device=DEVICE)[:, None].expand_as(row)[found], row[found], token[found]]
    if parent is not None:
        own = parent.gather(1, row.clamp(min=0))[found] + own
    assert torch.allclose(score[found], own, atol=1e-5)
    assert int(found.sum()) == min(width, n * vocab) * B


def test_ties_go_to_the_lowest_row_then_token_across_chunks():
    """Equal logits in several chunks and rows (rows wider than one chunk), masked tokens: the
    twin's order (lower row, then lower token) on every call."""
    vocab = 3 * chunk_size(10 ** 6) + 17  # several chunks, the last one partial
    logits = torch.full((1, 2, vocab), -5.0)
    hot = [vocab - 1, 3, chunk_size(10 ** 6) + 1, 2 * chunk_size(10 ** 6), 7]
    logits[0, 0, hot] = 2.0  # a five-way tie in row 0, spread over every chunk
    logits[0, 1, hot] = 2.0  # and the same in row 1: equal scores (no parents)
    logits[0, 1] = logits[0, 1].masked_fill(torch.arange(vocab) % 2 == 0, float("-inf"))  # row 1 masks even tokens
    logits = logits.to(DEVICE)
    score, token, row = level_topk(logits, None, 8)
    want = level_topk_reference(logits, None, 8)
    assert torch.equal(token, want[1]) and torch.equal(row, want[2])
    assert torch.allclose(score, want[0], atol=2e-4)  # sums of ~10^4 equal terms: fp32 order apart
    r0 = [t for r, t in zip(row[0].tolist(), token[0].tolist()) if r == 0]
    r1 = [t for r, t in zip(row[0].tolist(), token[0].tolist()) if r == 1]
    assert r0 == sorted(hot) and all(t % 2 == 1 for t in r1)  # never a masked (even) token
    assert all(torch.equal(a, b) for a, b in zip(level_topk(logits, None, 8), (score, token, row)))


def test_a_level_with_fewer_children_than_width_pads():
    logits = torch.randn(2, 1, 3, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    score, token, row = level_topk(logits, None, 5)
    assert token[:, 3:].eq(-1).all() and row[:, 3:].eq(-1).all() and score[:, 3:].isneginf().all()
    assert sorted(token[0, :3].tolist()) == [0, 1, 2]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="width must be in"):
        level_topk(torch.zeros(1, 1, 100, device=DEVICE), None, 65)
    with pytest.raises(ValueError, match="must be \\[B, n, V\\]"):
        level_topk(torch.zeros(1, 100, device=DEVICE), None, 4)
    with pytest.raises(ValueError, match="parent_scores must be float32"):
        level_topk(torch.zeros(1, 2, 100, device=DEVICE), torch.zeros(1, 3, device=DEVICE), 4)


def test_a_level_from_the_kernel_is_the_level_from_pytorch():
    """The pick equals what the CPU beam does (each row's top ``width`` of the full log-softmax,
    then the best ``width`` of the level): the same children with the same scores."""
    from sgl_longgen.core.longspec import best_children

    g = torch.Generator().manual_seed(3)
    B, n, vocab, width = 2, 16, 3000, 16
    logits = (torch.randn(B, n, vocab, generator=g) * 2).to(DEVICE)
    parents = (-torch.rand(B, n, generator=g) * 4).to(DEVICE)
    score, pick, row = level_topk(logits, parents, width)
    want_score, want_pick, want_row = best_children(parents, torch.log_softmax(logits, -1), width)
    assert torch.equal(pick, want_pick) and torch.equal(row, want_row)
    assert torch.allclose(score, want_score, atol=1e-5)


def test_the_twin_catches_a_wrong_order():
    """The comparison above could fail: a pick that takes each row's best child instead of the
    level's best is told apart from the twin."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(1, 8, 400, generator=g) * 3
    parents = torch.linspace(0, -20, 8).unsqueeze(0)  # the first rows dominate the level
    _, token, row = level_topk_reference(logits, parents, 8)
    per_row_best = torch.log_softmax(logits, -1)[0].argmax(-1)
    assert not torch.equal(row[0].sort().values, torch.arange(8)) or not torch.equal(token[0], per_row_best)
