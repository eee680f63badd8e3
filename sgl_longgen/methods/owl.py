"""OWL and HOWL's per-request logic, shared by the reference runtime and the SGLang workers.

OWL drafts from two target hidden states (post-final-norm): the last committed token's and the
[SPEC] leaf's that followed it in the last verify forward (:meth:`Owl.observe` keeps them). The
drafter's beam is a tensor function a runtime may replay as a CUDA graph, so it is passed in
(``expand``: :func:`sgl_longgen.core.owl.expand`'s signature). HOWL adds SuffixDecoding: when the
suffix index's draft is expected to beat OWL's best case, that chain is verified instead (no
[SPEC]; the next tree is drafted from the drafter's null state).

[SPEC] is an input-only row: ``spec_token`` is the id a runtime gives those rows (the reference
runtime embeds id ``vocab_size`` as the drafter's vector; SGLang overrides any id's embedding).
Leaves are never children in the trie, so the verifier's walk cannot enter one whatever id they
carry, and nothing drafted changes the output.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from ..config import HowlConfig, OwlConfig, SuffixConfig
from ..core.howl import HowlPolicy, HowlState, Route
from ..core.owl import DraftBeam, attach_spec_leaves, beam_trees
from ..core.suffix import SuffixCache, SuffixDraft
from ..core.tree import DraftTree, Source
from ..core.verify import Verdict
from .base import Draft

# (h_last [B, d], roots [B], h_spec [B, d] | None, has_spec [B] bools) -> DraftBeam
Expand = Callable[[torch.Tensor, Sequence[int], torch.Tensor | None, Sequence[bool]], DraftBeam]


@dataclass
class OwlState:
    h_last: torch.Tensor | None  # [d] post-norm hidden state of the last committed token
    h_spec: torch.Tensor | None = None  # [d] post-norm hidden state of the [SPEC] that followed it
    howl: HowlState | None = None


class Owl:
    def __init__(self, config: OwlConfig, expand: Expand, spec_token: int):
        self.config = config
        self.expand = expand
        self.spec_token = spec_token

    # -- per request ---------------------------------------------------------------------------

    def start(self, rid: Hashable, history: Sequence[int], h_last: torch.Tensor | None,
              h_spec: torch.Tensor | None = None) -> OwlState:
        """A new request whose prefill produced ``h_last`` (and ``h_spec`` after a prefill [SPEC]).

        Without ``h_last`` (a request whose prefill this runtime did not see) OWL has nothing
        to draft from until its first commit.
        """
        return OwlState(h_last, h_spec)

    def finish(self, rid: Hashable) -> None:
        """The request left (finished or aborted)."""

    def reset(self) -> None:
        """Forget every request (the engine flushed its cache)."""

    def route(self, state: OwlState, rid: Hashable, history: Sequence[int],
              max_chain: int | None = None) -> Route | None:
        """How this request drafts this step (None: no draft, one exact token).

        ``max_chain``: the most draft tokens a linear round may verify (the verify width less the
        root; None: the suffix settings alone decide).
        """
        if state.h_last is None:
            return None
        spec = self.config.spec
        return Route(linear=False, use_spec=spec and state.h_spec is not None, attach_spec=spec)

    def linear(self, rid: Hashable) -> list[int]:
        """The suffix chain :meth:`route` chose for a linear round (HOWL)."""
        return []

    def history_hint(self, state: OwlState, rid: Hashable, history: Sequence[int],
                     max_chain: int | None = None) -> float | None:
        """Draft tokens this step's draft is expected to get accepted, judged from the committed
        history before any draft forward (adaptive speculation's hint); None: no such estimate
        (OWL's tree needs its drafter)."""
        return None

    # -- the step ------------------------------------------------------------------------------

    @staticmethod
    def tree_rows(routes: Sequence[Route | None]) -> list[int]:
        """The batch rows whose round drafts an OWL tree (they share one beam)."""
        return [b for b, r in enumerate(routes) if r is not None and not r.linear]

    def beam(self, states: Sequence[OwlState], roots: Sequence[int], routes: Sequence[Route | None]) -> DraftBeam:
        """The drafter's beam for the tree rounds of a batch (rows :meth:`tree_rows`, in order).

        A function of the committed state alone: a runtime may expand it as soon as the last step
        was observed (ahead of the next step) and hand it to :meth:`propose`.
        """
        lstm = self.tree_rows(routes)
        h_last = torch.stack([states[b].h_last for b in lstm])
        has_spec = [routes[b].use_spec for b in lstm]
        h_spec = None
        if any(has_spec):
            h_spec = torch.stack([states[b].h_spec if use else torch.zeros_like(states[b].h_last)
                                  for b, use in zip(lstm, has_spec)])
        return self.expand(h_last, [roots[b] for b in lstm], h_spec, has_spec)

    def propose(self, rids: Sequence[Hashable], states: Sequence[OwlState], roots: Sequence[int],
                routes: Sequence[Route | None], max_nodes: int | None = None,
                beam: DraftBeam | None = None) -> list[Draft]:
        """One draft per request; the tree rounds of the batch share one beam. ``max_nodes``: each
        trie cut to its first that many nodes, the root included (a tree round keeps its beam's
        shallow levels, a linear round its chain's first ``max_nodes - 1`` tokens). [SPEC] leaves
        come on top of the cut: an engine passing its verify width in rows cuts no tree whose
        nodes and leaves fit that width. ``beam``: :meth:`beam` of these very states, roots and
        routes, expanded ahead (None: expanded here)."""
        drafts = [Draft(DraftTree(root), route=route) for root, route in zip(roots, routes)]
        lstm = self.tree_rows(routes)
        if lstm:
            if beam is None:
                beam = self.beam(states, roots, routes)
            for b, tree in zip(lstm, beam_trees(beam, [roots[b] for b in lstm], max_nodes)):
                drafts[b].tree = tree
        for b, (rid, draft, route) in enumerate(zip(rids, drafts, routes)):
            if route is None:
                continue
            if route.linear:
                cap = None if max_nodes is None else max_nodes - 1
                draft.tree.add_path(self.linear(rid)[:cap], Source.SUFFIX)
            draft.depth = draft.tree.max_depth
            if route.attach_spec:
                draft.leaves = attach_spec_leaves(draft.tree, self.spec_token)
        return drafts

    def observe(self, state: OwlState, rid: Hashable, draft: Draft, verdict: Verdict,
                h_last: torch.Tensor, h_spec: torch.Tensor | None) -> None:
        """After the commit: the accepted path's last node's state and its [SPEC] leaf's state.

        ``h_last``/``h_spec``: the verify forward's post-norm rows of ``verdict.nodes[-1]`` and of
        its leaf (None without leaves). Rows the commit dropped are never read again.
        """
        state.h_last = h_last
        state.h_spec = h_spec if draft.leaves else None


class Howl(Owl):
    """OWL trees, or SuffixDecoding chains when they are expected to accept more than ``c`` tokens."""

    def __init__(self, config: OwlConfig, expand: Expand, spec_token: int, suffix: SuffixConfig, howl: HowlConfig):
        super().__init__(config, expand, spec_token)
        self.suffix_config = suffix
        self.policy = HowlPolicy(howl, spec=config.spec)
        self.suffix = SuffixCache(suffix)
        self._chains: dict[Hashable, list[int]] = {}
        # The last suffix draft per request, keyed by (history length, max_chain): a hint and the
        # route of the same step share one walk of the index.
        self._scored: dict[Hashable, tuple[int, int | None, SuffixDraft]] = {}

    def prepare(self, rid: Hashable, history: Sequence[int]) -> None:
        """A prefill committed ``history`` of the request so far: index it for :meth:`start`,
        while the runtime's device runs that prefill (OWL's trees index nothing)."""
        self.suffix.prepare(rid, history)

    def start(self, rid, history, h_last, h_spec=None) -> OwlState:
        state = OwlState(h_last, h_spec, HowlState(has_spec=False))
        self.suffix.start_request(rid, history)  # only what prepare() did not index yet
        return state

    def finish(self, rid) -> None:
        self.suffix.stop_request(rid)
        self._chains.pop(rid, None)
        self._scored.pop(rid, None)

    def reset(self) -> None:
        self.suffix = SuffixCache(self.suffix_config)
        self._chains.clear()
        self._scored.clear()

    def _suffix_draft(self, rid, history, max_chain) -> SuffixDraft:
        key = (len(history), max_chain)
        cached = self._scored.get(rid)
        if cached is not None and cached[:2] == key:
            return cached[2]
        draft = self.suffix.speculate(rid, history, max_chain)
        self._scored[rid] = (*key, draft)
        return draft

    def history_hint(self, state, rid, history, max_chain=None) -> float | None:
        """The suffix chain's score when this step would verify it (above the threshold c); None
        when the step drafts an OWL tree."""
        draft = self._suffix_draft(rid, history, max_chain)
        return draft.score if draft.score > self.policy.threshold else None

    def route(self, state, rid, history, max_chain=None) -> Route | None:
        # The chain is scored as it will be verified: cut to the width before it is compared with c.
        draft = self._suffix_draft(rid, history, max_chain)
        if state.h_last is None and draft.score <= self.policy.threshold:
            return None
        state.howl.has_spec = state.h_spec is not None
        route = self.policy.route(draft.score, state.howl)
        if route.linear:
            self._chains[rid] = list(draft.tokens)
        return route

    def linear(self, rid) -> list[int]:
        return self._chains.pop(rid, [])

    def observe(self, state, rid, draft, verdict, h_last, h_spec) -> None:
        super().observe(state, rid, draft, verdict, h_last, h_spec)
        if draft.route is not None:
            self.policy.update(state.howl, draft.route)
        self.suffix.extend(rid, verdict.tokens)
