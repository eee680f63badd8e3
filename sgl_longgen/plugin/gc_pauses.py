"""Pauses of Python's cyclic garbage collector, for the step timer's detail mode.

A scheduler process holds millions of objects, so a full collection takes milliseconds; one that
falls between the draft's end and the verify's launch (the device waits for the host there)
adds its whole pause to the step. Reported per step, so a slow step can be told from one that
collected.
"""

from __future__ import annotations

import gc
import time


class GcPauses:
    """Milliseconds spent in collections since the last :meth:`take`."""

    def __init__(self):
        self._ms = 0.0
        self._start: float | None = None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self._ms += (time.perf_counter() - self._start) * 1e3
            self._start = None

    def take(self) -> float:
        ms, self._ms = self._ms, 0.0
        return ms

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
