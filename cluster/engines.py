"""Engine actors: one loaded model each, streaming generations back to the driver.

Every engine kind has the same face: ``info()`` once started, and ``generate(task)``, a generator
that yields :class:`Progress` messages (at most ``report_every`` tokens apart, or
``report_seconds`` apart, whichever comes first) and ends with one :class:`Finished`. The driver
calls it with ``num_returns="streaming"``, so tokens reach the driver (and its checkpoints) while
the generation is still running.

The kinds live in their own modules (:mod:`.reference_engine`, :mod:`.sglang_engine`), sharing
only :mod:`.engine_common`; this module is the one place that knows both, and imports the SGLang
adapter only when a job asks for it.
"""

from __future__ import annotations

from ..errors import LonggenError
from .reference_engine import ReferenceEngine


def actor_class(runtime: str):
    """The engine class for a runtime; the SGLang one is imported only when asked for, so a
    reference job's driver and actors never load the adapter's dependencies."""
    if runtime == "reference":
        return ReferenceEngine
    if runtime == "sglang":
        from .sglang_engine import SGLangEngine

        return SGLangEngine
    raise LonggenError(f"unknown runtime {runtime!r}")
