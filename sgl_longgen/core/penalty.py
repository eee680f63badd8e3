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


def tree_window_mask(
    history: Sequence[int],
    paths: Sequence[Sequence[int]],
    window: int,
    vocab_size: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Penalty masks of many tree nodes at once (``[len(paths), vocab_size]``).

    Equal to ``window_mask([window_tokens(history, p, window) for p in paths])`` but built from
    one token count of the base window plus a few sparse corrections per node, so a verify
    batch of dozens of nodes costs one scatter instead of one per node.
    """
    n = len(paths)
    if window <= 0 or n == 0:
        return torch.zeros(n, vocab_size, dtype=torch.bool, device=device)
    base = list(history[max(0, len(history) - window):])
    counts = torch.zeros(vocab_size, dtype=torch.int32)
    if base:
        counts.index_add_(0, torch.tensor(base, dtype=torch.long), torch.ones(len(base), dtype=torch.int32))
    rows, toks, deltas = [], [], []
    for row, path in enumerate(paths):
        d = len(path)
        # The node keeps the last W - d history tokens; the rest of the base window drops out.
        keep = min(len(base), max(0, window - d))
        drop = base[: len(base) - keep]
        kept_path = path[max(0, d - window):]
        for t in drop:
            rows.append(row)
            toks.append(t)
            deltas.append(-1)
        for t in kept_path:
            rows.append(row)
            toks.append(t)
            deltas.append(1)
    full = counts.expand(n, vocab_size).clone()
    if rows:
        full.index_put_(
            (torch.tensor(rows, dtype=torch.long), torch.tensor(toks, dtype=torch.long)),
            torch.tensor(deltas, dtype=torch.int32),
            accumulate=True,
        )
    return (full > 0).to(device)
