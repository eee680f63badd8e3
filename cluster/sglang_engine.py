"""The SGLang engine adapter: ``sglang.Engine`` in-process in the actor, token ids in and out.

It follows what ``ray.data.llm``'s SGLang stage does (engine inside the actor,
``skip_tokenizer_init=True``, ``async_generate(stream=True)``, GPUs per actor = TP size) and adds
what a 100K-token row needs: the stream is cut into :class:`Progress` deltas every
``report_every`` tokens so the driver can checkpoint, and a resumed request is the original
prompt plus its generated prefix, re-prefilled (SGLang's radix cache makes that cheap when the
same engine served the first part).

A speculative method runs as this package's SGLang algorithm of the same name (``TOKENSWIFT``,
``OWL``, ``HOWL``, ``LONGSPEC``, ``SUFFIX``) with its draft checkpoint as the draft model path. The
plugin reads the method's settings (tree, n-gram, partial KV, drafter beam, suffix, default
penalty) from the ``longgen.toml`` in that directory, so the actor builds a draft directory of its
own: links to the checkpoint's files (SUFFIX has none) plus a ``longgen.toml`` holding the job's
effective settings. The contextual
penalty also rides on each request as ``custom_params`` (with plain decoding, through the plugin's
``ContextualPenaltyProcessor``).

SGLang is reached only through :mod:`sgl_longgen.sglang.engine`, the one package that imports it,
and only inside the actor: the driver imports this module (to name the actor class) and must not
pay for SGLang, nor break where it is not installed.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

import msgspec

from ..config import SPECULATIVE_ALGORITHMS, GenerateConfig, to_dict
from ..errors import LonggenError
from .engine_common import effective_config, finished_early, ray_node
from .messages import EngineInfo, Finished, Progress, Segment, Task

DEFAULTS_FILE = "longgen.toml"
# The tables of a draft directory's longgen.toml that the plugin reads (see sglang.draft_dir).
METHOD_TABLES = ("tokenswift", "owl", "suffix", "howl", "longspec")


def engine_kwargs(model_path: str, draft_dir: str | None, config: GenerateConfig, tp_size: int,
                  user: dict[str, Any]) -> dict[str, Any]:
    """``sglang.Engine`` arguments; the job's ``[sglang] engine_kwargs`` win."""
    kw: dict[str, Any] = {
        "model_path": model_path,
        "tp_size": tp_size,
        "skip_tokenizer_init": True,  # token ids in and out; the actor tokenizes
        "random_seed": config.seed,
    }
    algorithm = SPECULATIVE_ALGORITHMS.get(config.method)
    if algorithm is not None:
        from ..runtime import DRAFT_FIELD

        if draft_dir is None and config.method in DRAFT_FIELD:
            raise LonggenError(f"{config.method} needs its draft checkpoint: set `{DRAFT_FIELD[config.method]}` in the job "
                               f"(none found inside {model_path})")
        kw.update(speculative_algorithm=algorithm, disable_overlap_schedule=True)
        if draft_dir is not None:
            kw["speculative_draft_model_path"] = draft_dir
    elif config.sampling.penalty_active:
        kw["enable_custom_logit_processor"] = True
    kw.update(user)
    return kw


def request_args(config: GenerateConfig, max_new_tokens: int) -> dict[str, Any]:
    """One request's ``async_generate`` arguments besides the input ids."""
    s = config.sampling
    params: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k if s.top_k > 0 else -1,
        "min_p": s.min_p,
        "ignore_eos": config.ignore_eos,
        "no_stop_trim": True,  # keep the EOS token in output_ids, as the reference runtime does
    }
    args: dict[str, Any] = {"sampling_params": params}
    if s.penalty_active:
        params["custom_params"] = {"penalty": s.penalty, "penalty_window": s.penalty_window}
        if config.method not in SPECULATIVE_ALGORITHMS:  # our workers read custom_params themselves
            from ..sglang.engine import penalty_processor  # imports SGLang: called in the actor only

            args["custom_logit_processor"] = penalty_processor()
    return args


def _toml(table: dict[str, Any], prefix: str = "") -> list[str]:
    """A nested dict of numbers, booleans, strings and lists as TOML (JSON scalars are TOML scalars)."""
    lines = [f"{k} = {json.dumps(v)}" for k, v in table.items() if not isinstance(v, dict)]
    for k, v in table.items():
        if isinstance(v, dict):
            lines += ["", f"[{prefix}{k}]", *_toml(v, f"{prefix}{k}.")]
    return lines


def draft_dir_for(checkpoint: Path | None, config: GenerateConfig) -> Path:
    """The draft checkpoint's files (None: a method without one, SUFFIX) plus a ``longgen.toml``
    with the job's effective method settings."""
    out = Path(tempfile.mkdtemp(prefix="sgl-longgen-draft-"))
    for f in checkpoint.iterdir() if checkpoint is not None else ():
        if f.name != DEFAULTS_FILE:
            (out / f.name).symlink_to(f.resolve())
    settings = {name: to_dict(getattr(config, name)) for name in METHOD_TABLES}
    # The adaptive controller's server default; its `widths` are a reference-runtime option the
    # plugin refuses, so they stay out.
    settings["adaptive"] = {k: v for k, v in to_dict(config.adaptive).items() if k != "widths"}
    settings["sampling"] = {"penalty": config.sampling.penalty, "penalty_window": config.sampling.penalty_window}
    (out / DEFAULTS_FILE).write_text(f"# Written by sgl-longgen batch: the job's {config.method} settings.\n"
                                     + "\n".join(_toml(settings)) + "\n")
    return out


def _finish_reason(meta: dict) -> tuple[str, str | None]:
    fr = meta.get("finish_reason")
    kind = fr.get("type") if isinstance(fr, dict) else fr
    if kind in ("length", "stop"):
        return kind, None
    message = fr.get("message") if isinstance(fr, dict) else None
    return "error", f"sglang finished the request with {kind!r}" + (f": {message}" if message else "")


class SGLangEngine:
    """One ``sglang.Engine`` (one TP group) as a Ray async actor; many requests at once."""

    def __init__(self, index: int, model: str, drafts: dict[str, str | None], generation: dict[str, Any],
                 tp_size: int = 1, sglang_kwargs: dict[str, Any] | None = None):
        from ..runtime import DRAFT_FIELD, draft_dirs, resolve_model
        from ..runtime.embedded import is_name

        self.index = index
        if is_name(model) or Path(model).is_dir():
            model_dir: Path | None = resolve_model(model)
            model_path = str(model_dir)
        else:
            model_dir, model_path = None, model  # a hub id: SGLang fetches it
        dirs = draft_dirs(model_dir, drafts)
        self.config = effective_config(generation, dirs)
        self.tokenizer = self._tokenizer(model_dir, model_path)
        self.eos_ids = self._eos_ids(model_dir)

        checkpoint = dirs.get(DRAFT_FIELD.get(self.config.method, ""))
        # A method without a checkpoint (SUFFIX) still gets the job's settings in a directory.
        needs_dir = checkpoint is not None or (self.config.method in SPECULATIVE_ALGORITHMS
                                               and self.config.method not in DRAFT_FIELD)
        draft = str(draft_dir_for(checkpoint, self.config)) if needs_dir else None

        from ..sglang.engine import open_engine  # heavy; only engine actors of this runtime import it

        self.kwargs = engine_kwargs(model_path, draft, self.config, tp_size, dict(sglang_kwargs or {}))
        self.engine = open_engine(**self.kwargs)
        self.speculative = self.kwargs.get("speculative_algorithm") is not None
        self.incremental = bool(getattr(self.engine.server_args, "incremental_streaming_output", False))
        self.tokens_generated = 0

    @staticmethod
    def _tokenizer(model_dir: Path | None, model_path: str):
        if model_dir is not None and (model_dir / "tokenizer.json").is_file():
            from ..runtime.tokenizer import Tokenizer

            return Tokenizer.from_dir(model_dir)
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(model_path)
        except Exception:  # token-id-only jobs need no tokenizer
            return None

    @staticmethod
    def _eos_ids(model_dir: Path | None) -> set[int]:
        if model_dir is None:
            return set()
        try:
            from ..runtime.checkpoint import read_config

            return set(read_config(model_dir).eos_ids)
        except LonggenError:
            return set()

    def info(self) -> EngineInfo:
        node, gpus = ray_node()
        return EngineInfo(index=self.index, runtime="sglang", node=node, pid=os.getpid(), gpus=gpus,
                          config=to_dict(self.config))

    def _text(self, ids: list[int]) -> str | None:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else None

    async def generate(self, task: Task, report_every: int, report_seconds: float = 1.0) -> AsyncIterator[Progress | Finished]:
        seg = Segment(engine=self.index, start=len(task.prefix))
        if task.input_ids is not None:
            prompt_ids = list(task.input_ids)
        elif self.tokenizer is None:
            yield Finished(id=task.id, new_tokens=[], segment=seg, finish_reason="error",
                           error="the model has no tokenizer: give `input_ids` instead of `prompt`")
            return
        else:
            prompt_ids = list(self.tokenizer.encode(task.prompt))
        early = finished_early(task, self.eos_ids, self.config)
        if early is not None:
            yield Finished(id=task.id, new_tokens=[], segment=seg, finish_reason=early,
                           text=self._text(task.prefix), prompt_tokens=len(prompt_ids))
            return

        args = request_args(self.config, task.max_new_tokens - len(task.prefix))
        out_ids: list[int] = []
        sent = 0
        meta: dict = {}
        t0 = time.perf_counter()
        t_first: float | None = None
        last = t0
        try:
            stream = await self.engine.async_generate(
                input_ids=prompt_ids + list(task.prefix), stream=True, **args,
                rid=f"{task.id}#{task.attempt}-{uuid.uuid4().hex[:8]}",
            )
            async for chunk in stream:
                ids = chunk.get("output_ids") or []
                # Cumulative mode hands over the same growing list each time: copy only the new
                # tail, so a 100K-token stream stays O(n).
                out_ids.extend(ids if self.incremental else ids[len(out_ids):])
                meta = chunk.get("meta_info", {})
                now = time.perf_counter()
                if t_first is None and out_ids:
                    t_first = now
                if meta.get("finish_reason") is not None:
                    break
                n = len(out_ids)
                if n - sent >= report_every or (now - last >= report_seconds and n > sent):
                    yield Progress(id=task.id, new_tokens=out_ids[sent:n], segment=self._segment(seg, n, meta, t0, t_first, now))
                    sent, last = n, now
        except Exception as exc:  # noqa: BLE001 - e.g. CUDA OOM surfaced by the engine: fail fast, keep the tokens
            self.tokens_generated += len(out_ids)
            yield Finished(id=task.id, new_tokens=out_ids[sent:], finish_reason="error",
                           segment=self._segment(seg, len(out_ids), meta, t0, t_first, time.perf_counter()),
                           error=f"{type(exc).__name__}: {exc}", prompt_tokens=len(prompt_ids),
                           text=self._text(list(task.prefix) + out_ids))
            return
        reason, error = _finish_reason(meta) if meta else ("error", "the stream ended without a finish reason")
        self.tokens_generated += len(out_ids)
        yield Finished(
            id=task.id, new_tokens=out_ids[sent:], finish_reason=reason, error=error,
            segment=self._segment(seg, len(out_ids), meta, t0, t_first, time.perf_counter()),
            text=self._text(list(task.prefix) + out_ids), prompt_tokens=len(prompt_ids),
            extra={k: meta[k] for k in ("spec_accept_length", "spec_accept_rate", "spec_verify_ct", "cached_tokens")
                   if k in meta},
        )

    def _segment(self, seg: Segment, n: int, meta: dict, t0: float, t_first: float | None, now: float) -> Segment:
        # SGLang reports a request's verify count with its last chunk only: mid-stream (and in a
        # stretch a stopped driver cut short) a speculative stretch's steps are unknown, 0, not one
        # per token, which would read as tau 1.
        steps = int(meta.get("spec_verify_ct") or 0) if self.speculative else max(n - 1, 0)
        prefill = (t_first - t0) if t_first is not None else now - t0
        return msgspec.structs.replace(
            seg, tokens=n, steps=steps,
            accepted=int(meta.get("spec_num_correct_drafts") or 0),
            drafted=int(meta.get("spec_num_proposed_drafts") or 0),
            prefill_seconds=prefill, decode_seconds=now - t0 - prefill,
        )

    def shutdown(self) -> None:
        self.engine.shutdown()
