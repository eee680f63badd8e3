"""SuffixDecoding's linear drafts: continue the context's suffix the way the history did most often.

Semantics (those of ArcticInference's suffix tree in path mode, which OWL's HOWL uses, without
its depth limit on the continuation): the "node" of a pattern g has ``count(g)`` = its number of
occurrences in the indexed sequences. For each match length p (the last p context tokens,
``1 <= p < max_depth``) the draft walks from that node to the most frequent child again and
again; each emitted token carries the running probability ``prob *= count(child) / count(node)``,
the walk stops at the budget ``min(max_spec_tokens, floor(factor * p + offset))``, at a pattern
nothing followed, or before a token whose probability would fall below ``min_token_prob``. A
depth-limited tree also stops at depth ``max_depth`` (p + drafted tokens), which caps a repeating
stretch's draft at ``max_depth - p`` tokens, about nothing once the match is long; here the
continuation is read from the history itself, so ``max_depth`` bounds only the match. The draft's
score is the sum of its probabilities (an estimate of how many tokens will be accepted); the
best score over all p wins, ties going to the longer match. Ties between equally frequent
children go to the one seen most recently.

A request's own index (``own=True``: the context *is* the indexed sequence, so the draft continues
it) reads two things a foreign index cannot:

* *the draft as history*: the walk counts occurrences in the indexed sequence followed by the
  tokens drafted so far, which is what the index will hold if they are accepted. An occurrence
  that reaches the end of the history goes on reading the draft instead of dropping out, so a
  stretch seen once before is drafted past the history's end (a loop of period P seen twice
  offers the whole budget, not P tokens at most), and its probability does not halve each time
  an earlier copy runs out.
* *a loop's budget*: when the matched pattern's latest earlier occurrence is at most p tokens
  back, the context ends in two or more back-to-back copies of a period of d <= p tokens; if
  those copies span at least ``loop_min_tokens`` tokens (p + d), the match drafts up to
  ``max_spec_tokens`` whatever ``factor * p + offset`` says. The factor keeps a short match from
  drafting far on thin evidence; a context that already repeats itself is the evidence that it
  goes on repeating (a greedy loop does, to the end).

Either only changes what is proposed, never what is committed: every draft goes through the
verifier's walk like any other.

Data structure: no tree. The indexed tokens live in one growing int array, and each token id maps
to the growing array of *end positions* e of its occurrences (``seq[e - 1] == token``). The
occurrences of the length-p context suffix are those of length p - 1 filtered by one vectorised
comparison (``seq[e - p] == context[-p]``); a walk step groups the tokens that follow the current
occurrences and keeps the positions of the chosen one. Costs:

* indexing: O(1) amortised per token (one array append per token; a long extend: one sort of its
  tokens and one linear merge, below);
* matching: ``O(sum_p |E_p|)`` where ``E_p`` are the occurrences of the length-p suffix; the walk of
  a match costs ``O(|E_p|)`` per drafted token. Both grow with a pattern's copies, without bound on
  a loop (a greedy 8B model looping with period 2 for 90K tokens: 45K copies, 157 ms a query on
  one CPU core), so ``max_occurrences`` (K) keeps the latest K occurrences of the context's last
  token: every query is ``O(K * (max_depth + max_spec_tokens))`` whatever the history. A pattern
  seen more than K times is estimated from its latest copies, and a long match is found only
  among the latest K copies of its last token: what is proposed changes, never what is committed.
  Every operation is a numpy call, and walks are tried in decreasing order of the most they could
  score (their token budget times the share of their occurrences that have a next token), skipping
  those that cannot beat the best score found, so on repetitive text only one or two walks run. On
  a 100K-token history a query takes well under a millisecond to a few milliseconds.

A long extend (a prompt, a resumed generation, a finished output joining the global index) would
still pay one Python step per distinct token: a 98K-token prompt of a 128K vocabulary has about
68K of them, a fifth of a second in the serving loop. So the occurrences live in two layers: a
*packed* layer, every position before ``_packed_until`` grouped by token in three arrays (the
tokens in order, each one's offset, the end positions: a token's occurrences are one slice), and
per-token arrays for the tokens appended to since. A short extend appends to a token's own array,
first copying its packed slice there, so a token's occurrences are its own array if it has one,
its packed slice otherwise: the same ascending positions either way. A long extend (at least
``_BULK`` tokens, and at least 1/``_BULK_SHARE`` of what is packed already) instead merges every
position since ``_packed_until`` into the packed layer (one stable sort of those tokens and one
linear merge: numpy calls only) and drops the per-token arrays, whose positions are all packed by
then. The occurrences, hence every match, walk and draft, are those the per-token path gives.

Memory is about 16 bytes per indexed token (the token and its position entry, plus up to twice a
token's positions while its own array grows from its packed slice). The index holds numpy arrays
and ints only, one array per distinct token and no Python object per token or per occurrence list:
the garbage collector tracks none of them, so
indexing a 100K-token prompt of a 128K vocabulary does not add tens of thousands of objects to
every full collection of the serving process (nor trigger one). Several sequences can
share one index (the global index over past outputs): they are separated by a sentinel that no
context contains, so matches and walks never cross a boundary.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import NamedTuple

import numpy as np

from ..config import SuffixConfig
from .prepared import Prepared

SENTINEL = -1
# An extend of at least this many tokens, and of at least 1/_BULK_SHARE of the packed positions (the
# merge reads them all), is merged into the packed layer (see the module docstring).
_BULK = 1024
_BULK_SHARE = 16
_EMPTY = np.empty(0, dtype=np.int64)


def _with_room(data: np.ndarray | None, size: int, n: int) -> np.ndarray:
    """``data`` (its first ``size`` entries kept) with room for ``n`` more: at least doubled when
    it grows, so appends cost amortised O(1)."""
    if data is not None and size + n <= data.shape[0]:
        return data
    grown = np.empty(max(8, 2 * size, size + n), dtype=np.int64)
    if size:
        grown[:size] = data[:size]
    return grown


class _Growable:
    """An int64 array with amortised O(1) append."""

    __slots__ = ("data", "size")

    def __init__(self, capacity: int = 8):
        self.data = np.empty(capacity, dtype=np.int64)
        self.size = 0

    def append(self, value: int) -> None:
        self.data = _with_room(self.data, self.size, 1)
        self.data[self.size] = value
        self.size += 1

    def extend(self, values: np.ndarray) -> None:
        n = values.shape[0]
        self.data = _with_room(self.data, self.size, n)
        self.data[self.size : self.size + n] = values
        self.size += n

    def view(self) -> np.ndarray:
        return self.data[: self.size]


@dataclass
class SuffixDraft:
    """A linear draft: ``tokens`` with the estimated probability of each, ``score = sum(probs)``."""

    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0


class MatchGroup(NamedTuple):
    """Matches of the context's suffixes that share one occurrence set (see :meth:`SuffixIndex.match_groups`).

    ``members``: (match length p, draft budget) of each, shortest first; ``top``: their largest
    budget; ``bound``: the most a draft from these occurrences can score; ``own``: the
    occurrences end the indexed sequence and the draft continues it.
    """

    bound: float
    top: int
    ends: np.ndarray
    own: bool
    members: list[tuple[int, int]]

    @property
    def longest(self) -> int:
        return self.members[-1][0]


def continuations(seq: np.ndarray, pos: np.ndarray, path, own: bool) -> tuple[np.ndarray, np.ndarray]:
    """The occurrences among ``pos`` (ascending end positions of a pattern in ``seq``) that have a
    next token, and that token. ``own``: the pattern ends ``seq`` and ``path`` continues it (the
    tokens drafted so far): positions past the history read ``path``, and the draft's own
    occurrence, at ``len(seq) + len(path)``, has none."""
    n = seq.shape[0]
    inside = int(np.searchsorted(pos, n))
    if own and inside < pos.size:
        pos = pos[pos < n + len(path)]
        nxt = np.empty(pos.size, dtype=np.int64)
        nxt[:inside] = seq[pos[:inside]]
        nxt[inside:] = np.asarray(path, dtype=np.int64)[pos[inside:] - n]
    else:
        pos = pos[:inside]
        nxt = seq[pos]
    keep = nxt != SENTINEL
    if not keep.all():
        pos, nxt = pos[keep], nxt[keep]
    return pos, nxt


class SuffixIndex:
    """Occurrence index over one or more token sequences (see the module docstring)."""

    def __init__(self, max_depth: int = 64, max_occurrences: int = 0):
        if max_depth < 2:
            raise ValueError("max_depth must be at least 2")
        if max_occurrences < 0:
            raise ValueError("max_occurrences must be >= 0 (0: all)")
        self.max_depth = max_depth
        self.max_occurrences = max_occurrences
        self._seq = _Growable(1024)
        # token -> its end positions, in an array with room to grow, and how many there are: the
        # tokens appended to since the last merge. Arrays and ints only: the garbage collector
        # tracks neither (see the module docstring).
        self._ends: dict[int, np.ndarray] = {}
        self._sizes: dict[int, int] = {}
        # The packed layer: the end positions e <= _packed_until grouped by token (ascending within
        # one), _packed_tokens[i]'s at _packed_ends[_packed_offsets[i]:_packed_offsets[i + 1]].
        self._packed_until = 0
        self._packed_tokens = _EMPTY
        self._packed_offsets = np.zeros(1, dtype=np.int64)
        self._packed_ends = _EMPTY

    @classmethod
    def for_config(cls, config: SuffixConfig) -> SuffixIndex:
        return cls(config.max_depth, config.max_occurrences)

    def __len__(self) -> int:
        return self._seq.size

    @property
    def nbytes(self) -> int:
        """Bytes of the index's arrays (the tokens, the occurrence lists, the packed layer, their spare room)."""
        return (self._seq.data.nbytes + sum(a.nbytes for a in self._ends.values()) + self._packed_tokens.nbytes
                + self._packed_offsets.nbytes + self._packed_ends.nbytes)

    @property
    def sequence(self) -> np.ndarray:
        """The indexed tokens, sequences separated by :data:`SENTINEL` (a view: read, never write)."""
        return self._seq.view()

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the current (last) sequence."""
        arr = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if arr.size == 0:
            return
        if (arr < 0).any():
            raise ValueError("token ids must be non-negative")
        start = self._seq.size
        self._seq.extend(arr)
        if arr.size >= _BULK and arr.size * _BULK_SHARE >= self._packed_ends.size:
            self._merge()
            return
        ends = np.arange(start + 1, start + 1 + arr.size, dtype=np.int64)
        if arr.size > 64:
            # Group by token: one append per distinct token instead of one per position.
            order = np.argsort(arr, kind="stable")
            sorted_tokens = arr[order]
            cuts = np.flatnonzero(np.diff(sorted_tokens)) + 1
            for group in np.split(order, cuts):
                self._append(int(arr[group[0]]), ends[group])
        else:
            for tok, e in zip(arr.tolist(), ends.tolist()):
                self._append(tok, e)

    def end_sequence(self) -> None:
        """Close the current sequence: the next tokens start a new one."""
        if self._seq.size and self._seq.data[self._seq.size - 1] != SENTINEL:
            self._seq.append(SENTINEL)

    def _merge(self) -> None:
        """Move every position since ``_packed_until`` into the packed layer.

        The new positions are grouped by token with a stable sort (ascending within a token), then
        merged after the packed ones: a stable sort of two sorted runs is one linear merge, and
        a token's packed positions all come before its new ones. The per-token arrays only ever
        hold positions that are packed now, so they go.
        """
        seq, until = self._seq.view(), self._packed_until
        tokens = seq[until:]
        ends = np.arange(until + 1, seq.shape[0] + 1, dtype=np.int64)
        real = tokens != SENTINEL
        if not real.all():
            tokens, ends = tokens[real], ends[real]
        order = np.argsort(tokens, kind="stable")
        tokens, ends = tokens[order], ends[order]
        if self._packed_ends.size:
            packed = np.repeat(self._packed_tokens, np.diff(self._packed_offsets))
            tokens = np.concatenate([packed, tokens])
            order = np.argsort(tokens, kind="stable")
            tokens, ends = tokens[order], np.concatenate([self._packed_ends, ends])[order]
        starts = np.flatnonzero(tokens[1:] != tokens[:-1]) + 1
        self._packed_tokens = tokens[np.concatenate([[0], starts])]
        self._packed_offsets = np.concatenate([[0], starts, [tokens.size]]).astype(np.int64)
        self._packed_ends = ends
        self._packed_until = seq.shape[0]
        self._ends, self._sizes = {}, {}

    def _packed(self, tok: int) -> np.ndarray | None:
        """``tok``'s packed end positions (a view), None if it has none."""
        tokens = self._packed_tokens
        i = int(np.searchsorted(tokens, tok))
        if i == tokens.shape[0] or tokens[i] != tok:
            return None
        return self._packed_ends[self._packed_offsets[i] : self._packed_offsets[i + 1]]

    def _append(self, tok: int, ends) -> None:
        """Append end positions (an int or an array) to ``tok``'s, in amortised O(1) per position.

        A token's first append since the last merge copies its packed positions into its own array
        (``_with_room`` always copies a slice that has no room), which holds them all from then on.
        """
        n = 1 if isinstance(ends, int) else ends.shape[0]
        size = self._sizes.get(tok)
        if size is None:
            data = self._packed(tok)
            size = 0 if data is None else data.shape[0]
        else:
            data = self._ends[tok]
        data = self._ends[tok] = _with_room(data, size, n)
        data[size : size + n] = ends
        self._sizes[tok] = size + n

    def _occurrences(self, tok: int) -> np.ndarray | None:
        """End positions of ``tok``'s occurrences, ascending; None if it never occurred."""
        data = self._ends.get(tok)
        if data is None:
            return self._packed(tok)
        return data[: self._sizes[tok]]

    # -- queries -------------------------------------------------------------------------------

    def matches(self, context: Sequence[int]) -> list[np.ndarray]:
        """``E_p`` for p = 1, 2, ...: end positions of the occurrences of ``context[-p:]``.

        Stops at ``max_depth - 1`` and as soon as no occurrence has a continuation (longer
        matches cannot have one either).
        """
        ctx = list(context[-(self.max_depth - 1):]) if self.max_depth > 1 else []
        out: list[np.ndarray] = []
        if not ctx:
            return out
        ends = self._occurrences(int(ctx[-1]))
        if ends is None:
            return out
        if self.max_occurrences and ends.size > self.max_occurrences:
            ends = ends[-self.max_occurrences:]  # the latest copies (see the module docstring)
        seq = self._seq.view()
        n = seq.shape[0]
        for p in range(1, len(ctx) + 1):
            if p > 1:
                ends = ends[ends >= p]
                ends = ends[seq[ends - p] == ctx[-p]]
            if ends.size == 0:
                break
            follow = ends[ends < n]
            if follow.size == 0 or not (seq[follow] != SENTINEL).any():
                break
            out.append(ends)
        return out

    def walk(self, ends: np.ndarray, budget: int, min_token_prob: float, own: bool = False) -> SuffixDraft:
        """The most-frequent-continuation path from the pattern ending at ``ends`` (ascending).

        ``own``: the pattern ends the indexed sequence (``ends[-1] == len(self)``), and the draft
        continues it: an occurrence that reaches the end reads the tokens drafted so far.
        """
        seq = self._seq.view()
        draft = SuffixDraft()
        count = ends.size
        prob = 1.0
        cur = ends
        drafted = np.empty(budget if own else 0, dtype=np.int64)
        while len(draft.tokens) < budget:
            # Positions ascend: the ones past the history are the last few (own walks only). The
            # draft's own occurrence sits at the token being drafted, n + len, and drops out.
            pos, nxt = continuations(seq, cur, drafted[: len(draft.tokens)], own)
            if nxt.size == 0:
                break
            first = nxt[0]
            if (nxt == first).all():
                tok, c = int(first), nxt.size
            else:
                values, inverse, counts = np.unique(nxt, return_inverse=True, return_counts=True)
                top = counts.max()
                tied = np.flatnonzero(counts == top)
                if tied.size == 1:
                    choice = int(tied[0])
                else:
                    last = np.full(values.size, -1, dtype=np.int64)
                    np.maximum.at(last, inverse, pos)
                    choice = int(tied[np.argmax(last[tied])])
                tok, c = int(values[choice]), int(top)
            new_prob = prob * c / count
            if new_prob < min_token_prob:
                break
            prob = new_prob
            if own:
                drafted[len(draft.tokens)] = tok
            draft.tokens.append(tok)
            draft.probs.append(prob)
            draft.score += prob
            cur = pos[nxt == tok] + 1
            count = c
        return draft

    def speculate(
        self,
        context: Sequence[int],
        max_spec_tokens: int = 64,
        max_spec_factor: float = 1.0,
        max_spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
        own: bool = False,
        loop_min_tokens: int = 0,
    ) -> SuffixDraft:
        """The best linear draft continuing ``context`` (its last ``max_depth - 1`` tokens are used):
        over every match length p, the highest score, ties going to the longer match.

        ``own``: ``context`` is this index's own sequence (a request's local index), so the walk
        reads its draft as history and a loop's budget applies from ``loop_min_tokens`` tokens of
        back-to-back copies (0: never); see the module docstring. Both need the pattern to end the
        indexed sequence, which the context's own suffix does.

        One walk per distinct occurrence set, not per p: a longer match's occurrences are a subset
        of a shorter one's, so matches of equal counts have the same occurrences, and a walk does
        not depend on its budget until it stops (a smaller budget's draft is a prefix of a larger
        one's, its score the prefix's sum). On a repeating stretch every p from the loop's length
        up shares one set, and the walks drop from one per p to one.
        """
        best = SuffixDraft()
        for group in self.match_groups(context, max_spec_tokens, max_spec_factor, max_spec_offset, own,
                                       loop_min_tokens):
            if group.bound < best.score or (group.bound == best.score and group.longest < best.match_len):
                break
            walked = self.walk(group.ends, group.top, min_token_prob, group.own)
            scores = list(accumulate(walked.probs))
            for p, budget in group.members:
                n_tokens = min(budget, len(walked.tokens))
                score = scores[n_tokens - 1] if n_tokens else 0.0
                if score > best.score or (score == best.score and p > best.match_len):
                    best = SuffixDraft(walked.tokens[:n_tokens], walked.probs[:n_tokens], score, p)
        return best

    def match_groups(self, context: Sequence[int], max_spec_tokens: int, max_spec_factor: float,
                     max_spec_offset: float, own: bool = False, loop_min_tokens: int = 0) -> list[MatchGroup]:
        """The matches of ``context``'s suffixes with a positive budget, one group per distinct
        occurrence set, highest :attr:`MatchGroup.bound` first (longer matches first among equals):
        the order in which a search for the best draft walks them, stopping at the first group
        whose bound cannot beat the best score found (see :meth:`speculate`)."""
        n = len(self)
        groups: list[tuple[np.ndarray, bool, list[tuple[int, int]]]] = []  # occurrences, own, [(p, budget)]
        for p, ends in enumerate(self.matches(context), 1):
            mine = own and int(ends[-1]) == n
            budget = min(max_spec_tokens, int(p * max_spec_factor + max_spec_offset + 1e-6))
            if mine and loop_min_tokens and ends.size > 1:
                back = n - int(ends[-2])  # the latest earlier copy of the pattern
                if back <= p and p + back >= loop_min_tokens:
                    budget = max_spec_tokens
            if budget <= 0:
                continue
            if groups and groups[-1][0].size == ends.size:
                groups[-1][2].append((p, budget))
            else:
                groups.append((ends, mine, [(p, budget)]))
        # A draft's j-th probability is (occurrences still on its path) / (occurrences of the
        # pattern), and an occurrence at the end of the history has no next token, so a score
        # never exceeds budget * (k - ends_at_n) / k. Highest bounds first (longer matches first
        # among equals); once a bound cannot beat the best score the rest are skipped. On a loop
        # the pattern with the most copies comes first and reaches its bound: one walk.
        ranked = []
        for ends, mine, members in groups:
            top = max(b for _, b in members)
            k = ends.size
            ranked.append(MatchGroup(top * (k - int(int(ends[-1]) == n)) / k, top, ends, mine, members))
        ranked.sort(key=lambda g: (-g.bound, -g.longest))
        return ranked

    def draft(self, context: Sequence[int], config: SuffixConfig, max_spec_tokens: int | None = None,
              own: bool = False) -> SuffixDraft:
        """:meth:`speculate` with ``config``'s settings (``max_spec_tokens``: a tighter cap, e.g.
        the verify width)."""
        c = config
        limit = c.max_spec_tokens if max_spec_tokens is None else min(max_spec_tokens, c.max_spec_tokens)
        return self.speculate(context[-c.max_depth:], limit, c.max_spec_factor, c.max_spec_offset, c.min_token_prob,
                              own=own, loop_min_tokens=c.loop_min_tokens)


class SuffixCorpus:
    """Past outputs shared across requests (SuffixDecoding's global tree), in one index.

    Keeps the latest ``config.global_requests`` outputs, at most ``config.global_tokens`` tokens
    in all (an output longer than that, its last ``global_tokens``); older ones are dropped
    first. Eviction is lazy: the index is rebuilt from the kept outputs once it holds twice as
    many outputs or tokens as are kept, so it costs amortised O(1) per token and the index holds
    at most twice the bound (matches may read the outputs evicted since the last rebuild).
    """

    def __init__(self, config: SuffixConfig):
        self.config = config
        self.max_sequences = max(1, config.global_requests)
        self.max_tokens = config.global_tokens
        self.index = SuffixIndex.for_config(config)
        self._kept: deque[np.ndarray] = deque()
        self._kept_tokens = 0
        self._indexed_sequences = 0
        self._indexed_tokens = 0

    def add(self, tokens: Sequence[int]) -> None:
        """A finished request's output joins the corpus."""
        arr = np.array(np.asarray(tokens, dtype=np.int64).reshape(-1)[-self.max_tokens:])  # a copy: kept
        if arr.size == 0:
            return
        self._kept.append(arr)
        self._kept_tokens += arr.size
        while len(self._kept) > self.max_sequences or self._kept_tokens > self.max_tokens:
            self._kept_tokens -= self._kept.popleft().size
        self.index.end_sequence()
        self.index.extend(arr)
        self._indexed_sequences += 1
        self._indexed_tokens += arr.size
        if self._indexed_sequences > 2 * self.max_sequences or self._indexed_tokens > 2 * self.max_tokens:
            index = SuffixIndex.for_config(self.config)
            for kept in self._kept:
                index.end_sequence()
                index.extend(kept)
            self.index = index
            self._indexed_sequences, self._indexed_tokens = len(self._kept), self._kept_tokens


class SuffixCache:
    """Per-request local indexes (prompt + output) and an optional global index over past outputs.

    ``start_request`` indexes a prompt; ``extend`` adds generated tokens to the request's local
    index; ``stop_request`` drops it and, when the global index is on, adds the request's output
    there (a :class:`SuffixCorpus`: the outputs of the last ``config.global_requests`` finished
    requests, at most ``config.global_tokens`` tokens). A query keeps the better of the local and
    the global draft (local wins ties).
    """

    def __init__(self, config: SuffixConfig):
        self.config = config
        self._local: dict[Hashable, SuffixIndex] = {}
        self._prepared: Prepared[SuffixIndex] = Prepared()  # prompts indexed ahead of their start
        self._outputs: dict[Hashable, list[int]] = {}
        self._corpus: SuffixCorpus | None = SuffixCorpus(config) if config.global_requests else None

    def prepare(self, rid: Hashable, tokens: Sequence[int]) -> None:
        """Index ``tokens``, the request's prompt as far as its prefill got (one chunk more per
        call), ahead of :meth:`start_request`, which then indexes only the rest: the runtime
        does this while the device runs the prefill, not at the first step with the device
        waiting (a 32K prompt takes milliseconds). The index is the one ``start_request`` would
        build: an index grows by appending, in any pieces."""
        self._prepared.put(rid, self._grown(rid, tokens), len(tokens))

    def start_request(self, rid: Hashable, prompt: Sequence[int]) -> None:
        self._local[rid] = self._grown(rid, prompt)
        if self._corpus is not None:
            self._outputs[rid] = []

    def _grown(self, rid: Hashable, tokens: Sequence[int]) -> SuffixIndex:
        """An index of ``tokens``: the one prepared for the request grown by the rest, or a new one."""
        index, n = self._prepared.take(rid, len(tokens))
        if index is None:
            index = SuffixIndex.for_config(self.config)
        index.extend(tokens[n:])
        return index

    def extend(self, rid: Hashable, tokens: Sequence[int]) -> None:
        self._local[rid].extend(tokens)
        if rid in self._outputs:
            self._outputs[rid].extend(int(t) for t in tokens)

    def stop_request(self, rid: Hashable) -> None:
        self._local.pop(rid, None)
        self._prepared.drop(rid)
        output = self._outputs.pop(rid, None)
        if self._corpus is not None and output:
            self._corpus.add(output)

    def speculate(self, rid: Hashable, context: Sequence[int], max_spec_tokens: int | None = None) -> SuffixDraft:
        """The best linear draft after ``context`` (the request's committed tokens, root included)."""
        best = SuffixDraft()
        if rid in self._local:  # the request's own sequence: its draft continues it
            best = self._local[rid].draft(context, self.config, max_spec_tokens, own=True)
        if self._corpus is not None:
            other = self._corpus.index.draft(context, self.config, max_spec_tokens)
            if other.score > best.score:
                best = other
        return best
