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
from ..core.verify import verify_tree
from ..methods import Suffix, SuffixState
from .checkpoint import LoadedModel
from .decoder import Decoder, GenerationResult, ProgressFn
from .model import ForwardSpec

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
        dev = self.model.device
        t = time.perf_counter()
        draft = self.method.propose(self.state, self.history, self.full_nodes, self.max_nodes)
        tree = draft.tree
        t_draft = time.perf_counter()
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
        s.drafted += draft.depth
        s.verify_tokens += len(tree)
        s.draft_seconds += t_draft - t
        s.verify_seconds += time.perf_counter() - t_draft
        return verdict.tokens
