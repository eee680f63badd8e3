"""TOKENSWIFT as an SGLang speculative worker.

Per step and request: the root token goes through SGLang's model runner in DECODE mode over the
request's *partial* KV only (explicit ``kv_indices``: sinks, the selected positions and the
newest ones), the pre-norm state feeds the three heads, and their top candidates plus n-grams of
the request's history form the trie that :class:`TreeSpecWorker` verifies. The forward, the heads
and their top-k replay as one CUDA graph (:mod:`.draft_graph`); the host reads back a few
candidates per head. While that graph runs, the host does what does not need its result:
indexing the n-grams committed last step and queuing the verify's fixed inputs. Whenever the newest
tokens would reach the sinks, that same draft forward re-scores the committed positions with the
root's query. Between re-selections every draft attends to exactly ``budget`` positions, so the
next draft's inputs follow from the verify's walk on the device and the draft is queued right
behind the commit (:meth:`TokenSwiftWorker.chain_draft`); otherwise the host queues it once it
has walked the trees (:meth:`TokenSwiftWorker.draft_ahead`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

from ..config import PartialKVConfig
from ..core.heads import load_heads
from ..core.ngram import NgramPool
from ..core.partial_kv import PartialKVPolicy, steady_visible_slots
from ..core.penalty import window_tokens
from ..core.tokenswift import candidate_count, draft_trie, head_candidates, rank_candidates
from ..core.tree import DraftTree
from ..core.verify import TreeWalks, Verdict
from .capture import ImportanceScorer, PreNormCapture
from .draft_dir import inspect_heads_draft_dir
from .draft_graph import DraftGraphRunner
from .requests import PenaltyDefaults
from .spec_inputs import PartialDraftInput
from .tree_worker import StepRequest, TreeSpecWorker


@dataclass
class DraftAhead:
    """A draft forward queued at the end of a step for the next one (see :meth:`TreeSpecWorker.draft_ahead`)."""

    key: tuple  # (rid, req_pool_idx, seq_len) per request: the next step must match it exactly
    candidates: torch.Tensor
    done: torch.cuda.Event | None  # recorded on the draft's stream after it (GPU)
    gpu_span: list | None  # the forward's CUDA events (host detail mode)


def batch_key(steps) -> tuple:
    return tuple((s.req.rid, s.req.req_pool_idx, s.seq_len) for s in steps)


def likely_finishes(req, tokens: list[int]) -> bool:
    """The scheduler will finish ``req`` on these tokens (length or a stop token id).

    A draft queued for a finished request is only wasted device time, so this need not be
    complete (stop strings are not checked).
    """
    if len(req.output_ids) + len(tokens) >= req.sampling_params.max_new_tokens:
        return True
    if req.sampling_params.ignore_eos:
        return False
    stops = set(req.eos_token_ids or ()) | set(req.sampling_params.stop_token_ids or ())
    tokenizer = getattr(req, "tokenizer", None)
    if tokenizer is not None:
        stops.add(tokenizer.eos_token_id)
        stops.update(getattr(tokenizer, "additional_stop_token_ids", None) or ())
    return any(t in stops for t in tokens)


@dataclass
class TokenSwiftState:
    pool: NgramPool | None
    policy: PartialKVPolicy
    # The policy's current selection as KV slots on the device: (the policy's tensor, slots ranked
    # like it); see TokenSwiftWorker._selected_slots.
    selected: tuple[torch.Tensor, torch.Tensor] | None = None


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
        self.num_candidates = candidate_count(self.ts.tree, self.vocab_size)
        if self.vocab_size >= 1 << 24:
            raise ValueError(f"TOKENSWIFT supports vocabularies below 2**24 tokens, got {self.vocab_size}")
        self.draft_graphs = DraftGraphRunner(self.model_runner, self.capture, self._candidates)
        self._ahead: DraftAhead | None = None
        self._last_candidates: tuple[list, list] | None = None  # for _rehearse
        self._chained: tuple | None = None  # a draft queued by chain_draft, for draft_ahead
        self._steady_fixed: dict[int, tuple] = {}  # batch size -> steady draft's constant inputs
        self._fused_steady = None  # the steady draft inputs' kernel, where the walk is fused too
        if self._fused_accept is not None:
            from ..kernels.tree_accept import steady_draft_inputs

            self._fused_steady = steady_draft_inputs
        self._ahead_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    # -- state ------------------------------------------------------------------------------------

    def new_method_state(self, step: StepRequest) -> TokenSwiftState:
        ng = self.ts.ngram
        pool = NgramPool(ng.n, ng.top_k) if ng.enabled else None
        policy = PartialKVPolicy(self.partial_kv, 1, 1)
        policy.reset(step.seq_len)  # first selection: scored by the first draft forward
        return TokenSwiftState(pool, policy)  # the prompt's n-grams: indexed by the first draft

    def _index_ngrams(self, state: TokenSwiftState, step: StepRequest) -> None:
        if state.pool is None:
            return
        exclude = step.sampling.penalty_window if (self.ts.ngram.exclude_penalty_window and step.sampling.penalty_active) else 0
        state.pool.extend(step.history, len(step.history) - exclude)

    # -- draft -------------------------------------------------------------------------------------

    def _candidates(self, normed: torch.Tensor, h0: torch.Tensor) -> tuple[torch.Tensor]:
        """The heads' raw top candidates (in the draft graph when there is one).

        Values and token ids travel as one ``[2, bs, 1 + H, k]`` fp32 tensor (ids below 2**24 are
        exact), so the host reads them with one copy.
        """
        values, ids = head_candidates(self.heads, h0, normed, self.lm_head_weight, self.ts.num_heads,
                                      self.vocab_size, self.num_candidates)
        return (torch.stack([values, ids.to(values.dtype)]),)

    def _draft_inputs(self, batch, steps: list[StepRequest]) -> SimpleNamespace:
        """What the draft forward reads: each root over its request's partial KV (see :data:`INPUTS`).

        Slots are gathered from views of each request's ``req_to_token`` row (one concatenation
        for the batch); the few per-request integers travel in one pinned host-to-device copy.
        """
        dev = self.device
        bs = len(steps)
        table = batch.req_to_token_pool.req_to_token
        parts, root_slots, lens = [], [], []
        for step in steps:
            state: TokenSwiftState = step.state.method_state
            ranges, keep = state.policy.visible_parts()
            row = table[step.req.req_pool_idx]  # a view: slices of it copy nothing
            n = 1
            for lo, hi in ranges:
                if hi > lo:
                    parts.append(row[lo:hi])
                    n += hi - lo
            if keep.shape[1]:
                parts.append(self._selected_slots(state, row)[: keep.shape[1]])
                n += keep.shape[1]
            root_slots.append(row[step.seq_len : step.seq_len + 1])  # the first slot of its verify window
            parts.append(root_slots[-1])
            lens.append(n)
        host = self.staging("draft", 4 * bs + 1, torch.int32)
        packed = host.numpy()
        packed[:bs] = [s.root for s in steps]
        packed[bs : 2 * bs] = lens
        packed[2 * bs : 3 * bs] = [s.seq_len for s in steps]
        packed[3 * bs :] = list(itertools.accumulate(lens, initial=0))
        kv_lens_cpu = torch.tensor(lens, dtype=torch.int32)
        ints = host.to(dev, non_blocking=True, copy=True)
        spec = PartialDraftInput(positions=ints[2 * bs : 3 * bs], kv_indptr=ints[3 * bs :],
                                 kv_indices=torch.cat(parts), score_ranges=[self._score_range(step) for step in steps])
        return SimpleNamespace(input_ids=ints[:bs], positions=spec.positions,
                               out_cache_loc=root_slots[0] if bs == 1 else torch.cat(root_slots),
                               req_pool_indices=batch.req_pool_indices, seq_lens=ints[bs : 2 * bs],
                               seq_lens_cpu=kv_lens_cpu, seq_lens_sum=int(sum(lens)), spec_info=spec)

    def _selected_slots(self, state: TokenSwiftState, row: torch.Tensor) -> torch.Tensor:
        """KV slots of the policy's current selection (ranked), computed once per selection.

        Selected positions lie before every later verify window, so their slots never move.
        """
        if state.selected is None or state.selected[0] is not state.policy.selected:
            state.selected = (state.policy.selected, row[state.policy.selected[0].to(self.device)])
        return state.selected[1]

    def _partial_forward(self, batch, steps: list[StepRequest], stream: torch.cuda.Stream | None = None,
                         inputs: SimpleNamespace | None = None
                         ) -> tuple[torch.Tensor, torch.cuda.Event | None, list | None]:
        """Root tokens through the target over their partial KV; the heads' raw top candidates.

        From a CUDA graph the results are still being computed when this returns; with
        ``stream`` the graph replays there (see :meth:`_replay`). Also returns an event recorded
        after the candidates and the forward's GPU span (host detail mode), for graph replays.
        ``inputs``: built on the device already (:meth:`_steady_inputs`), else from the host's
        view of ``steps``.
        """
        if inputs is None:
            inputs = self._draft_inputs(batch, steps)
        spec = inputs.spec_info
        self.timer.section("draft_inputs")
        done = span = None
        if self.draft_graphs.ready(len(steps)) and not spec.wants_scores:
            self.draft_graphs.load(inputs)
            self.timer.section("draft_plan")
            candidates, done, span = self._replay(len(steps), stream)
        else:
            (candidates,) = self._forward_batch(batch, inputs)
        for b, scores in spec.scores.items():
            state = steps[b].state.method_state
            state.policy.select(scores[None, None].cpu())
            # The host just waited for the scores: the slots' copy to the device costs no sync now.
            self._selected_slots(state, batch.req_to_token_pool.req_to_token[steps[b].req.req_pool_idx])
        self.timer.section("draft_forward")
        return candidates, done, span

    def _replay(self, batch_size: int, stream: torch.cuda.Stream | None):
        """Launch the draft graph (loaded) on ``stream``, after the current stream's work so far.

        Inputs are gathered and loaded on the current stream, ordered before anything SGLang
        does to the request table next (a finished request's row can be reassigned); only the
        replay moves.
        """
        timing = self.timer.detail == "host"
        main = torch.cuda.current_stream()
        if stream is not None:
            stream.wait_stream(main)
        start = torch.cuda.Event(enable_timing=True) if timing else None
        done = torch.cuda.Event(enable_timing=timing) if timing or stream is not None else None
        with torch.cuda.stream(stream or main):
            if start is not None:
                start.record()
            (candidates,) = self.draft_graphs.launch(batch_size)
            if done is not None:
                done.record()
        return candidates, done, [start, done] if timing else None

    def _forward_batch(self, batch, inputs: SimpleNamespace) -> tuple[torch.Tensor]:
        """The draft forward through a ``ForwardBatch``: first captures, scoring steps, no graphs."""
        names = ("forward_mode", "input_ids", "out_cache_loc", "spec_info", "seq_lens", "seq_lens_cpu", "seq_lens_sum")
        saved = tuple(getattr(batch, k) for k in names)
        try:
            batch.forward_mode = ForwardMode.DECODE
            for k in names[1:]:
                setattr(batch, k, getattr(inputs, k))
            forward_batch = ForwardBatch.init_new(batch, self.model_runner, return_hidden_states_before_norm=False)
            if self.draft_graphs.can_run(forward_batch):
                return self.draft_graphs.run(forward_batch)
            with self.capture:
                self.model_runner.forward(forward_batch)
            return self._candidates(self.capture.normed, self.capture.value)
        finally:
            for k, v in zip(names, saved):
                setattr(batch, k, v)

    def _steady(self, steps: list[StepRequest], trees: list[DraftTree]) -> bool:
        """Every request's next draft attends to exactly ``budget`` positions, whatever this step commits.

        That is: no re-selection due now or after committing the tree's deepest path, a full
        selection, and no finish by length within those tokens. Then the next draft's inputs
        follow from the walk on the device (:meth:`_steady_inputs`).
        """
        if self._ahead_stream is not None and not self.draft_graphs.ready(len(steps)):
            return False
        for step, tree in zip(steps, trees):
            n = tree.max_depth + 1  # the most tokens this step can commit
            policy = step.state.method_state.policy
            if (policy.pending is not None or policy.selected.shape[1] < policy.capacity
                    or step.seq_len + n - policy.sel_len > policy.capacity
                    or len(step.req.output_ids) + n >= step.req.sampling_params.max_new_tokens):
                return False
        return True

    def _steady_inputs(self, batch, steps: list[StepRequest], walks: TreeWalks) -> SimpleNamespace:
        """The next draft's inputs (see :meth:`_draft_inputs`) from the walk, on the device."""
        dev, bs = self.device, len(steps)
        table = batch.req_to_token_pool.req_to_token
        kv_len = self.partial_kv.budget + 1
        selected = []
        for step in steps:
            state: TokenSwiftState = step.state.method_state
            selected.append(self._selected_slots(state, table[step.req.req_pool_idx])[: state.policy.capacity])
        host = self.staging("chain", bs, torch.int64)
        host.numpy()[:] = [s.state.method_state.policy.sel_len for s in steps]
        sel_lens = host.to(dev, non_blocking=True, copy=True)
        fixed = self._steady_fixed.get(bs)
        if fixed is None:  # KV index pointers and lengths, device and host, and arange(budget)
            fixed = self._steady_fixed[bs] = (
                torch.arange(bs + 1, dtype=torch.int32, device=dev) * kv_len,
                torch.full((bs,), kv_len, dtype=torch.int32, device=dev),
                torch.full((bs,), kv_len, dtype=torch.int32),
                torch.arange(kv_len - 1, device=dev))
        indptr, kv_lens, kv_lens_cpu, offsets = fixed
        selected = selected[0][None] if bs == 1 else torch.stack(selected)
        if self._fused_steady is not None:
            slots, root_slots, input_ids, lengths = self._fused_steady(
                table, batch.req_pool_indices, batch.seq_lens, walks.count, sel_lens, selected, walks.last,
                self.partial_kv.sinks, self.partial_kv.budget)
        else:
            lengths = batch.seq_lens + walks.count
            slots = steady_visible_slots(table, batch.req_pool_indices, lengths, sel_lens, selected,
                                         self.partial_kv.sinks, offsets)
            root_slots, input_ids = slots[:, -1], walks.last
        spec = PartialDraftInput(positions=lengths, kv_indptr=indptr, kv_indices=slots.flatten(),
                                 score_ranges=[None] * bs)
        return SimpleNamespace(input_ids=input_ids, positions=lengths, out_cache_loc=root_slots,
                               req_pool_indices=batch.req_pool_indices, seq_lens=kv_lens,
                               seq_lens_cpu=kv_lens_cpu, seq_lens_sum=bs * kv_len, spec_info=spec)

    @torch.no_grad()
    def chain_draft(self, batch, steps: list[StepRequest], trees: list[DraftTree], walks: TreeWalks) -> None:
        """In the steady state, queue the next draft right behind the commit on the device.

        The host is free while the verify forward runs, so the draft's inputs are queued then,
        from the walk's device results; the GPU goes from the verify to the draft without
        waiting for the host to read the draws, walk and commit. :meth:`draft_ahead` keeps it
        for the next step.
        """
        self._chained = None
        steady = self._steady(steps, trees)
        self.timer.note("draft_chained", float(steady))
        if steady:
            inputs = self._steady_inputs(batch, steps, walks)
            self._chained = self._partial_forward(batch, steps, self._ahead_stream, inputs)

    @torch.no_grad()
    def draft_ahead(self, batch, steps: list[StepRequest], verdicts: list[Verdict]) -> None:
        """Queue the next step's draft forward now; :meth:`draft` uses it if the batch is unchanged.

        The draft only depends on the committed KV, the root and the partial-KV selection, all
        final here, so it equals the draft the next step would compute. On a GPU its graph
        replays on a stream of its own: SGLang's scheduler reads this step's results (a
        device-to-host copy on the main stream) while the draft computes, instead of waiting
        for it. Every forward waits for it on the device first (:meth:`forward_batch_generation`):
        nothing else writes the KV or the graph buffers it uses meanwhile.

        Not when a request's next draft re-scores the partial KV (an eager forward with
        hooks), when a request is about to finish, or on a GPU without a ready draft graph. A
        draft :meth:`chain_draft` already queued is kept as it is.
        """
        self._drop_ahead()
        chained, self._chained = self._chained, None
        nxt = [replace(step, seq_len=step.seq_len + len(verdict.tokens)) for step, verdict in zip(steps, verdicts)]
        if chained is not None:
            self._ahead = DraftAhead(batch_key(nxt), *chained)
            return
        if any(likely_finishes(step.req, verdict.tokens) for step, verdict in zip(steps, verdicts)):
            return
        if any(self._score_range(step) is not None for step in nxt):
            return
        if self._ahead_stream is not None and not self.draft_graphs.ready(len(nxt)):
            return  # an eager forward gains nothing from running early on a GPU
        self._ahead = DraftAhead(batch_key(nxt), *self._partial_forward(batch, nxt, self._ahead_stream))

    def forward_batch_generation(self, batch, on_publish=None, **kwargs):
        ahead = self._ahead
        if ahead is not None and ahead.done is not None:
            torch.cuda.current_stream().wait_event(ahead.done)
        return super().forward_batch_generation(batch, on_publish, **kwargs)

    def clear_cache_pool(self):
        self._chained = None
        self._drop_ahead()
        super().clear_cache_pool()

    def _drop_ahead(self) -> None:
        """Forget a queued draft once its copies have read their (reused) staging buffers."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.done is not None:
            ahead.done.synchronize()

    def _take_ahead(self, steps: list[StepRequest]) -> DraftAhead | None:
        ahead = self._ahead
        if ahead is not None and ahead.key == batch_key(steps):
            self._ahead = None
            return ahead
        self._drop_ahead()  # the batch changed
        return None

    @torch.no_grad()
    def draft(self, batch, steps: list[StepRequest]) -> list[DraftTree]:
        ahead = self._take_ahead(steps)
        self.timer.note("draft_queued_ahead", float(ahead is not None))
        if ahead is not None:
            candidates, span = ahead.candidates, ahead.gpu_span
        else:
            candidates, _, span = self._partial_forward(batch, steps)
        if span is not None:
            self.timer.adopt_gpu_span("draft_gpu", span)
        # In the draft forward's shadow: everything that does not need its candidates.
        windows = []
        for step in steps:
            self._index_ngrams(step.state.method_state, step)
            sampling = step.sampling
            # Proposals only decide what gets verified: the committed window is enough.
            active = step.blocker is None and sampling.penalty_active
            windows.append(set(window_tokens(step.history, [], sampling.penalty_window)) if active else None)
        self.prepare_verify_static(batch, steps)
        self._rehearse(steps, windows)
        self.timer.section("draft_shadow")
        values, ids = candidates.cpu().tolist()
        self.timer.section("draft_wait")
        trees = self._tries(steps, values, ids, windows)
        self._last_candidates = (values, ids)
        self.timer.section("draft_tree")
        return trees

    def _tries(self, steps: list[StepRequest], values: list, ids: list, windows: list) -> list[DraftTree]:
        width = max(self.ts.tree)
        trees = []
        for b, step in enumerate(steps):
            if step.blocker is not None:
                trees.append(DraftTree(step.root))
                continue
            cands = rank_candidates(values[b], ids[b], step.sampling, windows[b], width)
            trees.append(draft_trie(step.root, cands, self.ts.tree, step.state.method_state.pool, self.num_nodes))
        return trees

    def _rehearse(self, steps: list[StepRequest], windows: list) -> None:
        """Build tries and verify inputs once from the previous step's candidates, and drop them.

        From the draft's end to the verify's launch the GPU waits for exactly this host work. Run
        cold, after SGLang's scheduler has been through its own data between steps, the same
        Python takes 3-4 times as long as warm (one trie: 180 us cold, 50 us rehearsed, 38 us in
        a loop, on a CPU host); here the host is waiting for the draft forward anyway.
        """
        last = self._last_candidates
        if last is None or len(last[0]) != len(steps):
            return
        self.fill_verify_inputs(steps, self._tries(steps, *last, windows))

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
        # The new n-grams are indexed by the next draft, while its forward runs.
        for step, verdict in zip(steps, verdicts):
            step.state.method_state.policy.commit(step.seq_len + len(verdict.nodes))
