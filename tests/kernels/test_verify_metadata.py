"""SGLang's TARGET_VERIFY metadata (flat custom mask, req_to_token) to the hybrid's inputs."""

from __future__ import annotations

import pytest
import torch

from sgl_longgen.kernels.reference import random_tree_mask
from sgl_longgen.kernels.verify_metadata import (
    custom_mask_layout,
    page_table_from_indices,
    prefix_kv_indices,
    tree_mask_from_custom_mask,
)


def sglang_full_mask(seq_lens, trees):
    """What SGLang's NGRAM/EAGLE verify builds: per request cat(ones(N, L), tree).flatten()."""
    parts = []
    for L, tree in zip(seq_lens, trees):
        parts.append(torch.cat([torch.ones(tree.shape[0], L, dtype=torch.bool), tree], dim=1).flatten())
    return torch.cat(parts)


def test_full_layout_round_trip():
    seq_lens = [7, 0, 130]
    trees = random_tree_mask(3, 5, generator=torch.Generator().manual_seed(0))
    flat = sglang_full_mask(seq_lens, trees)
    lens = torch.tensor(seq_lens)
    assert custom_mask_layout(flat.numel(), 3, 5, sum(seq_lens)) == "full"
    got = tree_mask_from_custom_mask(flat, lens, 5, layout="full")
    assert torch.equal(got, trees)
    # the transpose would be wrong and is distinguishable
    assert not torch.equal(got, trees.transpose(1, 2))


def test_qlen_layout():
    trees = random_tree_mask(2, 4, generator=torch.Generator().manual_seed(1))
    flat = trees.flatten()
    assert custom_mask_layout(flat.numel(), 2, 4, 100) == "qlen"
    assert torch.equal(tree_mask_from_custom_mask(flat, torch.tensor([60, 40]), 4, layout="qlen"), trees)


def test_padded_batch_rows_become_visible_and_reads_stay_in_range():
    """CUDA-graph replays pad the batch beyond the mask's real requests."""
    trees = random_tree_mask(2, 3, generator=torch.Generator().manual_seed(2))
    flat = sglang_full_mask([4, 2], trees)
    lens = torch.tensor([4, 2, 1, 1])  # two padding requests with the fill length
    out = torch.zeros(4, 3, 3, dtype=torch.uint8)
    tree_mask_from_custom_mask(flat, lens, 3, layout="full", out=out)
    assert torch.equal(out[:2].bool(), trees)
    assert out[2:].bool().all()


def test_layout_size_mismatch_is_an_error():
    with pytest.raises(ValueError):
        custom_mask_layout(17, 2, 3, 5)


def test_prefix_kv_indices():
    req_to_token = torch.arange(5 * 20, dtype=torch.int32).reshape(5, 20) * 3
    rp = torch.tensor([3, 0, 4])
    lens = torch.tensor([5, 0, 11])
    indptr, indices = prefix_kv_indices(req_to_token, rp, lens, 16)
    assert indptr.tolist() == [0, 5, 5, 16]
    expect = torch.cat([req_to_token[3, :5], req_to_token[4, :11]])
    assert torch.equal(indices, expect)


@pytest.mark.parametrize("lens", [[5, 0, 11], [2500, 1, 1024, 0]])
def test_prefix_slots_kernel_matches_the_torch_gather(lens):
    """The grid over (request, chunk) writes what the torch reference writes, chunks past a short
    prefix included (they must not write), across chunk boundaries."""
    from kernel_cases import DEVICE
    from sgl_longgen.kernels.prefix_slots import prefix_slots

    g = torch.Generator().manual_seed(1)
    req_to_token = torch.randperm(6 * 3000, generator=g).to(torch.int32).reshape(6, 3000).to(DEVICE)
    rp = torch.tensor([5, 0, 3, 2][: len(lens)], device=DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    ref_indptr, ref = prefix_kv_indices(req_to_token, rp, seq_lens, sum(lens))
    indptr = torch.full((len(lens) + 1,), -7, dtype=torch.int32, device=DEVICE)
    out = torch.full((sum(lens) + 5,), -1, dtype=torch.int32, device=DEVICE)
    prefix_slots(req_to_token, rp, seq_lens, indptr, out, max(lens))
    assert torch.equal(indptr, ref_indptr)
    assert torch.equal(out[: sum(lens)], ref) and (out[sum(lens):] == -1).all()


def test_page_table_holds_each_prefix_row_by_row():
    """FA3's page table (page size 1) from the hybrid's flat prefix slots, into a wider buffer."""
    g = torch.Generator().manual_seed(3)
    lens = [5, 0, 9]
    kv_indptr = torch.tensor([0, 5, 5, 14], dtype=torch.int32)
    kv_indices = torch.randperm(40, generator=g)[:14].to(torch.int32)
    buf = torch.full((4, 16), -1, dtype=torch.int32)
    seq = torch.full((4,), -1, dtype=torch.int32)
    table, got_lens = page_table_from_indices(kv_indptr, kv_indices, buf[:3, :9], seq)
    assert got_lens.tolist() == lens and seq[3] == -1
    for b, n in enumerate(lens):
        assert table[b, :n].tolist() == kv_indices[kv_indptr[b] : kv_indptr[b] + n].tolist()
        # Past the prefix: slots that exist (the kernel never reads them, but they must be valid).
        assert set(table[b, n:].tolist()) <= set(kv_indices.tolist())
    assert (buf[:, 9:] == -1).all() and (buf[3] == -1).all()  # nothing outside the slice written
    empty, empty_lens = page_table_from_indices(torch.zeros(2, dtype=torch.int32),
                                                torch.empty(0, dtype=torch.int32), torch.ones(1, 4, dtype=torch.int32))
    assert empty_lens.tolist() == [0] and (empty == 0).all()
