"""What a runtime computed for a request ahead of its first step, until that step takes it.

A long prompt's indexes (n-grams, suffixes) take milliseconds to build. A runtime that builds
them while its device runs the prompt's prefill, chunk by chunk, keeps them here, keyed by
request, with the length of the history they cover; the request's first step takes them and
indexes only the rest. Requests that never start (aborted in their prefill) must not pile up:
the oldest entries go once there are ``limit``.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

T = TypeVar("T")

# Requests prepared ahead of their start, at most (the oldest go first).
PREPARED_MAX = 1024


class Prepared(Generic[T]):
    def __init__(self, limit: int = PREPARED_MAX):
        self.limit = limit
        self._entries: dict[Hashable, tuple[T, int]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, rid: Hashable, value: T, length: int) -> None:
        """``value`` covers the first ``length`` tokens of the request's history."""
        self._entries.pop(rid, None)
        self._entries[rid] = (value, length)
        while len(self._entries) > self.limit:
            del self._entries[next(iter(self._entries))]

    def take(self, rid: Hashable, length: int) -> tuple[T | None, int]:
        """The request's entry, removed, if it covers at most ``length`` tokens (a prefix of a
        history that long): (value, its length); else (None, 0)."""
        value, covered = self._entries.pop(rid, (None, 0))
        return (value, covered) if value is not None and covered <= length else (None, 0)

    def drop(self, rid: Hashable) -> None:
        self._entries.pop(rid, None)

    def clear(self) -> None:
        self._entries.clear()
