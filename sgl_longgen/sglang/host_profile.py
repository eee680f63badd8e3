"""Opt-in cProfile of the scheduler thread around our workers' decode steps.

The step clock (:mod:`.timing`) says which section a step pays for; this says which Python
functions inside them, and what SGLang's scheduler does between two of our steps: the profile
runs from the start of a profiled step to the start of the next one. The server opts in with
``SGLANG_LONGGEN_HOST_PROFILE=FILE`` and then only the steps of requests whose
``custom_params`` hold ``{"longgen_host_profile": true}`` are profiled (so a benchmark can
profile a few steps at the context length it cares about). The statistics accumulate over those
steps and are written to ``FILE`` (``pstats`` format) with the number of steps they cover in
``FILE.steps``, every :data:`DUMP_EVERY` profiled steps and when a batch without such requests
comes.
"""

from __future__ import annotations

import cProfile

from .. import env
from .request_settings import HOST_PROFILE_PARAM as PROFILE_PARAM  # noqa: F401 - the request's key
from .request_settings import settings_of

PROFILE_ENV = env.name("HOST_PROFILE")
DUMP_EVERY = 16


class HostProfile:
    def __init__(self, path: str):
        self.path = path
        self.profiler = cProfile.Profile()
        self.steps = 0
        self.active = False

    @classmethod
    def from_env(cls) -> "HostProfile | None":
        path = (env.get("HOST_PROFILE") or "").strip()
        return cls(path) if path else None

    def wants(self, reqs) -> bool:
        return any(settings_of(r).host_profile for r in reqs)

    def run(self, fn, *args):
        """One profiled step; the profiler keeps running until the next step starts."""
        if not self.active:
            self.profiler.enable()
            self.active = True
        result = fn(*args)
        self.steps += 1
        if self.steps % DUMP_EVERY == 0:
            self.stop()
        return result

    def stop(self) -> None:
        """End the current stretch of profiled steps and write the statistics so far."""
        if not self.active:
            return
        self.profiler.disable()
        self.active = False
        self.profiler.dump_stats(self.path)
        with open(self.path + ".steps", "w") as f:
            f.write(f"{self.steps}\n")
