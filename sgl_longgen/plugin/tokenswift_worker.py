"""TOKENSWIFT as an SGLang speculative worker.

Per step and request: the root token goes through SGLang's model runner in DECODE mode over the
request's *partial* KV only (explicit ``kv_indices``: sinks, the selected positions and the
newest ones), the pre-norm state feeds the three heads, and their top candidates plus n-grams of
the request's history form the trie that :class:`TreeSpecWorker` verifies. Whenever the newest
tokens would reach the sinks, that same draft forward re-scores the committed positions with the
root's query.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

from ..config import PartialKVConfig
from ..core.heads import load_heads
from ..core.ngram import NgramPool
from ..core.partial_kv import PartialKVPolicy
from ..core.penalty import tree_window_mask
from ..core.sampling import LogitsProcessor
from ..core.tree import DraftTree, Source, cartesian_paths
from ..core.verify import Verdict
from .capture import ImportanceScorer, PreNormCapture
from .draft_dir import inspect_heads_draft_dir
from .draft_graph import DraftGraphRunner
from .requests import PenaltyDefaults
from .spec_inputs import PartialDraftInput
from .tree_worker import StepRequest, TreeSpecWorker


@dataclass
class TokenSwiftState:
    pool: NgramPool | None
    policy: PartialKVPolicy


class TokenSwiftWorker(TreeSpecWorker):
    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker, **kwargs):
        super().__init__(server_args, gpu_id, nccl_port, target_worker, **kwargs)
        draft = inspect_heads_draft_dir(server_args.speculative_draft_model_path, server_args.model_path)
        self.ts = draft.defaults.tokenswift
        # The engine passes one KV index list per request to the attention backend, so the
        # selection is shared by all layers and heads (scores summed over them).
        self.partial_kv = PartialKVConfig(budget=self.ts.partial_kv.budget, sinks=self.ts.partial_kv.sinks,
                                          granularity="shared")
        sampling = draft.defaults.sampling
        self.set_penalty_defaults(PenaltyDefaults(sampling.penalty, sampling.penalty_window))
        dtype = next(self.model.parameters()).dtype
        self.heads = load_heads(draft.path, hidden_size=draft.checkpoint["hidden_size"],
                                num_heads=self.ts.num_heads).to(device=self.device, dtype=dtype).eval()
        self.lm_head_weight = self.model.lm_head.weight
        self.capture = PreNormCapture(self.model)
        self.scorer = ImportanceScorer(self.model_runner)
        self.draft_graphs = DraftGraphRunner(self.model_runner, self.capture)

    # -- state ------------------------------------------------------------------------------------

    def new_method_state(self, step: StepRequest) -> TokenSwiftState:
        ng = self.ts.ngram
        pool = NgramPool(ng.n, ng.top_k) if ng.enabled else None
        policy = PartialKVPolicy(self.partial_kv, 1, 1)
        policy.reset(step.seq_len)  # first selection: scored by the first draft forward
        state = TokenSwiftState(pool, policy)
        self._index_ngrams(state, step)
        return state

    def _index_ngrams(self, state: TokenSwiftState, step: StepRequest) -> None:
        if state.pool is None:
            return
        exclude = step.sampling.penalty_window if (self.ts.ngram.exclude_penalty_window and step.sampling.penalty_active) else 0
        state.pool.extend(step.history, len(step.history) - exclude)

    # -- draft -------------------------------------------------------------------------------------

    def _partial_forward(self, batch, steps: list[StepRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        """Root tokens through the target over their partial KV; base logits and pre-norm states."""
        dev = self.device
        rows = batch.req_to_token_pool.req_to_token
        indices, lens = [], []
        for b, step in enumerate(steps):
            policy = step.state.method_state.policy
            positions = policy.visible()[0].to(dev)
            rp = batch.req_pool_indices[b]
            slots = rows[rp, positions]
            root_slot = rows[rp, step.seq_len : step.seq_len + 1]
            indices.append(torch.cat([slots, root_slot]))
            lens.append(len(positions) + 1)
        kv_indices = torch.cat(indices).to(torch.int32)
        score_ranges = [self._score_range(step) for step in steps]
        kv_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
        kv_indptr = torch.zeros(len(steps) + 1, dtype=torch.int32, device=dev)
        kv_indptr[1:] = torch.cumsum(kv_lens, 0)

        saved = (batch.forward_mode, batch.input_ids, batch.out_cache_loc, batch.spec_info,
                 batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum)
        roots = torch.tensor([s.root for s in steps], dtype=torch.int64, device=dev)
        root_slots = torch.stack([rows[batch.req_pool_indices[b], s.seq_len] for b, s in enumerate(steps)])
        try:
            # The root's slot is the first of its verify window: verify overwrites it right after.
            batch.forward_mode = ForwardMode.DECODE
            batch.input_ids = roots
            batch.out_cache_loc = root_slots.to(torch.int64)
            spec = PartialDraftInput(positions=batch.seq_lens.to(torch.int64), kv_indptr=kv_indptr,
                                     kv_indices=kv_indices, score_ranges=score_ranges)
            batch.spec_info = spec
            batch.seq_lens = kv_lens
            batch.seq_lens_cpu = kv_lens.cpu()
            batch.seq_lens_sum = int(sum(lens))
            forward_batch = ForwardBatch.init_new(batch, self.model_runner, return_hidden_states_before_norm=False)
            if self.draft_graphs.can_run(forward_batch):
                logits, h0 = self.draft_graphs.run(forward_batch)
            else:
                with self.capture:
                    logits = self.model_runner.forward(forward_batch).logits_output.next_token_logits
                h0 = self.capture.value
        finally:
            (batch.forward_mode, batch.input_ids, batch.out_cache_loc, batch.spec_info,
             batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum) = saved
        for b, scores in spec.scores.items():
            steps[b].state.method_state.policy.select(scores[None, None].cpu())
        return logits[:, : self.vocab_size], h0

    @torch.no_grad()
    def draft(self, batch, steps: list[StepRequest]) -> list[DraftTree]:
        base_logits, h0 = self._partial_forward(batch, steps)
        head_states = torch.stack(self.heads(h0)[: self.ts.num_heads], dim=1)  # [bs, heads, d]
        head_logits = torch.matmul(head_states, self.lm_head_weight.t())[..., : self.vocab_size]
        all_logits = torch.cat([base_logits[:, None].to(head_logits.dtype), head_logits], dim=1).float()
        width = max(self.ts.tree)
        trees = []
        for b, step in enumerate(steps):
            tree = DraftTree(step.root)
            trees.append(tree)
            if step.blocker is not None:
                continue
            proc = LogitsProcessor(step.sampling, self.vocab_size)
            rows = all_logits[b]
            mask = None
            if step.sampling.penalty_active:
                # Proposals only decide what gets verified: the committed window is enough.
                mask = tree_window_mask(step.history, [[]] * rows.shape[0], step.sampling.penalty_window,
                                        self.vocab_size, rows.device)
            cands = proc.top_candidates(rows, width, mask)
            for path in cartesian_paths(cands, self.ts.tree):
                tree.add_path(path, Source.HEADS, max_nodes=self.num_nodes)
            pool = step.state.method_state.pool
            if pool is not None and cands[0]:
                d1 = cands[0][0]
                for cont in pool.lookup(d1):
                    tree.add_path((d1, *cont), Source.NGRAM, max_nodes=self.num_nodes)
        return trees

    # -- commit ----------------------------------------------------------------------------------

    @staticmethod
    def _score_range(step: StepRequest) -> tuple[int, int] | None:
        policy = step.state.method_state.policy
        rng = policy.score_range() if step.blocker is None else None
        if rng is not None and rng[1] <= rng[0]:
            policy.select(torch.empty(1, 1, 0))  # nothing beyond the sinks to rank yet
            rng = None
        return rng

    def after_commit(self, steps: list[StepRequest], verdicts: list[Verdict]) -> None:
        for step, verdict in zip(steps, verdicts):
            state: TokenSwiftState = step.state.method_state
            state.policy.commit(step.seq_len + len(verdict.nodes))
            self._index_ngrams(state, step)
