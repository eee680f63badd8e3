"""The driver loop: requests to engines, tokens to checkpoints, finished generations to records.

The driver is the only writer of checkpoints and records. Engines stream token deltas back
(:mod:`.messages`); the driver appends them to the request's tokens and, every
``checkpoint_every`` tokens, replaces the request's checkpoint. So:

- an engine actor that dies (killed, preempted, its node lost) costs nothing already streamed: its
  requests are checkpointed at once with every token received and go back to the queue, where any
  engine continues them by re-prefilling prompt + tokens; the slot gets a fresh actor in the same
  placement group;
- a driver that dies loses at most ``checkpoint_every`` tokens per running request;
- a record is written once, by the driver, when it receives the engine's ``Finished``: an engine
  that dies before that message arrives has written nothing, and one that dies after it cannot
  take the record back.

A generation that fails inside a healthy engine (an OOM, a prompt that does not fit) fails fast: it
gets a record with ``finish_reason = "error"`` at once, and its tokens stay in the checkpoint, so
``batch run --retry-errors`` can continue it later.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from ..errors import LonggenError
from .checkpoint import Checkpoint, CheckpointStore, RecordHead, RecordLog
from .engines import actor_class
from .messages import EngineInfo, Finished, Mark, Progress, Segment, Task
from .placement import strategy
from .progress import BatchProgress
from .prompts import Prompt
from .spec import Job

LONGGEN_ERROR = "sgl_longgen.errors.LonggenError: "


@dataclass
class Request:
    """One prompt's generation as the driver tracks it across attempts and runs."""

    prompt: Prompt
    key: str  # digest of the prompt's content (a checkpoint of another prompt is stale)
    tokens: list[int] = field(default_factory=list)  # generated so far
    segments: list[Segment] = field(default_factory=list)  # closed stretches of decoding
    timeline: list[Mark] = field(default_factory=list)  # the engines' reports, every run
    attempts: int = 0  # over all runs
    tries: int = 0  # in this run
    resumed: int = 0  # tokens this run took from an earlier run's checkpoint
    checkpointed: int = 0  # len(tokens) in the checkpoint on disk
    running: Segment | None = None  # latest snapshot of the stretch in flight

    @property
    def id(self) -> str:
        return self.prompt.id

    def advance(self, seg: Segment) -> None:
        """An engine's running totals of the stretch in flight: kept, and marked on the timeline."""
        self.running = seg
        self.timeline.append(Mark.of(seg))

    def close_segment(self) -> None:
        if self.running is not None:
            if self.running.tokens:
                self.segments.append(self.running)
            self.running = None


@dataclass
class Slot:
    """An engine position: its placement group outlives the actors that fill it."""

    index: int
    group: Any
    actor: Any = None
    starting: Any = None  # ObjectRef of info() while the actor loads
    started_at: float = 0.0
    info: EngineInfo | None = None
    restarts: int = 0
    gave_up: bool = False
    inflight: dict[str, Any] = field(default_factory=dict)  # request id -> ObjectRefGenerator
    finished: int = 0
    tokens: int = 0
    last_error: str | None = None

    @property
    def ready(self) -> bool:
        return self.actor is not None and self.starting is None and not self.gave_up


def segment_seed(seed: int, start: int) -> int:
    """A resumed stretch draws from its own stream (greedy decoding does not draw at all)."""
    return seed if start == 0 else (seed * 1_000_003 + start * 7_919) % (2**63 - 1)


def _error_text(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


class Scheduler:
    def __init__(self, job: Job, run_name: str, groups: list, store: CheckpointStore, records: RecordLog,
                 progress: BatchProgress, runtime_env: dict | None = None, done_before: int = 0,
                 poll_seconds: float = 0.5):
        self.job = job
        self.spec = job.spec
        self.run_name = run_name
        self.slots = [Slot(index=i, group=g) for i, g in enumerate(groups)]
        self.store = store
        self.records = records
        self.progress = progress
        self.runtime_env = runtime_env
        self.poll_seconds = poll_seconds
        self.pending: deque[Request] = deque()
        self.by_id: dict[str, Request] = {}
        self.generated = 0  # tokens streamed by engines in this run
        self.finished_ok = 0
        self.finished_error = 0
        self.written: list[RecordHead] = []  # heads of the records written in this run
        self.done_before = done_before  # prompts finished by earlier runs

    # -- engines -------------------------------------------------------------------------------

    def _spawn(self, slot: Slot) -> None:
        spec = self.spec
        cls = actor_class(spec.runtime)
        opts: dict[str, Any] = dict(
            num_cpus=spec.engines.cpus, num_gpus=spec.gpus_per_engine, scheduling_strategy=strategy(slot.group),
            name=f"{self.run_name}/engine-{slot.index}.{slot.restarts}", max_restarts=0,
        )
        if spec.runtime == "sglang":
            opts["max_concurrency"] = spec.engines.max_concurrent_requests + 2
        if self.runtime_env:
            opts["runtime_env"] = self.runtime_env
        args: dict[str, Any] = dict(index=slot.index, model=self.job.model, drafts=self.job.drafts,
                                    generation=self.job.generation)
        if spec.runtime == "sglang":
            args.update(tp_size=spec.engines.tp_size, sglang_kwargs=spec.sglang.engine_kwargs)
        else:
            args.update(threads=max(1, int(spec.engines.cpus)))
        slot.actor = ray.remote(cls).options(**opts).remote(**args)
        slot.starting = slot.actor.info.remote()
        slot.started_at = time.perf_counter()
        slot.info = None

    def _replace(self, slot: Slot, reason: str) -> None:
        """Kill what is left of the slot's actor and start another, within ``max_restarts``."""
        slot.last_error = reason
        if slot.actor is not None:
            try:
                ray.kill(slot.actor, no_restart=True)
            except Exception:
                pass
        slot.actor, slot.starting, slot.info = None, None, None
        if slot.restarts >= self.spec.engines.max_restarts:
            slot.gave_up = True
            self.progress.note(f"engine {slot.index} gave up after {slot.restarts} restart(s): {reason}")
            return
        slot.restarts += 1
        self.progress.note(f"engine {slot.index}: {reason}; starting a replacement ({slot.restarts}/"
                           f"{self.spec.engines.max_restarts})")
        self._spawn(slot)

    def start(self) -> None:
        """Start every engine; return once one is up (the others join while requests run)."""
        for slot in self.slots:
            self._spawn(slot)
        while not any(s.ready for s in self.slots) and any(s.starting is not None for s in self.slots):
            refs = [s.starting for s in self.slots if s.starting is not None]
            ready, _ = ray.wait(refs, num_returns=1, timeout=1.0)
            for ref in ready:
                slot = next((s for s in self.slots if s.starting is ref), None)
                if slot is not None:
                    self._on_started(slot)
            self._check_startup_timeouts()
        if not any(s.ready for s in self.slots):
            errors = "; ".join(f"engine {s.index}: {s.last_error}" for s in self.slots if s.last_error)
            raise LonggenError(f"no engine could start ({errors})")

    def _on_started(self, slot: Slot) -> None:
        ref, slot.starting = slot.starting, None
        try:
            slot.info = ray.get(ref)
        except RayActorError as exc:
            msg = _error_text(exc)
            if msg.startswith(LONGGEN_ERROR):
                # The job asks for something the engine cannot do: every restart would fail alike.
                raise LonggenError(msg[len(LONGGEN_ERROR):]) from None
            self._replace(slot, f"failed to start ({msg})")

    # -- requests ------------------------------------------------------------------------------

    def _task(self, req: Request) -> Task:
        p = req.prompt
        return Task(id=req.id, prompt=p.prompt, input_ids=list(p.input_ids) if p.input_ids is not None else None,
                    prefix=list(req.tokens), max_new_tokens=self.spec.max_new_tokens,
                    seed=segment_seed(self.spec.seed, len(req.tokens)), attempt=req.attempts + 1)

    def _assign(self) -> None:
        cap = self.spec.engines.max_concurrent_requests
        live = [s for s in self.slots if s.ready or s.starting is not None]
        if any(s.starting is not None for s in live):
            # While engines are still starting, the first one up takes only its share of the work
            # (not the whole queue, which would leave the late ones idle for the entire job).
            outstanding = len(self.pending) + sum(len(s.inflight) for s in self.slots)
            cap = min(cap, -(-outstanding // len(live)))
        for slot in self.slots:
            while slot.ready and len(slot.inflight) < cap and self.pending:
                req = self.pending.popleft()
                req.attempts += 1
                req.tries += 1
                req.running = Segment(engine=slot.index, start=len(req.tokens))
                gen = slot.actor.generate.options(num_returns="streaming").remote(
                    self._task(req), self.spec.checkpoint_every)
                slot.inflight[req.id] = gen

    def _checkpoint(self, req: Request, error: str | None = None) -> None:
        segments = req.segments + ([req.running] if req.running is not None and req.running.tokens else [])
        self.store.save(Checkpoint(id=req.id, prompt_key=req.key, tokens=req.tokens, segments=segments,
                                   timeline=req.timeline, attempts=req.attempts, error=error))
        req.checkpointed = len(req.tokens)

    def _on_progress(self, slot: Slot, req: Request, msg: Progress) -> None:
        req.tokens.extend(msg.new_tokens)
        req.advance(msg.segment)
        slot.tokens += len(msg.new_tokens)
        self.generated += len(msg.new_tokens)
        if len(req.tokens) - req.checkpointed >= self.spec.checkpoint_every:
            self._checkpoint(req)

    def _on_finished(self, slot: Slot, req: Request, msg: Finished) -> None:
        del slot.inflight[req.id]
        req.tokens.extend(msg.new_tokens)
        slot.tokens += len(msg.new_tokens)
        self.generated += len(msg.new_tokens)
        req.advance(msg.segment)
        req.close_segment()
        slot.finished += 1
        if msg.finish_reason == "error":
            if req.tokens:
                self._checkpoint(req, error=msg.error)
            self.progress.note(f"request {req.id} (line {req.prompt.line}) failed after {len(req.tokens)} tokens: "
                               f"{msg.error}")
        self._write(req, msg.finish_reason, msg.error, msg.text, msg.prompt_tokens, msg.extra)

    def _write(self, req: Request, finish_reason: str, error: str | None, text: str | None = None,
               prompt_tokens: int | None = None, extra: dict | None = None) -> None:
        record = make_record(self.job, req, finish_reason, error, text, prompt_tokens, extra)
        if self.records.append(record):
            self.written.append(self.records.heads[req.id])
        if finish_reason == "error":
            self.finished_error += 1
        else:
            self.finished_ok += 1
            self.store.remove(req.id)
        req.tokens, req.segments, req.timeline = [], [], []  # on disk now: the driver keeps no finished tokens

    def _engine_lost(self, slot: Slot, exc: BaseException) -> None:
        """The actor is gone: save what its requests streamed, requeue them, refill the slot."""
        why = "preempted" if getattr(exc, "preempted", False) else "lost"
        reason = f"actor {why} ({_error_text(exc)})"
        for rid in list(slot.inflight):
            req = self.by_id[rid]
            req.close_segment()
            if req.tries > self.spec.max_retries:
                error = (f"engine lost {req.tries} time(s), giving up (max_retries = {self.spec.max_retries}); "
                         f"last: {reason}")
                if req.tokens:
                    self._checkpoint(req, error=error)
                self._write(req, "error", error)
            else:
                if req.tokens:
                    self._checkpoint(req)
                self.progress.note(f"request {rid} goes back to the queue with {len(req.tokens)} tokens "
                                   f"(engine {slot.index} {why})")
                self.pending.appendleft(req)
        slot.inflight.clear()
        self._replace(slot, reason)

    def _on_stream(self, slot: Slot, rid: str, gen) -> None:
        req = self.by_id[rid]
        try:
            msg = ray.get(next(gen))
        except StopIteration:
            del slot.inflight[rid]
            req.close_segment()
            self._write(req, "error", "the engine's stream ended without a result")
            return
        except RayActorError as exc:
            self._engine_lost(slot, exc)
            return
        except RayTaskError as exc:  # an exception escaped the engine's generate: a bug, not the input
            del slot.inflight[rid]
            req.close_segment()
            if req.tokens:
                self._checkpoint(req, error=_error_text(exc))
            self._write(req, "error", _error_text(exc))
            return
        if isinstance(msg, Finished):
            self._on_finished(slot, req, msg)
        else:
            self._on_progress(slot, req, msg)

    # -- the loop ------------------------------------------------------------------------------

    def remaining_tokens(self) -> int:
        n = self.spec.max_new_tokens
        live = [self.by_id[rid] for s in self.slots for rid in s.inflight]
        return sum(n - len(r.tokens) for r in [*self.pending, *live])

    def report(self) -> None:
        self.progress.update(
            done=self.done_before + self.finished_ok + self.finished_error,
            failed=self.finished_error,
            running=sum(len(s.inflight) for s in self.slots),
            remaining_tokens=self.remaining_tokens(),
            generated=self.generated,
        )

    def run(self, requests: list[Request]) -> None:
        for r in requests:
            self.by_id[r.id] = r
        self.pending.extend(requests)
        try:
            while self.pending or any(s.inflight for s in self.slots):
                self._assign()
                waiting: dict[Any, tuple[Slot, str | None]] = {}
                for s in self.slots:
                    for rid, gen in s.inflight.items():
                        waiting[gen] = (s, rid)
                    if s.starting is not None:
                        waiting[s.starting] = (s, None)
                if not waiting:
                    raise LonggenError(
                        f"every engine is gone ({'; '.join(f'engine {s.index}: {s.last_error}' for s in self.slots)}); "
                        f"{len(self.pending)} request(s) left, their checkpoints are kept: rerun the job to continue"
                    )
                try:
                    ready, _ = ray.wait(list(waiting), num_returns=1, timeout=self.poll_seconds)
                except GetTimeoutError:
                    ready = []
                for obj in ready:
                    slot, rid = waiting[obj]
                    if rid is None:
                        if slot.starting is obj:
                            self._on_started(slot)
                    elif slot.inflight.get(rid) is obj:
                        self._on_stream(slot, rid, obj)
                self._check_startup_timeouts()
                self.report()
        finally:
            self.save_inflight()

    def _check_startup_timeouts(self) -> None:
        limit = self.spec.engines.startup_timeout_s
        for s in self.slots:
            if s.starting is not None and time.perf_counter() - s.started_at > limit:
                s.restarts = self.spec.engines.max_restarts  # a load that does not end will not end next time
                self._replace(s, f"did not start within {limit:.0f} s")

    def save_inflight(self) -> None:
        """On the way out (done, interrupted or failed): checkpoint every token received."""
        for s in self.slots:
            for rid in s.inflight:
                req = self.by_id[rid]
                if len(req.tokens) > req.checkpointed:
                    self._checkpoint(req)

    def stop(self, grace_seconds: float = 10.0) -> None:
        """Let engines release their devices (SGLang's subprocesses hold GPU memory), then kill them."""
        live = [s.actor for s in self.slots if s.actor is not None and s.starting is None]
        if live and self.spec.runtime == "sglang":  # a reference engine holds nothing outside its process
            try:
                ray.wait([a.shutdown.remote() for a in live], num_returns=len(live), timeout=grace_seconds)
            except Exception:
                pass
        for s in self.slots:
            if s.actor is not None:
                try:
                    ray.kill(s.actor, no_restart=True)
                except Exception:
                    pass
                s.actor = None

    def engine_report(self) -> list[dict]:
        out = []
        for s in self.slots:
            info = s.info
            out.append({"index": s.index, "node": info.node if info else None, "pid": info.pid if info else None,
                        "gpus": info.gpus if info else [], "requests": s.finished, "tokens": s.tokens,
                        "restarts": s.restarts, "last_error": s.last_error})
        return out


def accept_length(segments: list[Segment]) -> float | None:
    """tau over the stretches whose steps are known: tokens committed by target forwards / forwards
    (first token excluded); None when no stretch's are (a speculative one an engine did not finish)."""
    steps = sum(s.steps for s in segments)
    committed = sum(max(s.tokens - 1, 0) for s in segments if s.steps)
    return committed / steps if steps else None


def make_record(job: Job, req: Request, finish_reason: str, error: str | None, text: str | None,
                prompt_tokens: int | None, extra: dict | None) -> dict:
    segs = req.segments
    drafted = sum(s.drafted for s in segs)
    decode = sum(s.decode_seconds for s in segs)
    n = len(req.tokens)
    return {
        "id": req.id,
        "line": req.prompt.line,
        "model": job.spec.model,
        "runtime": job.spec.runtime,
        "method": job.spec.method,
        "output_ids": list(req.tokens),
        "text": text,
        "prompt_tokens": prompt_tokens if prompt_tokens is not None else (len(req.prompt.input_ids or ()) or None),
        "num_new_tokens": n,
        "accept_length": accept_length(segs),
        "acceptance_rate": sum(s.accepted for s in segs) / drafted if drafted else 0.0,
        "decode_seconds": decode,
        "prefill_seconds": sum(s.prefill_seconds for s in segs),
        "tokens_per_second": sum(s.tokens for s in segs) / decode if decode > 0 else 0.0,
        "finish_reason": finish_reason,
        "error": error,
        "resumed_tokens": req.resumed,
        "attempts": req.attempts,
        "segments": [{"engine": s.engine, "start": s.start, "tokens": s.tokens, "steps": s.steps} for s in segs],
        # [start, tokens, decode seconds, steps] of each stretch at each engine report: ms/token by position.
        "timeline": msgspec.to_builtins(req.timeline),
        "stats": extra or {},
    }
