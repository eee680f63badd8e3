"""Opt-in cProfile of our workers' decode steps: where the host time of a step goes.

The step timer (:mod:`.step_timer`) says which section a step pays for; this says which Python
functions inside them. The server opts in with ``SGLANG_LONGGEN_HOST_PROFILE=FILE`` and then
only the steps of requests whose ``custom_params`` hold ``{"longgen_host_profile": true}`` are
profiled (so a benchmark can profile a few steps at the context length it cares about). The
statistics accumulate over those steps and are written to ``FILE`` (``pstats`` format) every
:data:`DUMP_EVERY` profiled steps, with the number of steps they cover in ``FILE.steps``.
"""

from __future__ import annotations

import cProfile
import os

PROFILE_ENV = "SGLANG_LONGGEN_HOST_PROFILE"
PROFILE_PARAM = "longgen_host_profile"
DUMP_EVERY = 16


class HostProfile:
    def __init__(self, path: str):
        self.path = path
        self.profiler = cProfile.Profile()
        self.steps = 0

    @classmethod
    def from_env(cls) -> "HostProfile | None":
        path = os.environ.get(PROFILE_ENV, "").strip()
        return cls(path) if path else None

    def wants(self, reqs) -> bool:
        return any((r.sampling_params.custom_params or {}).get(PROFILE_PARAM) for r in reqs)

    def run(self, fn, *args):
        self.profiler.enable()
        try:
            return fn(*args)
        finally:
            self.profiler.disable()
            self.steps += 1
            if self.steps % DUMP_EVERY == 0:
                self.profiler.dump_stats(self.path)
                with open(self.path + ".steps", "w") as f:
                    f.write(f"{self.steps}\n")
