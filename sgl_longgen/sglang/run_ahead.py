"""The next call's first plain step, queued before this call returns.

Our workers are synchronous: between two calls the GPU waits while the host reads the step back
and observes it, SGLang's scheduler processes the results and schedules the next batch (time
that plain decoding's overlapped scheduler hides). In a stretch of plain steps the next call's
first token needs nothing the host learns in between: its forward reads the KV this call
committed and the token this call drew last, and its draw uses the request's generator. So the
worker queues that forward and its draw right behind its run of plain steps
(:meth:`SpecWorker._plain_run`), on a stream of its own on a GPU, and the device computes it
while the host and the scheduler do their part.

The next call takes it only if its batch is the one it was made for (rid, request slot and
committed length per request, :func:`~.pipeline.batch_key`) and that call is a run of plain
steps again; then it is that run's first forward, drawn exactly as the run would have drawn it
(same logits, same generator at the same state). Otherwise it is dropped: every generator its
draw advanced is put back to its state from before the draw, so the draws that follow are the
ones made without it, and its KV, written to the slot after the committed length (inside the
window SGLang keeps allocated for a verify: twice its width past the committed length), is
overwritten by whatever forward comes next at that position. Every forward of the worker first
makes its stream wait for the queued one (:meth:`RunAhead.wait`), so nothing else writes that
slot, the verify buffers or the graphs' inputs while it runs.

A device without streams (the CPU engine of the tests) computes it in place, before the call
returns: no time saved, the same bookkeeping. So it is on by default on GPUs and off on CPUs;
``SGLANG_LONGGEN_PLAIN_RUN_AHEAD=1`` / ``0`` turns it on / off on either. What it saves is
measured by ``sgl_longgen.bench.adaptive_check`` (figures in docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import env
from .pipeline import StreamSlot, where_streams

RUN_AHEAD_ENV = env.name("PLAIN_RUN_AHEAD")


def run_ahead_enabled(device: torch.device) -> bool:
    """``SGLANG_LONGGEN_PLAIN_RUN_AHEAD``; unset: on where the device has streams (a GPU)."""
    return where_streams("PLAIN_RUN_AHEAD", device)


@dataclass
class QueuedPlain:
    key: tuple  # batch_key of the call that may take it
    launched: object  # the forward's verify.Launched (its inputs continue the run)
    token: torch.Tensor  # [bs] int64: the token each request drew
    hidden: torch.Tensor | None  # [bs, d]: the forward's hidden rows where the drafter reads them
    generators: list[tuple[torch.Generator, torch.Tensor]]  # their states from before the draw
    done: torch.cuda.Event | None  # recorded on the run-ahead stream after the draw (GPU)


class RunAhead(StreamSlot):
    def __init__(self, device: torch.device, enabled: bool | None = None):
        super().__init__(device, "PLAIN_RUN_AHEAD", enabled)
        self.queued: QueuedPlain | None = None

    def release(self, queued: QueuedPlain) -> None:
        """A dropped forward gives its draws back: the generators return to their states from
        before it (after the current stream waits for it, so nothing else writes what it reads)."""
        if queued.done is not None:
            torch.cuda.current_stream().wait_event(queued.done)
        for generator, state in reversed(queued.generators):
            generator.set_state(state)

    def queue(self, key: tuple, generators: list[torch.Generator],
              forward: Callable[[], tuple[object, torch.Tensor, torch.Tensor | None]]) -> None:
        """Queue ``forward()`` -> (launched, token, hidden) for the call with ``key``, behind
        everything queued so far; ``generators``: those its draw uses."""
        self.drop()
        states, seen = [], set()
        for g in generators:
            if g is not None and id(g) not in seen:
                seen.add(id(g))
                states.append((g, g.get_state()))
        (launched, token, hidden), done = self.run(forward)
        self.queued = QueuedPlain(key, launched, token, hidden, states, done)
