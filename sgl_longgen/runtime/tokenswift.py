"""TokenSwift in the reference runtime: two forwards per step.

1. Draft: the root token alone through the model over the *partial* KV; the base head and the
   three extra heads give four rows, whose top candidates form the [1,3,3,3] tree; n-grams keyed
   on the depth-1 token add paths; everything merges into one trie.
2. Verify: the whole trie through the model over the *full* KV with the ancestor mask; the
   per-node walk decides what is committed; the accepted rows' KV is compacted in place.
"""

from __future__ import annotations

import time

import torch

from ..config import GenerateConfig
from ..core.heads import TokenSwiftHeads
from ..core.ngram import NgramPool
from ..core.partial_kv import PartialKVPolicy
from ..core.penalty import window_tokens
from ..core.tokenswift import candidate_count, draft_trie, head_candidates, rank_candidates
from ..core.tree import DraftTree, Source
from ..core.verify import verify_tree
from ..errors import LonggenError
from .checkpoint import LoadedModel
from .decoder import Decoder
from .model import ForwardSpec


class TokenSwiftDecoder(Decoder):
    def __init__(self, loaded: LoadedModel, config: GenerateConfig, heads: TokenSwiftHeads):
        super().__init__(loaded, config)
        ts = config.tokenswift
        self.ts = ts
        if heads.hidden_size != loaded.config.hidden_size:
            raise LonggenError(
                f"heads have hidden size {heads.hidden_size} but the model's is {loaded.config.hidden_size}"
            )
        if heads.num_heads < ts.num_heads:
            raise LonggenError(f"the tree {ts.tree} needs {ts.num_heads} heads, the checkpoint has {heads.num_heads}")
        ctx = loaded.config.max_position_embeddings
        if ts.partial_kv.budget > ctx:
            raise LonggenError(f"partial KV budget {ts.partial_kv.budget} is larger than the model's context ({ctx})")
        self.heads = heads.to(device=self.model.device, dtype=self.model.dtype).eval().requires_grad_(False)
        # The largest trie: the full head tree plus every n-gram path's own nodes.
        tree_nodes, width = 1, 1
        for b in ts.tree:
            width *= b
            tree_nodes += width
        ngram_nodes = ts.ngram.top_k * ts.ngram.n if ts.ngram.enabled else 0
        self.slack = tree_nodes + ngram_nodes

    def after_prefill(self) -> None:
        cfg = self.loaded.config
        ng = self.ts.ngram
        self.pool = NgramPool(ng.n, ng.top_k) if ng.enabled else None
        self.policy = PartialKVPolicy(self.ts.partial_kv, cfg.num_hidden_layers, cfg.n_kv_heads)
        self.policy.reset(self.length)  # the first draft forward scores the prompt
        self.after_commit()

    def after_commit(self) -> None:
        self.policy.commit(self.length)
        if self.pool is not None:
            exclude = self.window if self.ts.ngram.exclude_penalty_window else 0
            self.pool.extend(self.history, len(self.history) - exclude)

    def draft(self) -> DraftTree:
        """Propose a trie from the heads over the partial KV and from the n-gram pool."""
        dev = self.model.device
        root = self.history[-1]
        spec = ForwardSpec(start=self.length, visible=self.policy.visible())
        rng = self.policy.score_range()
        if rng is not None:
            # A (re-)selection is due: the root's query scores the committed keys in this same
            # forward (it runs eagerly on every engine, unlike the verify forward).
            spec.score = (0, *rng)
        h0 = self.model(torch.tensor([root], device=dev), torch.tensor([self.length], device=dev), self.cache, spec)
        if spec.scores:
            self.policy.select(torch.stack(spec.scores))
        vocab = self.loaded.config.vocab_size
        values, ids = head_candidates(self.heads, h0, self.model.model.norm(h0), self.model.lm_head.weight,
                                      self.ts.num_heads, vocab, candidate_count(self.ts.tree, vocab))
        # Proposals only decide what gets verified; the committed-context window is enough here.
        window = set(window_tokens(self.history, [], self.window)) if self.window else None
        cands = rank_candidates(values[0].cpu(), ids[0].cpu(), self.processor.params, window, max(self.ts.tree))
        return draft_trie(root, cands, self.ts.tree, self.pool)

    def step(self) -> list[int]:
        dev = self.model.device
        t = time.perf_counter()
        tree = self.draft()
        t_draft = time.perf_counter()
        L = self.length
        self.cache.ensure(L + len(tree))
        spec = ForwardSpec(start=L, mask=tree.ancestor_mask(dev))
        h = self.model(tree.token_tensor(dev), tree.positions(L, dev), self.cache, spec)
        verdict = verify_tree(tree, self.model.logits(h), self.processor, self.history, self.generator)
        self.cache.keep(L, verdict.nodes)
        self.length = L + len(verdict.nodes)

        s = self.stats
        s.accepted += verdict.accepted
        s.drafted += tree.max_depth
        last = verdict.nodes[-1]
        if tree.sources[last] & Source.NGRAM and not tree.sources[last] & Source.HEADS:
            s.ngram_steps += 1
        s.draft_seconds += t_draft - t
        s.verify_seconds += time.perf_counter() - t_draft
        return verdict.tokens
