"""SUFFIX in the reference runtime: one target forward per step, no drafter.

The method (:class:`~sgl_longgen.methods.Suffix`) drafts a tree from the request's own prompt and
output (and, with ``suffix.global_requests``, the outputs of earlier generations of this
decoder); the tree goes through the target over the full KV with the ancestor mask; one draw per
node and the walk decide what is committed; the accepted rows' KV is compacted in place. A step
whose history offers no match verifies the root alone: a plain step's token.
"""

from __future__ import annotations

import time

from ..config import GenerateConfig
from ..methods import Suffix, SuffixState
from .checkpoint import LoadedModel
from .decoder import Decoder, GenerationResult, ProgressFn

RID = 0  # one request at a time: the method keys its running requests by it


class SuffixDecoder(Decoder):
    def __init__(self, loaded: LoadedModel, config: GenerateConfig):
        super().__init__(loaded, config)
        self.method = Suffix(config.suffix)
        self.state: SuffixState | None = None  # the generation in progress
        self.slack = self.full_nodes = 1 + config.suffix.max_spec_tokens

    def generate(self, prompt_ids: list[int], max_new_tokens: int,
                 progress: ProgressFn | None = None) -> GenerationResult:
        self.state = None
        try:
            return super().generate(prompt_ids, max_new_tokens, progress)
        finally:
            if self.state is not None:  # the last step's tokens too
                self.method.sync(self.state, self.history)
            self.method.finish(RID)  # the output joins the shared corpus (when on)

    def after_prefill(self) -> None:
        self.state = self.method.start(RID, self.history)

    def hint(self) -> float | None:
        return self.method.history_hint(self.state, self.history, self.full_nodes)

    def step(self) -> list[int]:
        t = time.perf_counter()
        draft = self.method.propose(self.state, self.history, self.full_nodes, self.max_nodes)
        t_draft = time.perf_counter()
        verdict = self.verify(draft)
        self.stats.draft_seconds += t_draft - t
        self.stats.verify_seconds += time.perf_counter() - t_draft
        return verdict.tokens
