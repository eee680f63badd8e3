"""TokenSwift's contextual penalty window, computed per tree node.

Plain decoding penalizes the distinct tokens among the last W tokens of *its* context. A draft
node at depth d has the context ``history + path[:d]``, so its window drops the oldest d history
tokens and adds its own path. Upstream TokenSwift froze the window per step, which makes the
verified distribution differ from plain decoding; computing it per node keeps the method lossless.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def window_tokens(history: Sequence[int], path: Sequence[int], window: int) -> list[int]:
    """The last ``window`` tokens of ``history + path`` (``history`` ends with the root token)."""
    if window <= 0:
        return []
    d = len(path)
    if d >= window:
        return list(path[d - window:])
    keep = window - d
    start = max(0, len(history) - keep)
    return list(history[start:]) + list(path)


def window_mask(windows: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean ``[len(windows), vocab_size]``: True where a token occurs in that row's window."""
    mask = torch.zeros(len(windows), vocab_size, dtype=torch.bool, device=device)
    for row, toks in enumerate(windows):
        if len(toks):
            idx = torch.as_tensor(list(toks), dtype=torch.long, device=device)
            mask[row, idx] = True
    return mask


def apply_penalty(logits: torch.Tensor, mask: torch.Tensor, theta: float) -> torch.Tensor:
    """CTRL-style: penalized positive logits are divided by theta, negative ones multiplied."""
    penalized = torch.where(logits > 0, logits / theta, logits * theta)
    return torch.where(mask, penalized, logits)
