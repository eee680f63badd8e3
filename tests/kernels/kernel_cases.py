"""Random verification batches and tolerances shared by the kernel tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch

from sgl_longgen.kernels.reference import make_paged_prefix, random_tree_mask, tree_attention_reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Max abs error allowed against the fp32 reference: output rounding of the dtype plus the
# rounding of the probabilities fed to the second matrix product.
TOL = {torch.float32: 2e-3, torch.float16: 4e-3, torch.bfloat16: 2e-2}


@dataclass
class VerifyBatch:
    q: torch.Tensor
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    k_tree: torch.Tensor
    v_tree: torch.Tensor
    tree_mask: torch.Tensor
    prefix_lens: List[int]
    sm_scale: float

    @property
    def tree_size(self) -> int:
        return self.tree_mask.shape[1]

    def reference(self, tree_mask=None):
        return tree_attention_reference(
            self.q, self.k_buffer, self.v_buffer, self.kv_indptr, self.kv_indices,
            self.k_tree, self.v_tree, self.tree_mask if tree_mask is None else tree_mask, self.sm_scale,
        )


def make_batch(prefix_lens, tree_size, num_q_heads, num_kv_heads, head_dim, dtype, seed=0, spare_slots=64):
    """A batch whose prefixes sit at random, scattered pool slots, with random trees.

    Scores are scaled up (``sm_scale`` 2/sqrt(D)) so softmaxes are peaked and a wrong mask, head
    mapping or merge weight moves the output well beyond the tolerance.
    """
    g = torch.Generator().manual_seed(seed)
    bs = len(prefix_lens)
    num_slots = sum(prefix_lens) + spare_slots
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    kv_indptr, kv_indices = make_paged_prefix(prefix_lens, num_slots, generator=g)
    batch = VerifyBatch(
        q=rand(bs * tree_size, num_q_heads, head_dim),
        k_buffer=rand(num_slots, num_kv_heads, head_dim),
        v_buffer=rand(num_slots, num_kv_heads, head_dim),
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        k_tree=rand(bs * tree_size, num_kv_heads, head_dim),
        v_tree=rand(bs * tree_size, num_kv_heads, head_dim),
        tree_mask=random_tree_mask(bs, tree_size, generator=g),
        prefix_lens=list(prefix_lens),
        sm_scale=2.0 / head_dim**0.5,
    )
    for name, value in vars(batch).items():
        if isinstance(value, torch.Tensor):
            setattr(batch, name, value.to(DEVICE))
    return batch


def nan_like(x: torch.Tensor, dtype=None) -> torch.Tensor:
    """A poisoned output buffer: any element a kernel fails to write stays NaN."""
    return torch.full(x.shape, float("nan"), dtype=dtype or x.dtype, device=x.device)


def run_attention(attn, batch: VerifyBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``attn.run`` on ``batch`` into NaN-filled fp32 outputs (a row it leaves unwritten shows up)."""
    out = nan_like(batch.q, torch.float32)
    lse = nan_like(batch.q[..., 0], torch.float32)
    attn.run(batch.q, batch.k_buffer, batch.v_buffer, batch.k_tree, batch.v_tree, out=out, lse=lse)
    return out, lse


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference; NaN anywhere counts as infinite. ``-inf`` entries must match exactly."""
    a, b = a.float(), b.float()
    if torch.isnan(a).any() or torch.isnan(b).any():
        return float("inf")
    both_inf = torch.isinf(a) & torch.isinf(b) & (torch.sign(a) == torch.sign(b))
    diff = torch.where(both_inf, torch.zeros_like(a), (a - b).abs())
    return float(diff.max()) if diff.numel() else 0.0


def with_own_slots(batch: VerifyBatch):
    """Width-1 batches: each token's own K/V written into a spare pool slot appended to its prefix
    (``kv_indptr``, ``kv_indices`` as a verify planned with ``own_kv_in_prefix`` reads them)."""
    bs = len(batch.prefix_lens)
    used = torch.zeros(batch.k_buffer.shape[0], dtype=torch.bool, device=batch.k_buffer.device)
    used[batch.kv_indices.long()] = True
    own = torch.nonzero(~used).flatten()[:bs].to(torch.int32)
    batch.k_buffer[own.long()] = batch.k_tree
    batch.v_buffer[own.long()] = batch.v_tree
    lens = torch.tensor(batch.prefix_lens, dtype=torch.int32, device=own.device) + 1
    indptr = torch.zeros(bs + 1, dtype=torch.int32, device=own.device)
    indptr[1:] = torch.cumsum(lens, 0)
    parts = []
    for b in range(bs):
        parts += [batch.kv_indices[batch.kv_indptr[b] : batch.kv_indptr[b + 1]], own[b : b + 1]]
    return indptr, torch.cat(parts), lens.tolist()


def make_shared_batch(shared_len, own_lens, tree_size, num_q_heads, num_kv_heads, head_dim, dtype, seed=0):
    """A batch whose requests share their first ``shared_len`` pool slots (as the radix cache
    shares a common prompt's pages), each followed by ``own_lens[b]`` slots of its own.
    ``kv_indptr``/``kv_indices`` list every request's whole prefix, shared slots included, as
    the non-cascade path and the reference read them.
    """
    batch = make_batch([shared_len + n for n in own_lens], tree_size, num_q_heads, num_kv_heads, head_dim,
                       dtype, seed=seed)
    indptr = batch.kv_indptr.tolist()
    shared = batch.kv_indices[: shared_len].clone()
    for b in range(1, len(own_lens)):
        batch.kv_indices[indptr[b] : indptr[b] + shared_len] = shared
    return batch
