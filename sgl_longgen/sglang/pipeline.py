"""The one draft forward queued ahead of the step that will use it.

A draft that needs only what is committed can run before its step. OWL's beam reads the
committed hidden states, so it is expanded as soon as the host has observed a step. A TokenSwift
draft depends only on the committed KV, the root and the partial-KV selection, so it can start as
soon as a step's commit is queued: on the device right behind the commit (a *chained* draft, whose
inputs come from the walk without the host) or, once the host has walked the trees, at the end of
the step (*ahead*). Either way the next step uses it only if its batch
is the same (rid, request slot, committed length per request); otherwise it is dropped.

On a GPU its graph replays on a stream of its own, so SGLang's scheduler reads the step's
results (a device-to-host copy on the main stream) while the draft computes. Every forward of
the worker first makes the main stream wait for it (:meth:`QueuedSlot.wait`): nothing else
writes the KV or the graph buffers it reads meanwhile. (:class:`QueuedSlot` also holds a run of
plain steps' next forward, :mod:`.run_ahead`.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import env


@dataclass
class QueuedDraft:
    key: tuple  # (rid, req_pool_idx, seq_len) per request: the step that may use it
    candidates: object  # the draft's device results (TokenSwift's candidates, OWL's tree rows and beam)
    done: torch.cuda.Event | None  # recorded on the draft's stream after it (GPU)
    gpu_span: list | None  # the forward's CUDA events (timed steps)


def where_streams(key: str, device: torch.device, default: bool = True) -> bool:
    """An on/off setting ``SGLANG_LONGGEN_<key>`` (``1``/``0``) of work queued ahead; unset, on
    where the device has streams to run it beside the host (a GPU; a CPU computes it in place)
    unless ``default`` is False (opt-in everywhere)."""
    raw = (env.get(key) or "").strip().lower()
    if raw == "":
        return default and device.type == "cuda"
    if raw in ("0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{env.name(key)} must be 1 or 0, got {raw!r}")


def batch_key(steps, lengths=None) -> tuple:
    lengths = lengths if lengths is not None else [s.seq_len for s in steps]
    return tuple((s.req.rid, s.req.req_pool_idx, n) for s, n in zip(steps, lengths))


def likely_finishes(req, tokens: list[int]) -> bool:
    """The scheduler will finish ``req`` on these tokens (length or a stop token id).

    A draft queued for a finished request is only wasted device time, so this need not be
    complete (stop strings are not checked).
    """
    if len(req.output_ids) + len(tokens) >= req.sampling_params.max_new_tokens:
        return True
    if req.sampling_params.ignore_eos:
        return False
    stops = set(req.eos_token_ids or ()) | set(req.sampling_params.stop_token_ids or ())
    tokenizer = getattr(req, "tokenizer", None)
    if tokenizer is not None:
        stops.add(tokenizer.eos_token_id)
        stops.update(getattr(tokenizer, "additional_stop_token_ids", None) or ())
    return any(t in stops for t in tokens)


class QueuedSlot:
    """Work queued ahead for the step with a key (``queued.key``; ``queued.done``: its event on
    the stream it ran on, None off GPUs): that step takes it, any other drops it (:meth:`release`)."""

    def __init__(self):
        self.queued = None

    def wait(self) -> None:
        """Make the current stream wait for the queued work (before any other forward)."""
        queued = self.queued
        if queued is not None and queued.done is not None:
            torch.cuda.current_stream().wait_event(queued.done)

    def take(self, key: tuple):
        """The queued work if it was made for this batch; otherwise it is dropped."""
        queued = self.queued
        if queued is not None and queued.key == key:
            self.queued = None
            return queued
        self.drop()
        return None

    def drop(self) -> None:
        queued, self.queued = self.queued, None
        if queued is not None:
            self.release(queued)

    def release(self, queued) -> None:
        """What dropping ``queued`` takes besides forgetting it."""


class StreamSlot(QueuedSlot):
    """A :class:`QueuedSlot` whose work runs on a stream of its own where the device has streams,
    while the setting ``SGLANG_LONGGEN_<key>`` is on (:func:`where_streams`; ``enabled`` overrides it)."""

    def __init__(self, device: torch.device, key: str, enabled: bool | None = None, default: bool = True):
        super().__init__()
        self.enabled = where_streams(key, device, default) if enabled is None else enabled
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" and self.enabled else None

    def run(self, work):
        """``work()`` now, behind everything queued on the current stream: on this slot's stream,
        with an event recorded after it, where the device has one; else in place (event None).
        Returns (``work()``'s result, the event)."""
        if self.stream is None:
            return work(), None
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            out = work()
            done = torch.cuda.Event()
            done.record(self.stream)
        return out, done


class DraftPipeline(QueuedSlot):
    def __init__(self, device: torch.device):
        super().__init__()
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.queued: QueuedDraft | None = None
        self.chained: tuple | None = None  # (candidates, done, span) queued behind this step's commit

    def keep(self, key: tuple, launched: tuple) -> None:
        """Queue ``launched`` = (candidates, done, span) for the step with ``key``."""
        self.drop()
        self.queued = QueuedDraft(key, *launched)

    def release(self, queued: QueuedDraft) -> None:
        """A dropped draft is forgotten once its copies have read their (reused) staging buffers."""
        if queued.done is not None:
            queued.done.synchronize()

    def reset(self) -> None:
        self.chained = None
        self.drop()
