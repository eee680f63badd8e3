"""Python's cyclic garbage collector around a speculative step: measured, and kept off the
stretch where the device waits for the host.

A scheduler process holds millions of objects, so a full collection takes milliseconds. Between
the draft's end and the verify's launch the GPU is idle until the host has built the tries and
the verify inputs; a collection that falls there adds its whole pause to the step. Deferred
(:func:`deferred_gc`), the same collection runs at the first allocation after the block, while
the verify forward keeps the device busy. :class:`GcPauses` measures the pauses for the step
timer's detail mode.
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager


@contextmanager
def deferred_gc():
    """No automatic collection inside the block (a pending one runs after it)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


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
