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


class NgramPool:
    def __init__(self, n: int = 4, top_k: int = 20):
        if n < 2:
            raise ValueError("n-grams need n >= 2")
        self.n = n
        self.top_k = top_k
        # first token -> {continuation: [count, last start position]}
        self._table: dict[int, dict[tuple[int, ...], list[int]]] = {}
        # first token -> its best continuations (at most top_k), best first
        self._best: dict[int, list[tuple[int, ...]]] = {}
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
        if end - n + 1 <= start:
            return
        # One slice, then plain list access: the history may be a view whose items are costly.
        window = [int(t) for t in tokens[start:end]]
        table, best_of, k = self._table, self._best, self.top_k
        for i in range(len(window) - n + 1):
            first = window[i]
            conts = table.get(first)
            if conts is None:
                conts = table[first] = {}
                best_of[first] = []
            cont = tuple(window[i + 1 : i + n])
            entry = conts.get(cont)
            if entry is None:
                entry = conts[cont] = [1, start + i]
            else:
                entry[0] += 1
                entry[1] = start + i
            if k > 0:
                _promote(best_of[first], cont, entry, conts, k)
        self._next_start = end - n + 1

    def lookup(self, first: int, k: int | None = None) -> list[tuple[int, ...]]:
        """Up to ``k`` continuations of ``first``, most frequent first."""
        k = self.top_k if k is None else k
        conts = self._table.get(int(first))
        if not conts or k <= 0:
            return []
        if k <= self.top_k:
            return self._best[int(first)][:k]
        best = heapq.nlargest(k, conts.items(), key=lambda kv: (kv[1][0], kv[1][1]))
        return [c for c, _ in best]


def _promote(best: list[tuple[int, ...]], cont: tuple[int, ...], entry: list[int],
             conts: dict[tuple[int, ...], list[int]], k: int) -> None:
    """``cont``'s key just grew to ``entry``: move it to its place in ``best`` (insertion step)."""
    if cont in best:
        i = best.index(cont)
    elif len(best) < k:
        best.append(cont)
        i = len(best) - 1
    else:
        last = conts[best[-1]]
        if (entry[0], entry[1]) <= (last[0], last[1]):
            return
        best[-1] = cont
        i = k - 1
    key = (entry[0], entry[1])
    while i > 0:
        above = conts[best[i - 1]]
        if (above[0], above[1]) >= key:
            break
        best[i] = best[i - 1]
        i -= 1
    best[i] = cont
