"""A drafter's reduced draft vocabulary: a head over N of the target's V tokens, and their map.

An 8B target's LM head is 128K rows; a drafter that scores every row at every level of its tree
reads it once per level, which can cost as much as the rest of the draft. Scoring only the N most
frequent tokens (``token_map``: draft id -> target id, EAGLE-3's token map) cuts that read by V/N
and loses only the proposals of rare tokens. Lossless whatever the map: it changes which tokens
are proposed, never how a committed token is drawn (the verify walk draws each one from the target).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import LonggenError


def token_map_problem(token_map: torch.Tensor, vocab_size: int, draft_vocab_size: int) -> str | None:
    """What is wrong with a draft id -> target id map, or None: N unique integer ids in [0, vocab_size)."""
    if token_map.is_floating_point() or token_map.is_complex() or token_map.dtype == torch.bool:
        return f"must hold integer token ids, not {token_map.dtype}"
    if tuple(token_map.shape) != (draft_vocab_size,):
        return f"has shape {tuple(token_map.shape)}, expected ({draft_vocab_size},)"
    ids = token_map.to(torch.long)
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.numel():
        return f"has ids out of range [0, {vocab_size}): {bad[:4].tolist()}"
    uniq, counts = ids.unique(return_counts=True)
    if uniq.numel() != ids.numel():
        return f"lists target ids more than once: {uniq[counts > 1][:4].tolist()}"
    return None


def check_token_map_file(weights: Path, cfg: dict, cfg_path: Path) -> None:
    """A reduced checkpoint's ``token_map`` tensor (``cfg``: its JSON config) is a valid map; one
    error naming both files otherwise. N integers: cheap to read even when a server starts."""
    if cfg.get("draft_vocab_size", cfg["vocab_size"]) >= cfg["vocab_size"]:
        return
    try:
        with safe_open(str(weights), framework="pt") as f:
            token_map = f.get_tensor("token_map")
    except (SafetensorError, OSError) as exc:
        raise LonggenError(f"cannot read {weights}: {exc}") from None
    problem = token_map_problem(token_map, cfg["vocab_size"], cfg["draft_vocab_size"])
    if problem:
        raise LonggenError(f"{weights}: tensor token_map {problem} ({cfg_path} sets draft_vocab_size = "
                           f"{cfg['draft_vocab_size']})")


class DraftVocabulary:
    """The token-map half of a drafter module (mixed into an ``nn.Module`` that sets
    ``vocab_size``, ``draft_vocab_size`` and a ``token_map`` buffer, None when full)."""

    vocab_size: int
    draft_vocab_size: int
    token_map: torch.Tensor | None

    @property
    def reduced(self) -> bool:
        """The drafter scores a subset of the target vocabulary (through ``token_map``)."""
        return self.draft_vocab_size < self.vocab_size

    def set_token_map(self, token_map: torch.Tensor | Sequence[int]) -> None:
        """Fill the draft id -> target id map (validated like a checkpoint's)."""
        if not self.reduced:
            raise ValueError("a full-vocabulary drafter has no token map")
        ids = torch.as_tensor(token_map)
        problem = token_map_problem(ids, self.vocab_size, self.draft_vocab_size)
        if problem:
            raise ValueError(f"token map {problem}")
        with torch.no_grad():
            self.token_map.copy_(ids.to(torch.long))

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft ids: a device-side gather, no host sync (identity when full)."""
        return draft_ids if self.token_map is None else self.token_map[draft_ids]
