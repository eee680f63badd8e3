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

A long extend (a prompt, a resumed generation) would still pay a Python step per n-gram and a dict
per distinct first token: a fifth of a second for a 98K-token prompt, in the serving loop. So its
n-grams are counted with numpy instead, into a *packed* layer: one record per distinct n-gram
(first token, continuation tokens, count, last start position) in arrays grouped by first token.
A first token lives in the packed layer until an extend touches it, which first unpacks its
records into its dict (the count and last position of each continuation, as the per-token path
would have left them), so ``_table`` is exact for the first tokens it holds and the packed layer
for the others. A lookup of a packed first token ranks its records by ``(count, last position)``,
which is the order of the rank key, and keeps its ``top_k`` rows. Rank keys are distinct within a
first token (one n-gram starts at each position), so the ranking has no ties to break and every
lookup, count and rank is the one the per-token path gives. A later long extend folds the packed
records of untouched first tokens and its own into a new packed layer, and adds its records of
the unpacked first tokens to their dicts. The packed layer is numpy arrays, and a packed first
token's kept rows a tuple of ints: nothing there for the garbage collector to track either.

Counting groups equal n-grams by one sort of a 64-bit key per n-gram: the first token above a
32-bit hash of the continuation, so a sort also groups by first token. Distinct continuations of
one first token may share a hash; the grouping then disagrees with a token-by-token comparison,
which is checked, and the n-grams are sorted by their tokens instead (exact, a few times slower).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

# An extend() with more n-grams than this (a prompt) ranks each touched first token once at the end,
# and counts them with numpy into the packed layer when there are at least 1/_BULK_SHARE as many as
# there are packed records (folding reads them all).
_BULK = 512
_BULK_SHARE = 16
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
        # The packed layer (see the module docstring): record r is the n-gram
        # (_packed_firsts[i], *_packed_conts[r]), i its group, seen _packed_counts[r] times, last
        # at start position _packed_last[r]; group i's records are those from _packed_offsets[i]
        # to _packed_offsets[i + 1]. A first token in _table is no longer read from here.
        self._packed_firsts = np.empty(0, dtype=np.int64)
        self._packed_offsets = np.zeros(1, dtype=np.int64)
        self._packed_conts = np.empty((0, n - 1), dtype=np.int64)
        self._packed_counts = np.empty(0, dtype=np.int64)
        self._packed_last = np.empty(0, dtype=np.int64)
        self._packed_pending = 0  # records of first tokens not unpacked into _table
        self._packed_best: dict[int, tuple[int, ...]] = {}  # first token -> its top_k record rows

    def __len__(self) -> int:
        return sum(len(v) for v in self._table.values()) + self._packed_pending

    @property
    def indexed_until(self) -> int:
        """Every n-gram lying entirely before this position is in the pool."""
        return self._next_start + self.n - 1

    def counts(self) -> dict[int, dict[tuple[int, ...], tuple[int, int]]]:
        """Every indexed n-gram: first token -> {continuation: (count, last start position)}."""
        m, low = self.n - 1, _COUNT_ONE - 1
        out = {first: {unpack(c, m): (v >> POSITION_BITS, v & low) for c, v in conts.items()}
               for first, conts in self._table.items()}
        offsets = self._packed_offsets.tolist()
        for i, first in enumerate(self._packed_firsts.tolist()):
            if first not in self._table:
                lo, hi = offsets[i], offsets[i + 1]
                out[first] = {tuple(c): (k, p) for c, k, p in zip(self._packed_conts[lo:hi].tolist(),
                              self._packed_counts[lo:hi].tolist(), self._packed_last[lo:hi].tolist())}
        return out

    def extend(self, tokens: Sequence[int], limit: int | None = None) -> None:
        """Index the n-grams of ``tokens[:limit]`` not seen yet (``tokens`` only ever grows)."""
        end = len(tokens) if limit is None else min(limit, len(tokens))
        n = self.n
        start = self._next_start
        count = end - n + 1 - start
        if count <= 0:
            return
        # One slice, then plain list (or array) access: the history may be a view whose items are costly.
        piece = tokens[start:end]
        packed = count > _BULK and count * _BULK_SHARE >= self._packed_counts.shape[0]
        if packed:
            try:
                window = np.asarray(piece, dtype=np.int64)
                lo, hi = int(window.min()), int(window.max())
            except OverflowError:  # beyond int64: the message needs the Python values
                lo, hi = min(int(t) for t in piece), max(int(t) for t in piece)
        else:
            window = [int(t) for t in piece]
            lo, hi = min(window), max(window)
        if lo < 0 or hi > _TOKEN_MASK:
            raise ValueError(f"n-gram tokens must lie in [0, 2**{TOKEN_BITS}), got {lo}..{hi}")
        if start + count > _COUNT_ONE:
            raise ValueError(f"n-gram pools index at most 2**{POSITION_BITS} positions")
        if packed:
            self._extend_packed(window, start)
            self._next_start = end - n + 1
            return
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
                conts = self._unpack_first(first)
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
        if conts is None and k > 0:
            return self._packed_lookup(int(first), k)
        if not conts or k <= 0:
            return []
        if k <= self.top_k:
            keys = self._best[int(first)][:k]
        else:
            keys = heapq.nlargest(k, conts, key=conts.__getitem__)
        return [unpack(c, self.n - 1) for c in keys]

    # -- the packed layer ----------------------------------------------------------------------

    def _packed_group(self, first: int) -> tuple[int, int] | None:
        """The record rows ``[lo, hi)`` of ``first`` in the packed layer (None: it has none or it
        was unpacked)."""
        firsts = self._packed_firsts
        i = int(np.searchsorted(firsts, first))
        if i == firsts.shape[0] or firsts[i] != first or first in self._table:
            return None
        return int(self._packed_offsets[i]), int(self._packed_offsets[i + 1])

    def _ranked_rows(self, lo: int, hi: int, k: int) -> list[int]:
        """The best ``k`` rows of ``[lo, hi)`` by ``(count, last position)``, best first."""
        order = np.lexsort((self._packed_last[lo:hi], self._packed_counts[lo:hi]))[::-1][:k]
        return (order + lo).tolist()

    def _packed_lookup(self, first: int, k: int) -> list[tuple[int, ...]]:
        group = self._packed_group(first)
        if group is None:
            return []
        if k > self.top_k:
            rows = self._ranked_rows(*group, k)
        else:
            rows = self._packed_best.get(first)
            if rows is None:
                rows = self._packed_best[first] = tuple(self._ranked_rows(*group, self.top_k))
            rows = rows[:k]
        return [tuple(c) for c in self._packed_conts[list(rows)].tolist()]

    def _unpack_first(self, first: int) -> dict[int, int]:
        """``first``'s dict and best list, from its packed records if it has any (an extend is about
        to touch it)."""
        group = self._packed_group(first)
        conts = self._table[first] = {}
        self._best[first] = ()
        if group is None:
            return conts
        lo, hi = group
        keys = _pack_rows(self._packed_conts[lo:hi])
        conts.update(zip(keys, _entries(self._packed_counts[lo:hi], self._packed_last[lo:hi])))
        if self.top_k > 0:
            rows = self._packed_best.pop(first, None) or self._ranked_rows(lo, hi, self.top_k)
            self._best[first] = tuple(keys[r - lo] for r in rows)
        self._packed_pending -= hi - lo
        return conts

    def _extend_packed(self, window: np.ndarray, start: int) -> None:
        """Index the n-grams starting in ``window`` (at positions ``start, start + 1, ...``) with
        numpy: the records of unpacked first tokens go to their dicts, the rest (with the packed
        records of untouched first tokens) become the new packed layer."""
        n = self.n
        m = window.shape[0] - n + 1
        firsts, offsets, conts, counts, last = _count(window[:m], [window[j : j + m] for j in range(1, n)], None,
                                                      np.arange(start, start + m, dtype=np.int64))
        owner = np.repeat(firsts, np.diff(offsets))  # each record's first token
        unpacked = np.fromiter(self._table, dtype=np.int64, count=len(self._table)) if self._table else None
        if unpacked is not None:
            mine = np.isin(owner, unpacked)
            if mine.any():
                self._add_to_tables(owner[mine], conts[mine], counts[mine], last[mine])
                keep = ~mine
                owner, conts, counts, last = owner[keep], conts[keep], counts[keep], last[keep]
        if self._packed_pending:  # fold in the packed records of the first tokens still packed
            old = np.repeat(self._packed_firsts, np.diff(self._packed_offsets))
            kept = slice(None) if unpacked is None else ~np.isin(old, unpacked)
            both = np.concatenate([self._packed_conts[kept], conts])
            firsts, offsets, conts, counts, last = _count(
                np.concatenate([old[kept], owner]), [both[:, j] for j in range(n - 1)],
                np.concatenate([self._packed_counts[kept], counts]), np.concatenate([self._packed_last[kept], last]))
        elif owner.shape[0] != offsets[-1]:  # some records went to the dicts: regroup the rest
            firsts, offsets = _groups(owner)
        self._packed_firsts, self._packed_offsets = firsts, offsets
        self._packed_conts, self._packed_counts, self._packed_last = conts, counts, last
        self._packed_pending = int(counts.shape[0])
        self._packed_best = {}

    def _add_to_tables(self, owner: np.ndarray, conts: np.ndarray, counts: np.ndarray, last: np.ndarray) -> None:
        """Add counted records (each n-gram once, with its count and latest start) to the dicts of
        their unpacked first tokens, then rank each touched one once."""
        table, touched = self._table, set()
        for first, key, c, p in zip(owner.tolist(), _pack_rows(conts), counts.tolist(), last.tolist()):
            d = table[first]
            entry = d.get(key)
            d[key] = (c if entry is None else (entry >> POSITION_BITS) + c) << POSITION_BITS | p
            touched.add(first)
        if self.top_k > 0:
            for first in touched:
                d = table[first]
                self._best[first] = tuple(heapq.nlargest(self.top_k, d, key=d.__getitem__))


def _pack_rows(conts: np.ndarray) -> list[int]:
    """:func:`pack` of each row of ``conts``: two tokens per 64-bit word in numpy, then the words
    joined as Python ints (one op per word beyond the first, not one per token)."""
    words = []
    for j in range(0, conts.shape[1], 2):
        word = conts[:, j].astype(np.uint64)
        if j + 1 < conts.shape[1]:
            word |= conts[:, j + 1].astype(np.uint64) << np.uint64(TOKEN_BITS)
        words.append(word.tolist())
    keys = words[0]
    for i, word in enumerate(words[1:], 1):
        keys = [k | w << (2 * TOKEN_BITS * i) for k, w in zip(keys, word)]
    return keys


def _entries(counts: np.ndarray, last: np.ndarray) -> list[int]:
    """The rank keys ``count << POSITION_BITS | last`` (Python ints: a count may not fit numpy's)."""
    return [c << POSITION_BITS | p for c, p in zip(counts.tolist(), last.tolist())]


def _groups(owner: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of a sorted ``owner`` and the offsets of their runs."""
    starts = np.flatnonzero(owner[1:] != owner[:-1]) + 1
    firsts = owner[np.concatenate([[0], starts])] if owner.shape[0] else owner
    offsets = np.concatenate([[0], starts, [owner.shape[0]]]) if owner.shape[0] else np.zeros(1)
    return firsts, offsets.astype(np.int64)


_MIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def _cont_hash(conts: list[np.ndarray]) -> np.ndarray:
    """A 32-bit hash of each continuation (its token columns), in a uint64 array."""
    h = np.zeros(conts[0].shape[0], dtype=np.uint64)
    for j, column in enumerate(conts):
        h ^= column.astype(np.uint64)
        h *= np.uint64(_MIX[j % 3])
        h ^= h >> np.uint64(31)
    return h >> np.uint64(32)


def _count(first: np.ndarray, conts: list[np.ndarray], counts: np.ndarray | None, last: np.ndarray):
    """The n-grams ``(first[i], conts[0][i], conts[1][i], ...)`` seen ``counts[i]`` times (None:
    once each), last at start ``last[i]``, with equal ones merged (counts added), grouped by first
    token in ascending order: ``(firsts, offsets, conts, counts, last)`` as the packed layer holds
    them (``conts`` as one ``[records, n - 1]`` array).

    Equal n-grams must come in ascending order of ``last`` (positions, or packed records followed
    by newer ones): both sorts below are stable, so a run's latest start is its last entry.
    One sort of ``first << 32 | hash`` (see the module docstring); if a run of equal keys holds
    different continuations (a hash collision), a sort of the tokens themselves instead.
    """
    key = first.astype(np.uint64) << np.uint64(32) | _cont_hash(conts)
    order = np.argsort(key, kind="stable")
    sorted_key = key[order]
    same = np.flatnonzero(sorted_key[1:] == sorted_key[:-1])  # neighbours that should be equal n-grams
    differs = sorted_key[1:] != sorted_key[:-1]
    if same.size and _differs(first, conts, order[same], order[same + 1]).any():
        order = np.lexsort([*conts[::-1], first])
        differs = _differs(first, conts, order[:-1], order[1:])
    starts = np.concatenate([[0], np.flatnonzero(differs) + 1])
    stops = np.append(starts[1:], order.shape[0])
    rep, latest = order[starts], order[stops - 1]
    firsts, offsets = _groups(first[rep])
    merged = stops - starts if counts is None else np.add.reduceat(counts[order], starts)
    return firsts, offsets, np.stack([c[rep] for c in conts], axis=1), merged, last[latest]


def _differs(first: np.ndarray, conts: list[np.ndarray], a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Do the n-grams at ``a`` and at ``b`` differ (pairwise)?"""
    out = first[a] != first[b]
    for column in conts:
        out |= column[a] != column[b]
    return out


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
