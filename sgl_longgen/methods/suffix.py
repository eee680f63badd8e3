"""SUFFIX's per-request logic, shared by the reference runtime and the SGLang worker.

SUFFIX needs no drafter: each step drafts a tree of the continuations the request's own prompt
and output gave the longest matches of its context (:mod:`sgl_longgen.core.suffix_tree`), or
those the outputs of earlier requests gave (the shared corpus, ``suffix.global_requests > 0``),
whichever scores higher. No forward runs but the target's verify, so a runtime only verifies
what :meth:`Suffix.propose` returns.

A request's index is its history exactly: before each query it is grown by the tokens committed
since the last one (:meth:`Suffix.sync`: only the new tokens, whatever kind of step committed
them), so plain steps between speculative ones need no catch-up of their own. A prompt may be
indexed while its prefill runs (:meth:`Suffix.prepare`). The index lives in the request's
state, so a request the runtime forgets takes its index with it; with the shared corpus on, the
method also keeps the running requests' states (the most recent :data:`RUNNING_MAX`) until
:meth:`Suffix.finish` hands their outputs to the corpus.

The tree of one history length and cap is drafted once: adaptive speculation's hint and the
step's draft share it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from ..config import SuffixConfig
from ..core.prepared import Prepared
from ..core.suffix import SuffixCorpus, SuffixIndex
from ..core.suffix_tree import SuffixTree, tree_draft
from .base import Draft

# Running requests whose outputs the shared corpus waits for, at most (requests that leave
# without a finish notice must not pile up: the oldest go first).
RUNNING_MAX = 4096


@dataclass
class SuffixState:
    index: SuffixIndex  # the request's history (prompt and output) as far as the last sync
    start: int  # history tokens at the request's start: the output follows
    drafted: tuple[int, int] | None = None  # (history length, node cap) ``tree`` was drafted at
    tree: SuffixTree = field(default_factory=SuffixTree)


class Suffix:
    def __init__(self, config: SuffixConfig):
        self.config = config
        self.corpus = SuffixCorpus(config) if config.global_requests else None
        self._prepared: Prepared[SuffixIndex] = Prepared()  # prompts indexed ahead of their start
        self._running: OrderedDict[Hashable, SuffixState] = OrderedDict()

    # -- per request ---------------------------------------------------------------------------

    def prepare(self, rid: Hashable, history: Sequence[int]) -> None:
        """Index ``history``, the request's prompt as far as its prefill got, ahead of
        :meth:`start` (a runtime calls this while its device runs the prefill)."""
        self._prepared.put(rid, self._index(rid, history), len(history))

    def start(self, rid: Hashable, history: Sequence[int]) -> SuffixState:
        """A request whose committed tokens are ``history`` (the root last)."""
        state = SuffixState(self._index(rid, history), len(history))
        if self.corpus is not None:
            self._running[rid] = state
            while len(self._running) > RUNNING_MAX:
                self._running.popitem(last=False)
        return state

    def _index(self, rid: Hashable, history: Sequence[int]) -> SuffixIndex:
        """An index of ``history``: the one prepared for the request grown by the rest, or a new one."""
        index, n = self._prepared.take(rid, len(history))
        if index is None:
            index = SuffixIndex.for_config(self.config)
        index.extend(history[n:])
        return index

    def finish(self, rid: Hashable) -> None:
        """The request left: its output joins the shared corpus (when on)."""
        self._prepared.drop(rid)
        state = self._running.pop(rid, None)
        if self.corpus is not None and state is not None:
            self.corpus.add(state.index.sequence[state.start:])

    def reset(self) -> None:
        """Forget every request (the shared corpus of finished outputs stays)."""
        self._prepared.clear()
        self._running.clear()

    # -- the step ------------------------------------------------------------------------------

    @staticmethod
    def sync(state: SuffixState, history: Sequence[int]) -> None:
        """Index the tokens committed since the last call (``history``: committed tokens, root last)."""
        n = len(state.index)
        if n < len(history):
            state.index.extend(history[n:])

    def tree(self, state: SuffixState, history: Sequence[int], max_nodes: int) -> SuffixTree:
        """The request's draft tree of at most ``max_nodes - 1`` nodes (the root excluded)."""
        key = (len(history), max_nodes)
        if state.drafted != key:
            self.sync(state, history)
            cap = max_nodes - 1
            best = tree_draft(state.index, history, self.config, cap, own=True)
            if self.corpus is not None:
                other = tree_draft(self.corpus.index, history, self.config, cap)
                if other.score > best.score:
                    best = other
            state.drafted, state.tree = key, best
        return state.tree

    def history_hint(self, state: SuffixState, history: Sequence[int], max_nodes: int) -> float:
        """Draft tokens this step's tree of ``max_nodes`` nodes is expected to get accepted (its
        score), from the committed tokens alone: adaptive speculation's hint."""
        return self.tree(state, history, max_nodes).score

    def propose(self, state: SuffixState, history: Sequence[int], max_nodes: int, width: int | None = None) -> Draft:
        """The step's trie below the root ``history[-1]``: the tree of ``max_nodes`` nodes (the
        method's whole draft), cut to its first ``width`` nodes when the step verifies fewer."""
        tree = self.tree(state, history, max_nodes).draft_tree(history[-1], width)
        return Draft(tree, depth=tree.max_depth)
