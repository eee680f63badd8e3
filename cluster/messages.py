"""What the driver and the engine actors say to each other.

An engine streams a generation back as a sequence of :class:`Progress` messages (new tokens since
the previous message) and one :class:`Finished`. Only deltas travel, so a 100K-token generation
costs O(n) to stream, and the driver, the one writer of checkpoints and records, always holds
everything an engine has reported.
"""

from __future__ import annotations

import msgspec


class Task(msgspec.Struct, kw_only=True):
    """One generation, or the rest of one: ``prefix`` holds the tokens already generated."""

    id: str
    prompt: str | None = None
    input_ids: list[int] | None = None
    prefix: list[int] = msgspec.field(default_factory=list)
    max_new_tokens: int  # the total, prefix included
    seed: int = 0
    attempt: int = 1


class Segment(msgspec.Struct, kw_only=True):
    """Counters of one uninterrupted stretch of decoding, as the engine measured it.

    ``tokens`` is what the engine's decoder produced in this stretch: a resumed request's first
    segment starts at ``start`` = the checkpoint's length, and nothing before it is generated again.
    """

    engine: int = -1
    start: int = 0  # tokens already generated when this segment began
    tokens: int = 0
    steps: int = 0  # target forwards after prefill (tau = committed tokens per step); 0: unknown
    accepted: int = 0  # accepted draft tokens
    drafted: int = 0  # draft depth offered, summed
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0


class Mark(msgspec.Struct, array_like=True):
    """One point of a generation's timeline: where it stood (``start + tokens``) after
    ``seconds`` of decoding in the stretch that began at ``start``, and that stretch's ``steps``.

    The driver keeps one per engine report (every ``checkpoint_every`` tokens or second), in the
    checkpoint and then the record, so a 100K-token run shows its ms/token against position and a
    resumed run keeps the marks of the runs before it. Arrays, not objects: a long run has
    hundreds.
    """

    start: int
    tokens: int
    seconds: float
    steps: int

    @classmethod
    def of(cls, seg: Segment) -> Mark:
        return cls(seg.start, seg.tokens, round(seg.decode_seconds, 4), seg.steps)


class Progress(msgspec.Struct, tag=True, kw_only=True):
    id: str
    new_tokens: list[int]
    segment: Segment  # running totals


class Finished(msgspec.Struct, tag=True, kw_only=True):
    id: str
    new_tokens: list[int]  # the last delta
    segment: Segment
    finish_reason: str  # "length", "stop" or "error"
    error: str | None = None
    text: str | None = None  # the whole output (prefix included), when the engine has a tokenizer
    prompt_tokens: int = 0
    extra: dict = msgspec.field(default_factory=dict)  # method-specific counters


class EngineInfo(msgspec.Struct, kw_only=True):
    """What a started engine reports about itself."""

    index: int
    runtime: str
    node: str
    pid: int
    gpus: list[str] = msgspec.field(default_factory=list)
    config: dict = msgspec.field(default_factory=dict)  # the effective GenerateConfig
