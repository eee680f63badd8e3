"""The reduced draft vocabulary of a drafter's head, as the trainers build and train it.

OWL's LSTM head and LongSpec's borrowed target head can both score only N < V target tokens,
listed by a ``token_map`` (draft id -> target id). The map is the N most frequent tokens of the
trainer's own (self-distilled) training sequences: those are what the target emits, so they are
what a draft can get accepted with. Its *coverage* (the share of training tokens inside it) is the
most a reduced head's drafts can match. Targets outside the map are left out of the drafter's
cross-entropy: the drafter can never propose them, so no gradient should push it toward them.
Drafting over a subset is lossless as all drafting is: verification draws every committed token
from the target.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from ..errors import LonggenError


class DraftVocabulary(Protocol):
    """What the loss needs of a drafter with a (possibly) reduced head (OWL's and LongSpec's)."""

    vocab_size: int
    draft_vocab_size: int
    token_map: torch.Tensor | None

    @property
    def reduced(self) -> bool: ...

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor: ...


def frequent_tokens(sequences: torch.Tensor, vocab_size: int, n: int) -> torch.Tensor:
    """The ``n`` most frequent ids of ``sequences`` (ties to the lower id), in increasing id order.

    Ids that never occur fill the remaining places, lowest first, so the map always has ``n`` ids.
    """
    if not 1 <= n <= vocab_size:
        raise LonggenError(f"the draft vocabulary must have 1 to {vocab_size} tokens, got {n}")
    counts = torch.bincount(sequences.reshape(-1).long().cpu(), minlength=vocab_size)[:vocab_size]
    order = torch.argsort(counts, descending=True, stable=True)  # stable: equal counts keep id order
    return order[:n].sort().values


def map_coverage(sequences: torch.Tensor, token_map: torch.Tensor, vocab_size: int) -> float:
    """Share of the tokens of ``sequences`` that the map covers (the best a reduced head can reach)."""
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[token_map.cpu()] = True
    flat = sequences.reshape(-1).long().cpu()
    return float(inside[flat].float().mean()) if flat.numel() else 1.0


def draft_cross_entropy(drafter: DraftVocabulary, logits: torch.Tensor, target: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy of the drafter's head over ``target`` (target ids), and top-1 accuracy.

    A reduced head scores draft ids: targets are translated through the map, and targets outside
    it are ignored (they could never be drafted, so no gradient can teach it to propose them);
    when none is inside, the loss is 0. Accuracy counts every target, so it is what drafting gets.
    """
    logits, target = logits.flatten(0, -2), target.flatten()
    with torch.no_grad():
        acc = (drafter.to_target(logits.argmax(-1)) == target).float().mean()
    if not drafter.reduced:
        return F.cross_entropy(logits, target), acc
    index = torch.full((drafter.vocab_size,), -100, dtype=torch.long, device=target.device)
    index[drafter.token_map] = torch.arange(drafter.draft_vocab_size, device=target.device)
    draft_target = index[target]
    total = F.cross_entropy(logits, draft_target, ignore_index=-100, reduction="sum")
    return total / (draft_target >= 0).sum().clamp(min=1), acc


def check_draft_vocab(draft_vocab: int, vocab_size: int) -> None:
    """``--draft-vocab`` fits the target (checked before any data is generated)."""
    if draft_vocab > vocab_size:
        raise LonggenError(f"--draft-vocab {draft_vocab} exceeds the target's vocabulary ({vocab_size})")
