"""LongSpec's per-row top-k of the log-softmax (compiled on a GPU, interpreted on a CPU) against
its PyTorch twin: the same tokens in the same order, ties lowest index first, the same
log-probabilities; and the beam built on it proposes what the PyTorch beam proposes."""

from __future__ import annotations

import pytest
import torch

from sgl_longgen.kernels.longspec_topk import (
    chunk_size,
    log_softmax_topk,
    log_softmax_topk_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows,vocab,k", [(1, 50, 4), (16, 300, 16), (3, 5000, 16), (4, 20000, 13), (2, 8, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_is_its_twin(rows, vocab, k, dtype):
    g = torch.Generator().manual_seed(vocab + k)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype).to(DEVICE)
    val, idx = log_softmax_topk(logits, k)
    want_val, want_idx = log_softmax_topk_reference(logits, k)
    assert val.dtype == torch.float32 and idx.dtype == torch.int64 and val.shape == idx.shape == (rows, k)
    if dtype == torch.float32:  # bf16 logits repeat: tie order is checked below
        assert torch.equal(idx, want_idx)
    assert torch.allclose(val, want_val, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.log_softmax(logits.float(), -1).gather(-1, idx), want_val)  # the right tokens' values


def test_ties_go_to_the_lowest_index_across_chunks():
    """Equal logits in several chunks (a row wider than one chunk): lowest index first, as the twin orders them."""
    vocab = 3 * chunk_size(10 ** 6) + 17  # several chunks, the last one partial
    logits = torch.full((2, vocab), -5.0)
    hot = [vocab - 1, 3, chunk_size(10 ** 6) + 1, 2 * chunk_size(10 ** 6), 7]
    logits[0, hot] = 2.0  # five-way tie, spread over every chunk
    logits[1, [vocab - 2, 5]] = 1.0
    logits[1] = logits[1].masked_fill(torch.arange(vocab) % 2 == 0, float("-inf"))  # masked tokens
    logits = logits.to(DEVICE)
    val, idx = log_softmax_topk(logits, 8)
    want_val, want_idx = log_softmax_topk_reference(logits, 8)
    assert idx[0].tolist() == sorted(hot) + [0, 1, 2]
    assert idx[1].tolist() == [5, vocab - 2, 1, 3, 7, 9, 11, 13]  # never a masked (even) token
    assert torch.equal(idx, want_idx)
    assert torch.allclose(val, want_val, atol=1e-5)
    assert torch.equal(log_softmax_topk(logits, 8)[1], idx)  # the same on every call


def test_k_past_the_unrolled_limit_is_refused():
    with pytest.raises(ValueError, match="k must be in"):
        log_softmax_topk(torch.zeros(1, 100, device=DEVICE), 65)
    with pytest.raises(ValueError, match="k must be in"):
        log_softmax_topk(torch.zeros(1, 3, device=DEVICE), 4)


def test_a_beam_level_from_the_kernel_is_the_level_from_pytorch():
    """What the beam does with the kernel's output (``[B, n, k]`` values and ids, then the best
    ``width`` of the level) picks the same children with the same scores as from the full
    log-softmax."""
    from sgl_longgen.core.longspec import best_children, best_of_rows

    g = torch.Generator().manual_seed(3)
    B, n, vocab, width = 2, 16, 3000, 16
    logits = (torch.randn(B, n, vocab, generator=g) * 2).to(DEVICE)
    parents = (-torch.rand(B, n, generator=g) * 4).to(DEVICE)
    score, pick, row = best_of_rows(parents, *log_softmax_topk(logits, width), width)
    want_score, want_pick, want_row = best_children(parents, torch.log_softmax(logits, -1), width)
    assert torch.equal(pick, want_pick) and torch.equal(row, want_row)
    assert torch.allclose(score, want_score, atol=1e-5)


@pytest.mark.parametrize("B,n,k,width", [(1, 1, 4, 4), (2, 4, 16, 16), (3, 16, 16, 16), (1, 5, 3, 7)])
def test_the_level_pick_is_its_twin_and_the_beams_pick(B, n, k, width):
    """The level's best ``width`` of ``n * k`` candidates: the CPU beam's pick (its twin), the same
    children in the same order with the same float32 sums, and the same set and scores as one
    ``torch.topk`` over the flattened candidates."""
    from sgl_longgen.core.longspec import best_of_rows as torch_best_of_rows
    from sgl_longgen.kernels.longspec_topk import best_of_rows

    g = torch.Generator().manual_seed(B * 100 + n * 10 + k)
    top = (-torch.rand(B, n, k, generator=g) * 6).sort(dim=-1, descending=True).values.to(DEVICE)
    ids = torch.randint(0, 50000, (B, n, k), generator=g).to(DEVICE)
    parents = (-torch.rand(B, n, generator=g) * 4).to(DEVICE)
    got = best_of_rows(parents, top, ids, width)
    want = torch_best_of_rows(parents, top, ids, width)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    cand = (parents.unsqueeze(-1) + top).flatten(-2)
    score, flat = cand.topk(width, dim=-1)
    assert torch.equal(got[0], score)
    assert sorted(zip(got[2].flatten().tolist(), got[1].flatten().tolist())) == \
        sorted(zip(torch.div(flat, k, rounding_mode="floor").flatten().tolist(),
                   ids.flatten(-2).gather(-1, flat).flatten().tolist()))


def test_the_level_pick_breaks_ties_by_row_then_candidate():
    """The kernel and its twin (the CPU beam's pick) alike."""
    from sgl_longgen.core.longspec import best_of_rows as torch_best_of_rows
    from sgl_longgen.kernels.longspec_topk import best_of_rows

    top = torch.full((1, 3, 2), -1.0, device=DEVICE)
    ids = torch.arange(6, device=DEVICE).view(1, 3, 2)
    parents = torch.zeros(1, 3, device=DEVICE)
    parents[0, 2] = 0.5  # row 2 first, then rows 0 and 1 tied: row 0's candidates first
    for pick in (best_of_rows, torch_best_of_rows):
        score, token, row = pick(parents, top, ids, 4)
        assert token[0].tolist() == [4, 5, 0, 1] and row[0].tolist() == [2, 2, 0, 0]
        assert score[0].tolist() == [-0.5, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError, match="width must be in"):
        best_of_rows(parents, top, ids, 7)
