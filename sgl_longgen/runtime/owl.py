"""OWL and HOWL in the reference runtime: one target forward per step.

OWL: the LSTM drafter expands a tree from the last committed state (and the last [SPEC] state);
every tree node and the root get one [SPEC] leaf; the tree goes through the target over the full KV
with the ancestor mask; the per-node walk decides what is committed. The accepted path's last
node gives the next round's ``h_last`` and its [SPEC] leaf gives ``h_S``; compaction keeps only the
root and the accepted nodes, so no [SPEC] KV survives.

HOWL: a SuffixDecoding draft is verified as a one-path trie (no [SPEC]) when its score exceeds the
threshold, an OWL tree otherwise; the tree round right after a linear round uses the null state.

[SPEC] is an input-only token: id ``vocab_size`` of the reference model, embedded as the drafter
checkpoint's vector. The prefill appends one after the prompt (at the position of the first new
token) so the first round already has a [SPEC] state; its KV slot is overwritten by the first step.
"""

from __future__ import annotations

import time

import torch

from ..config import GenerateConfig
from ..core.howl import HowlPolicy, HowlState, Route
from ..core.owl import OwlDrafter, attach_spec_leaves, propose, verify_width
from ..core.suffix import SuffixCache
from ..core.tree import DraftTree, Source
from ..core.verify import Verdict, verify_tree
from ..errors import LonggenError
from .checkpoint import LoadedModel
from .decoder import PREFILL_CHUNK, Decoder, GenerationResult, ProgressFn
from .model import ForwardSpec


class OwlDecoder(Decoder):
    def __init__(self, loaded: LoadedModel, config: GenerateConfig, drafter: OwlDrafter):
        super().__init__(loaded, config)
        cfg = loaded.config
        if drafter.hidden_size != cfg.hidden_size:
            raise LonggenError(f"the OWL drafter reads hidden size {drafter.hidden_size} but the model's is {cfg.hidden_size}")
        if drafter.vocab_size != cfg.vocab_size:
            raise LonggenError(f"the OWL drafter has vocabulary {drafter.vocab_size} but the model's is {cfg.vocab_size}")
        self.owl = config.owl
        if self.owl.spec and not drafter.spec:
            raise LonggenError("the OWL drafter was trained without [SPEC]; set owl.spec = false")
        self.use_spec = self.owl.spec
        self.drafter = drafter.to(device=self.model.device, dtype=self.model.dtype).eval().requires_grad_(False)
        self.spec_id = cfg.vocab_size  # input-only: embedded as the checkpoint's [SPEC] vector
        self.spec_rows = self.drafter.spec_embedding.detach()[None] if drafter.spec else None
        self.slack = verify_width(self.owl.tree_size, self.use_spec)
        self.h_last: torch.Tensor | None = None  # [1, d] post-norm state of the last committed token
        self.h_spec: torch.Tensor | None = None  # [1, d] post-norm state of the last [SPEC], if any

    # -- prefill -------------------------------------------------------------------------------

    def _prefill(self, prompt_ids: list[int]) -> torch.Tensor:
        """The prompt (plus one [SPEC] at position P when enabled); keeps ``h_last`` and ``h_S``."""
        dev = self.model.device
        with_spec = self.use_spec and self.owl.prefill_spec
        ids = list(prompt_ids) + ([self.spec_id] if with_spec else [])
        tail = None
        for lo in range(0, len(ids), PREFILL_CHUNK):
            hi = min(len(ids), lo + PREFILL_CHUNK)
            chunk = torch.tensor(ids[lo:hi], dtype=torch.long, device=dev)
            h = self.model(chunk, torch.arange(lo, hi, device=dev), self.cache, ForwardSpec(start=lo),
                           self.spec_rows if with_spec else None)
            tail = h[-2:] if tail is None else torch.cat([tail, h])[-2:]
        norm = self.model.model.norm
        if with_spec:
            self.h_last, self.h_spec = norm(tail[-2:-1]), norm(tail[-1:])
            return self.model.logits(tail[-2:-1])
        self.h_last, self.h_spec = norm(tail[-1:]), None
        return self.model.logits(tail[-1:])

    # -- drafting and verification ---------------------------------------------------------------

    def draft_tree(self, use_spec_state: bool, attach: bool) -> tuple[DraftTree, list[int], int]:
        """The OWL trie for this round, its [SPEC] leaves (``leaf[node]``; empty if none) and its depth."""
        o = self.owl
        h_spec = self.h_spec if use_spec_state else None
        (tree,) = propose(self.drafter, self.h_last, h_spec, [self.history[-1]],
                          top_k=o.top_k, depth=o.depth, tree_size=o.tree_size)
        depth = tree.max_depth
        leaves = attach_spec_leaves(tree, self.spec_id) if attach else []
        return tree, leaves, depth

    def verify(self, tree: DraftTree, leaves: list[int]) -> Verdict:
        """One target forward over the trie; commits the walk's result and updates the states."""
        dev = self.model.device
        L = self.length
        self.cache.ensure(L + len(tree))
        spec = ForwardSpec(start=L, mask=tree.ancestor_mask(dev))
        h = self.model(tree.token_tensor(dev), tree.positions(L, dev), self.cache, spec,
                       self.spec_rows if leaves else None)
        # [SPEC] leaves come after every draft node and are never drawn from: no logits for them.
        verdict = verify_tree(tree, self.model.logits(h[: tree.num_walkable]), self.processor, self.history,
                              self.generator)
        self.cache.keep(L, verdict.nodes)  # drops every [SPEC] slot with the rejected nodes
        self.length = L + len(verdict.nodes)
        last = verdict.nodes[-1]
        norm = self.model.model.norm
        self.h_last = norm(h[last : last + 1])
        self.h_spec = norm(h[leaves[last] : leaves[last] + 1]) if leaves else None
        self.stats.accepted += verdict.accepted
        self.stats.verify_tokens += len(tree)
        return verdict

    def step(self) -> list[int]:
        t = time.perf_counter()
        tree, leaves, depth = self.draft_tree(self.use_spec and self.h_spec is not None, self.use_spec)
        t_draft = time.perf_counter()
        verdict = self.verify(tree, leaves)
        self.stats.drafted += depth
        self.stats.draft_seconds += t_draft - t
        self.stats.verify_seconds += time.perf_counter() - t_draft
        return verdict.tokens


class HowlDecoder(OwlDecoder):
    """OWL trees with [SPEC], or a linear suffix draft when SuffixDecoding expects more than c tokens.

    The suffix index (prompt + output) persists across ``generate`` calls only through its
    optional global index over past outputs (``suffix.global_requests``).
    """

    def __init__(self, loaded: LoadedModel, config: GenerateConfig, drafter: OwlDrafter):
        super().__init__(loaded, config, drafter)
        self.policy = HowlPolicy(config.howl, spec=self.use_spec)
        self.suffix = SuffixCache(config.suffix)
        self.slack = max(self.slack, 1 + config.suffix.max_spec_tokens)
        self._request = 0

    def generate(self, prompt_ids: list[int], max_new_tokens: int, progress: ProgressFn | None = None) -> GenerationResult:
        self._request += 1
        try:
            return super().generate(prompt_ids, max_new_tokens, progress)
        finally:
            self.suffix.stop_request(self._request)

    def after_prefill(self) -> None:
        self.suffix.start_request(self._request, self.history[: self.length])
        self._indexed = self.length
        self.state = HowlState(has_spec=self.h_spec is not None)
        self.after_commit()

    def after_commit(self) -> None:
        self.suffix.extend(self._request, self.history[self._indexed :])
        self._indexed = len(self.history)

    def step(self) -> list[int]:
        t = time.perf_counter()
        draft = self.suffix.speculate(self._request, self.history)
        route: Route = self.policy.route(draft.score, self.state)
        if route.linear:
            tree = DraftTree(self.history[-1])
            tree.add_path(draft.tokens, Source.SUFFIX)
            leaves, depth = [], len(draft.tokens)
        else:
            tree, leaves, depth = self.draft_tree(route.use_spec, route.attach_spec)
        t_draft = time.perf_counter()
        verdict = self.verify(tree, leaves)
        self.policy.update(self.state, route)
        s = self.stats
        s.drafted += depth
        s.linear_steps += route.linear
        s.draft_seconds += t_draft - t
        s.verify_seconds += time.perf_counter() - t_draft
        return verdict.tokens
