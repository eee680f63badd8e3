"""The decode loop every method shares, and plain autoregressive decoding.

A method only says how one step turns the root token (the last sampled one, not yet in the KV
cache) into committed tokens; prefill, stopping, accounting and failure handling live here, so
methods cannot differ in anything but the step.

Adaptive speculation (``[adaptive]``, :mod:`sgl_longgen.core.adaptive`) lives here too: before
each step of a speculative method the controller picks the method's step or a plain one
(:meth:`Decoder.plain_step`, the step of ``--method ar``), fed with the measured wall time of
each. A method keeps its state consistent after a plain step in :meth:`Decoder.after_plain_step`.
With ``[adaptive] widths`` the controller also picks the step's draft width: the method drafts
with :attr:`Decoder.max_nodes` for that step (its trie cut to its first nodes) and reports the
accepted path's node positions in :attr:`Decoder.step_nodes`, from which the controller learns
what every narrower width would have committed.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import msgspec
import torch

from ..config import AdaptiveConfig, GenerateConfig
from ..core.adaptive import PLAIN, AdaptiveController
from ..core.penalty import window_tokens
from ..core.sampling import LogitsProcessor
from ..core.verify import Verdict, verify_tree
from ..errors import LonggenError
from ..methods import Draft
from .checkpoint import LoadedModel
from .model import ForwardSpec

PREFILL_CHUNK = 512


@dataclass
class Stats:
    """Per-run counters; ``steps`` counts target forwards after prefill."""

    steps: int = 0
    plain_steps: int = 0  # steps a speculative method took as plain decode steps (adaptive speculation)
    hinted_steps: int = 0  # speculative steps adaptive speculation took on the method's hint alone
    # Speculative steps per draft width ("full": the whole draft), with adaptive widths only.
    width_steps: dict[str, int] = field(default_factory=dict)
    accepted: int = 0  # accepted draft tokens (bonus excluded)
    drafted: int = 0  # draft depth offered per step, summed (TokenSwift Eq. 4's gamma * T)
    ngram_steps: int = 0  # steps whose accepted path went past the head tree along the history (n-gram, suffix)
    linear_steps: int = 0  # HOWL: steps that verified a linear suffix draft instead of an OWL tree
    verify_tokens: int = 0  # rows through the verify forwards (draft nodes, root, [SPEC] leaves)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0


@dataclass
class GenerationResult:
    output_ids: list[int]
    prompt_tokens: int
    num_new_tokens: int
    accept_length: float  # tau: tokens committed per target step
    acceptance_rate: float  # alpha: accepted drafts / drafted (TokenSwift Eq. 4)
    decode_seconds: float
    prefill_seconds: float
    finish_reason: str  # "length", "stop", "error"
    stats: Stats = field(default_factory=Stats)
    error: str | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.num_new_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def record(self) -> dict:
        out = asdict(self)
        out["tokens_per_second"] = self.tokens_per_second
        return out


# Called after every step with the tokens generated so far (a live view: copy to keep) and the
# counters; checkpointing and progress bars hang off it.
ProgressFn = Callable[[Sequence[int], Stats], None]


class Decoder(ABC):
    """One generation at a time over a loaded model (batch 1, like gpt-fast)."""

    # Extra KV slots a step may write past the committed length (the verify tree).
    slack = 1
    # Whether ``step`` speculates (then adaptive speculation may replace it by a plain step).
    speculative = True
    # The kind of draft the last speculative step verified, for the controller's per-source means.
    step_source: str | None = None
    # The most trie nodes (the root included) this method drafts: wider adaptive widths are its
    # whole draft. None: the method drafts no trie (plain decoding).
    full_nodes: int | None = None
    # The draft width of the coming step (its ``max_nodes``; None: the whole draft) and the
    # accepted path's node positions in the last verified trie (the root's 0 first).
    max_nodes: int | None = None
    step_nodes: list[int] | None = None
    # The clock adaptive speculation's costs are measured with (seconds). Wall time by default;
    # a test sets a model of step costs here, so the controller's choices repeat on any machine.
    clock: Callable[[], float] = staticmethod(time.perf_counter)

    def __init__(self, loaded: LoadedModel, config: GenerateConfig):
        self.loaded = loaded
        self.model = loaded.model
        self.config = config
        self.sampling = config.sampling
        self.processor = LogitsProcessor(config.sampling, loaded.config.vocab_size)
        self.window = config.sampling.penalty_window if config.sampling.penalty_active else 0

    # -- the method's part ---------------------------------------------------------------------

    def after_prefill(self) -> None:
        """Set up per-generation state once the prompt is in the cache."""

    @abstractmethod
    def step(self) -> list[int]:
        """Commit the root and return the newly generated tokens (the last one is the new root)."""

    def after_plain_step(self, h: torch.Tensor, token: int) -> None:
        """After a :meth:`plain_step` (plain decoding keeps no state: nothing) (``h``: the root's output row, ``[1, d]``
        before the final norm; ``token``: the one drawn, the new root, not yet in ``history``):
        bring the method's state up to the new committed length."""

    def plain_step(self) -> list[int]:
        """One target forward of the root and one draw: the whole step of plain decoding."""
        dev = self.model.device
        root = self.history[-1]
        t = time.perf_counter()
        h = self.model(torch.tensor([root], device=dev), torch.tensor([self.length], device=dev),
                       self.cache, ForwardSpec(start=self.length))
        tok = int(self.processor.sample(self.model.logits(h), self.penalty_windows([[]]), self.generator)[0])
        self.stats.verify_seconds += time.perf_counter() - t
        self.length += 1
        self.after_plain_step(h, tok)
        return [tok]

    def verify(self, draft: Draft) -> Verdict:
        """One target forward over the draft's trie (the full KV, the ancestor mask); one draw per
        node and the walk decide what is committed (:func:`~sgl_longgen.core.verify.verify_tree`);
        the accepted rows' KV is compacted in place."""
        dev = self.model.device
        tree = draft.tree
        L = self.length
        self.cache.ensure(L + len(tree))
        spec = ForwardSpec(start=L, mask=tree.ancestor_mask(dev))
        h = self.model(tree.token_tensor(dev), tree.positions(L, dev), self.cache, spec)
        verdict = verify_tree(tree, self.model.logits(h), self.processor, self.history, self.generator)
        self.cache.keep(L, verdict.nodes)
        self.length = L + len(verdict.nodes)
        self.step_nodes = verdict.nodes
        s = self.stats
        s.accepted += verdict.accepted
        s.verify_tokens += len(tree)
        s.drafted += draft.depth
        return verdict

    def hint(self) -> float | None:
        """Draft tokens the next step's draft is expected to get accepted, judged from the
        committed history alone (adaptive speculation's hint, see :mod:`sgl_longgen.core.adaptive`);
        None: the method has no such estimate."""
        return None

    def adaptive_step(self, controller: AdaptiveController) -> list[int]:
        """The step the controller picks (with its draft width), timed and reported back to it."""
        clock = self.clock
        hint = controller.hint_if_due(self.hint, clock)
        if controller.decide(hint=hint) == PLAIN:
            t = clock()
            new = self.plain_step()
            controller.record_plain(clock() - t)
            self.stats.plain_steps += 1
        else:
            self.max_nodes = width = controller.width  # None (the whole draft) without widths
            try:
                t = clock()
                new = self.step()
                seconds = clock() - t
            finally:
                self.max_nodes = None
            self.stats.hinted_steps += controller.hinted
            controller.record_spec(len(new), seconds, self.step_source, width=width, nodes=self.step_nodes, hint=hint)
            if controller.widths:
                key = "full" if width is None else str(width)
                self.stats.width_steps[key] = self.stats.width_steps.get(key, 0) + 1
        return new

    def adaptive_config(self) -> AdaptiveConfig:
        """``[adaptive]`` with the widths this method can cut to (below its largest trie: a wider
        one is its whole draft)."""
        adaptive = self.config.adaptive
        widths = [w for w in adaptive.widths if self.full_nodes is not None and w < self.full_nodes]
        return msgspec.structs.replace(adaptive, widths=widths) if widths != adaptive.widths else adaptive

    # -- shared machinery ----------------------------------------------------------------------

    def penalty_windows(self, paths: list[list[int]]) -> list[list[int]] | None:
        if not self.window:
            return None
        return [window_tokens(self.history, p, self.window) for p in paths]

    def check_prompt(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        ctx = self.loaded.config.max_position_embeddings
        if not prompt_ids:
            raise LonggenError("the prompt is empty")
        if len(prompt_ids) >= ctx:
            raise LonggenError(f"the prompt has {len(prompt_ids)} tokens but the model's context is {ctx}")
        if len(prompt_ids) + max_new_tokens > ctx:
            raise LonggenError(
                f"prompt ({len(prompt_ids)} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the "
                f"model's context of {ctx} tokens"
            )
        bad = [t for t in prompt_ids if not 0 <= t < self.loaded.config.vocab_size]
        if bad:
            raise LonggenError(f"prompt token ids out of the vocabulary: {bad[:5]}")

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, progress: ProgressFn | None = None) -> GenerationResult:
        self.check_prompt(prompt_ids, max_new_tokens)
        self.generator = torch.Generator().manual_seed(self.config.seed)
        self.stats = Stats()
        adaptive = self.adaptive_config()
        self.controller = AdaptiveController(adaptive) if self.speculative and adaptive.enabled else None
        P = len(prompt_ids)
        eos = set() if self.config.ignore_eos else set(self.loaded.eos_ids)
        self.cache = self.model.new_cache(P + max_new_tokens + self.slack)
        self.history: list[int] = list(prompt_ids)
        finish, error = "length", None

        t0 = time.perf_counter()
        logits = self._prefill(prompt_ids)
        first = int(self.processor.sample(logits, self.penalty_windows([[]]), self.generator)[0])
        self.history.append(first)
        self.length = P  # committed KV length; history[-1] (the root) has no KV yet
        self.after_prefill()
        t1 = time.perf_counter()
        if first in eos:
            finish = "stop"
        try:
            while finish == "length" and len(self.history) - P < max_new_tokens:
                new = self.step() if self.controller is None else self.adaptive_step(self.controller)
                self.stats.steps += 1
                for i, tok in enumerate(new):
                    if tok in eos:
                        new = new[: i + 1]
                        finish = "stop"
                        break
                self.history.extend(new)
                self.after_commit()
                if progress is not None:
                    progress(self.history[P : P + max_new_tokens], self.stats)
        except (Exception, KeyboardInterrupt) as exc:  # keep what was generated
            finish, error = "error", f"{type(exc).__name__}: {exc}"
        t2 = time.perf_counter()

        output = self.history[P : P + max_new_tokens]
        s = self.stats
        return GenerationResult(
            output_ids=output,
            prompt_tokens=P,
            num_new_tokens=len(output),
            accept_length=(len(self.history) - P - 1) / s.steps if s.steps else 1.0,
            acceptance_rate=s.accepted / s.drafted if s.drafted else 0.0,
            decode_seconds=t2 - t1,
            prefill_seconds=t1 - t0,
            finish_reason=finish,
            stats=s,
            error=error,
        )

    def after_commit(self) -> None:
        """Hook after new tokens joined the history (e.g. index n-grams)."""

    def _prefill(self, prompt_ids: list[int]) -> torch.Tensor:
        """Fill the cache with the prompt; return the last position's logits (``[1, V]``)."""
        dev = self.model.device
        P = len(prompt_ids)
        h = None
        for lo in range(0, P, PREFILL_CHUNK):
            hi = min(P, lo + PREFILL_CHUNK)
            ids = torch.tensor(prompt_ids[lo:hi], dtype=torch.long, device=dev)
            h = self.model(ids, torch.arange(lo, hi, device=dev), self.cache, ForwardSpec(start=lo))
        return self.model.logits(h[-1:])


class ARDecoder(Decoder):
    """Plain decoding: one target forward and one draw per token. The baseline and the oracle."""

    speculative = False

    def step(self) -> list[int]:
        return self.plain_step()
