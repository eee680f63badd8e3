"""Positions and RoPE of LongSpec's drafter: the rotation its queries carry, and training's positions.

The drafter's queries carry RoPE at the drafter token's own position with the target's frequencies
(:func:`rope_tables`: float64 angles, as the target computes them), so they meet the target's
last-layer keys, which hold theirs: why a checkpoint records and checks the target's RoPE
settings (:mod:`.longspec_checkpoint`).

**Anchor-Offset Indices** (:func:`anchor_offset_positions`): training positions ``0 .. a-1`` are
kept as attention sinks and every later one is shifted by one random offset, so a drafter trained
on short samples sees the large positions it meets in a long generation. The target computes its
K/V with the same positions (only its loss, not its weights, sees them).
"""

from __future__ import annotations

import torch


def anchor_offset_positions(length: int, anchors: int, offset: int) -> torch.Tensor:
    """``[0, .., a-1, a + offset, .., length - 1 + offset]`` (LongSpec Alg. 1; ``a = anchors``).

    The first ``anchors`` positions stay where the target's attention sinks expect them; the rest
    keep their spacing (RoPE sees relative distances) but sit ``offset`` further out.
    """
    if length < 0 or anchors < 0 or offset < 0:
        raise ValueError("length, anchors and offset must be non-negative")
    pos = torch.arange(length, dtype=torch.long)
    pos[anchors:] += offset
    return pos


def sample_anchor_offset(length: int, max_position: int, anchors: int, max_offset: int,
                         generator: torch.Generator | None = None) -> torch.Tensor:
    """Anchor-offset positions with an offset uniform in ``[0, min(max_offset, max_position - length)]``.

    ``max_position``: the target's context (positions stay below it).
    """
    high = max(0, min(max_offset, max_position - length))
    offset = int(torch.randint(0, high + 1, (), generator=generator))
    return anchor_offset_positions(length, min(anchors, length), offset)


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[..., T, head_dim]`` for ``positions`` (float64 angles, as the target computes them)."""
    freqs = positions.to(torch.float64)[..., None] * inv_freq.to(device=positions.device, dtype=torch.float64)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x``: ``[..., H, T, D]``; ``cos``/``sin``: ``[..., T, D]`` (broadcast over heads)."""
    cos, sin = cos.unsqueeze(-3).to(x.dtype), sin.unsqueeze(-3).to(x.dtype)
    return x * cos + _rotate_half(x) * sin
