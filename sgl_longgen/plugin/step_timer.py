"""Where a speculative step's time goes, as ``meta_info`` series.

Always: ``longgen_draft_ms`` / ``longgen_verify_ms`` / ``longgen_overhead_ms`` (the verify forward
is synchronised before its mark, so a forward's GPU time is not billed to what follows it).
In detail mode every section boundary synchronises the GPU and each section gets its own
``longgen_<section>_ms`` series: slower steps, but the numbers say which part of the host or
device work a step pays for. Detail mode is on for the whole server with
``SGLANG_LONGGEN_STEP_DETAIL=1``, or for the steps of requests whose ``custom_params`` hold
``{"longgen_step_detail": true}``.
"""

from __future__ import annotations

import os
import time

import torch

DETAIL_ENV = "SGLANG_LONGGEN_STEP_DETAIL"
DETAIL_PARAM = "longgen_step_detail"

# The coarse phase each detailed section belongs to.
PHASES = ("draft", "verify", "overhead")


def detail_enabled() -> bool:
    return os.environ.get(DETAIL_ENV, "").strip().lower() in ("1", "true", "yes", "on")


class StepTimer:
    def __init__(self, device: torch.device, detail: bool | None = None):
        self.cuda = device.type == "cuda"
        self.default_detail = detail_enabled() if detail is None else detail
        self.detail = self.default_detail
        self.values: dict[str, float] = {}
        self._phase_start = self._last = 0.0

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def start(self, detail: bool = False) -> None:
        """A new step; ``detail`` turns detail mode on for this step."""
        self.detail = self.default_detail or detail
        self.values = {}
        self._phase_start = self._last = time.perf_counter()

    def section(self, name: str) -> None:
        """End the detailed section ``name`` (recorded only in detail mode)."""
        if not self.detail:
            return
        self._sync()
        now = time.perf_counter()
        self.values[f"longgen_{name}_ms"] = round((now - self._last) * 1e3, 3)
        self._last = now

    def phase(self, name: str, sync: bool = False) -> None:
        """End the coarse phase ``name`` (one of :data:`PHASES`)."""
        if sync or self.detail:
            self._sync()
        now = time.perf_counter()
        self.values[f"longgen_{name}_ms"] = round((now - self._phase_start) * 1e3, 3)
        self._phase_start = self._last = now
