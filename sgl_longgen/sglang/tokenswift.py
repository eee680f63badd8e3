"""TOKENSWIFT's drafter on SGLang: the root over the partial KV through the target's own runner.

Per step and request the root token goes through SGLang's model runner in DECODE mode over the
request's *partial* KV only (explicit ``kv_indices``: the positions
:meth:`sgl_longgen.methods.TokenSwift.view` names, as KV slots), the pre-norm state feeds the
three heads, and their top candidates plus n-grams of the request's history form the trie. The
forward, the heads and their top-k replay as one CUDA graph (:mod:`.draft_graph`); the host reads
back a few candidates per head. While that graph runs, the host does what does not need its
result: indexing the n-grams committed last step and the verify's fixed inputs. A due
re-selection is scored in the same draft forward (eagerly, with the root's query).

Between re-selections every draft attends to exactly ``budget`` positions, so the next draft's
inputs follow from the verify's walk on the device and it is queued right behind the commit
(:meth:`TokenSwiftDrafter.after_walk`); otherwise the host queues it once it has walked the
trees (:meth:`TokenSwiftDrafter.after_commit`). See :mod:`.pipeline`.

Under ``[tokenswift.partial_kv] policy = "verify"`` the selection comes from every verify instead:
the attention backend writes each layer's scores of the committed keys
(:class:`~sgl_longgen.sglang.capture.VerifyScores`), and behind the walk the device ranks them per
layer (:func:`verified_selection`) and builds the next draft's per-layer slot lists from them
(``PartialDraftInput.layer_kv_indices``: layer ``l`` attends to its own selection). The host never
reads the ranking: it only keeps how many positions each selection holds
(:func:`hold_device_selection`), which is all its partial-KV policy needs to say what a draft
sees. A request whose verify selected a full ``budget - sinks`` positions and whose step commits
at most that many stays in the steady state, chained behind the commit as above.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

from ..core.heads import load_heads
from ..core.partial_kv import PartialKVPolicy, steady_visible_slots
from ..core.prepared import Prepared
from ..core.tokenswift import candidate_count, head_candidates
from ..core.verify import TreeWalks, Verdict
from ..errors import LonggenError
from ..methods import Draft, TokenSwift, TokenSwiftState
from .capture import ImportanceScorer, PreNormCapture, VerifyScores
from .draft_dir import DEFAULTS_FILE, inspect_heads_draft_dir
from .draft_graph import DraftGraphRunner
from .drafter import Drafter, Shadow
from .inputs import PartialDraftInput, restored
from .pipeline import DraftPipeline, batch_key, likely_finishes
from .requests import PenaltyDefaults, StepRequest


def lm_head_group(lm_head):
    """The group a vocabulary-parallel LM head is split over (None: every row is on this rank).

    With tensor parallelism each rank holds a shard of the rows; the shards' logits, gathered in
    rank order, are the padded vocabulary's, as SGLang's ``LogitsProcessor`` gathers them.
    """
    if getattr(lm_head, "tp_size", 1) <= 1:
        return None
    from sglang.srt.distributed.parallel_state import get_attn_tp_group, get_tp_group

    return get_attn_tp_group() if getattr(lm_head, "use_attn_tp_group", False) else get_tp_group()


_NO_POSITION = torch.full((1, 1), -1, dtype=torch.long)


def hold_device_selection(policy: PartialKVPolicy, length: int, count: int) -> torch.Tensor:
    """Record on the host ``policy`` a verify selection taken at committed length ``length`` whose
    ``count`` ranked positions per layer stay on the device (as the KV slots drafts read).

    The policy's state is what :meth:`PartialKVPolicy.select_verified` would leave, except that
    ``selected`` holds ``-1`` placeholders: the host only ever needs how many positions a selection
    holds (:meth:`PartialKVPolicy.visible_parts` keeps its best ones, a prefix). Returns them.
    """
    policy.selected = _NO_POSITION.expand(policy.groups, count)
    policy.sel_len = length
    policy.pending = None
    return policy.selected


def verified_selection(scores: torch.Tensor, bounds: torch.Tensor, width: int, k: int, table: torch.Tensor,
                       rows: torch.Tensor, total=None) -> torch.Tensor:
    """Per layer, each request's ``k`` best verify-scored positions as KV slots, best first:
    ``[layers, bs, k]``.

    ``scores``: ``[>= bs, layers, kv_heads, >= width]``, a verify's selection scores over this rank's
    KV heads (``total``, if given, sums a tensor over the tensor-parallel ranks); ``bounds``:
    ``[bs, 2]``, the positions ``[lo, hi)`` request ``b`` ranks (:meth:`PartialKVPolicy.verify_range`,
    all below ``width``). A position ranks by its mean logit over the layer's KV heads, as in
    :meth:`PartialKVPolicy.select_verified`; positions outside a request's bounds rank last, so its
    first ``min(k, hi - lo)`` columns are its selection. ``table[rows[b]]`` maps request ``b``'s
    positions to slots (those before the verify never move). All on the device, no host sync.
    """
    bs = rows.shape[0]
    mean = scores[:bs, :, :, :width].mean(dim=2)  # [bs, layers, width]
    if total is not None:
        mean = total(mean)
    position = torch.arange(width, device=mean.device)
    outside = (position < bounds[:, :1]) | (position >= bounds[:, 1:])
    mean = mean.masked_fill(outside[:, None, :], float("-inf"))
    top = mean.transpose(0, 1).topk(k, dim=-1).indices  # [layers, bs, k]
    return table[rows.to(torch.long)[None, :, None], top]


@dataclass
class VerifiedSelection:
    """One step's per-layer selections, ranked on the device from its verify's scores."""

    slots: torch.Tensor  # [layers, bs, k] KV slots, best first
    lengths: list[int]  # the committed length each request's selection was taken at
    counts: list[int]  # request b's selection: its first counts[b] columns (0: none taken)


class TokenSwiftDrafter(Drafter):
    def __init__(self, env):
        self.env = env
        sa = env.server_args
        draft = inspect_heads_draft_dir(sa.speculative_draft_model_path, sa.model_path)
        self.defaults = draft.defaults
        self.defaults_file = draft.path / DEFAULTS_FILE
        ts = draft.defaults.tokenswift
        # Under the verify policy each layer has its own selection (a policy row per layer).
        self.per_layer = ts.partial_kv.policy == "verify"
        cfg = env.runner.model_config
        self.num_layers = getattr(cfg, "num_attention_layers", None) or cfg.num_hidden_layers
        self.method = TokenSwift(ts, draft.defaults.suffix, num_layers=self.num_layers)
        sampling = draft.defaults.sampling
        self.penalty = PenaltyDefaults(sampling.penalty, sampling.penalty_window)
        model = env.runner.model
        dtype = next(model.parameters()).dtype
        self.heads = load_heads(draft.path, hidden_size=draft.checkpoint["hidden_size"],
                                num_heads=ts.num_heads).to(device=env.device, dtype=dtype).eval()
        self.lm_head_weight = model.lm_head.weight
        self.lm_head_group = lm_head_group(model.lm_head)
        if env.vocab_size >= 1 << 24:
            raise LonggenError(f"TOKENSWIFT supports vocabularies below 2**24 tokens, got {env.vocab_size}")
        self.num_candidates = candidate_count(ts.tree, env.vocab_size)
        self.capture = PreNormCapture(model)
        self.scorer = ImportanceScorer(env.runner)
        self.graphs = DraftGraphRunner(env.runner, self.capture, self._candidates,
                                       kv_width=ts.partial_kv.budget + 1 if self.per_layer else None)
        self.pipeline = DraftPipeline(env.device)
        # The verify's scores (the attention backends write them; built after this drafter).
        self.verify_scores = VerifyScores.of(env.runner) if self.per_layer else None
        self._backend_scores = False  # the attention backend was seen to write them
        self._fresh: tuple[tuple, VerifiedSelection] | None = None  # this step's, until observe
        self._prepared: Prepared[TokenSwiftState] = Prepared()  # indexes built in the prefill's shadow
        self._last_candidates: tuple[list, list] | None = None  # for _rehearse
        self._steady_fixed: dict[int, tuple] = {}  # batch size -> steady draft's constant inputs
        self._fused_steady = None  # the steady draft inputs' kernel, where the walk is fused too
        if env.device.type == "cuda":
            from ..kernels.tree_accept import MAX_NODES, steady_draft_inputs

            if env.num_nodes <= MAX_NODES:
                self._fused_steady = steady_draft_inputs

    # -- per request ------------------------------------------------------------------------------

    def prepare(self, rid: str, history, sampling) -> None:
        state, _ = self._prepared.take(rid, len(history))
        self._prepared.put(rid, self.method.prepare(state, history, sampling), len(history))

    def start(self, step: StepRequest) -> TokenSwiftState:
        prepared, _ = self._prepared.take(step.rid, len(step.history))
        return self.method.start(step.seq_len, prepared)

    def finish(self, rid: str) -> None:
        self._prepared.drop(rid)

    def can_draft_ahead(self, key: tuple) -> bool:
        # A draft queued for that batch, or a draft graph of its batch size that exists (none is
        # captured ahead, on the run-ahead stream).
        queued = self.pipeline.queued
        return (queued is not None and queued.key == key) or not self.graphs.would_capture(len(key))

    def hint(self, step: StepRequest) -> float | None:
        return self.method.history_hint(step.state.method, step.history, step.sampling)

    # -- draft -----------------------------------------------------------------------------------

    @torch.no_grad()
    def draft(self, batch, steps: list[StepRequest], shadow: Shadow, max_nodes: int) -> list[Draft]:
        clock = self.env.clock
        queued = self.pipeline.take(batch_key(steps))
        clock.note("draft_queued_ahead", float(queued is not None))
        if queued is not None:
            candidates, span = queued.candidates, queued.gpu_span
        else:
            candidates, _, span = self._forward(batch, steps)
        clock.adopt("draft_gpu", span)
        # In the draft forward's shadow: everything that does not need its candidates.
        windows = []
        for step in steps:
            self.method.index(step.state.method, step.history, step.sampling)
            windows.append(self.method.penalty_window(step.history, step.sampling) if step.blocker is None else None)
        shadow()
        self._rehearse(steps, windows, max_nodes)
        clock.section("draft_shadow")
        values, ids = candidates.cpu().tolist()
        clock.section("draft_wait")
        drafts = self._tries(steps, values, ids, windows, max_nodes)
        self._last_candidates = (values, ids)
        clock.section("draft_tree")
        return drafts

    def _tries(self, steps: list[StepRequest], values: list, ids: list, windows: list, max_nodes: int) -> list[Draft]:
        return [Draft.root_only(step.root) if step.blocker is not None else
                self.method.propose(step.state.method, step.root, values[b], ids[b], step.sampling, windows[b],
                                    max_nodes)
                for b, step in enumerate(steps)]

    def _rehearse(self, steps: list[StepRequest], windows: list, max_nodes: int) -> None:
        """Build the tries once from the previous step's candidates, and drop them.

        From the draft's end to the verify's launch the GPU waits for exactly this host work. Run
        cold, after SGLang's scheduler has been through its own data between steps, the same
        Python takes several times as long as warm (figures in docs/performance.md); here the host
        is waiting for the draft forward anyway.
        """
        last = self._last_candidates
        if last is not None and len(last[0]) == len(steps):
            self._tries(steps, *last, windows, max_nodes)

    def _candidates(self, normed: torch.Tensor, h0: torch.Tensor) -> tuple[torch.Tensor]:
        """The heads' raw top candidates (in the draft graph when there is one).

        Values and token ids travel as one ``[2, bs, 1 + H, k]`` fp32 tensor (ids below 2**24 are
        exact), so the host reads them with one copy.
        """
        group = self.lm_head_group  # a vocabulary-parallel head: SGLang's own gather of the shards
        gather = None if group is None else (lambda logits: group.all_gather(logits, dim=-1))
        values, ids = head_candidates(self.heads, h0, normed, self.lm_head_weight, self.method.config.num_heads,
                                      self.env.vocab_size, self.num_candidates, gather)
        return (torch.stack([values, ids.to(values.dtype)]),)

    def _draft_inputs(self, batch, steps: list[StepRequest]) -> SimpleNamespace:
        """What the draft forward reads: each root over its request's partial KV.

        Slots are gathered from views of each request's ``req_to_token`` row (one concatenation
        for the batch); the few per-request integers travel in one pinned host-to-device copy.
        """
        bs = len(steps)
        table = batch.req_to_token_pool.req_to_token
        parts, root_slots, lens, scores = [], [], [], []
        for step in steps:
            state: TokenSwiftState = step.state.method
            view = self.method.view(state)
            row = table[step.req.req_pool_idx]  # a view: slices of it copy nothing
            n = 1
            for lo, hi in view.ranges:
                if hi > lo:
                    parts.append(row[lo:hi])
                    n += hi - lo
            if view.keep.shape[1]:
                parts.append(self._selected_slots(state, row)[..., : view.keep.shape[1]])
                n += view.keep.shape[1]
            root_slots.append(row[step.seq_len : step.seq_len + 1])  # the first slot of its verify window
            parts.append(root_slots[-1])
            lens.append(n)
            scores.append(view.score if step.blocker is None else None)
        host = self.env.staging("draft", 4 * bs + 1, torch.int32)
        packed = host.numpy()
        packed[:bs] = [s.root for s in steps]
        packed[bs : 2 * bs] = lens
        packed[2 * bs : 3 * bs] = [s.seq_len for s in steps]
        packed[3 * bs :] = list(itertools.accumulate(lens, initial=0))
        kv_lens_cpu = torch.tensor(lens, dtype=torch.int32)
        ints = host.to(self.env.device, non_blocking=True, copy=True)
        if self.per_layer:  # the ranges and the root for every layer, each layer's own selection
            layers = self.num_layers
            kv = torch.cat([p if p.dim() == 2 else p.expand(layers, -1) for p in parts], dim=1)
            spec = PartialDraftInput(positions=ints[2 * bs : 3 * bs], kv_indptr=ints[3 * bs :],
                                     kv_indices=kv[0].clone(), score_ranges=scores, layer_kv_indices=kv)
        else:
            spec = PartialDraftInput(positions=ints[2 * bs : 3 * bs], kv_indptr=ints[3 * bs :],
                                     kv_indices=torch.cat(parts), score_ranges=scores)
        return SimpleNamespace(input_ids=ints[:bs], positions=spec.positions,
                               out_cache_loc=root_slots[0] if bs == 1 else torch.cat(root_slots),
                               req_pool_indices=batch.req_pool_indices, seq_lens=ints[bs : 2 * bs],
                               seq_lens_cpu=kv_lens_cpu, seq_lens_sum=int(sum(lens)), spec_info=spec)

    def _selected_slots(self, state: TokenSwiftState, row: torch.Tensor) -> torch.Tensor:
        """KV slots of the policy's current selection (ranked), computed once per selection:
        ``[m]``, or ``[layers, m]`` under the verify policy (a verify's selection is on the device
        already, see :meth:`observe`).

        Selected positions lie before every later verify window, so their slots never move.
        """
        selected = state.policy.selected
        if state.slots is None or state.slots[0] is not selected:
            if self.per_layer:
                state.slots = (selected, row[selected.to(self.env.device)])
            else:
                state.slots = (selected, row[selected[0].to(self.env.device)])
        return state.slots[1]

    def _forward(self, batch, steps: list[StepRequest], stream: torch.cuda.Stream | None = None,
                 inputs: SimpleNamespace | None = None) -> tuple[torch.Tensor, torch.cuda.Event | None, list | None]:
        """Root tokens through the target over their partial KV: the heads' raw top candidates.

        From a CUDA graph the results are still being computed when this returns; with
        ``stream`` the graph replays there (see :meth:`_replay`). Also returns an event recorded
        after the candidates and the forward's GPU span (timed steps), for graph replays.
        ``inputs``: built on the device already (:meth:`_steady_inputs`), else from the host's
        view of ``steps``.
        """
        if inputs is None:
            inputs = self._draft_inputs(batch, steps)
        spec = inputs.spec_info
        done = span = None
        if self.graphs.ready(len(steps)) and not spec.wants_scores:
            self.graphs.load(inputs)
            candidates, done, span = self._replay(len(steps), stream)
        else:
            (candidates,) = self._forward_batch(batch, inputs)
        for b, scores in spec.scores.items():
            state = steps[b].state.method
            self.method.select(state, self.scorer.total(scores)[None, None].cpu())
            # The host just waited for the scores: the slots' copy to the device costs no sync now.
            self._selected_slots(state, batch.req_to_token_pool.req_to_token[steps[b].req.req_pool_idx])
        return candidates, done, span

    def _replay(self, batch_size: int, stream: torch.cuda.Stream | None):
        """Launch the draft graph (loaded) on ``stream``, after the current stream's work so far.

        Inputs are gathered and loaded on the current stream, ordered before anything SGLang
        does to the request table next (a finished request's row can be reassigned); only the
        replay moves.
        """
        main = torch.cuda.current_stream()
        if stream is not None:
            stream.wait_stream(main)
        span = self.env.clock.span_events()
        done = span[1] if span is not None else (torch.cuda.Event() if stream is not None else None)
        with torch.cuda.stream(stream or main):
            if span is not None:
                span[0].record()
            (candidates,) = self.graphs.launch(batch_size)
            if done is not None:
                done.record()
        return candidates, done, span

    def _forward_batch(self, batch, inputs: SimpleNamespace) -> tuple[torch.Tensor]:
        """The draft forward through a ``ForwardBatch``: first captures, scoring steps, no graphs."""
        names = ("input_ids", "out_cache_loc", "spec_info", "seq_lens", "seq_lens_cpu", "seq_lens_sum")
        with restored(batch, "forward_mode", *names):
            batch.forward_mode = ForwardMode.DECODE
            for k in names:
                setattr(batch, k, getattr(inputs, k))
            forward_batch = ForwardBatch.init_new(batch, self.env.runner, return_hidden_states_before_norm=False)
            if self.graphs.can_run(forward_batch):
                return self.graphs.run(forward_batch)
            with self.capture:
                self.env.runner.forward(forward_batch)
            return self._candidates(self.capture.normed, self.capture.value)

    # -- the next draft, queued early --------------------------------------------------------------

    def _steady(self, steps: list[StepRequest], drafts: list[Draft], fresh: VerifiedSelection | None = None) -> bool:
        """Every request's next draft attends to exactly ``budget`` positions, whatever this step
        commits, and none finishes by length within those tokens.

        Under the verify policy: this step's verify selected a full ``budget - sinks`` positions
        for every request (``fresh``), and no step commits more than that.
        """
        if self.pipeline.stream is not None and not self.graphs.ready(len(steps)):
            return False
        if self.per_layer and fresh is None:
            return False
        capacity = self.method.config.partial_kv.budget - self.method.config.partial_kv.sinks
        for b, (step, draft) in enumerate(zip(steps, drafts)):
            most = draft.tree.max_depth + 1  # the most tokens this step can commit
            if self.per_layer:
                fixed = fresh.counts[b] >= capacity and most <= capacity
            else:
                fixed = self.method.fixed_view(step.state.method, step.seq_len, most)
            if not fixed or len(step.req.output_ids) + most >= step.req.sampling_params.max_new_tokens:
                return False
        return True

    def _steady_constants(self, bs: int) -> tuple:
        """KV index pointers and lengths (device and host) and ``arange(budget)`` of a steady draft."""
        fixed = self._steady_fixed.get(bs)
        if fixed is None:
            dev, kv_len = self.env.device, self.method.config.partial_kv.budget + 1
            fixed = self._steady_fixed[bs] = (
                torch.arange(bs + 1, dtype=torch.int32, device=dev) * kv_len,
                torch.full((bs,), kv_len, dtype=torch.int32, device=dev),
                torch.full((bs,), kv_len, dtype=torch.int32),
                torch.arange(kv_len - 1, device=dev))
        return fixed

    def _steady_inputs(self, batch, steps: list[StepRequest], walks: TreeWalks) -> SimpleNamespace:
        """The next draft's inputs (see :meth:`_draft_inputs`) from the walk, on the device."""
        dev, bs = self.env.device, len(steps)
        table = batch.req_to_token_pool.req_to_token
        pkv = self.method.config.partial_kv
        kv_len = pkv.budget + 1
        selected = []
        for step in steps:
            state: TokenSwiftState = step.state.method
            selected.append(self._selected_slots(state, table[step.req.req_pool_idx])[: state.policy.capacity])
        host = self.env.staging("chain", bs, torch.int64)
        host.numpy()[:] = [s.state.method.policy.sel_len for s in steps]
        sel_lens = host.to(dev, non_blocking=True, copy=True)
        indptr, kv_lens, kv_lens_cpu, offsets = self._steady_constants(bs)
        selected = selected[0][None] if bs == 1 else torch.stack(selected)
        if self._fused_steady is not None:
            slots, root_slots, input_ids, lengths = self._fused_steady(
                table, batch.req_pool_indices, batch.seq_lens, walks.count, sel_lens, selected, walks.last,
                pkv.sinks, pkv.budget)
        else:
            lengths = batch.seq_lens + walks.count
            slots = steady_visible_slots(table, batch.req_pool_indices, lengths, sel_lens, selected, pkv.sinks, offsets)
            root_slots, input_ids = slots[:, -1], walks.last
        spec = PartialDraftInput(positions=lengths, kv_indptr=indptr, kv_indices=slots.flatten(),
                                 score_ranges=[None] * bs)
        return SimpleNamespace(input_ids=input_ids, positions=lengths, out_cache_loc=root_slots,
                               req_pool_indices=batch.req_pool_indices, seq_lens=kv_lens,
                               seq_lens_cpu=kv_lens_cpu, seq_lens_sum=bs * kv_len, spec_info=spec)

    def _steady_layer_inputs(self, batch, steps: list[StepRequest], walks: TreeWalks,
                             fresh: VerifiedSelection) -> SimpleNamespace:
        """:meth:`_steady_inputs` under the verify policy: each layer's slots from its own fresh
        selection (taken at the verify's prefix length), on the device.

        The layers go through the steady computation as ``layers x bs`` requests, layer-major, so
        the slot lists come out as the ``[layers, bs * (budget + 1)]`` per-layer indices.
        """
        bs, layers = len(steps), self.num_layers
        table = batch.req_to_token_pool.req_to_token
        pkv = self.method.config.partial_kv
        kv_len = pkv.budget + 1
        indptr, kv_lens, kv_lens_cpu, offsets = self._steady_constants(bs)
        selected = fresh.slots.reshape(layers * bs, -1)
        rows = batch.req_pool_indices.repeat(layers)
        sel_lens = batch.seq_lens.repeat(layers)  # every selection was taken before this step's commit
        if self._fused_steady is not None:
            slots, root_slots, input_ids, lengths = self._fused_steady(
                table, rows, sel_lens, walks.count.repeat(layers), sel_lens, selected, walks.last.repeat(layers),
                pkv.sinks, pkv.budget)
            root_slots, input_ids, lengths = root_slots[:bs], input_ids[:bs], lengths[:bs]
        else:
            lengths = batch.seq_lens + walks.count
            slots = steady_visible_slots(table, rows, lengths.repeat(layers), sel_lens, selected, pkv.sinks, offsets)
            root_slots, input_ids = slots[:bs, -1], walks.last
        kv = slots.view(layers, bs * kv_len)
        spec = PartialDraftInput(positions=lengths, kv_indptr=indptr, kv_indices=kv[0].clone(),
                                 score_ranges=[None] * bs, layer_kv_indices=kv)
        return SimpleNamespace(input_ids=input_ids, positions=lengths, out_cache_loc=root_slots,
                               req_pool_indices=batch.req_pool_indices, seq_lens=kv_lens,
                               seq_lens_cpu=kv_lens_cpu, seq_lens_sum=bs * kv_len, spec_info=spec)

    def _select_verified(self, batch, steps: list[StepRequest]) -> VerifiedSelection | None:
        """Rank this step's verify scores into each layer's selection, on the device (verify policy).

        Each request ranks the positions its policy's :meth:`~PartialKVPolicy.verify_range` names,
        as of this step's verify (before its commit).
        """
        if not self._backend_scores:
            backend = self.env.runner.attn_backend
            if getattr(backend, "verify_scores", None) is not self.verify_scores:
                raise LonggenError(f"{self.defaults_file}: [tokenswift.partial_kv] policy = \"verify\" takes the "
                                   "partial KV from the verify forward's scores, which attention backend "
                                   f"{type(backend).__name__} does not write (longgen's hybrid verify and "
                                   "longgen_torch do)")
            self._backend_scores = True
        scores = self.verify_scores.take(len(steps))
        if scores is None:
            return None
        bounds = [step.state.method.policy.verify_range() or (0, 0) for step in steps]
        capacity = self.method.config.partial_kv.budget - self.method.config.partial_kv.sinks
        counts = [max(0, min(capacity, hi - lo)) for lo, hi in bounds]
        if not any(counts):
            return None
        bs = len(steps)
        host = self.env.staging("verify_bounds", 2 * bs, torch.int64)
        host.numpy()[:] = [x for pair in bounds for x in pair]
        on_device = host.to(self.env.device, non_blocking=True, copy=True).view(bs, 2)
        slots = verified_selection(scores, on_device, max(hi for _, hi in bounds), max(counts),
                                   batch.req_to_token_pool.req_to_token, batch.req_pool_indices, self.scorer.total)
        return VerifiedSelection(slots, [hi for _, hi in bounds], counts)

    @torch.no_grad()
    def after_walk(self, batch, steps: list[StepRequest], drafts: list[Draft], walks: TreeWalks) -> None:
        """In the steady state, queue the next draft right behind the commit on the device.

        The host is free while the verify forward runs, so the draft's inputs are queued then,
        from the walk's device results; the GPU goes from the verify to the draft without waiting
        for the host to read the draws, walk and commit. Under the verify policy this step's
        selections are ranked first (they change every step); :meth:`observe` records them.
        """
        self.pipeline.chained = None
        self._fresh = fresh = None
        if self.per_layer:
            fresh = self._select_verified(batch, steps)
            if fresh is not None:
                self._fresh = (batch_key(steps), fresh)
        steady = self._steady(steps, drafts, fresh)
        self.env.clock.note("draft_chained", float(steady))
        if steady:
            if self.per_layer:
                inputs = self._steady_layer_inputs(batch, steps, walks, fresh)
            else:
                inputs = self._steady_inputs(batch, steps, walks)
            self.pipeline.chained = self._forward(batch, steps, self.pipeline.stream, inputs)

    def observe(self, steps: list[StepRequest], drafts: list[Draft], verdicts: list[Verdict]) -> None:
        # The new n-grams are indexed by the next draft, while its forward runs.
        fresh, self._fresh = self._fresh, None
        if fresh is not None and fresh[0] != batch_key(steps):
            fresh = None
        for b, (step, verdict) in enumerate(zip(steps, verdicts)):
            state = step.state.method
            if fresh is not None and fresh[1].counts[b]:  # the verify's selection, taken before the commit
                selection = fresh[1]
                held = hold_device_selection(state.policy, selection.lengths[b], selection.counts[b])
                state.slots = (held, selection.slots[:, b, : selection.counts[b]])
            self.method.observe(state, step.seq_len + len(verdict.nodes))

    @torch.no_grad()
    def after_commit(self, batch, steps: list[StepRequest], verdicts: list[Verdict]) -> None:
        """Queue the next step's draft now, unless it was chained already.

        Not when a request's next draft re-scores the partial KV (an eager forward with hooks),
        when a request is about to finish, or on a GPU without a ready draft graph.
        """
        chained, self.pipeline.chained = self.pipeline.chained, None
        nxt = [replace(step, seq_len=step.seq_len + len(verdict.tokens)) for step, verdict in zip(steps, verdicts)]
        if chained is not None:
            self.pipeline.keep(batch_key(nxt), chained)
            return
        self.pipeline.drop()
        if any(likely_finishes(step.req, verdict.tokens) for step, verdict in zip(steps, verdicts)):
            return
        if any(step.blocker is None and self.method.view(step.state.method).score is not None for step in nxt):
            return
        if self.pipeline.stream is not None and not self.graphs.ready(len(nxt)):
            return  # an eager forward gains nothing from running early on a GPU
        self.pipeline.keep(batch_key(nxt), self._forward(batch, nxt, self.pipeline.stream))

    def before_forward(self) -> None:
        self.pipeline.wait()

    def drop_queued(self) -> None:
        self._fresh = None
        self.pipeline.reset()

    def reset(self) -> None:
        self._fresh = None
        self._prepared.clear()
        self.pipeline.reset()
