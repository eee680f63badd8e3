"""The learning-rate schedule: linear warmup, then cosine decay to a floor."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class CosineSchedule:
    """``lr(step)`` for 0-based steps out of ``total``.

    Warmup rises linearly to ``peak`` over ``warmup`` steps (step 0 already trains, at
    ``peak / warmup``); the cosine then falls from ``peak`` to ``peak * min_ratio`` at the last
    step. A warmup longer than the run is shortened to a tenth of it.
    """

    peak: float
    total: int
    warmup: int = 0
    min_ratio: float = 0.0

    def __call__(self, step: int) -> float:
        warmup = self.warmup if self.warmup < self.total else self.total // 10
        if step < warmup:
            return self.peak * (step + 1) / warmup
        span = max(1, self.total - 1 - warmup)
        progress = min(1.0, max(0.0, (step - warmup) / span))
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.peak * (self.min_ratio + (1.0 - self.min_ratio) * cosine)
