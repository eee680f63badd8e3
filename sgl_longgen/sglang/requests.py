"""Per-request state and sampling rules of our SGLang workers.

SGLang's batch carries the tokens; everything a speculative method remembers across steps (its
n-gram pool, partial-KV selection, random generator) lives here, keyed by request id, so
requests joining and leaving the batch never disturb each other. What a request asks for (its
target distribution, penalty, seed) was parsed when it was admitted (:mod:`.request_settings`):
a step only reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..config import SamplingConfig
from .grammar import active_grammar
from .request_settings import DEFAULT_SETTINGS, RequestSettings, penalty_of, settings_of


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


def worker_active() -> bool:
    """A worker of ours runs in this process (the scheduler's): hooks on SGLang's shared code
    act only there."""
    return _active_defaults is not None


def active_penalty_defaults() -> PenaltyDefaults | None:
    """The penalty defaults of the worker running in this process (None: no worker of ours)."""
    return _active_defaults


def penalty_settings(req, defaults: PenaltyDefaults) -> tuple[float, int]:
    """Contextual penalty ``(theta, window)`` of a request: its own, else the server's defaults."""
    return penalty_of(settings_of(req), defaults)


def sampling_config(req, defaults: PenaltyDefaults, settings: RequestSettings | None = None) -> SamplingConfig:
    """The request's target distribution in our terms, with SGLang's joint filter semantics
    (``settings``: the request's, where the caller has them already)."""
    s = settings_of(req) if settings is None else settings
    theta, window = penalty_of(s, defaults)
    return SamplingConfig(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p, penalty=theta,
                          penalty_window=window, filter_order="joint")


def tree_blocker(req, settings: RequestSettings) -> str | None:
    """Why a request's drafts cannot be verified losslessly here (None: they can).

    These features make a node's distribution depend on state we cannot extend along a draft
    path (SGLang's count-based penalties, opaque logit processors). Such requests still run, one
    exact token per step from the root. A grammar is extended along the paths (:mod:`.grammar`).
    """
    sp = req.sampling_params
    if sp.frequency_penalty or sp.presence_penalty or sp.repetition_penalty != 1.0:
        return "frequency/presence/repetition penalty"
    if sp.min_new_tokens and len(req.output_ids) < sp.min_new_tokens:
        return "min_new_tokens"
    if req.custom_logit_processor and not settings.penalty_processor:
        return "custom logit processor"
    if req.return_logprob:
        return "logprobs"
    return None


@dataclass
class RequestState:
    """What one request's speculation remembers between steps."""

    rid: str
    generator: torch.Generator
    method: Any = None  # the method's own (n-gram pool and partial KV, OWL states, ...)
    failed: bool = False  # its drafting raised: plain decode steps from now on
    adaptive: Any = None  # adaptive speculation's per-request state (.adaptive.RequestAdaptive)
    last_seen: int = 0  # worker step at which the request was last in a batch


@dataclass
class StepRequest:
    """One request's view of the current step."""

    req: Any  # SGLang's Req
    state: RequestState
    history: TokenHistory  # committed tokens; history[-1] is the root (no KV yet)
    seq_len: int  # committed KV length
    sampling: SamplingConfig
    blocker: str | None  # why its drafts cannot be verified exactly here (None: they can)
    settings: RequestSettings = DEFAULT_SETTINGS  # what the request asked for (.request_settings)
    grammar: Any = None  # its grammar while it still constrains tokens (.grammar.active_grammar)

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def root(self) -> int:
        return self.history[-1]


class RequestTable:
    """Each running request's state, by request id; a new request gets its own generator."""

    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)  # requests without a seed
        self.states: dict[str, RequestState] = {}
        self.step_count = 0

    def begin(self, batch, defaults: PenaltyDefaults) -> list[StepRequest]:
        """The batch's requests as :class:`StepRequest`; forgets requests that left silently."""
        self.step_count += 1
        seq_lens = batch.seq_lens_cpu.tolist() if batch.seq_lens_cpu is not None else batch.seq_lens.tolist()
        steps = []
        for req, seq_len in zip(batch.reqs, seq_lens):
            settings = settings_of(req)
            steps.append(StepRequest(req, self._state(req, settings), request_tokens(req), int(seq_len),
                                     sampling_config(req, defaults, settings), tree_blocker(req, settings), settings,
                                     active_grammar(req)))
        self._forget_absent({s.rid for s in steps})
        return steps

    def pop(self, rid: str) -> RequestState | None:
        return self.states.pop(rid, None)

    def clear(self) -> None:
        self.states.clear()

    def _state(self, req, settings: RequestSettings) -> RequestState:
        state = self.states.get(req.rid)
        if state is None:
            seed = settings.seed
            gen = torch.Generator(device=self.device).manual_seed(seed) if seed is not None else self.generator
            state = self.states[req.rid] = RequestState(req.rid, gen)
        state.last_seen = self.step_count
        return state

    def _forget_absent(self, present: set[str]) -> None:
        """Requests that left without a finish notice (aborts, retractions)."""
        limit = 4 * max(1, len(present)) + 64
        if len(self.states) > limit:
            for rid in [r for r, s in self.states.items() if r not in present and s.last_seen < self.step_count]:
                del self.states[rid]
