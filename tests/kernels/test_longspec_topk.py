"""LongSpec's per-row top-k of the log-softmax (compiled on a GPU, interpreted on a CPU) against
its PyTorch twin: the same tokens in the same order, ties lowest index first, the same
log-probabilities; and the beam built on it proposes what the PyTorch beam proposes."""

from __future__ import annotations

import pytest
import torch

from sgl_longgen.kernels.longspec_topk import (
    MAX_CUT_NODES,
    chunk_size,
    cut_beam,
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


def test_the_order_holds_across_signs_zeros_and_extremes():
    """The kernels select by one integer key a value: the float order must survive the mapping for
    negative and positive values, subnormals, the largest magnitudes and -inf, and -0.0 must tie
    with +0.0 (lower index first), as they compare as floats."""
    special = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 3e38, -3e38, float("-inf"), 1.0, -1.0, 2.5, -2.5])
    vocab = 2 * chunk_size(10 ** 6) + 5
    g = torch.Generator().manual_seed(3)
    logits = special[torch.randint(len(special), (3, vocab), generator=g)]
    logits[2] = torch.where(logits[2] > -1e-30, logits[2] * 0, logits[2])  # row 2 tops out at +-0.0: a tie
    logits = logits.to(DEVICE)
    val, idx = log_softmax_topk(logits, 16)
    want_val, want_idx = log_softmax_topk_reference(logits, 16)
    assert torch.equal(idx, want_idx)
    assert torch.allclose(val, want_val, atol=1e-5, rtol=1e-5)  # the sums' order aside, at 3e38 too
    zeros = (logits[2] == 0).nonzero().flatten()[:16].tolist()
    assert idx[2].tolist() == zeros  # +0.0 and -0.0 alike, by index
    from sgl_longgen.core.longspec_beam import best_of_rows as torch_best_of_rows
    from sgl_longgen.kernels.longspec_topk import best_of_rows

    top = special[torch.randint(len(special), (2, 4, 8), generator=g)].to(DEVICE)
    parents = torch.tensor([[0.0, -0.0, -1.0, 2.0], [float("-inf"), 0.5, -0.0, 0.0]], device=DEVICE)
    ids = torch.arange(64, device=DEVICE).view(2, 4, 8)
    got, want = best_of_rows(parents, top, ids, 16), torch_best_of_rows(parents, top, ids, 16)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("bitonic", [False, True])
def test_both_selections_are_the_twin(bitonic, monkeypatch):
    """The repeated max (the interpreter's) and Triton's bitonic top-k (a GPU's) select the same
    keys: ties over chunks and rows, masked tokens, the level's pick (small shapes: the
    interpreter pays for every compare-exchange of the bitonic network)."""
    from sgl_longgen.core.longspec_beam import best_of_rows as torch_best_of_rows
    from sgl_longgen.kernels import longspec_topk
    from sgl_longgen.kernels.longspec_topk import best_of_rows

    monkeypatch.setattr(longspec_topk, "INTERPRETER_BITONIC", bitonic)
    monkeypatch.setattr(longspec_topk, "CHUNK_LOGITS", 128)  # several chunks a row, compiled or interpreted
    monkeypatch.setattr(longspec_topk, "INTERPRETER_CHUNK", 128)
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(3, 300, generator=g) * 2).round()  # many ties
    logits[2, ::3] = float("-inf")
    logits = logits.to(DEVICE)
    val, idx = longspec_topk.log_softmax_topk(logits, 16)
    want_val, want_idx = log_softmax_topk_reference(logits, 16)
    assert torch.equal(idx, want_idx) and torch.allclose(val, want_val, atol=1e-5, rtol=1e-5)
    top = (torch.randn(2, 4, 8, generator=g) * 2).round().to(DEVICE)
    parents = torch.tensor([[0.0, -1.0, 0.0, -2.0], [-1.0, -1.0, 0.0, 0.0]], device=DEVICE)
    ids = torch.arange(64, device=DEVICE).view(2, 4, 8)
    got, want = best_of_rows(parents, top, ids, 16), torch_best_of_rows(parents, top, ids, 16)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_k_past_the_unrolled_limit_is_refused():
    with pytest.raises(ValueError, match="k must be in"):
        log_softmax_topk(torch.zeros(1, 100, device=DEVICE), 65)
    with pytest.raises(ValueError, match="k must be in"):
        log_softmax_topk(torch.zeros(1, 3, device=DEVICE), 4)


def test_a_beam_level_from_the_kernel_is_the_level_from_pytorch():
    """What the beam does with the kernel's output (``[B, n, k]`` values and ids, then the best
    ``width`` of the level) picks the same children with the same scores as from the full
    log-softmax."""
    from sgl_longgen.core.longspec_beam import best_children, best_of_rows

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
    from sgl_longgen.core.longspec_beam import best_of_rows as torch_best_of_rows
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
    from sgl_longgen.core.longspec_beam import best_of_rows as torch_best_of_rows
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


def random_beam(B, widths, seed, ties=True):
    """``[B, P]`` scores, tokens and parents of beam trees (each level's parents among the level
    before; a child's score below its parent's, often by the same step, so scores repeat) and the
    ``[P]`` depths."""
    g = torch.Generator().manual_seed(seed)
    depths = torch.cat([torch.full((w,), d + 1) for d, w in enumerate(widths)])
    scores, parents = [], []
    for _ in range(B):
        sc, par, prev, start = [], [], None, 0
        for w in widths:
            if prev is None:
                par += [-1] * w
                sc += (-torch.randint(0, 4, (w,), generator=g).float() * 0.25).tolist()
            else:
                chosen = torch.randint(prev[0], prev[1], (w,), generator=g).tolist()
                par += chosen
                step = torch.randint(1, 3, (w,), generator=g).float() * 0.5 if ties else torch.rand(w, generator=g) + 0.1
                sc += [sc[c] - float(x) for c, x in zip(chosen, step)]
            prev, start = (start, start + w), start + w
        scores.append(sc)
        parents.append(par)
    tokens = torch.randint(0, 128256, (B, len(depths)), generator=g)
    return (torch.tensor(scores, dtype=torch.float32), tokens, torch.tensor(parents), depths)


@pytest.mark.parametrize("B,widths,n", [(1, (4, 16, 16, 16, 16), 63), (3, (4, 16, 16, 16, 16), 20),
                                        (2, (2, 3, 5), 1), (2, (2, 3, 5), 99), (4, (8, 40, 60), 31)])
def test_the_cut_is_its_twin(B, widths, n):
    """The kept nodes, their order, renumbered parents, depths, scores and flags: exactly the
    PyTorch cut's (two stable sorts, a scatter and gathers) on trees full of equal scores."""
    from sgl_longgen.core.longspec_beam import beam_rows, select_nodes_batched

    scores, tokens, parents, depths = random_beam(B, widths, seed=B * 100 + n)
    want = beam_rows(*select_nodes_batched(scores, tokens, parents, depths, n))
    got = cut_beam(*(t.to(DEVICE) for t in (scores, tokens, parents, depths)), n)
    assert got[0].dtype == torch.int64 and got[0].shape == want[0].shape and got[1].shape == want[1].shape
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


def test_the_cut_flags_a_kept_node_whose_parent_was_cut():
    """A node scored above its parent (never in a beam, where scores only fall) is kept while the
    parent is cut: the row's flag is set, as the twin sets it, and the orphan's parent is -1."""
    from sgl_longgen.core.longspec_beam import beam_rows, select_nodes_batched

    scores, tokens, parents, depths = random_beam(2, (2, 3, 5), seed=7, ties=False)
    parents[0, -1] = parents.shape[1] - 2
    scores[0, -2], scores[0, -1] = -100.0, 0.5
    want = beam_rows(*select_nodes_batched(scores, tokens, parents, depths, 5))
    got = cut_beam(*(t.to(DEVICE) for t in (scores, tokens, parents, depths)), 5)
    assert torch.equal(got[0].cpu(), want[0]) and want[0][:, -1].tolist() == [1, 0]
    assert got[0][0, 5 + 4].item() == -1  # the orphan is kept last (creation order) and lost its parent


def test_a_swapped_tie_is_caught():
    """Two equal scores at the cut's edge: keeping the later node instead of the earlier one (what
    an unstable order could do) changes the rows, so the exact comparison above would see it."""
    from sgl_longgen.core.longspec_beam import beam_rows, select_nodes_batched

    scores = torch.tensor([[-1.0, -2.0, -2.0, -3.0]])
    tokens, parents, depths = torch.tensor([[10, 11, 12, 13]]), torch.tensor([[-1, 0, 0, 1]]), torch.tensor([1, 2, 2, 3])
    got = cut_beam(*(t.to(DEVICE) for t in (scores, tokens, parents, depths)), 2)[0].cpu()
    assert got[0, :2].tolist() == [10, 11]  # the earlier of the two -2.0 nodes
    swapped = beam_rows(*select_nodes_batched(scores, tokens[:, [0, 2, 1, 3]], parents, depths, 2))[0]
    assert not torch.equal(got, swapped)


def test_bad_cut_inputs_are_refused():
    scores, tokens, parents, depths = random_beam(1, (2, 3), seed=1)
    with pytest.raises(ValueError, match="depths"):
        cut_beam(scores, tokens, parents, depths[:-1], 3)
    with pytest.raises(ValueError, match="keeps n"):
        cut_beam(scores, tokens, parents, depths, 0)
    big = torch.zeros(1, MAX_CUT_NODES + 1)
    with pytest.raises(ValueError, match="keeps n"):
        cut_beam(big, big.long(), big.long(), torch.zeros(MAX_CUT_NODES + 1, dtype=torch.long), 3)
