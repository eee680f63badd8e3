"""The SGLang V2 speculative worker of every sgl-longgen algorithm.

A prefill is SGLang's own target step; while its forward runs, the drafter builds what each
request's first step will need from the prompt so far (:meth:`Drafter.prepare`: a long prompt's
indexes, milliseconds of host time that would otherwise keep the device waiting at that step).
A decode step is, in order (:meth:`SpecWorker.decode`):

1. **draft**: the algorithm's drafter (:mod:`.tokenswift`, :mod:`.owl`, :mod:`.longspec`,
   :mod:`.suffix`) proposes one trie per request from its method's state;
2. **verify**: the padded tries go through one TARGET_VERIFY forward of the target (:mod:`.verify`);
3. **draw and walk**: queued on the device behind it, one draw per node, the walk and the commit
   of each walked path's KV; the host reads the draws back, repeats the walk and checks it;
4. **observe**: the method learns what was committed; the results go to SGLang's scheduler
   (``accept_lens`` counts the bonus token).

With adaptive speculation (:mod:`.adaptive`) a step may be plain instead: no draft, the roots
alone through a width-1 verify (its own CUDA graph on GPUs, :mod:`.width_graphs`), the same
draws and commit. Whichever kind a step is, the next one's is decided before a drafter may queue
its draft behind the commit, so no draft is queued for a plain step.

Where the next step is planned speculative, its draft and verify forward may be queued before
the call returns (:mod:`.spec_ahead`, opt-in): SGLang's scheduler then processes this step's
results while that verify computes, and the next call starts from its draws.

Where nothing in the batch needs the host between two tokens (no contextual penalty or SGLang
processing that reads the newest output, no logprobs), a plain step is a *run* of up to
:data:`PLAIN_RUN` width-1 forwards queued back to back, each fed the token the last one drew on
the device (:meth:`SpecWorker._plain_run`): the host and SGLang's scheduler, which run between
steps while the GPU waits (these workers are synchronous), are paid once per run instead of once
per token, so plain tokens cost what SGLang's overlapped decoding costs. Each forward draws its
token exactly as a single plain step would, in the same order from the same generator, so a run
of k is k plain steps.

Structured-output requests speculate: each node is drawn under the grammar's mask after its
path (:mod:`.grammar`). Requests whose sampling settings cannot be carried along a draft path
(SGLang's count-based penalties, foreign logit processors, logprobs) get a root-only trie: one exact token
per step from SGLang's own processing of the root. So does a request whose drafting raised: the
exception is logged once for it, it decodes plain from then on, and the server keeps serving.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, replace
from types import SimpleNamespace

import msgspec
import torch
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker

from .. import env
from ..core.adaptive import SPECULATE
from ..core.tree import DraftTree, Source
from ..core.verify import Verdict
from ..methods import Draft
from . import compat
from .adaptive import SPECULATION_OFF, AdaptiveSteps, server_config
from .buffers import Staging
from .drafter import Drafter
from .host_profile import HostProfile
from .inputs import relay_input, restored
from .pipeline import batch_key, likely_finishes
from .requests import (
    RequestTable,
    StepRequest,
    activate_penalty_defaults,
    request_tokens,
    sampling_config,
)
from .run_ahead import RunAhead
from .slot_rows import check_rows
from .spec_ahead import SpecAhead
from .timing import StepClock, append_step_values
from .verify import Launched, Verifier
from .width_graphs import capture_width_graphs

logger = logging.getLogger(__name__)

# Fault injection for tests of the fault isolation: drafting raises on the N-th decode step.
FAULT_ENV = env.name("INJECT_DRAFT_FAULT")
DRAFTING_FAILED = "drafting failed"
# Plain steps queued back to back in one call (at most the verify width: a step's KV window).
# The scheduler's and the host's time per call is spread over this many tokens. A plain
# step that only measures (or refreshes) the plain cost between speculative steps stays one token
# (its controllers allow one: AdaptiveSteps.plain_run_limit); a stretch where nothing pays runs
# PLAIN_RUN at a time, up to the next due probe. Runs grow again from one token, doubling with each
# plain call, after a prefill (SGLang admits a waiting request only between two calls, so a burst
# of arrivals is admitted at plain decoding's pace, one token per running request between two
# prefills, instead of a run apart, and its requests decode together to the end instead of in
# turns) and after speculative steps that were not a probe (where drafts just stopped paying, the
# method's hint is asked again within a few tokens, once per call, and a loop the last drafts
# missed is taken up early).
PLAIN_RUN = 32


@dataclass
class WorkerEnv:
    """What a drafter may use of its worker."""

    server_args: object
    runner: object  # SGLang's ModelRunner of the target
    device: torch.device
    num_nodes: int  # speculative_num_draft_tokens: the verify width per request
    vocab_size: int
    staging: Staging
    clock: StepClock


def keep_for(stream: torch.cuda.Stream | None, batch, *tensors: torch.Tensor) -> None:
    """Work about to be queued on ``stream`` (None: none, off GPUs) reads the batch's device
    tensors and ``tensors``, made on the main stream: they stay allocated until it ran (the caching
    allocator would otherwise hand their memory out again once the main stream is done with them)."""
    if stream is None:
        return
    for tensor in tensors:
        tensor.record_stream(stream)
    for owner in (batch, getattr(batch, "sampling_info", None)):
        for value in getattr(owner, "__dict__", {}).values():
            if isinstance(value, torch.Tensor) and value.is_cuda:
                value.record_stream(stream)


def drafter_for(algorithm: str, env: WorkerEnv) -> Drafter:
    if algorithm == "TOKENSWIFT":
        from .tokenswift import TokenSwiftDrafter

        return TokenSwiftDrafter(env)
    if algorithm in ("OWL", "HOWL"):
        from .owl import HowlDrafter, OwlDrafter

        return (OwlDrafter if algorithm == "OWL" else HowlDrafter)(env)
    if algorithm == "LONGSPEC":
        from .longspec import LongSpecDrafter

        return LongSpecDrafter(env)
    if algorithm == "SUFFIX":
        from .suffix import SuffixDrafter

        return SuffixDrafter(env)
    raise ValueError(f"no drafter for speculative algorithm {algorithm!r}")


def committed_hidden_rows(hidden: torch.Tensor, paths: list[list[int]], stride: int) -> torch.Tensor:
    """The hidden rows of the committed tokens where SGLang reads them: request ``b``'s ``j``-th
    token at row ``b * stride + j``, taken from the row that drew it (``paths[b][j]``: the root,
    then each accepted node, as :class:`~sgl_longgen.core.verify.Verdict` lists them), as a decode
    step returns the row of the position whose logits gave its token. ``hidden``: ``[bs * rows, d]``
    or ``[bs, rows, d]`` in the step's node order."""
    bs = len(paths)
    flat = hidden.reshape(bs, -1, hidden.shape[-1])
    rows = flat.shape[1]
    src = [b * rows + node for b, path in enumerate(paths) for node in path]
    dst = [b * stride + j for b, path in enumerate(paths) for j in range(len(path))]
    out = flat.new_zeros(bs * stride, flat.shape[-1])
    index = lambda ids: torch.tensor(ids, dtype=torch.int64, device=flat.device)
    out[index(dst)] = flat.reshape(bs * rows, -1)[index(src)]
    return out


class SpecWorker(BaseSpecWorker):
    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker, **kwargs):
        super().__init__()
        compat.require_fields("target_worker", target_worker)
        runner = target_worker.model_runner
        compat.require_fields("model_runner", runner)
        compat.require_fields("model", runner.model)
        self.server_args = server_args
        self._target_worker = target_worker
        self.device = torch.device(runner.device)
        self.num_nodes = int(server_args.speculative_num_draft_tokens)
        self.clock = StepClock(self.device)
        staging = Staging(self.device)
        self.env = WorkerEnv(server_args, runner, self.device, self.num_nodes, int(runner.model_config.vocab_size),
                             staging, self.clock)
        self.drafter = drafter_for(server_args.speculative_algorithm.upper(), self.env)
        activate_penalty_defaults(self.drafter.penalty)
        self.requests = RequestTable(self.device, int(server_args.random_seed or 0))
        self.verifier = Verifier(target_worker, self.num_nodes, self.env.vocab_size, self.device, staging,
                                 self.drafter.verify_capture)
        self.adaptive = AdaptiveSteps(self._adaptive_config(), self._hint, cut=self._drafted_width)
        self.host_profile = HostProfile.from_env()
        self._fault_at = int(env.get("INJECT_DRAFT_FAULT") or 0)
        self._run_cap = PLAIN_RUN  # the longest plain run the next plain call may queue (see PLAIN_RUN)
        self.run_ahead = RunAhead(self.device)  # the next plain call's first forward (see .run_ahead)
        self.spec_ahead = SpecAhead(self.device)  # the next speculative step's draft and verify (.spec_ahead)
        # The drafter builds something during prefills (else no prompt is copied out for it).
        self._prepares = type(self.drafter).prepare is not Drafter.prepare

    # -- SGLang's worker contract -----------------------------------------------------------------

    @property
    def draft_worker(self):
        return None

    def alloc_memory_pool(self, **kwargs):
        self.req_to_token_pool, self.token_to_kv_pool_allocator = self._target_worker.get_memory_pool()

    def init_attention_backends(self):
        # SGLang has built the target's pools and attention backend by now.
        compat.require_fields("model_runner_ready", self.env.runner)
        compat.require_fields("req_to_token_pool", self.env.runner.req_to_token_pool)
        runner = self.env.runner
        check_rows(runner.req_to_token_pool, runner.model_config.context_len, self.server_args)

    def init_cuda_graphs(self):
        """After SGLang captured the target's verify graphs: the width-1 graphs of plain steps,
        where adaptive speculation may take them (a request may ask for it, so always), and the
        graphs of each ``[adaptive] widths`` draft width's verify; then the walk of every width,
        compiled (:meth:`Verifier.warm_up`)."""
        rows = [self.drafter.rows(w) for w in self.adaptive.config.widths]
        for graphs in capture_width_graphs(self.env.runner, self.num_nodes, [1, *rows]):
            self.verifier.graphs_by_width[graphs.width] = graphs
        self.verifier.warm_up([1, *rows, self.num_nodes])

    def _adaptive_config(self):
        """The server's ``[adaptive]``, with the draft widths narrower than a full verify (a wider
        one is the whole draft)."""
        config = server_config(self.drafter.defaults.adaptive)
        widths = [w for w in config.widths if self._drafted_width(w) is not None]
        return msgspec.structs.replace(config, widths=widths) if widths != config.widths else config

    def _drafted_width(self, width: int) -> int | None:
        """A draft width as drafted: None where its verify is not narrower than the full one."""
        return width if 2 <= width and self.drafter.rows(width) < self.num_nodes else None

    def clear_cache_pool(self):
        self.run_ahead.drop()
        self.spec_ahead.drop()
        self.drafter.reset()
        self.requests.clear()

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        self.requests.pop(rid)
        self.clock.forget(rid)
        self.drafter.finish(rid)

    def forward_batch_generation(self, batch, on_publish=None, **kwargs) -> GenerationBatchResult:
        self.drafter.before_forward()
        self.run_ahead.wait()
        self.spec_ahead.wait()
        profile = self.host_profile
        if batch.forward_mode.is_decode():
            if profile is not None and profile.wants(batch.reqs):
                return profile.run(self.decode, batch, on_publish)
            if profile is not None:
                profile.stop()
            return self.decode(batch, on_publish)
        if profile is not None:
            profile.stop()
        return self.extend(batch, on_publish)

    # -- prefill --------------------------------------------------------------------------------

    def extend(self, batch, on_publish) -> GenerationBatchResult:
        """Prefill (or any non-decode batch): a plain target step, exactly SGLang's sampling."""
        self.adaptive.broke()
        self._run_cap = 1  # see PLAIN_RUN
        for req in batch.reqs:
            self.requests.pop(req.rid)  # a (re-)prefilled request starts its speculation afresh
        res = self._target_worker.forward_batch_generation(batch, capture_hidden_mode=self.drafter.prefill_capture)
        self.drafter.after_extend(batch, res)
        self._prepare(batch)
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

    def _prepare(self, batch) -> None:
        """In the shadow of the prefill forward just queued: the drafter builds what each
        request's first step needs from the tokens committed so far (:meth:`Drafter.prepare`).
        Where it raises, the request's first step builds it instead."""
        lens = batch.seq_lens_cpu
        if lens is None or not self._prepares:  # reading the lengths off the device would wait for the prefill
            return
        for req, n in zip(batch.reqs, lens.tolist()):
            try:
                self.drafter.prepare(req.rid, request_tokens(req)[:n], sampling_config(req, self.drafter.penalty))
            except Exception as exc:
                logger.warning("request %s: preparing its drafts during the prefill raised %s: %s; its first step "
                               "prepares them", req.rid, type(exc).__name__, exc, exc_info=exc)

    # -- a speculative step --------------------------------------------------------------------------

    def decode(self, batch, on_publish) -> GenerationBatchResult:
        clock = self.clock
        clock.start(batch.reqs)
        steps = self._begin(batch)
        speculate = self.adaptive.begin(steps) == SPECULATE
        clock.section("setup")

        run = 1 if speculate else self._plain_run_length(batch, steps)
        if not speculate:
            self._run_cap = min(PLAIN_RUN, 2 * self._run_cap)
        elif not self.adaptive.probing():  # a probe inside a plain stretch does not restart its runs
            self._run_cap = 1
        # This step's draft and verify, if the last call queued them (see .spec_ahead).
        queued = self.spec_ahead.take_at(batch_key(steps), self.adaptive.width) if speculate else None
        if not speculate:
            self.spec_ahead.drop()
        if not speculate and (run > 1 or (run == 1 and self.run_ahead.queued is not None)):
            return self._plain_run(batch, steps, run, on_publish)
        self.run_ahead.drop()  # before anything draws: its generators go back
        if queued is not None:
            drafts = queued.drafts
        elif speculate:
            drafts = self._draft(batch, steps, self.adaptive.width)
        else:  # a plain step: the roots alone, no draft forward
            self.drafter.drop_queued()
            self.verifier.prepare(batch, steps, width=1)
            drafts = [Draft.root_only(step.root) for step in steps]
        clock.note("plain_step", float(not speculate))
        clock.phase("draft")

        seq_lens = batch.seq_lens  # the verify windows start here (the forward may rebind it)
        if queued is not None:
            launched = queued.launched  # its drafter's after_verify ran behind it
        else:
            clock.gpu_mark("verify_gpu")
            launched = self._launch(batch, steps, drafts)
            clock.gpu_mark("verify_gpu")
        logits_output = launched.result.logits_output
        clock.note("verify_rows", float(launched.spec.draft_token_num))
        clock.section("verify_launch")

        # Queued behind the verify forward: draws, walk, commit, their read-back, maybe the next draft.
        draws = self.verifier.draw(batch, steps, drafts, logits_output.next_token_logits)
        walks = self.verifier.walk_and_commit(batch, seq_lens, draws, launched.inputs)
        read_back = self.verifier.read_back(draws, walks.count)
        # The next step's kind, before anything is queued for it.
        ahead = self.adaptive.plan(steps, self.num_nodes) == SPECULATE
        if ahead:
            self._guarded("after_walk", steps, self.drafter.after_walk, batch, steps, drafts, walks)
        clock.section("accept_queue")
        drawn, counts = read_back()
        clock.phase("verify")  # ends when the verify forward's draws are on the host

        verdicts = self.verifier.host_walks(drafts, drawn, counts)
        for step, verdict in zip(steps, verdicts):
            step.history = step.history.extended(verdict.tokens)
        clock.section("walk")
        self._guarded("observe", steps, self.drafter.observe, steps, drafts, verdicts)
        if ahead:
            self._guarded("after_commit", steps, self.drafter.after_commit, batch, steps, verdicts)
        else:
            self.drafter.drop_queued()
        reports = self.adaptive.record(steps, [len(v.tokens) for v in verdicts], SPECULATE if speculate else "plain",
                                       [v.nodes for v in verdicts], ahead=queued is not None)
        for step, verdict, report in zip(steps, verdicts, reports):
            if report is not None:
                append_step_values(step.req, report, len(verdict.tokens))
        clock.section("observe")

        result = self._publish(batch, seq_lens, steps, drafts, verdicts, drawn, launched, on_publish,
                               launched.result.logits_output.hidden_states)
        if speculate and ahead and self._spec_ahead_ok(batch, steps, verdicts):
            self._queue_spec_ahead(batch, steps, verdicts, result.new_seq_lens)
        clock.phase("overhead")
        clock.finish({s.rid: len(v.tokens) for s, v in zip(steps, verdicts)})
        return result

    def _launch(self, batch, steps: list[StepRequest], drafts: list[Draft]) -> Launched:
        """The verify forward of ``drafts`` queued, and the drafter's ``after_verify`` right behind it."""
        launched = self.verifier.launch(
            batch, steps, drafts, lambda b: self._guarded("before_verify", steps, self.drafter.before_verify, b, steps, drafts))
        self._guarded("after_verify", steps, self.drafter.after_verify, steps, drafts, launched.result.logits_output)
        return launched

    # -- the next speculative step, queued ahead (see .spec_ahead) -------------------------------------

    def _spec_ahead_ok(self, batch, steps: list[StepRequest], verdicts: list[Verdict]) -> bool:
        """The next call will find what this one would queue for it: nothing SGLang processes per
        token or returns besides the tokens, no request ending with this step, no timed step. (Only
        behind a speculative step: its batch just drafted, so a drafter that captures a graph per
        batch size has it; see :meth:`Drafter.can_draft_ahead`.)"""
        if not self.spec_ahead.enabled or self.clock.active or batch.return_logprob:
            return False
        for step, verdict in zip(steps, verdicts):
            if step.blocker not in (None, SPECULATION_OFF) or getattr(step.req, "return_hidden_states", False):
                return False
            if likely_finishes(step.req, verdict.tokens):
                return False
        return True

    def _queue_spec_ahead(self, batch, steps: list[StepRequest], verdicts: list[Verdict],
                          new_seq_lens: torch.Tensor) -> None:
        """The next step's draft (at the width planned for it) and verify forward, queued now,
        with the batch's lengths moved past what this step committed and put back after."""
        nxt = [replace(step, seq_len=step.seq_len + len(v.tokens)) for step, v in zip(steps, verdicts)]
        if not self.drafter.can_draft_ahead(batch_key(nxt)):
            return
        width = self.adaptive.planned_width()
        keep_for(self.spec_ahead.stream, batch, new_seq_lens)

        def step():
            with restored(batch, "forward_mode", "input_ids", "out_cache_loc", "spec_info", "seq_lens", "seq_lens_cpu",
                          "seq_lens_sum"):
                lens = [s.seq_len for s in nxt]
                batch.seq_lens = new_seq_lens
                batch.seq_lens_cpu = torch.tensor(lens, dtype=torch.int64)
                batch.seq_lens_sum = sum(lens)
                self.drafter.before_forward()  # its draft queued ahead, on this stream
                drafts = self._draft(batch, nxt, width, step_count=self.requests.step_count + 1)
                return drafts, self._launch(batch, nxt, drafts)

        self.spec_ahead.queue(batch_key(nxt), width, step)

    # -- a run of plain steps ----------------------------------------------------------------------

    def _plain_run_length(self, batch, steps: list[StepRequest]) -> int:
        """Plain steps this call may queue back to back: 1 where a token needs the host before the
        next one is drawn (our contextual penalty's window, SGLang's own processing of a blocked
        request, a grammar's state, logprobs or hidden states returned per token), else :data:`PLAIN_RUN` (fewer
        right after a prefill or a speculative step: see there), at most the verify width, every
        request's remaining budget and the plain steps its controller allows before its next probe
        (one where a plain step only measures or refreshes the plain cost). 0: this step needs the
        host after its token (it is one plain step, never a run)."""
        if batch.return_logprob or not all(self._runs_plain(step) for step in steps):
            return 0
        run = min(self._run_cap, self.num_nodes, self.adaptive.plain_run_limit(steps))
        for step in steps:
            req = step.req
            run = min(run, req.sampling_params.max_new_tokens - len(req.output_ids))
        return max(1, run)

    @staticmethod
    def _runs_plain(step: StepRequest) -> bool:
        """Nothing needs the host between two of the request's tokens (see :meth:`_plain_run_length`)."""
        return (step.blocker in (None, SPECULATION_OFF) and not step.sampling.penalty_active
                and step.grammar is None and not getattr(step.req, "return_hidden_states", False))

    def _plain_run(self, batch, steps: list[StepRequest], k: int, on_publish) -> GenerationBatchResult:
        """``k`` plain steps in one call: ``k`` width-1 forwards queued back to back, each drawing
        the next root on the device, one read-back at the end. The first may have been queued by
        the previous call (:mod:`.run_ahead`); where the next call is likely a run too, its first
        forward is queued behind this one's last.

        The tokens' KV lands in the first ``k`` slots of each request's verify window, in order,
        as a fully accepted chain of ``k - 1`` drafts would put it, so the drafters observe the run
        as such a chain (:class:`~sgl_longgen.methods.Draft` of the drawn tokens, no drafted
        depth) with the hidden state of each forward's row.
        """
        clock = self.clock
        self.drafter.drop_queued()
        ahead = self.run_ahead.take(batch_key(steps))
        clock.note("plain_step", 1.0)
        clock.note("plain_run", float(k))
        clock.note("plain_run_ahead", float(ahead is not None))
        clock.phase("draft")
        bs = len(steps)
        seq_lens = batch.seq_lens
        roots = [Draft.root_only(step.root) for step in steps]
        draws = torch.empty(k, bs, dtype=torch.int64, device=self.device)
        hidden = None
        launched = None
        clock.gpu_mark("verify_gpu")
        with self._moved_batch(batch) as origin:
            for i in range(k):
                if i == 0 and ahead is not None:
                    launched, draws[0] = ahead.launched, ahead.token
                    rows = ahead.hidden
                else:
                    launched, draws[i], rows = self._plain_forward(batch, origin, steps, i, roots, launched,
                                                                   draws[i - 1] if i else None)
                if rows is not None:
                    if hidden is None:
                        hidden = torch.empty(bs, k, rows.shape[-1], dtype=rows.dtype, device=self.device)
                    hidden[:, i] = rows
            if self._should_run_ahead(steps, k):
                self._queue_run_ahead(batch, origin, steps, k, roots, launched, draws)
        clock.gpu_mark("verify_gpu")
        host = self.env.staging("plain_run", k * bs, torch.int64)
        host.view(k, bs).copy_(draws, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        drawn = host.numpy().reshape(k, bs)
        clock.section("verify_launch")
        clock.phase("verify")

        drafts, verdicts = [], []
        for b, step in enumerate(steps):
            tokens = [int(t) for t in drawn[:, b]]
            tree = DraftTree(step.root)
            node = 0
            for token in tokens[:-1]:
                node = tree.add_child(node, token, Source.NONE)
            drafts.append(Draft(tree))
            verdicts.append(Verdict(tokens, list(range(k))))
            step.history = step.history.extended(tokens)
        self._guarded("after_verify", steps, self.drafter.after_verify, steps, drafts,
                      SimpleNamespace(hidden_states=None if hidden is None else hidden.view(bs * k, -1)))
        self._guarded("observe", steps, self.drafter.observe, steps, drafts, verdicts)
        # The next step's kind once the methods saw the run (their hints read its tokens).
        if self.adaptive.plan(steps, k) == SPECULATE:
            self.run_ahead.drop()
            self._guarded("after_commit", steps, self.drafter.after_commit, batch, steps, verdicts)
        else:
            self.drafter.drop_queued()
        reports = self.adaptive.record(steps, [k] * bs, "plain")
        for step, verdict, report in zip(steps, verdicts, reports):
            if report is not None:
                append_step_values(step.req, report, k)
            # SGLang counts one verify per call: count each forward, none of the run's tokens as
            # accepted drafts, as k single plain steps would (spec_accept_length = tokens per forward).
            step.req.spec_verify_ct += k - 1
            step.req.spec_num_correct_drafts -= k - 1
        clock.section("observe")
        result = self._publish(batch, seq_lens, steps, drafts, verdicts, drawn, launched, on_publish, hidden)
        clock.phase("overhead")
        clock.finish({s.rid: k for s in steps})
        return result

    def _plain_forward(self, batch, origin, steps: list[StepRequest], i: int, roots: list[Draft], last, prev_draw):
        """The ``i``-th forward of a run (the roots ``i`` positions on) and its draw: (launched,
        tokens ``[bs]``, the hidden rows ``[bs, d]`` or None). ``origin``: the call's lengths
        (:meth:`_moved_batch`); ``prev_draw``: the tokens the forward before it drew, still on the
        device (None for the first)."""
        inner = steps if i == 0 else [replace(step, seq_len=step.seq_len + i) for step in steps]
        hook = lambda b: self._guarded("before_verify", steps, self.drafter.before_verify, b, inner, roots)
        if last is None:
            self.verifier.prepare(batch, inner, width=1)
            launched = self.verifier.launch(batch, inner, roots, hook)
        else:
            self._move_batch(batch, origin, i)
            launched = self.verifier.relaunch(batch, inner, last, prev_draw, hook)
        out = launched.result.logits_output
        tokens = self.verifier.draw(batch, inner, roots, out.next_token_logits)[:, 0]
        rows = None
        if out.hidden_states is not None:
            rows = out.hidden_states.view(len(steps), -1, out.hidden_states.shape[-1])[:, 0]
        return launched, tokens, rows

    @contextmanager
    def _moved_batch(self, batch):
        """The batch's lengths as SGLang gave them (yielded), back after the forwards of a run moved them."""
        saved = (batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum)
        try:
            yield saved
        finally:
            batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum = saved

    @staticmethod
    def _move_batch(batch, origin, i: int) -> None:
        """The batch's lengths ``i`` tokens past the call's committed ones (``origin``)."""
        seq_lens, seq_lens_cpu, seq_lens_sum = origin
        batch.seq_lens = seq_lens + i
        if seq_lens_cpu is not None:
            batch.seq_lens_cpu = seq_lens_cpu + i
        if seq_lens_sum is not None:
            batch.seq_lens_sum = seq_lens_sum + len(batch.reqs) * i

    def _should_run_ahead(self, steps: list[StepRequest], k: int) -> bool:
        """Queue the next call's first forward: its controllers allow another plain step and no
        request ends with this run (a stop token may still end one: its forward is then dropped)."""
        if not self.run_ahead.enabled or self.adaptive.plain_run_limit(steps) <= k:
            return False
        return all(s.req.sampling_params.max_new_tokens - len(s.req.output_ids) > k for s in steps)

    def _queue_run_ahead(self, batch, origin, steps: list[StepRequest], k: int, roots: list[Draft], launched,
                         draws: torch.Tensor) -> None:
        """The forward at ``k`` past this call's lengths, for the next call (see :mod:`.run_ahead`)."""
        keep_for(self.run_ahead.stream, batch, draws)

        def forward():
            # The batch leaves this call as the run's last forward left it, not as this one does.
            with restored(batch, "forward_mode", "input_ids", "out_cache_loc", "spec_info"):
                queued, token, rows = self._plain_forward(batch, origin, steps, k, roots, launched, draws[k - 1])
            return queued, token, None if rows is None else rows.clone()  # a graph's output is overwritten

        key = batch_key(steps, [s.seq_len + k for s in steps])
        self.run_ahead.queue(key, [s.state.generator for s in steps], forward)

    def _begin(self, batch) -> list[StepRequest]:
        steps = self.requests.begin(batch, self.drafter.penalty)
        for step in steps:
            state = step.state
            if state.failed:
                step.blocker = DRAFTING_FAILED
            if state.method is None:
                state.method = self._guarded("start", [step], self.drafter.start, step)
        return steps

    def _draft(self, batch, steps: list[StepRequest], width: int | None, step_count: int | None = None) -> list[Draft]:
        """The drafter's tries, cut to ``width`` nodes (None: its whole draft), and the verify
        windows of their rows (``step_count``: the decode step they are for, when not this one)."""
        max_nodes, rows = (self.num_nodes,) * 2 if width is None else (width, self.drafter.rows(width))
        if self._fault_at and (step_count or self.requests.step_count) == self._fault_at:
            self._failed("draft", steps, RuntimeError(f"injected by {FAULT_ENV}={self._fault_at}"))
        else:
            drafts = self._guarded("draft", steps, self.drafter.draft, batch, steps,
                                   lambda: self.verifier.prepare(batch, steps, width=rows), max_nodes)
            if drafts is not None:
                for step, draft in zip(steps, drafts):
                    if step.blocker is not None and len(draft.tree) > 1:
                        raise RuntimeError("a drafter must return a root-only tree for a blocked request")
                return drafts
        return [Draft.root_only(step.root) for step in steps]

    def _hint(self, step: StepRequest) -> float | None:
        """The drafter's hint for a request's next step (none for a request whose method is gone)."""
        if step.state.method is None or step.state.failed:
            return None
        return self._guarded("hint", [step], self.drafter.hint, step)

    def _guarded(self, hook: str, steps: list[StepRequest], fn, *args):
        """Run a drafter hook; if it raises, its requests decode plain from now on (never the server)."""
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - drafting must not take the server down
            self._failed(hook, steps, exc)
            return None

    def _failed(self, hook: str, steps: list[StepRequest], exc: BaseException) -> None:
        self.drafter.reset()
        for step in steps:
            state = step.state
            if not state.failed:
                logger.error("request %s: the %s drafter's %s raised %s: %s; it decodes without speculation "
                             "from here on (output unchanged)", step.rid, self.server_args.speculative_algorithm,
                             hook, type(exc).__name__, exc, exc_info=exc)
            state.failed = True
            step.blocker = DRAFTING_FAILED
            try:  # a fresh method state: the drafter still sees the request, as a blocked one
                state.method = self.drafter.start(step)
            except Exception:  # noqa: BLE001
                state.method = None

    def _publish(self, batch, seq_lens, steps, drafts, verdicts, drawn, launched: Launched,
                 on_publish, hidden: torch.Tensor | None = None) -> GenerationBatchResult:
        """The committed tokens and their counts to the device in one copy; SGLang's result.
        ``hidden``: the step's hidden rows, the same number per request, in draft-node order (a plain
        run's: one per forward), laid out as SGLang returns them where a request asks
        (:func:`committed_hidden_rows`)."""
        bs, n = len(steps), self.num_nodes
        host = self.env.staging("result", bs * n + bs, torch.int32)
        packed = host.numpy()
        packed[: bs * n] = 0
        for b, verdict in enumerate(verdicts):
            packed[b * n : b * n + len(verdict.tokens)] = verdict.tokens
            packed[bs * n + b] = len(verdict.tokens)
        on_device = host.to(self.device, non_blocking=True, copy=True)
        next_token_ids, accept_lens = on_device[: bs * n], on_device[bs * n :]
        new_seq_lens = seq_lens + accept_lens
        logits_output = launched.result.logits_output
        if hidden is not None and any(getattr(step.req, "return_hidden_states", False) for step in steps):
            logits_output = replace(
                logits_output, hidden_states=committed_hidden_rows(hidden, [v.nodes for v in verdicts], n))
        if batch.return_logprob:
            self.verifier.logprobs(batch, logits_output, drafts, drawn, verdicts)
        if on_publish is not None:
            on_publish(new_seq_lens)
        batch.forward_mode = ForwardMode.DECODE
        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=next_token_ids,
            accept_lens=accept_lens,
            new_seq_lens=new_seq_lens,
            next_draft_input=relay_input(n, new_seq_lens, next_token_ids, accept_lens),
            speculative_num_draft_tokens=n,
            can_run_cuda_graph=launched.result.can_run_cuda_graph,
        )

