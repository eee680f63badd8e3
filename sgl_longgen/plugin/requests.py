"""Per-request state and sampling rules of our SGLang workers.

SGLang's batch carries the tokens; everything a speculative method remembers across steps (its
n-gram pool, partial-KV selection, random generator) lives here, keyed by request id, so
requests joining and leaving the batch never disturb each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import SamplingConfig

# SGLang's "no top-k" sentinel (sampling_params.TOP_K_ALL) and greedy encoding (top_k == 1).
_TOP_K_ALL = 1 << 30


class TokenHistory(Sequence):
    """Prompt plus committed output (plus this step's verdict), read in place.

    A 100K-token request would otherwise copy its whole history twice per step; every reader
    (penalty windows, n-gram indexing, suffix matching) only looks at the tail or at new tokens.
    """

    __slots__ = ("_parts", "_ends")

    def __init__(self, *parts: Sequence[int]):
        self._parts = parts
        ends, total = [], 0
        for part in parts:
            total += len(part)
            ends.append(total)
        self._ends = ends

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            out: list[int] = []
            begin = 0
            for part, end in zip(self._parts, self._ends):
                if stop <= begin:
                    break
                if start < end:
                    out.extend(part[max(start - begin, 0) : min(stop, end) - begin])
                begin = end
            return out
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("history index out of range")
        begin = 0
        for part, end in zip(self._parts, self._ends):
            if index < end:
                return int(part[index - begin])
            begin = end
        raise IndexError("history index out of range")  # unreachable

    def __iter__(self):
        for part in self._parts:
            for t in part:
                yield int(t)

    def extended(self, tokens: Sequence[int]) -> "TokenHistory":
        """This history followed by ``tokens`` (nothing is copied but ``tokens``)."""
        return TokenHistory(*self._parts, list(tokens))


def request_tokens(req) -> TokenHistory:
    """Prompt plus everything committed so far; the last token is the next root."""
    return TokenHistory(req.origin_input_ids, req.output_ids)


@dataclass
class PenaltyDefaults:
    penalty: float = 1.0
    window: int = 1024


_active_defaults: PenaltyDefaults | None = None


def activate_penalty_defaults(defaults: PenaltyDefaults) -> None:
    """Called by our worker: this process serves one of our algorithms with these defaults."""
    global _active_defaults
    _active_defaults = defaults


def active_penalty_defaults() -> PenaltyDefaults | None:
    """The penalty defaults of the worker running in this process (None: no worker of ours)."""
    return _active_defaults


def penalty_settings(req, defaults: PenaltyDefaults) -> tuple[float, int]:
    """Contextual penalty of a request: its ``custom_params`` override the server's defaults."""
    params: dict[str, Any] = req.sampling_params.custom_params or {}
    theta = float(params.get("penalty", defaults.penalty))
    window = int(params.get("penalty_window", defaults.window))
    if theta < 1.0 or window < 0:
        raise ValueError(f"bad contextual penalty for request {req.rid}: penalty={theta}, penalty_window={window}")
    return theta, window


def sampling_config(req, defaults: PenaltyDefaults) -> SamplingConfig:
    """The request's target distribution in our terms, with SGLang's joint filter semantics."""
    sp = req.sampling_params
    theta, window = penalty_settings(req, defaults)
    greedy = sp.top_k == 1
    top_k = 0 if greedy or sp.top_k is None or sp.top_k <= 0 or sp.top_k >= _TOP_K_ALL else sp.top_k
    return SamplingConfig(
        temperature=0.0 if greedy else float(sp.temperature),
        top_p=float(sp.top_p),
        top_k=top_k,
        min_p=float(sp.min_p),
        penalty=theta,
        penalty_window=window,
        filter_order="joint",
    )


def tree_blocker(req, penalty_processor_cls) -> str | None:
    """Why a request's drafts cannot be verified losslessly here (None: they can).

    These features make a node's distribution depend on state we cannot extend along a draft
    path (SGLang's count-based penalties, grammars, opaque logit processors). Such requests
    still run, one exact token per step from the root.
    """
    sp = req.sampling_params
    if sp.frequency_penalty or sp.presence_penalty or sp.repetition_penalty != 1.0:
        return "frequency/presence/repetition penalty"
    if sp.min_new_tokens and len(req.output_ids) < sp.min_new_tokens:
        return "min_new_tokens"
    if req.grammar is not None:
        return "structured output"
    if req.custom_logit_processor:
        from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

        proc = CustomLogitProcessor.from_str(req.custom_logit_processor)
        if not isinstance(proc, penalty_processor_cls):
            return "custom logit processor"
    if req.return_logprob:
        return "logprobs"
    return None


@dataclass
class RequestState:
    """What one request's speculation remembers between steps."""

    rid: str
    generator: torch.Generator
    method_state: Any = None  # the method's own (e.g. n-gram pool, partial-KV policy)
    last_seen: int = 0  # worker step at which the request was last in a batch
    stats: dict[str, float] = field(default_factory=dict)
