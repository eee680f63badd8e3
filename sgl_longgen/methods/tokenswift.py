"""TokenSwift's per-request logic, shared by the reference runtime and the SGLang workers.

A runtime owns one forward: the root token over the positions :meth:`TokenSwift.view` names (the
request's partial KV). It returns the heads' raw candidates
(:func:`sgl_longgen.core.tokenswift.head_candidates`) and, when the view asks for them, the root
query's importance scores over ``view.score``. Everything else is here: when the partial KV is
re-selected, which n-grams join the pool, how candidates become a trie, what a commit changes.

None of it can change the output: drafts only decide which tokens the verifier gets a chance to
accept, and every committed token is drawn from the target distribution by the per-node walk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import SamplingConfig, SuffixConfig, TokenSwiftConfig
from ..core.ngram import NgramPool
from ..core.partial_kv import PartialKVPolicy
from ..core.penalty import window_tokens
from ..core.suffix import SuffixIndex
from ..core.tokenswift import draft_trie, rank_candidates
from .base import Draft


@dataclass
class TokenSwiftState:
    """One request's n-gram pool, suffix index and partial-KV policy.

    ``slots``: whatever a runtime caches per selection (the SGLang worker keeps the selected
    positions' KV slots on the device, so a step gathers them without a host copy).
    """

    pool: NgramPool | None
    policy: PartialKVPolicy
    suffix: SuffixIndex | None = None
    indexed: int = 0  # history tokens in the suffix index
    drafted: int = -1  # the history length the continuation was drafted at
    continuation: list[int] = field(default_factory=list)  # the history's draft for this step
    continuation_score: float = 0.0  # its expected accepted tokens (the suffix draft's score)
    slots: Any = None


@dataclass(frozen=True)
class DraftView:
    """What the draft forward attends to besides the root itself.

    ``ranges``: committed positions ``[lo, hi)``; ``keep``: ``[groups, m]`` selected positions
    (ranked); disjoint from the ranges. ``score``: ``(lo, hi)`` when a (re-)selection is due: the
    root query must also score the committed keys in that range (see :meth:`TokenSwift.select`).
    """

    ranges: list[tuple[int, int]]
    keep: torch.Tensor
    score: tuple[int, int] | None

    @property
    def size(self) -> int:
        """Positions per group (the partial KV's length)."""
        return sum(hi - lo for lo, hi in self.ranges) + self.keep.shape[1]

    def positions(self) -> torch.Tensor:
        """``[groups, n]`` the positions in ascending order (attention ignores order; tests don't)."""
        parts = [torch.arange(lo, hi, dtype=torch.long).expand(self.keep.shape[0], -1) for lo, hi in self.ranges]
        return torch.cat([*parts, self.keep], dim=1).sort(dim=1).values


class TokenSwift:
    """``num_layers`` and ``num_kv_heads`` size the ``head`` granularity (one selection per layer and
    KV head); ``shared`` keeps one selection for all of them."""

    def __init__(self, config: TokenSwiftConfig, suffix: SuffixConfig | None = None, num_layers: int = 1,
                 num_kv_heads: int = 1):
        self.config = config
        self.suffix = suffix if config.suffix else None
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.width = max(config.tree)

    def start(self, seq_len: int, prepared: TokenSwiftState | None = None) -> TokenSwiftState:
        """A request whose first ``seq_len`` positions are committed (its prompt, say).

        The first draft forward scores the whole committed context (the first selection); the
        prompt's n-grams are indexed by the first :meth:`index`, or were by :meth:`prepare`
        (``prepared``: its state, whose indexes this request keeps).
        """
        if prepared is not None:
            prepared.policy.reset(seq_len)
            return prepared
        ng = self.config.ngram
        pool = NgramPool(ng.n, ng.top_k) if ng.enabled else None
        policy = PartialKVPolicy(self.config.partial_kv, self.num_layers, self.num_kv_heads)
        policy.reset(seq_len)
        index = SuffixIndex.for_config(self.suffix) if self.suffix is not None else None
        return TokenSwiftState(pool, policy, index)

    def view(self, state: TokenSwiftState) -> DraftView:
        """The next draft forward's positions; a due selection with nothing to rank is taken at once."""
        policy = state.policy
        score = policy.score_range()
        if score is not None and score[1] <= score[0]:
            policy.select(torch.empty(policy.groups, 0))  # nothing beyond the sinks yet
            score = None
        ranges, keep = policy.visible_parts()
        return DraftView(ranges, keep, score)

    def select(self, state: TokenSwiftState, scores: torch.Tensor) -> None:
        """Take the due selection from the root query's scores over ``view.score``
        (``[groups, n]`` for ``head``, ``[layers, n]`` or ``[n]`` summed in ``shared``)."""
        state.policy.select(scores)

    def verify_score_range(self, state: TokenSwiftState) -> tuple[int, int] | None:
        """Committed positions ``[lo, hi)`` this step's verify forward should score, before it
        commits anything (``partial_kv.policy = "verify"``; None: no scores wanted).

        The runtime's verify then yields, per layer, the mean logits of its first
        :func:`~sgl_longgen.core.verify_scores.score_rows` rows against those keys (the hybrid
        kernels' ``scores`` output, ``[bs, kv_heads, n]`` per layer) and hands them to
        :meth:`select_verified` before :meth:`observe`.
        """
        return state.policy.verify_range()

    def select_verified(self, state: TokenSwiftState, scores: torch.Tensor) -> None:
        """The next draft's selection from the verify's ``[layers, kv_heads, hi - lo]`` scores
        (:meth:`~sgl_longgen.core.partial_kv.PartialKVPolicy.select_verified`)."""
        state.policy.select_verified(scores)

    def index(self, state: TokenSwiftState, history: Sequence[int], sampling: SamplingConfig) -> None:
        """Index what was committed since the last call (``history``: committed tokens and the
        root) and find the history's continuation of it; none of it needs the draft forward.

        Upstream never indexes n-grams inside the contextual penalty's window: its tokens are
        penalized and rarely verify.
        """
        self._extend(state, history, sampling)
        if state.suffix is not None and state.drafted != len(history):
            # The request's own history: its draft reads as history, a loop drafts the whole budget.
            draft = state.suffix.draft(history, self.suffix, own=True)
            state.continuation, state.continuation_score = draft.tokens, draft.score
            state.drafted = len(history)

    def _extend(self, state: TokenSwiftState, history: Sequence[int], sampling: SamplingConfig) -> None:
        """The n-gram pool and suffix index grown to ``history``."""
        if state.pool is not None:
            ng = self.config.ngram
            exclude = sampling.penalty_window if (ng.exclude_penalty_window and sampling.penalty_active) else 0
            state.pool.extend(history, len(history) - exclude)
        if state.suffix is not None and state.indexed != len(history):
            state.suffix.extend(history[state.indexed :])
            state.indexed = len(history)

    def prepare(self, state: TokenSwiftState | None, history: Sequence[int],
                sampling: SamplingConfig) -> TokenSwiftState:
        """Index ``history``, a request's prompt as far as its prefill got, ahead of its first
        step (``state``: what the last call returned, None at first); :meth:`start` takes the
        result. The runtime calls it while its device runs the prefill: the first :meth:`index`
        (a hint's or a draft's) then has only the rest to do, where a long prompt's n-grams and
        suffixes took milliseconds with the device waiting. Indexes grow by appending, so the
        pieces build what one call would, under the same rules (the penalty window left out).
        """
        if state is None:
            state = self.start(len(history))
        self._extend(state, history, sampling)  # the continuation: the first step's, of its own history
        return state

    def history_hint(self, state: TokenSwiftState, history: Sequence[int], sampling: SamplingConfig) -> float | None:
        """Draft tokens the history's continuation is expected to get accepted (its suffix draft's
        score), before any draft forward (None: no continuation drafted); indexes ``history``.

        Adaptive speculation's hint (:mod:`sgl_longgen.core.adaptive`): a function of the committed
        tokens alone. The continuation is part of every trie this method drafts, so its score is a
        floor of what the trie is expected to get accepted.
        """
        if state.suffix is None:
            return None
        self.index(state, history, sampling)
        return state.continuation_score

    @staticmethod
    def penalty_window(history: Sequence[int], sampling: SamplingConfig) -> set[int] | None:
        """The tokens the contextual penalty demotes in the proposals (None: no penalty).

        Proposals only decide what gets verified, so the committed window is enough here; the
        verifier applies each node's exact window.
        """
        if not sampling.penalty_active:
            return None
        return set(window_tokens(history, [], sampling.penalty_window))

    def propose(self, state: TokenSwiftState, root: int, values: Sequence[Sequence[float]],
                ids: Sequence[Sequence[float]], sampling: SamplingConfig, window: set[int] | None,
                max_nodes: int | None = None) -> Draft:
        """The trie from the heads' raw candidates (``[1 + heads, k]``, best first) and the n-gram pool."""
        cands = rank_candidates(values, ids, sampling, window, self.width)
        tree = draft_trie(root, cands, self.config.tree, state.pool, max_nodes, state.continuation)
        return Draft(tree, depth=tree.max_depth)

    def observe(self, state: TokenSwiftState, seq_len: int) -> None:
        """The committed KV grew to ``seq_len`` positions; a re-selection falls due once it overflows."""
        state.policy.commit(seq_len)

    def fixed_view(self, state: TokenSwiftState, seq_len: int, max_commit: int) -> bool:
        """The next view is exactly ``budget`` positions (sinks, the positions committed since the
        selection, the best selected ones) whatever up to ``max_commit`` tokens this step commits.

        Then an engine can compute the next draft's inputs from the verify's walk on the device,
        without the host (see :func:`sgl_longgen.core.partial_kv.steady_visible_slots`).
        """
        policy = state.policy
        return (policy.pending is None and policy.selected.shape[1] >= policy.capacity
                and seq_len + max_commit - policy.sel_len <= policy.capacity)
