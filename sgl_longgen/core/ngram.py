"""Token reutilization: an n-gram pool over the history.

Long generations repeat themselves (names, code idioms, refrains), so continuations seen before
are cheap, often-correct drafts. The pool maps a first token to the (n-1)-token continuations that
followed it, with their counts; a lookup returns the most frequent ones, ties going to the most
recently seen. It grows incrementally as tokens are committed and is never evicted.

A lookup happens every step for a token the model just proposed, which in long natural text is
often one with thousands of distinct continuations (",", "the", an indent). So each first token
keeps its ``top_k`` best continuations in order, updated as n-grams are indexed: a
continuation's rank key ``(count, last position)`` only ever grows, so whatever is outside the
kept list stays below its last entry until it overtakes it, and the list is exact at all times.

Everything the pool keeps is a plain int: a continuation is its tokens packed into one int
(:data:`TOKEN_BITS` bits each), its rank key ``count << POSITION_BITS | last position`` (ints
order like the pairs). Python's garbage collector never tracks ints, nor dicts holding only ints,
so a pool indexing a 100K-token prompt adds nothing to the collector's heap. Tuples and inner
dicts did: over a hundred thousand container objects per long request, which pushed the serving
process into full collections (half a second each on a scheduler-sized heap), in whatever decode
step they fell. Packing changes no count, rank or lookup.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

# An extend() with more n-grams than this (a prompt) ranks each touched first token once at the end.
_BULK = 512
TOKEN_BITS = 32  # token ids below 2**32
POSITION_BITS = 48  # n-gram start positions below 2**48
_TOKEN_MASK = (1 << TOKEN_BITS) - 1
_COUNT_ONE = 1 << POSITION_BITS


def pack(tokens: Sequence[int]) -> int:
    """A continuation as one int (first token in the low bits)."""
    key = 0
    for i, t in enumerate(tokens):
        key |= t << (TOKEN_BITS * i)
    return key


def unpack(key: int, length: int) -> tuple[int, ...]:
    return tuple((key >> (TOKEN_BITS * i)) & _TOKEN_MASK for i in range(length))


class NgramPool:
    def __init__(self, n: int = 4, top_k: int = 20):
        if n < 2:
            raise ValueError("n-grams need n >= 2")
        self.n = n
        self.top_k = top_k
        # first token -> {packed continuation: count << POSITION_BITS | last start position}
        self._table: dict[int, dict[int, int]] = {}
        # first token -> its best packed continuations (at most top_k), best first
        self._best: dict[int, tuple[int, ...]] = {}
        self._next_start = 0  # first n-gram start position not indexed yet

    def __len__(self) -> int:
        return sum(len(v) for v in self._table.values())

    @property
    def indexed_until(self) -> int:
        """Every n-gram lying entirely before this position is in the pool."""
        return self._next_start + self.n - 1

    def counts(self) -> dict[int, dict[tuple[int, ...], tuple[int, int]]]:
        """Every indexed n-gram: first token -> {continuation: (count, last start position)}."""
        m, low = self.n - 1, _COUNT_ONE - 1
        return {first: {unpack(c, m): (v >> POSITION_BITS, v & low) for c, v in conts.items()}
                for first, conts in self._table.items()}

    def extend(self, tokens: Sequence[int], limit: int | None = None) -> None:
        """Index the n-grams of ``tokens[:limit]`` not seen yet (``tokens`` only ever grows)."""
        end = len(tokens) if limit is None else min(limit, len(tokens))
        n = self.n
        start = self._next_start
        count = end - n + 1 - start
        if count <= 0:
            return
        # One slice, then plain list access: the history may be a view whose items are costly.
        window = [int(t) for t in tokens[start:end]]
        if min(window) < 0 or max(window) > _TOKEN_MASK:
            raise ValueError(f"n-gram tokens must lie in [0, 2**{TOKEN_BITS}), got {min(window)}..{max(window)}")
        if start + count > _COUNT_ONE:
            raise ValueError(f"n-gram pools index at most 2**{POSITION_BITS} positions")
        # The packed continuations of every start, by a rolling shift (one int op per token).
        shift = TOKEN_BITS * (n - 2)
        keys = [0] * count
        key = pack(window[1:n - 1])
        for i in range(count):
            key |= window[i + n - 1] << shift
            keys[i] = key
            key >>= TOKEN_BITS
        table, best_of, k = self._table, self._best, self.top_k
        bulk = count > _BULK
        touched = set()
        for i in range(count):
            first = window[i]
            conts = table.get(first)
            if conts is None:
                conts = table[first] = {}
                best_of[first] = ()
            cont = keys[i]
            entry = conts.get(cont)
            position = start + i
            entry = conts[cont] = _COUNT_ONE | position if entry is None else (entry | (_COUNT_ONE - 1)) + 1 + position
            if k <= 0:
                continue
            if bulk:
                touched.add(first)
            else:
                best_of[first] = _promote(best_of[first], cont, entry, conts, k)
        for first in touched:
            conts = table[first]
            best_of[first] = tuple(heapq.nlargest(k, conts, key=conts.__getitem__))
        self._next_start = end - n + 1

    def lookup(self, first: int, k: int | None = None) -> list[tuple[int, ...]]:
        """Up to ``k`` continuations of ``first``, most frequent first."""
        k = self.top_k if k is None else k
        conts = self._table.get(int(first))
        if not conts or k <= 0:
            return []
        if k <= self.top_k:
            keys = self._best[int(first)][:k]
        else:
            keys = heapq.nlargest(k, conts, key=conts.__getitem__)
        return [unpack(c, self.n - 1) for c in keys]


def _promote(best: tuple[int, ...], cont: int, entry: int, conts: dict[int, int], k: int) -> tuple[int, ...]:
    """``best`` after ``cont``'s key grew to ``entry`` (one insertion step)."""
    if cont in best:
        rest = [c for c in best if c != cont]
    elif len(best) < k:
        rest = list(best)
    elif entry <= conts[best[-1]]:
        return best
    else:
        rest = list(best[:-1])
    i = len(rest)
    while i > 0 and conts[rest[i - 1]] < entry:
        i -= 1
    rest.insert(i, cont)
    return tuple(rest)
