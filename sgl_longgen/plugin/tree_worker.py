"""The SGLang V2 speculative worker shared by our tree methods.

A method only says how to draft one trie per request (:meth:`TreeSpecWorker.draft`). This base
does the rest the way SGLang's own NGRAM worker does it, with our lossless verifier:

1. pad every request's trie to ``speculative_num_draft_tokens`` nodes (SGLang verifies a fixed
   width per request) and run one TARGET_VERIFY forward of the target model;
2. process each node's logits into its target distribution (SGLang's logit bias, our per-node
   contextual penalty, temperature and SGLang's joint top-k/top-p/min-p), draw one token per
   node, and walk the trie (:func:`sgl_longgen.core.verify.walk_tree`);
3. put the accepted nodes' KV slots at the front of the verify window (a permutation of the
   request's ``req_to_token`` entries) and report the committed tokens (``accept_lens`` includes
   the bonus token) so SGLang's scheduler advances the request.

Draws, walk and commit are queued on the device behind the verify forward
(:func:`sgl_longgen.core.verify.walk_trees`), so a method can queue the next step's draft
behind them too (:meth:`TreeSpecWorker.chain_draft`) before the host has read anything back; the
host then repeats the walk on the draws it reads (:func:`walk_tree`) for its own bookkeeping and
checks that both walks agree.

Requests using features whose effect cannot be extended along a draft path (SGLang's
count-based penalties, grammars, foreign logit processors) get an empty tree: one exact token
per step, drawn from SGLang's own processing of the root.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from dataclasses import dataclass

import msgspec
import numpy as np
import torch
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker

from ..config import SamplingConfig
from ..core.penalty import tree_window_mask
from ..core.sampling import LogitsProcessor
from ..core.tree import DraftTree, bits_to_rows
from ..core.verify import TreeWalks, Verdict, walk_tree, walk_trees
from .penalty_processor import ContextualPenaltyProcessor
from .requests import (
    PenaltyDefaults,
    RequestState,
    activate_penalty_defaults,
    request_tokens,
    sampling_config,
    tree_blocker,
)
from .spec_inputs import TreeVerifyInput, relay_input
from .host_profile import HostProfile
from .step_timer import DETAIL_PARAM, StepTimer

logger = logging.getLogger(__name__)


@dataclass
class StepRequest:
    """One request's view of the current step."""

    req: object
    state: RequestState
    history: list[int]  # committed tokens; history[-1] is the root (no KV yet)
    seq_len: int  # committed KV length
    sampling: SamplingConfig
    blocker: str | None

    @property
    def root(self) -> int:
        return self.history[-1]


@dataclass
class VerifyStatic:
    """Verify inputs known before the tries: slots and the custom mask's prefix."""

    out_cache_loc: torch.Tensor  # [bs * N] int64: each request's verify window
    custom_mask: torch.Tensor | None  # flat FULL-layout mask, all True until the tries go in
    mask_offsets: list[int]  # where each request's [N, seq_len + N] block starts


class VerifyBuffers:
    """One batch size's verify inputs: a page-locked host buffer, its device copy, their views.

    Tokens, positions, parents and walk tokens (int64 ``[4, bs, N]``), then the ancestor masks
    (bool ``[bs, N, N]``): one host-to-device copy per step, and no tensor views to make on the
    step's critical path (between the draft's candidates and the verify forward). Reuse is safe
    for the same reason as :meth:`TreeSpecWorker.staging`: each step waits for the read-back of
    its draws, queued after the verify forward and the walk, the only readers; any later write to
    the host buffer (the next step's, or a method's rehearsal of it while its draft runs) comes
    after that wait.
    """

    def __init__(self, bs: int, n: int, device: torch.device):
        mask_at = 4 * bs * n * 8
        self.host = torch.empty(mask_at + bs * n * n, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.device = torch.empty_like(self.host, device=device)
        self.ints = self.host[:mask_at].numpy().view(np.int64).reshape(4, bs, n)
        self.masks = self.host[mask_at:].numpy().view(np.bool_).reshape(bs, n, n)
        ints = self.device[:mask_at].view(torch.int64).view(4, bs, n)
        self.draft_token, self.positions = ints[0].flatten(), ints[1].flatten()
        # What walk_trees reads besides the ancestor masks: each node's parent, and its token
        # where a walk may enter it (else -1).
        self.parents, self.walk_tokens = ints[2], ints[3]
        self.tree_mask = self.device[mask_at:].view(torch.bool).view(bs, n, n)


def verify_static(batch, steps: list[StepRequest], n: int, full_mask: bool) -> VerifyStatic:
    dev = batch.seq_lens.device
    table = batch.req_to_token_pool.req_to_token
    windows = [table[s.req.req_pool_idx, s.seq_len : s.seq_len + n] for s in steps]
    # A copy, never a view of the table: the commit permutes the table's window entries.
    out_cache_loc = windows[0].to(torch.int64, copy=True) if len(windows) == 1 else torch.cat(windows).to(torch.int64)
    custom_mask, offsets = None, []
    if full_mask:
        total = 0
        for s in steps:
            offsets.append(total)
            total += n * (s.seq_len + n)
        custom_mask = torch.ones(total, dtype=torch.bool, device=dev)
    return VerifyStatic(out_cache_loc, custom_mask, offsets)


class TreeSpecWorker(BaseSpecWorker):
    # What the target forwards must also return (OWL reads hidden states).
    capture_hidden_mode = CaptureHiddenMode.NULL  # verify
    prefill_capture_mode: CaptureHiddenMode | None = None  # prefill (None: SGLang's default)

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker, **kwargs):
        super().__init__()
        self.server_args = server_args
        self._target_worker = target_worker
        self._draft_worker = None
        self.model_runner = target_worker.model_runner
        self.model = self.model_runner.model
        self.device = torch.device(self.model_runner.device)
        self.num_nodes = int(server_args.speculative_num_draft_tokens)
        self.vocab_size = int(self.model_runner.model_config.vocab_size)
        self.states: dict[str, RequestState] = {}
        self.step_count = 0
        self.seed = int(server_args.random_seed or 0)
        self.generator = torch.Generator(device=self.device).manual_seed(self.seed)
        self.needs_full_mask: bool | None = None  # decided at the first verify: the backend exists by then
        self.set_penalty_defaults(PenaltyDefaults())
        self.timer = StepTimer(self.device)
        self.host_profile = HostProfile.from_env()
        self._staging: dict[str, torch.Tensor] = {}
        self._verify_bufs: dict[int, VerifyBuffers] = {}
        self._static: VerifyStatic | None = None
        self._window_offsets = torch.arange(self.num_nodes, device=self.device)  # a verify window's columns
        self._fused_accept = None  # the fused walk-and-commit kernel, on GPUs
        if self.device.type == "cuda":
            from ..kernels.tree_accept import MAX_NODES, walk_and_commit

            if self.num_nodes <= MAX_NODES:
                self._fused_accept = walk_and_commit

    def set_penalty_defaults(self, defaults: PenaltyDefaults) -> None:
        self.penalty_defaults = defaults
        activate_penalty_defaults(defaults)

    # -- SGLang's worker contract ---------------------------------------------------------------

    @property
    def draft_worker(self):
        return None

    def alloc_memory_pool(self, **kwargs):
        self.req_to_token_pool, self.token_to_kv_pool_allocator = self._target_worker.get_memory_pool()

    def clear_cache_pool(self):
        self.states.clear()

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        self.states.pop(rid, None)

    def forward_batch_generation(self, batch, on_publish=None, **kwargs) -> GenerationBatchResult:
        profile = self.host_profile
        if batch.forward_mode.is_decode():
            if profile is not None and profile.wants(batch.reqs):
                return profile.run(self._decode, batch, on_publish)
            if profile is not None:
                profile.stop()
            return self._decode(batch, on_publish)
        if profile is not None:
            profile.stop()
        return self._extend(batch, on_publish)

    # -- the method's part ----------------------------------------------------------------------

    def new_method_state(self, step: StepRequest):
        """Per-request state of the method, created at the request's first decode step."""
        return None

    @abstractmethod
    def draft(self, batch, steps: list[StepRequest]) -> list[DraftTree]:
        """One trie per request (at most ``num_nodes`` nodes), root = the request's last token."""

    def after_extend(self, batch, result) -> None:
        """Read what a prefill forward produced besides the first tokens (hidden states)."""

    def prepare_verify_static(self, batch, steps: list[StepRequest]) -> "VerifyStatic":
        """The verify inputs that do not depend on the tries, queued on the device now.

        A method whose draft runs asynchronously calls this while the draft forward is on the
        GPU, so the work is off the step's critical path; otherwise :meth:`_decode` calls it.
        """
        if self.needs_full_mask is None:
            # Backends that verify from TreeVerifyInput.tree_mask alone (ours) say so; for the
            # others each step builds SGLang's FULL custom mask ([N, seq_len + N] per request).
            reads_tree_blocks = getattr(self.model_runner.attn_backend, "reads_tree_blocks", None)
            self.needs_full_mask = not (callable(reads_tree_blocks) and reads_tree_blocks())
        self._static = verify_static(batch, steps, self.num_nodes, self.needs_full_mask)
        return self._static

    def staging(self, name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
        """A reused page-locked host buffer for one host-to-device copy per step and purpose.

        Reuse is safe because the host waits for the main stream to pass a buffer's copy before
        refilling it: each step waits for the read-back of its draws (queued after the verify
        inputs' copies) and, in the next step, for the draft's candidates (queued after
        anything the step before queued on the main stream, a chained draft's inputs included);
        copies of a draft queued ahead on its own stream are waited for before a refill.
        """
        buf = self._staging.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = torch.empty(max(n, 64), dtype=dtype, pin_memory=self.device.type == "cuda")
            self._staging[name] = buf
        return buf[:n]

    def prepare_verify(self, batch, steps: list[StepRequest], trees: list[DraftTree]) -> None:
        """Last changes to the verify batch before the forward (e.g. input embedding overrides)."""

    def after_verify_forward(self, steps: list[StepRequest], spec: TreeVerifyInput, logits_output) -> None:
        """Read what the verify forward produced besides logits (hidden states)."""

    def after_commit(self, steps: list[StepRequest], verdicts: list[Verdict]) -> None:
        """Update method state with the committed tokens (``step.history`` already extended).

        Runs before the step's results are handed to SGLang: the committed KV is in place.
        """

    def chain_draft(self, batch, steps: list[StepRequest], trees: list[DraftTree], walks: TreeWalks) -> None:
        """Queue the next step's draft behind this step's commit, if the method can without the host.

        Runs right after the verify forward was queued, with the walk's results still on the
        device (``walks.count``: committed tokens, ``walks.last``: the next roots): the draft
        then follows the commit on the device with no round trip through the host. The method
        takes such a draft up in :meth:`draft_ahead`.
        """

    def draft_ahead(self, batch, steps: list[StepRequest], verdicts: list[Verdict]) -> None:
        """Start the next step's draft now, if the method can (after :meth:`after_commit`).

        The device is idle between this step's draw and the next step's draft, while SGLang's
        scheduler processes the results: a draft queued here runs in that gap. ``steps`` still
        carry this step's ``seq_len``; add the verdict's length for the next step's.
        """

    # -- machinery ------------------------------------------------------------------------------

    def _extend(self, batch, on_publish) -> GenerationBatchResult:
        """Prefill (or any non-decode batch): a plain target step, exactly SGLang's sampling."""
        for req in batch.reqs:
            self.states.pop(req.rid, None)  # a (re-)prefilled request starts its speculation afresh
        res = self._target_worker.forward_batch_generation(batch, capture_hidden_mode=self.prefill_capture_mode)
        self.after_extend(batch, res)
        bs, n = len(batch.reqs), self.num_nodes
        new_seq_lens = batch.seq_lens.clone()
        accept_tokens = torch.zeros(bs, n, dtype=torch.int32, device=self.device)
        if bs:
            accept_tokens[:, 0] = res.next_token_ids
        accept_lens = torch.ones(bs, dtype=torch.int32, device=self.device)
        if on_publish is not None:
            on_publish(new_seq_lens)
        res.accept_lens = accept_lens
        res.new_seq_lens = new_seq_lens
        res.next_draft_input = relay_input(n, new_seq_lens, accept_tokens.flatten(), accept_lens)
        res.speculative_num_draft_tokens = n
        return res

    def _state(self, req) -> RequestState:
        state = self.states.get(req.rid)
        if state is None:
            seed = req.sampling_params.sampling_seed
            gen = torch.Generator(device=self.device).manual_seed(int(seed)) if seed is not None else self.generator
            state = RequestState(req.rid, gen)
            self.states[req.rid] = state
        state.last_seen = self.step_count
        return state

    def _gc(self, keep: set[str]) -> None:
        """Forget requests that left without a finish notice (aborts, retractions)."""
        limit = 4 * max(1, len(keep)) + 64
        if len(self.states) > limit:
            for rid in [r for r, s in self.states.items() if r not in keep and s.last_seen < self.step_count]:
                del self.states[rid]

    def _decode(self, batch, on_publish) -> GenerationBatchResult:
        reqs = batch.reqs
        timer = self.timer
        timer.start(next(filter(None, ((r.sampling_params.custom_params or {}).get(DETAIL_PARAM) for r in reqs)), None))
        self.step_count += 1
        self._static = None
        bs, n = len(reqs), self.num_nodes
        seq_lens = batch.seq_lens
        seq_cpu = batch.seq_lens_cpu.tolist() if batch.seq_lens_cpu is not None else seq_lens.tolist()
        steps = []
        for req, seq_len in zip(reqs, seq_cpu):
            state = self._state(req)
            blocker = tree_blocker(req, ContextualPenaltyProcessor)
            step = StepRequest(req, state, request_tokens(req), int(seq_len),
                               sampling_config(req, self.penalty_defaults), blocker)
            if state.method_state is None:
                state.method_state = self.new_method_state(step)
            steps.append(step)
        self._gc({r.rid for r in reqs})
        timer.section("setup")

        trees, spec, res, readback = self._queue_verify(batch, steps, seq_lens)
        logits_output = res.logits_output
        drawn, counts = readback()
        timer.phase("verify")  # ends when the verify forward's draws are on the host

        verdicts = []
        for b, (tree, count) in enumerate(zip(trees, counts)):
            verdict = walk_tree(tree, drawn[b].__getitem__)
            if len(verdict.nodes) != count:
                raise RuntimeError(f"device walk committed {count} tokens, host walk {len(verdict.nodes)}")
            verdicts.append(verdict)
        timer.section("walk")
        for step, verdict in zip(steps, verdicts):
            step.history = step.history.extended(verdict.tokens)
        self.after_commit(steps, verdicts)
        timer.section("commit_kv")
        self.draft_ahead(batch, steps, verdicts)
        timer.section("draft_ahead")

        # The committed tokens and their counts travel to the device in one copy.
        host = self.staging("result", bs * n + bs, torch.int32)
        packed = host.numpy()
        packed[: bs * n] = 0
        accepted = []
        for b, verdict in enumerate(verdicts):
            packed[b * n : b * n + len(verdict.tokens)] = verdict.tokens
            packed[bs * n + b] = len(verdict.tokens)
            accepted.append(len(verdict.tokens))
        on_device = host.to(self.device, non_blocking=True, copy=True)
        next_token_ids, accept_lens = on_device[: bs * n], on_device[bs * n :]
        new_seq_lens = seq_lens + accept_lens
        if batch.return_logprob:
            self._logprobs(batch, logits_output, trees, drawn, verdicts)
        if on_publish is not None:
            on_publish(new_seq_lens)
        batch.forward_mode = ForwardMode.DECODE
        timer.section("result")
        timer.phase("overhead")

        record_step_times(reqs, accepted, timer.finish())
        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=next_token_ids,
            accept_lens=accept_lens,
            new_seq_lens=new_seq_lens,
            next_draft_input=relay_input(n, new_seq_lens, next_token_ids, accept_lens),
            speculative_num_draft_tokens=n,
            can_run_cuda_graph=res.can_run_cuda_graph,
        )

    def _queue_verify(self, batch, steps: list[StepRequest], seq_lens: torch.Tensor):
        """Draft, verify forward, then (queued behind it) draws, walk, commit and their read-back.

        ``seq_lens``: where the verify windows start (taken before the forward, which may rebind
        ``batch.seq_lens``). Returns the tries, the verify input and forward result, and the wait
        for the read-back.
        """
        timer = self.timer
        trees = self.draft(batch, steps)
        for step, tree in zip(steps, trees):
            if step.blocker is not None and len(tree) > 1:
                raise RuntimeError("draft() must return a root-only tree for blocked requests")
        timer.phase("draft")

        static = self._static if self._static is not None else self.prepare_verify_static(batch, steps)
        spec, inputs = self._verify_input(steps, trees, static)
        batch.forward_mode = ForwardMode.TARGET_VERIFY
        batch.input_ids = spec.draft_token
        batch.out_cache_loc = static.out_cache_loc
        batch.spec_info = spec
        self.prepare_verify(batch, steps, trees)
        timer.section("verify_inputs")
        timer.gpu_mark("verify_gpu")
        res = self._target_worker.forward_batch_generation(batch, is_verify=True)
        timer.gpu_mark("verify_gpu")
        logits_output = res.logits_output
        self.after_verify_forward(steps, spec, logits_output)
        timer.section("verify_forward")

        # Queued behind the verify forward: one draw per node, the walk, the commit, their
        # read-back, and maybe the next draft; the host waits only for the read-back.
        draws = self._draw(batch, steps, trees, logits_output.next_token_logits)
        walks = self._walk_and_commit(batch, seq_lens, draws, inputs)
        readback = self._read_back(draws, walks.count)
        self.chain_draft(batch, steps, trees, walks)
        timer.section("accept_queue")
        return trees, spec, res, readback

    def _verify_buffers(self, bs: int) -> "VerifyBuffers":
        buffers = self._verify_bufs.get(bs)
        if buffers is None:
            buffers = self._verify_bufs[bs] = VerifyBuffers(bs, self.num_nodes, self.device)
        return buffers

    def fill_verify_inputs(self, steps: list[StepRequest], trees: list[DraftTree]) -> "VerifyBuffers":
        """The tries' verify inputs in the page-locked host buffer (nothing queued on the device).

        Each trie is padded to ``num_nodes``: padding nodes hang off the root and are never walked.
        """
        n = self.num_nodes
        buf = self._verify_buffers(len(trees))
        tokens, positions, parents, walk_tokens = buf.ints
        for b, (step, tree) in enumerate(zip(steps, trees)):
            t, walkable = len(tree), tree.num_walkable
            if t > n:
                raise RuntimeError(f"draft produced {t} nodes, more than speculative_num_draft_tokens={n}")
            pad = n - t
            bits = tree.ancestor_bits()
            bits.extend(1 | (1 << i) for i in range(t, n))  # padding nodes: the root and themselves
            bits_to_rows(bits, n, buf.masks[b])
            tokens[b] = tree.tokens + [step.root] * pad
            positions[b] = tree.depths + [1] * pad
            positions[b] += step.seq_len
            parents[b] = [0, *tree.parents[1:]] + [0] * pad
            walk_tokens[b] = [-1, *tree.tokens[1:walkable]] + [-1] * (n - walkable)
        return buf

    def _verify_input(self, steps: list[StepRequest], trees: list[DraftTree],
                      static: VerifyStatic) -> tuple[TreeVerifyInput, "VerifyBuffers"]:
        n = self.num_nodes
        buf = self.fill_verify_inputs(steps, trees)
        buf.device.copy_(buf.host, non_blocking=True)
        if static.custom_mask is not None:
            for b, (step, offset) in enumerate(zip(steps, static.mask_offsets)):
                width = step.seq_len + n
                static.custom_mask[offset : offset + n * width].view(n, width)[:, step.seq_len :].copy_(buf.tree_mask[b])
        spec = TreeVerifyInput(
            draft_token=buf.draft_token, positions=buf.positions, tree_mask=buf.tree_mask,
            custom_mask=static.custom_mask, draft_token_num=n, capture_hidden_mode=self.capture_hidden_mode,
        )
        return spec, buf

    def _draw(self, batch, steps: list[StepRequest], trees: list[DraftTree], logits: torch.Tensor) -> torch.Tensor:
        """One token per node, each from that node's exact target distribution: ``[bs, N]``.

        Queued on the device without a host sync; nodes a walk never draws at (padding,
        leaves) hold any value.
        """
        n, vocab = self.num_nodes, self.vocab_size
        bs = len(steps)
        logits = logits[:, :vocab].view(bs, n, vocab)
        sampling_info = batch.sampling_info
        root_sglang = None
        if any(s.blocker is not None for s in steps):
            # SGLang's own processing of the root rows: penalizers, grammar, bias, custom processors.
            from sglang.srt.layers.sampler import apply_custom_logit_processor

            root_sglang = logits[:, 0].clone()
            sampling_info.apply_logits_bias(root_sglang)
            if sampling_info.has_custom_logit_processor:
                apply_custom_logit_processor(root_sglang, sampling_info)
        # Requests whose distribution depends only on their own logits (greedy, no penalty, no
        # bias) share one draw of the processor.
        shared = [b for b, s in enumerate(steps) if s.blocker is None and s.sampling.greedy
                  and not s.sampling.penalty_active and sampling_info.logit_bias is None]
        if shared:
            proc = LogitsProcessor(steps[shared[0]].sampling, vocab)
            if len(shared) == bs:
                return proc.sample(logits.flatten(0, 1)).view(bs, n)
        draws = torch.full((bs, n), -2, dtype=torch.int64, device=logits.device)  # no token, no walk token
        if shared:
            draws[shared] = proc.sample(logits[shared].flatten(0, 1)).view(len(shared), n)
        for b, (step, tree) in enumerate(zip(steps, trees)):
            if b in shared:
                continue
            if step.blocker is not None:
                # Any penalty is already in SGLang's processing of the root.
                proc = LogitsProcessor(msgspec.structs.replace(step.sampling, penalty=1.0), vocab)
                draws[b, :1] = proc.sample(root_sglang[b : b + 1], None, step.state.generator)
                continue
            rows = logits[b, : tree.num_walkable]  # leaves (e.g. [SPEC]) are never drawn from
            if sampling_info.logit_bias is not None:
                rows = rows + sampling_info.logit_bias[b, :vocab]
            proc = LogitsProcessor(step.sampling, vocab)
            mask = None
            if step.sampling.penalty_active:
                paths = [tree.path_tokens(i) for i in range(tree.num_walkable)]
                mask = tree_window_mask(step.history, paths, step.sampling.penalty_window, vocab, rows.device)
            draws[b, : tree.num_walkable] = proc.sample(rows, mask, step.state.generator)
        return draws

    def _read_back(self, draws: torch.Tensor, counts: torch.Tensor):
        """Queue the draws and the device walk's counts to the host; returns the wait for them.

        One page-locked copy and an event: the host then waits for the verify forward and the
        draws only, not for anything queued after them (a chained draft).
        """
        bs, n = draws.shape
        host = self.staging("readback", bs * n + bs, torch.int64)
        host[: bs * n].view(bs, n).copy_(draws, non_blocking=True)
        host[bs * n :].copy_(counts, non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()

        def wait() -> tuple[np.ndarray, list[int]]:
            if event is not None:
                event.synchronize()
            values = host.numpy()
            return values[: bs * n].reshape(bs, n), values[bs * n :].tolist()

        return wait

    def _walk_and_commit(self, batch, seq_lens: torch.Tensor, draws: torch.Tensor,
                         inputs: "VerifyBuffers") -> TreeWalks:
        """The device walk of every trie, and each walked path's KV put at the front of its window.

        On a GPU one fused kernel does both (:mod:`sgl_longgen.kernels.tree_accept`): the ~20
        small torch ops would each leave the device idle for a launch between the two forwards.
        """
        if self._fused_accept is not None:
            count, last, order = self._fused_accept(draws, inputs.parents, inputs.walk_tokens, inputs.tree_mask,
                                                    batch.req_to_token_pool.req_to_token,
                                                    batch.req_pool_indices, seq_lens)
            return TreeWalks(count, last, order)
        walks = walk_trees(draws, inputs.parents, inputs.walk_tokens, inputs.tree_mask)
        self._commit_paths(batch, seq_lens, walks)
        return walks

    def _commit_paths(self, batch, seq_lens: torch.Tensor, walks: TreeWalks) -> None:
        """Put each walked path's KV at the front of its verify window (the root stays in place).

        With one token per page (required at startup) the slots of a window are only named by the
        request's ``req_to_token`` row: SGLang frees and reuses over-allocated slots through it.
        Permuting the row's window entries (``walks.order``) commits the path without touching
        the KV: a few index ops instead of a gather and scatter per layer.
        """
        table = batch.req_to_token_pool.req_to_token
        rows = batch.req_pool_indices[:, None]
        cols = seq_lens[:, None] + self._window_offsets
        table[rows, cols] = table[rows, cols].gather(1, walks.order)

    def _logprobs(self, batch, logits_output, trees, drawn, verdicts) -> None:
        from sglang.srt.layers.logprob_processor import compute_spec_v2_logprobs

        n = self.num_nodes
        predict = torch.zeros(len(trees) * n, dtype=torch.int64)
        accept_index = torch.full((len(trees), n), -1, dtype=torch.int64)
        for b, (tree, verdict) in enumerate(zip(trees, verdicts)):
            k = tree.num_walkable  # the nodes drawn at
            predict[b * n : b * n + k] = torch.from_numpy(drawn[b, :k].copy())
            accept_index[b, : len(verdict.nodes)] = torch.tensor(verdict.nodes) + b * n
        compute_spec_v2_logprobs(batch, logits_output, predict.to(self.device), accept_index.to(self.device), n - 1)


def record_step_times(reqs, accept_lens: list[int], values: dict[str, float]) -> None:
    """Per-step timings into ``meta_info``, through the request's ``customized_info``.

    SGLang streams ``customized_info`` as one entry per output token, so each step's value sits
    on the first token it committed and the step's other tokens get None:
    ``[x for x in meta_info["longgen_draft_ms"] if x is not None]`` is the per-step series.
    """
    for req, accepted in zip(reqs, accept_lens):
        info = req.customized_info if req.customized_info is not None else {}
        committed = len(req.output_ids)
        for key, value in values.items():
            series = info.setdefault(key, [])
            if len(series) < committed:
                series.extend([None] * (committed - len(series)))
            del series[committed:]
            series.append(value)
            series.extend([None] * (accepted - 1))
        req.customized_info = info
