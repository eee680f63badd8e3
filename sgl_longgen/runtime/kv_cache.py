"""Contiguous per-layer KV cache for one sequence.

Positions ``[0, length)`` are committed; a verify forward writes its tree past them and
:meth:`KVCache.keep` compacts the accepted rows right behind the committed ones, so the cache is
always exactly the KV of the emitted sequence.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype, device):
        shape = (layers, kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def ensure(self, needed: int) -> None:
        """Grow (by doubling) so that positions ``[0, needed)`` exist."""
        if needed <= self.capacity:
            return
        cap = max(needed, 2 * self.capacity)
        layers, heads, old, dim = self.k.shape
        for name in ("k", "v"):
            buf = getattr(self, name)
            grown = buf.new_zeros(layers, heads, cap, dim)
            grown[:, :, :old] = buf
            setattr(self, name, grown)

    def keep(self, start: int, rows: list[int]) -> None:
        """Move the KV of rows ``start + rows[i]`` to ``start + i`` (rows ascending)."""
        if rows == list(range(len(rows))):
            return
        src = torch.tensor(rows, dtype=torch.long, device=self.k.device) + start
        n = len(rows)
        self.k[:, :, start : start + n] = self.k[:, :, src]
        self.v[:, :, start : start + n] = self.v[:, :, src]
