"""TokenSwift in the reference runtime: two forwards per step.

1. Draft: the root token alone through the model over the *partial* KV that
   :class:`~sgl_longgen.methods.TokenSwift` names; the base head and the three extra heads give
   the candidates the method turns into a trie (with n-gram paths).
2. Verify: the whole trie through the model over the *full* KV with the ancestor mask; one draw
   per node and the walk decide what is committed; the accepted rows' KV is compacted in place.
   Under ``partial_kv.policy = "verify"`` it also scores the committed keys with its first rows
   (:mod:`sgl_longgen.core.verify_scores`): per layer, those scores pick the next draft's partial
   KV. They are read off the verify's queries and keys and change nothing in its output.
"""

from __future__ import annotations

import time

import torch

from ..config import GenerateConfig
from ..core.heads import TokenSwiftHeads
from ..core.tokenswift import candidate_count, head_candidates
from ..core.tree import Source
from ..core.verify import verify_tree
from ..core.verify_scores import score_rows
from ..errors import LonggenError
from ..methods import Draft, TokenSwift
from .checkpoint import LoadedModel
from .decoder import Decoder
from .model import ForwardSpec


class TokenSwiftDecoder(Decoder):
    def __init__(self, loaded: LoadedModel, config: GenerateConfig, heads: TokenSwiftHeads):
        super().__init__(loaded, config)
        ts = config.tokenswift
        if heads.hidden_size != loaded.config.hidden_size:
            raise LonggenError(
                f"heads have hidden size {heads.hidden_size} but the model's is {loaded.config.hidden_size}"
            )
        if heads.num_heads < ts.num_heads:
            raise LonggenError(f"the tree {ts.tree} needs {ts.num_heads} heads, the checkpoint has {heads.num_heads}")
        ctx = loaded.config.max_position_embeddings
        if ts.partial_kv.budget > ctx:
            raise LonggenError(f"partial KV budget {ts.partial_kv.budget} is larger than the model's context ({ctx})")
        cfg = loaded.config
        self.method = TokenSwift(ts, config.suffix, cfg.num_hidden_layers, cfg.n_kv_heads)
        self.heads = heads.to(device=self.model.device, dtype=self.model.dtype).eval().requires_grad_(False)
        # The largest trie: the full head tree plus every n-gram path's own nodes.
        tree_nodes, width = 1, 1
        for b in ts.tree:
            width *= b
            tree_nodes += width
        ngram_nodes = ts.ngram.top_k * ts.ngram.n if ts.ngram.enabled else 0
        suffix_nodes = config.suffix.max_spec_tokens if ts.suffix else 0
        self.slack = self.full_nodes = tree_nodes + ngram_nodes + suffix_nodes

    def after_prefill(self) -> None:
        self.state = self.method.start(self.length)

    def after_plain_step(self, h: torch.Tensor, token: int) -> None:
        """The partial KV's policy follows the committed length; the n-gram pool and the suffix
        index catch up with the history at the next draft (:meth:`TokenSwift.index`)."""
        self.method.observe(self.state, self.length)

    def hint(self) -> float | None:
        return self.method.history_hint(self.state, self.history, self.sampling)

    def draft(self) -> Draft:
        """The root over the partial KV (scoring the committed keys when a selection is due)."""
        dev = self.model.device
        root = self.history[-1]
        view = self.method.view(self.state)
        spec = ForwardSpec(start=self.length, visible=view.positions())
        if view.score is not None:
            spec.score = (0, *view.score)
        h0 = self.model(torch.tensor([root], device=dev), torch.tensor([self.length], device=dev), self.cache, spec)
        if spec.scores:
            self.method.select(self.state, torch.stack(spec.scores))
        vocab = self.loaded.config.vocab_size
        values, ids = head_candidates(self.heads, h0, self.model.model.norm(h0), self.model.lm_head.weight,
                                      self.method.config.num_heads, vocab, candidate_count(self.method.config.tree, vocab))
        self.method.index(self.state, self.history, self.sampling)
        window = self.method.penalty_window(self.history, self.sampling)
        return self.method.propose(self.state, root, values[0].tolist(), ids[0].tolist(), self.sampling, window,
                                   self.max_nodes)

    def step(self) -> list[int]:
        dev = self.model.device
        t = time.perf_counter()
        draft = self.draft()
        tree = draft.tree
        t_draft = time.perf_counter()
        L = self.length
        self.cache.ensure(L + len(tree))
        spec = ForwardSpec(start=L, mask=tree.ancestor_mask(dev))
        scored = self.method.verify_score_range(self.state)
        if scored is not None:
            spec.prefix_logits = (score_rows(len(tree)), *scored)
        h = self.model(tree.token_tensor(dev), tree.positions(L, dev), self.cache, spec)
        if spec.prefix_scores:  # before observe(): the selection is taken at length L
            self.method.select_verified(self.state, torch.stack(spec.prefix_scores))
        verdict = verify_tree(tree, self.model.logits(h), self.processor, self.history, self.generator)
        self.cache.keep(L, verdict.nodes)
        self.length = L + len(verdict.nodes)
        self.step_nodes = verdict.nodes
        self.method.observe(self.state, self.length)

        s = self.stats
        s.accepted += verdict.accepted
        s.drafted += draft.depth
        last = verdict.nodes[-1]
        if tree.sources[last] & (Source.NGRAM | Source.SUFFIX) and not tree.sources[last] & Source.HEADS:
            s.ngram_steps += 1
        s.draft_seconds += t_draft - t
        s.verify_seconds += time.perf_counter() - t_draft
        return verdict.tokens

