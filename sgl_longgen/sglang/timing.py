"""Opt-in timing of a speculative step, reported per request in ``meta_info``.

Off unless a request asks: ``"custom_params": {"longgen_timing": "host"}`` (or ``"sync"``, or
true for ``"sync"``; parsed at admission, :mod:`.request_settings`). A step that serves such a
request records, for that request only,

* ``longgen_draft_ms`` / ``longgen_verify_ms`` / ``longgen_overhead_ms``: the step's three
  phases (the verify phase ends when its draws are on the host);
* ``longgen_<section>_ms`` for each section of the step, ``longgen_between_steps_ms`` (the time
  since the worker's previous step returned: SGLang's scheduler), ``longgen_gc_ms`` (garbage
  collection inside the step) and the drafter's notes (``longgen_draft_queued_ahead``,
  ``longgen_draft_chained``: 1.0 when the step used a draft queued ahead / chained the next one;
  ``longgen_linear_steps``: HOWL's requests that verified a suffix chain that step);
* in ``host`` mode, the forwards' GPU spans from CUDA events (``longgen_draft_gpu_ms``,
  ``longgen_verify_gpu_ms``) and the device time between them
  (``longgen_gap_draft_verify_ms``, ``longgen_gap_verify_draft_ms``); in ``sync`` mode every
  section synchronises the GPU, so its figure includes the device work it queued (slower steps).

SGLang streams ``customized_info`` one entry per output token, so a step's values sit on the
first token it committed and its other tokens get None; at most ``longgen_timing_steps`` steps
(default :data:`DEFAULT_STEPS`) are recorded per request, so a 100K-token request cannot grow
them without bound.
"""

from __future__ import annotations

import gc
import time

import torch

from .request_settings import DEFAULT_TIMING_STEPS as DEFAULT_STEPS  # noqa: F401 - the request's keys
from .request_settings import TIMING_PARAM  # noqa: F401
from .request_settings import TIMING_STEPS_PARAM as STEPS_PARAM  # noqa: F401
from .request_settings import settings_of

PHASES = ("draft", "verify", "overhead")


class StepClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.mode: str | None = None
        self.values: dict[str, float] = {}
        self._timed: list = []  # the batch's requests that asked
        self._recorded: dict[str, int] = {}  # steps recorded per request id
        self._events: dict[str, list] = {}
        self._phase_start = self._last = 0.0
        self._finished_at: float | None = None
        self._last_verify_end = None  # the previous step's verify end event (host mode)
        self._gc_ms = 0.0
        self._gc_start: float | None = None

    @property
    def active(self) -> bool:
        return self.mode is not None

    # -- a step --------------------------------------------------------------------------------

    def start(self, reqs) -> None:
        """A new step: timed if one of its requests asked (and has steps left to record)."""
        self._timed, mode = [], None
        for req in reqs:
            settings = settings_of(req)
            want = settings.timing
            if want is None or self._recorded.get(req.rid, 0) >= settings.timing_steps:
                continue
            self._timed.append(req)
            mode = "sync" if "sync" in (mode, want) else want
        self.mode = mode
        if self._on_gc in gc.callbacks:  # a step that raised before finishing
            gc.callbacks.remove(self._on_gc)
        if mode is None:
            return
        self.values, self._events = {}, {}
        self._phase_start = self._last = now = time.perf_counter()
        if self._finished_at is not None:
            self.values["longgen_between_steps_ms"] = round((now - self._finished_at) * 1e3, 3)
        self._gc_ms, self._gc_start = 0.0, None
        gc.callbacks.append(self._on_gc)

    def section(self, name: str) -> None:
        """End the section ``name``."""
        now = self._lap(name, "_last")
        if now is not None:
            self._last = now

    def phase(self, name: str) -> None:
        """End the coarse phase ``name`` (one of :data:`PHASES`); the next section starts here."""
        now = self._lap(name, "_phase_start")
        if now is not None:
            self._phase_start = self._last = now

    def _lap(self, name: str, since: str) -> float | None:
        """Record ``longgen_<name>_ms`` from the time in attribute ``since`` to now (None: untimed step)."""
        if self.mode is None:
            return None
        if self.mode == "sync":
            self._sync()
        now = time.perf_counter()
        self.values[f"longgen_{name}_ms"] = round((now - getattr(self, since)) * 1e3, 3)
        return now

    def gpu_mark(self, name: str) -> None:
        """Start (first call) or end (second call) the GPU span ``name`` (host mode)."""
        if self.mode != "host" or not self.cuda:
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._events.setdefault(name, []).append(event)

    def span_events(self) -> tuple | None:
        """Start and end events for a span recorded elsewhere (a graph replayed on its own stream)."""
        if self.mode != "host" or not self.cuda:
            return None
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def adopt(self, name: str, events) -> None:
        """The GPU span ``name`` of this step from events recorded earlier (work queued ahead)."""
        if self.mode == "host" and self.cuda and events is not None:
            self._events[name] = list(events)

    def note(self, name: str, value: float) -> None:
        """A per-step value besides the timings (``longgen_<name>``)."""
        if self.mode is not None:
            self.values[f"longgen_{name}"] = value

    def finish(self, accepted: dict[str, int]) -> None:
        """Record the step for the requests that asked (``accepted``: tokens committed, per rid)."""
        if self.mode is None:
            self._finished_at = None
            return
        gc.callbacks.remove(self._on_gc)
        self.values["longgen_gc_ms"] = round(self._gc_ms, 3)
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
        for req in self._timed:
            self._record(req, accepted.get(req.rid, 1))
        self._timed, self._events = [], {}
        self._finished_at = time.perf_counter()

    def forget(self, rid: str) -> None:
        self._recorded.pop(rid, None)

    # -- internals --------------------------------------------------------------------------------

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            self._gc_ms += (time.perf_counter() - self._gc_start) * 1e3
            self._gc_start = None

    def _record(self, req, accepted: int) -> None:
        append_step_values(req, self.values, accepted)
        self._recorded[req.rid] = self._recorded.get(req.rid, 0) + 1


def append_step_values(req, values: dict, accepted: int) -> None:
    """Put a step's ``values`` in the request's ``meta_info``: on the first token the step
    committed, None on its other ``accepted - 1`` tokens (SGLang keeps one entry per token)."""
    info = req.customized_info if req.customized_info is not None else {}
    committed = len(req.output_ids)
    for key, value in values.items():
        series = info.setdefault(key, [])
        if len(series) < committed:
            series.extend([None] * (committed - len(series)))
        del series[committed:]
        series.append(value)
        series.extend([None] * (accepted - 1))
    req.customized_info = info
