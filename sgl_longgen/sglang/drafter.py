"""What a method does in an SGLang worker around the shared step (:mod:`.worker`).

A drafter runs its method (:mod:`sgl_longgen.methods`) on SGLang's model runner: it drafts one
trie per request, may change the verify batch (OWL's [SPEC] embeddings), reads what the verify
forward produced besides logits (hidden states) and tells its method what was committed. The
worker owns everything else: the requests' states, the verify forward, the draws, the walk and
the commit.

Each hook gets only the requests that draft: a request whose drafting raised once decodes plain
from then on and is never handed to its drafter again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

from ..config import GenerateConfig, SamplingConfig
from ..core.verify import TreeWalks, Verdict
from ..methods import Draft
from .requests import PenaltyDefaults, StepRequest

Shadow = Callable[[], None]


class Drafter:
    # What the target's forwards must also return.
    verify_capture = CaptureHiddenMode.NULL  # verify
    prefill_capture: CaptureHiddenMode | None = None  # prefill (None: SGLang's default)
    # The contextual penalty a request gets when it does not set one (the draft directory's).
    penalty = PenaltyDefaults()
    # The draft directory's defaults (``longgen.toml``): adaptive speculation's among them.
    defaults = GenerateConfig()

    def start(self, step: StepRequest):
        """The method's state for a request at its first decode step."""
        return None

    def draft(self, batch, steps: list[StepRequest], shadow: Shadow, max_nodes: int) -> list[Draft]:
        """One draft per request (root = the request's last token; a blocked request gets
        :meth:`Draft.root_only`), each trie cut to its first ``max_nodes`` nodes, the root included:
        the step's draft width (adaptive widths), or ``speculative_num_draft_tokens`` for the whole
        draft (which a trie with its [SPEC] leaves fits).

        ``shadow()`` queues the verify inputs that do not depend on the tries: a drafter whose
        forward runs asynchronously calls it while that forward is on the device.
        """
        raise NotImplementedError

    def rows(self, max_nodes: int) -> int:
        """Verify rows per request of a draft cut to ``max_nodes`` trie nodes (OWL adds its [SPEC] leaves)."""
        return max_nodes

    def hint(self, step: StepRequest) -> float | None:
        """Draft tokens the request's next draft is expected to get accepted, judged from its
        committed tokens (``step.history``) before any draft forward: adaptive speculation's hint
        (:mod:`sgl_longgen.core.adaptive`). None: no such estimate."""
        return None

    def can_draft_ahead(self, key: tuple) -> bool:
        """Whether the worker may draft the step with batch ``key`` before this call returns, on a
        stream of its own (:mod:`.spec_ahead`): nothing in that draft captures a CUDA graph (a
        drafter that captures per batch size has one for this batch, which just drafted)."""
        return True

    def before_verify(self, batch, steps: list[StepRequest], drafts: list[Draft]) -> None:
        """Last changes to the verify batch (e.g. input-embedding overrides)."""

    def after_verify(self, steps: list[StepRequest], drafts: list[Draft], logits_output) -> None:
        """Read what the verify forward returns besides logits (hidden states)."""

    def after_walk(self, batch, steps: list[StepRequest], drafts: list[Draft], walks: TreeWalks) -> None:
        """Right after the walk and commit were queued on the device (``walks``: still there).

        A drafter may queue the next step's draft behind the commit here, before the host has
        read anything back.
        """

    def observe(self, steps: list[StepRequest], drafts: list[Draft], verdicts: list[Verdict]) -> None:
        """The committed tokens (``step.history`` already extended; the KV in place)."""

    def after_commit(self, batch, steps: list[StepRequest], verdicts: list[Verdict]) -> None:
        """The device is idle from here to the next step's draft while SGLang's scheduler reads
        the results: a drafter may queue the next draft now (``steps`` still carry this step's
        ``seq_len``)."""

    def after_extend(self, batch, result) -> None:
        """Read what a prefill forward produced besides the first tokens (hidden states)."""

    def prepare(self, rid: str, history: Sequence[int], sampling: SamplingConfig) -> None:
        """A prefill committed ``history`` of the request so far (its prompt up to this chunk):
        build what its first step needs from it (a long prompt's indexes), while that prefill's
        forward runs with the host idle, instead of at the first step with the device waiting."""

    def before_forward(self) -> None:
        """Before any target forward: wait for work queued ahead that reads the KV."""

    def finish(self, rid: str) -> None:
        """A request left."""

    def drop_queued(self) -> None:
        """The next step is plain: drop a draft queued ahead for it (if any)."""

    def reset(self) -> None:
        """Drop work queued ahead (the batch changed under it, or a hook raised)."""
