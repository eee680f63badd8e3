"""The reference engine: the pure-PyTorch runtime behind the engine face of :mod:`.engines`.

It decodes one request at a time on CPU or one GPU, so a job can run (and its batch machinery be
tested) where SGLang cannot: a laptop, a CI runner, a CPU-only Ray cluster.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any, Iterator

import msgspec

from ..config import to_dict
from ..errors import LonggenError
from .engine_common import effective_config, finished_early, ray_node
from .messages import EngineInfo, Finished, Progress, Segment, Task


class ReferenceEngine:
    """The pure-PyTorch reference runtime as an engine: one generation at a time, on CPU or one GPU.

    The decoder runs in a worker thread; its per-step progress callback hands token deltas to the
    generator, which yields them to the driver.
    """

    def __init__(self, index: int, model: str, drafts: dict[str, str | None], generation: dict[str, Any],
                 threads: int = 0):
        import torch

        from ..runtime import build_decoder, draft_dirs, load_model, resolve_model

        self.index = index
        model_dir = resolve_model(model)
        dirs = draft_dirs(model_dir, drafts)
        self.config = effective_config(generation, dirs)
        rt = self.config.runtime
        n = rt.threads or threads
        if n:
            torch.set_num_threads(n)
        self.loaded = load_model(model_dir, rt.dtype, rt.device)
        self.decoder = build_decoder(self.loaded, self.config, dirs["heads"], dirs["drafter"], dirs["longspec_drafter"])
        self.eos_ids = set(self.loaded.eos_ids)
        self.tokens_generated = 0  # by this actor, over all tasks

    def info(self) -> EngineInfo:
        node, gpus = ray_node()
        return EngineInfo(index=self.index, runtime="reference", node=node, pid=os.getpid(), gpus=gpus,
                          config=to_dict(self.config))

    def shutdown(self) -> None:
        """Nothing outlives this actor's process (the SGLang engine's subprocesses do)."""

    def _prompt_ids(self, task: Task) -> list[int]:
        if task.input_ids is not None:
            return list(task.input_ids)
        if self.loaded.tokenizer is None:
            raise LonggenError("the model has no tokenizer.json: give `input_ids` instead of `prompt`")
        return self.loaded.tokenizer.encode(task.prompt)

    def _text(self, ids: list[int]) -> str | None:
        return self.loaded.tokenizer.decode(ids) if self.loaded.tokenizer is not None else None

    def generate(self, task: Task, report_every: int, report_seconds: float = 1.0) -> Iterator[Progress | Finished]:
        seg = Segment(engine=self.index, start=len(task.prefix))
        try:
            prompt_ids = self._prompt_ids(task)
        except LonggenError as exc:
            yield Finished(id=task.id, new_tokens=[], segment=seg, finish_reason="error", error=str(exc))
            return
        early = finished_early(task, self.eos_ids, self.config)
        if early is not None:
            yield Finished(id=task.id, new_tokens=[], segment=seg, finish_reason=early,
                           text=self._text(task.prefix), prompt_tokens=len(prompt_ids))
            return

        # The decoder takes its seed from its config; a resumed segment gets its own stream.
        self.decoder.config = msgspec.structs.replace(self.config, seed=task.seed)
        inbox: queue.Queue = queue.Queue()
        sent = 0
        last = time.perf_counter()
        t0 = last

        def on_step(tokens, stats) -> None:
            nonlocal sent, last
            n = len(tokens)
            now = time.perf_counter()
            if n - sent >= report_every or (now - last >= report_seconds and n > sent):
                delta = list(tokens[sent:n])
                sent, last = n, now
                snap = msgspec.structs.replace(seg, tokens=n, steps=stats.steps, accepted=stats.accepted,
                                               drafted=stats.drafted, decode_seconds=now - t0)
                inbox.put(Progress(id=task.id, new_tokens=delta, segment=snap))

        def work() -> None:
            try:
                result = self.decoder.generate(prompt_ids + list(task.prefix), task.max_new_tokens - len(task.prefix), on_step)
            except LonggenError as exc:  # the prompt does not fit the model: an input error
                inbox.put(Finished(id=task.id, new_tokens=[], segment=seg, finish_reason="error", error=str(exc),
                                   prompt_tokens=len(prompt_ids)))
                return
            except BaseException as exc:  # noqa: BLE001 - reported, the driver decides
                inbox.put(Finished(id=task.id, new_tokens=[], segment=seg, finish_reason="error",
                                   error=f"{type(exc).__name__}: {exc}", prompt_tokens=len(prompt_ids)))
                return
            out = result.output_ids
            s = result.stats
            final = msgspec.structs.replace(seg, tokens=len(out), steps=s.steps, accepted=s.accepted, drafted=s.drafted,
                                            prefill_seconds=result.prefill_seconds,
                                            decode_seconds=result.decode_seconds)
            inbox.put(Finished(
                id=task.id, new_tokens=list(out[sent:]), segment=final, finish_reason=result.finish_reason,
                error=result.error, text=self._text(list(task.prefix) + list(out)), prompt_tokens=len(prompt_ids),
                extra={"ngram_steps": s.ngram_steps, "draft_seconds": s.draft_seconds,
                       "verify_seconds": s.verify_seconds},
            ))

        thread = threading.Thread(target=work, name=f"generate-{task.id}", daemon=True)
        thread.start()
        while True:
            msg = inbox.get()
            if isinstance(msg, Finished):
                self.tokens_generated += msg.segment.tokens
                yield msg
                break
            yield msg
        thread.join()
