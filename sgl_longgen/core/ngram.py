"""Token reutilization: an n-gram pool over the history.

Long generations repeat themselves (names, code idioms, refrains), so continuations seen before
are cheap, often-correct drafts. The pool maps a first token to the (n-1)-token continuations that
followed it, with their counts; a lookup returns the most frequent ones, ties going to the most
recently seen. It grows incrementally as tokens are committed and is never evicted.
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
        table = self._table
        for i in range(len(window) - n + 1):
            conts = table.get(window[i])
            if conts is None:
                conts = table[window[i]] = {}
            cont = tuple(window[i + 1 : i + n])
            entry = conts.get(cont)
            if entry is None:
                conts[cont] = [1, start + i]
            else:
                entry[0] += 1
                entry[1] = start + i
        self._next_start = end - n + 1

    def lookup(self, first: int, k: int | None = None) -> list[tuple[int, ...]]:
        """Up to ``k`` continuations of ``first``, most frequent first."""
        k = self.top_k if k is None else k
        conts = self._table.get(int(first))
        if not conts or k <= 0:
            return []
        best = heapq.nlargest(k, conts.items(), key=lambda kv: (kv[1][0], kv[1][1]))
        return [c for c, _ in best]
