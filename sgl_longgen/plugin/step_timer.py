"""Where a speculative step's time goes, as ``meta_info`` series.

Always: ``longgen_draft_ms`` / ``longgen_verify_ms`` / ``longgen_overhead_ms`` (the verify forward
is synchronised before its mark, so a forward's GPU time is not billed to what follows it).

Detail modes give each section of a step its own ``longgen_<section>_ms`` series:

* ``sync``: every section boundary synchronises the GPU, so a section's figure is its host work
  plus the device work it queued. Slower steps, but each part on its own.
* ``host``: no extra synchronisation; a section's figure is the host time it took, as in an
  undisturbed step. Host work done while a forward runs on the GPU shows up here without
  delaying the step, and the GPU spans of the two forwards come from CUDA events
  (``longgen_draft_gpu_ms``: the draft forward's replay; ``longgen_verify_gpu_ms``: from the
  verify call to the end of its device work).

Both modes also report ``longgen_between_steps_ms``: the time since the worker's previous step
returned, i.e. what SGLang's scheduler does between two steps. TOKENSWIFT queues a step's
draft forward at the end of the step before (``longgen_draft_queued_ahead``: 1.0 when the step
used such a draft): its ``draft_inputs`` / ``draft_plan`` / ``draft_forward`` sections are then
in the series of the step that queued it, and its GPU span in the step that used it.
``longgen_draft_chained`` (1.0) marks a step that queued the next draft on the device right
behind its commit, before reading its draws back. ``longgen_gap_draft_verify_ms`` and
``longgen_gap_verify_draft_ms`` (host mode) are the device time between the draft's end and the
verify's start, and between the previous verify's end and the draft's start.
``longgen_gc_ms``: pauses of Python's garbage collector since the previous step returned.

Detail mode is on for the whole server with ``SGLANG_LONGGEN_STEP_DETAIL=1`` (or ``=host``), or
for the steps of requests whose ``custom_params`` hold ``{"longgen_step_detail": true}`` (or
``"host"``).
"""

from __future__ import annotations

import os
import time

import torch

from .gc_pauses import GcPauses

DETAIL_ENV = "SGLANG_LONGGEN_STEP_DETAIL"
DETAIL_PARAM = "longgen_step_detail"

# The coarse phase each detailed section belongs to.
PHASES = ("draft", "verify", "overhead")


def detail_mode(value) -> str | None:
    """``"sync"``, ``"host"`` or None (off) from an environment or request setting."""
    if value is None or value is False:
        return None
    text = str(value).strip().lower()
    if text == "host":
        return "host"
    return "sync" if text in ("1", "true", "yes", "on", "sync") else None


class StepTimer:
    def __init__(self, device: torch.device, detail: str | bool | None = None):
        self.cuda = device.type == "cuda"
        self.default_detail = detail_mode(os.environ.get(DETAIL_ENV) if detail is None else detail)
        self.detail: str | None = self.default_detail
        self.values: dict[str, float] = {}
        self._phase_start = self._last = 0.0
        self._events: dict[str, list] = {}
        self._finished_at: float | None = None
        self._last_verify_end = None  # the previous step's verify end event (host detail mode)
        self.gc_pauses = GcPauses()

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def start(self, detail: str | bool | None = None) -> None:
        """A new step; ``detail`` (a request's setting) turns a detail mode on for this step."""
        self.detail = self.default_detail or detail_mode(detail)
        self.values = {}
        self._events = {}
        self._phase_start = self._last = now = time.perf_counter()
        if self.detail and self._finished_at is not None:
            # Since our previous step returned: SGLang's scheduler (and any other batch it ran).
            self.values["longgen_between_steps_ms"] = round((now - self._finished_at) * 1e3, 3)

    def section(self, name: str) -> None:
        """End the detailed section ``name`` (recorded only in detail mode)."""
        if not self.detail:
            return
        if self.detail == "sync":
            self._sync()
        now = time.perf_counter()
        self.values[f"longgen_{name}_ms"] = round((now - self._last) * 1e3, 3)
        self._last = now

    def phase(self, name: str, sync: bool = False) -> None:
        """End the coarse phase ``name`` (one of :data:`PHASES`)."""
        if sync or self.detail == "sync":
            self._sync()
        now = time.perf_counter()
        self.values[f"longgen_{name}_ms"] = round((now - self._phase_start) * 1e3, 3)
        self._phase_start = self._last = now

    def gpu_mark(self, name: str) -> None:
        """Start (first call) or end (second call) the GPU span ``name``; host detail mode only."""
        if self.detail != "host" or not self.cuda:
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._events.setdefault(name, []).append(event)

    def note(self, name: str, value: float) -> None:
        """A per-step value besides the timings (``longgen_<name>``), recorded in detail modes."""
        if self.detail:
            self.values[f"longgen_{name}"] = value

    def adopt_gpu_span(self, name: str, events: list) -> None:
        """The GPU span ``name`` of this step from events recorded earlier (work queued ahead)."""
        if self.detail == "host" and self.cuda:
            self._events[name] = list(events)

    def finish(self) -> dict[str, float]:
        """The step's values, with its GPU spans (call after the step's last synchronisation)."""
        for name, events in self._events.items():
            if len(events) == 2:
                events[1].synchronize()
                self.values[f"longgen_{name}_ms"] = round(events[0].elapsed_time(events[1]), 3)
        draft, verify = self._events.get("draft_gpu"), self._events.get("verify_gpu")
        if draft is not None and verify is not None and len(draft) == len(verify) == 2:
            # Where the device waits between the forwards: before this step's verify (the host
            # builds the trie and the verify inputs) and before its draft (the previous step's
            # draws, walk, commit and the draft's inputs).
            self.values["longgen_gap_draft_verify_ms"] = round(draft[1].elapsed_time(verify[0]), 3)
            if self._last_verify_end is not None:
                self.values["longgen_gap_verify_draft_ms"] = round(self._last_verify_end.elapsed_time(draft[0]), 3)
        self._last_verify_end = verify[1] if verify is not None and len(verify) == 2 else None
        self._events = {}
        gc_ms = self.gc_pauses.take()  # since the previous step's end: this step and the scheduler's
        if self.detail:
            self.values["longgen_gc_ms"] = round(gc_ms, 3)
        self._finished_at = time.perf_counter()
        return self.values
