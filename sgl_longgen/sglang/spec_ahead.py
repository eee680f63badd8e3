"""The next speculative step's draft and verify forward, queued before this call returns.

Our workers are synchronous: after a speculative step the host publishes its results and SGLang's
scheduler processes them and schedules the next batch while the GPU waits, and only then does the
next call draft and queue its verify. Where the next step is planned speculative
(:meth:`~.adaptive.AdaptiveSteps.plan`) its draft needs nothing the scheduler adds: the method's
state after this step's commit, the KV just committed and the tokens the host has walked. So the
worker drafts it and queues its verify forward at the end of this call, on a stream of its own on
a GPU (:meth:`SpecWorker._queue_spec_ahead`), and the verify computes while the host and the
scheduler do their part. Its draws, walk and commit stay in the next call: they use the requests'
generators and SGLang's processing of the batch as that call finds them, in the same order as
without the run-ahead, so what the next step commits is what it would have committed (greedy or
sampled, token for token for a given generator state).

The drafter's ``after_verify`` runs right behind the queued verify, as it does behind any verify
(OWL clears its [SPEC] rows there, on the same stream, so no later forward sees them). The next
call takes the queued step only if its batch is the one it was made for (rid, request slot and
committed length per request, :func:`~.pipeline.batch_key`), it is speculative again and at the
same draft width; otherwise it is dropped: the host waits until the verify has read its
page-locked inputs (the next launch refills them), and its KV, written inside the window SGLang
keeps allocated past the committed length (twice the verify width: this step committed at most
one width), is overwritten by whatever forward comes next at those positions. Every forward of
the worker first makes its stream wait for the queued step (:meth:`SpecAhead.wait`).

It is not queued where the next call may differ in what the verify reads or returns: a request
that SGLang processes per token (blocked: count penalties), logprobs or hidden states
returned, a request likely to finish with this step (:func:`~.pipeline.likely_finishes`), or a
timed step (its sections would be another step's). A device without streams (the CPU engine of
the tests) computes it in place: no time saved, the same bookkeeping. It is opt-in for now
(``SGLANG_LONGGEN_SPEC_RUN_AHEAD=1``, on GPUs and CPUs alike): :data:`DEFAULT` turns it on for
GPUs once a GPU run has measured what it saves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import env
from .pipeline import StreamSlot, where_streams

SPEC_RUN_AHEAD_ENV = env.name("SPEC_RUN_AHEAD")


# Off unless asked for (``=1``) until its gain is measured on a GPU (``adaptive_check --spec-run-ahead both``).
DEFAULT = False


def spec_ahead_enabled(device: torch.device) -> bool:
    """``SGLANG_LONGGEN_SPEC_RUN_AHEAD``; unset: :data:`DEFAULT` where the device has streams."""
    return where_streams("SPEC_RUN_AHEAD", device, DEFAULT)


@dataclass
class QueuedSpec:
    key: tuple  # batch_key of the call that may take it
    width: int | None  # the draft width it was drafted at (None: the whole draft)
    drafts: list  # the requests' drafts (methods.Draft)
    launched: object  # the verify forward's verify.Launched
    done: torch.cuda.Event | None  # recorded on the run-ahead stream after the launch (GPU)


class SpecAhead(StreamSlot):
    def __init__(self, device: torch.device, enabled: bool | None = None):
        super().__init__(device, "SPEC_RUN_AHEAD", enabled, DEFAULT)
        self.queued: QueuedSpec | None = None

    def release(self, queued: QueuedSpec) -> None:
        """A dropped step: the host waits until its verify has read its page-locked inputs (the
        next launch refills them)."""
        if queued.done is not None:
            queued.done.synchronize()

    def take_at(self, key: tuple, width: int | None) -> QueuedSpec | None:
        """The queued step if it was made for this batch at this draft width; else it is dropped."""
        queued = self.take(key)
        if queued is not None and queued.width != width:
            self.release(queued)
            return None
        return queued

    def queue(self, key: tuple, width: int | None, step: Callable[[], tuple[list, object]]) -> None:
        """Queue ``step()`` -> (drafts, launched) for the call with ``key``, behind everything
        queued so far (on the run-ahead stream on a GPU)."""
        self.drop()
        (drafts, launched), done = self.run(step)
        self.queued = QueuedSpec(key, width, drafts, launched, done)
