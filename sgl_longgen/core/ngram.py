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
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


# An extend() with more n-grams than this (a prompt) ranks each touched first token once at the end.
_BULK = 512


class NgramPool:
    def __init__(self, n: int = 4, top_k: int = 20):
        if n < 2:
            raise ValueError("n-grams need n >= 2")
        self.n = n
        self.top_k = top_k
        # first token -> {continuation: (count, last start position)}. Tuples, not lists: the
        # garbage collector stops tracking tuples of ints, so a 100K-token pool costs it nothing.
        self._table: dict[int, dict[tuple[int, ...], tuple[int, int]]] = {}
        # first token -> its best continuations (at most top_k), best first
        self._best: dict[int, tuple[tuple[int, ...], ...]] = {}
        self._next_start = 0  # first n-gram start position not indexed yet

    def __len__(self) -> int:
        return sum(len(v) for v in self._table.values())

    @property
    def indexed_until(self) -> int:
        """Every n-gram lying entirely before this position is in the pool."""
        return self._next_start + self.n - 1

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
        table, best_of, k = self._table, self._best, self.top_k
        bulk = count > _BULK
        touched = set()
        for i in range(count):
            first = window[i]
            conts = table.get(first)
            if conts is None:
                conts = table[first] = {}
                best_of[first] = ()
            cont = tuple(window[i + 1 : i + n])
            entry = conts.get(cont)
            entry = conts[cont] = (1, start + i) if entry is None else (entry[0] + 1, start + i)
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
            return list(self._best[int(first)][:k])
        return heapq.nlargest(k, conts, key=conts.__getitem__)


def _promote(best: tuple[tuple[int, ...], ...], cont: tuple[int, ...], entry: tuple[int, int],
             conts: dict[tuple[int, ...], tuple[int, int]], k: int) -> tuple[tuple[int, ...], ...]:
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
