"""LongSpec's per-request logic, shared by the reference runtime and an engine.

A runtime owns the drafter's forwards and memory: a fixed ring of the last ``window`` tokens'
self-attention K/V per request, and read access to the target's committed last-layer K/V. The
method decides what the drafter must be fed this step and turns the beam into a trie:

* ``fed``: how many history tokens the request's ring has seen. A step feeds the history past
  it (the tokens committed since the last step and the new root) - only the last ``window`` of
  them, since older ones fall out of every later window - then expands the beam from the root.
* Nothing of a step survives into the next but the ring: the accepted tokens are simply part of
  the history the next step feeds (their window K/V depend only on token and position, so
  feeding them again gives exactly the K/V a copy from the draft forward would), and plain
  decode steps (adaptive speculation) need no catch-up of their own.

Lossless whatever the drafter proposes: the trie only decides which tokens the verifier may
accept, and every committed token is drawn from the target distribution by the per-node walk.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from ..config import LongSpecConfig
from ..core.longspec_beam import beam_tree
from ..core.owl import DraftBeam
from .base import Draft

# (rids, pending tokens [per request], the position of each one's first pending token) -> DraftBeam [B, N]
Expand = Callable[[Sequence[Hashable], Sequence[Sequence[int]], Sequence[int]], DraftBeam]


@dataclass
class LongSpecState:
    fed: int = 0  # history tokens the drafter's ring has seen (the ring holds the last window of them)


@dataclass(frozen=True)
class Feed:
    """What one step feeds the drafter: ``tokens`` at positions ``start ..``, the root last."""

    tokens: list[int]
    start: int


class LongSpec:
    def __init__(self, config: LongSpecConfig, expand: Expand, window: int):
        self.config = config
        self.expand = expand
        self.window = window

    def start(self, rid: Hashable, history: Sequence[int]) -> LongSpecState:
        """A new request: its ring is empty; the first step feeds the prompt's tail and the root."""
        return LongSpecState()

    def finish(self, rid: Hashable) -> None:
        """The request left (finished or aborted)."""

    def reset(self) -> None:
        """Forget every request (the engine flushed its cache)."""

    def feed(self, state: LongSpecState, history: Sequence[int]) -> Feed:
        """The history past ``state.fed``, cut to the last ``window`` tokens (``history`` ends with the root)."""
        start = max(state.fed, len(history) - self.window)
        return Feed(list(history[start:]), start)

    def propose(self, rids: Sequence[Hashable], states: Sequence[LongSpecState],
                histories: Sequence[Sequence[int]], max_nodes: int | None = None) -> list[Draft]:
        """One trie per request from one batched beam; the rings then hold every history token.
        ``max_nodes``: each trie cut to its first that many nodes (the root included)."""
        feeds = [self.feed(s, h) for s, h in zip(states, histories)]
        beam = self.expand(rids, [f.tokens for f in feeds], [f.start for f in feeds])
        drafts = []
        for b, (state, history) in enumerate(zip(states, histories)):
            state.fed = len(history)
            tree = beam_tree(beam, history[-1], b, max_nodes)
            drafts.append(Draft(tree, depth=tree.max_depth))
        return drafts

    def observe(self, state: LongSpecState, history_len: int) -> None:
        """After a commit: nothing to carry over (the next :meth:`feed` covers the new tokens)."""
