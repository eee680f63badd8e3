"""TokenSwift's dynamic partial KV cache (Eq. 2), as a policy over positions.

The draft forward attends to at most ``budget`` committed positions instead of the whole context:

* ``sinks`` first positions, always (attention sinks);
* the positions ranked most important at the last selection, by the GQA-summed score
  ``sum_{h in group(j)} q_h . k_{j,i}`` of one query (the paper's Eq. 2);
* every position committed since that selection, which displace the least important selected
  ones first ("tail insertion").

Once the new positions would reach the sinks, a re-selection is due: the next draft forward sees
the sinks plus the most recent ``budget - sinks`` positions, and the runtime scores the whole
committed context with that forward's root query (one pass over the keys every
``budget - sinks`` tokens). Scoring in the draft forward rather than the verify forward keeps the
verify forward free of extra outputs, so an engine can replay it from a CUDA graph.

The policy only deals in positions; runtimes turn them into KV slots (gather indices, SGLang
``kv_indices``). Selection is per (layer, KV head) in ``head`` granularity and one set for all in
``shared`` granularity.

With ``policy = "verify"`` (SpecAttn's verification-guided selection) the ranking comes from every
verify forward instead: the verify over committed length ``L`` scores the keys ``[sinks, L)``
with two of its rows (:mod:`sgl_longgen.core.verify_scores`) and :meth:`PartialKVPolicy.select_verified`
ranks them per layer (``shared``: the mean over the layer's query heads; ``head``: per KV head,
the mean over its group), as if a selection had been taken at ``L``. The same rules then hold: the
sinks, the positions the step commits (from ``L`` on; always visible, "tail insertion"), and the
best ranked ones up to the budget. Refreshed every step, so the draft always reads what the last
verify selected. Until the first verify (the draft right after the prompt), or when a step commits
more than ``budget - sinks`` tokens, the draft scores as above. Raw logits of different layers are
never compared: each layer ranks its own.

Lossless whatever the policy: a selection only changes which committed positions the draft
forward reads, i.e. which tokens get proposed; the verify forward attends to the whole context and
every committed token is drawn from its output.
"""

from __future__ import annotations

import torch

from ..config import PartialKVConfig


def gqa_importance(q: torch.Tensor, k: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Eq. 2: ``[Hq, D]`` query and ``[Hkv, n, D]`` keys -> ``[Hkv, n]`` scores.

    Summing the group's queries first scores every key once per KV head, never per query head.
    """
    hkv = k.shape[0]
    q_group = q.reshape(hkv, q.shape[0] // hkv, q.shape[-1]).sum(dim=1)
    return torch.einsum("hd,hnd->hn", q_group.to(k.dtype), k) * scale


class PartialKVPolicy:
    """One request's partial KV. ``groups`` rows of positions: ``layers * kv_heads`` in ``head``
    granularity; in ``shared`` one row, or one per layer under the ``verify`` policy (its
    selections are per layer; the draft-scored ones are then the same for every layer)."""

    def __init__(self, config: PartialKVConfig, num_layers: int, num_kv_heads: int):
        self.budget = config.budget
        self.sinks = config.sinks
        self.granularity = config.granularity
        self.policy = config.policy
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        if config.granularity == "head":
            self.groups = num_layers * num_kv_heads
        else:
            self.groups = num_layers if config.policy == "verify" else 1
        self.length = 0  # committed positions
        self.sel_len = 0  # committed length at the last selection
        self.selected = torch.empty(self.groups, 0, dtype=torch.long)  # ranked, most important first
        self.pending: int | None = None  # committed length a due re-selection will score up to

    @property
    def capacity(self) -> int:
        """Selected plus new positions the budget holds besides the sinks."""
        return self.budget - self.sinks

    def reset(self, length: int) -> None:
        """A fresh context of ``length`` committed positions: the first selection is due."""
        self.length = length
        self.sel_len = 0
        self.selected = torch.empty(self.groups, 0, dtype=torch.long)
        self.pending = length

    def score_range(self) -> tuple[int, int] | None:
        """Positions ``[start, end)`` to score with the next full forward, if a selection is due."""
        if self.pending is None:
            return None
        return min(self.sinks, self.pending), self.pending

    def select(self, scores: torch.Tensor) -> None:
        """Take a due selection. ``scores``: ``[layers, kv_heads, end - start]`` over score_range()."""
        if self.pending is None:
            raise RuntimeError("no selection is due")
        start, end = self.score_range()
        scores = scores.flatten(0, -2)
        if scores.shape[-1] != end - start:
            raise ValueError(f"expected scores over {end - start} positions, got {scores.shape[-1]}")
        if self.granularity == "shared":
            # Raw q.k scales differ between layers; compare attention weights instead.
            scores = torch.softmax(scores.double(), dim=-1).sum(dim=0, keepdim=True)
        self._take(scores, start, end)

    def verify_range(self) -> tuple[int, int] | None:
        """Committed positions ``[start, end)`` the next verify forward should score (the
        ``verify`` policy; None otherwise or when nothing lies past the sinks)."""
        if self.policy != "verify":
            return None
        start, end = min(self.sinks, self.length), self.length
        return (start, end) if end > start else None

    def select_verified(self, scores: torch.Tensor) -> None:
        """Take a selection at the current length from a verify forward's scores over
        :meth:`verify_range`: ``[layers, kv_heads, n]`` mean logits (``sgl_longgen.core.verify_scores``).

        ``head``: per (layer, KV head) the top ``capacity`` of its row; ``shared``: per layer the
        top of the mean over its KV heads (the mean logit over all the layer's query heads).
        Replaces any due draft-scored selection: this one is as recent.
        """
        rng = self.verify_range()
        if rng is None:
            raise RuntimeError("no verify selection is expected")
        start, end = rng
        if scores.dim() != 3 or scores.shape[0] != self.num_layers or scores.shape[-1] != end - start:
            raise ValueError(f"expected [{self.num_layers}, kv_heads, {end - start}] scores, got {tuple(scores.shape)}")
        if self.granularity == "head":
            if scores.shape[1] != self.num_kv_heads:
                raise ValueError(f"head granularity needs scores per KV head ({self.num_kv_heads}), got {scores.shape[1]}")
            scores = scores.flatten(0, 1)
        else:
            scores = scores.mean(dim=1)
        self._take(scores, start, end)

    def _take(self, scores: torch.Tensor, start: int, end: int) -> None:
        """The top ``capacity`` of each row of ``scores`` (over positions ``start + i``), ranked,
        as the selection at committed length ``end``; one row serves every group."""
        m = min(self.capacity, end - start)
        top = scores.topk(m, dim=-1).indices if m else scores.new_empty(scores.shape[0], 0, dtype=torch.long)
        top = top.to(torch.long).cpu() + start
        self.selected = top.expand(self.groups, -1).contiguous() if top.shape[0] != self.groups else top
        self.sel_len = end
        self.pending = None

    def commit(self, length: int) -> None:
        """The committed context grew to ``length``; schedule a re-selection once it overflows."""
        self.length = length
        if self.pending is None and length - self.sel_len > self.capacity:
            self.pending = length

    def visible_parts(self) -> tuple[list[tuple[int, int]], torch.Tensor]:
        """The visible positions as ranges ``[lo, hi)`` plus kept selected positions ``[groups, m]``.

        Disjoint; :meth:`visible` is their sorted union. Attention does not care about order, so
        engines can gather slots from the parts directly.
        """
        L = self.length
        s = min(self.sinks, L)
        if self.pending is not None:
            return [(0, s), (max(s, L - self.capacity), L)], self.selected[:, :0]
        n_new = L - self.sel_len
        keep = self.selected[:, : max(0, self.capacity - n_new)]
        return [(0, s), (max(s, self.sel_len), L)], keep

    def visible(self) -> torch.Tensor:
        """``[groups, n]`` positions the draft token attends to besides itself (sorted per row)."""
        ranges, keep = self.visible_parts()
        parts = [torch.arange(lo, hi, dtype=torch.long).expand(self.groups, -1) for lo, hi in ranges]
        return torch.cat([*parts, keep], dim=1).sort(dim=1).values


def steady_visible_slots(
    table: torch.Tensor,
    rows: torch.Tensor,
    lengths: torch.Tensor,
    sel_lens: torch.Tensor,
    selected: torch.Tensor,
    sinks: int,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """KV slots a draft root attends to, computed on the device: ``[bs, budget + 1]``.

    For requests in the steady state of :class:`PartialKVPolicy` (no re-selection due, a full
    selection of ``capacity`` positions, so ``sel_len >= sinks + capacity``), the visible set is always
    ``budget`` positions: the sinks, the ``n_new = length - sel_len`` positions committed since
    the selection, and the ``capacity - n_new`` best selected ones. Built from tensors only
    (``table[rows[b]]`` maps request b's positions to slots; ``lengths`` and ``sel_lens`` per
    request; ``selected``: ``[bs, capacity]`` slots of the ranked selection; ``offsets``:
    ``arange(budget)``), so an engine can queue it behind the verify step that decides
    ``lengths`` without reading them back. The last column is the root's own slot
    (``table[rows, lengths]``). Same set as :meth:`PartialKVPolicy.visible_parts`, another order.
    """
    capacity = selected.shape[1]
    j = offsets[None, :]
    n_new = (lengths - sel_lens)[:, None]
    position = torch.where(j < sinks, j, sel_lens[:, None] + (j - sinks)).clamp_(max=table.shape[1] - 1)
    from_table = table[rows[:, None], position]
    from_selection = selected.gather(1, (j - sinks - n_new).clamp(0, capacity - 1))
    slots = torch.where(j < sinks + n_new, from_table, from_selection)
    root = table[rows, lengths]
    return torch.cat([slots, root[:, None].to(slots.dtype)], dim=1)
