"""OWL and HOWL's drafters on SGLang.

OWL needs no draft forward of the target: its LSTM drafter reads the post-final-norm hidden
state of the last committed token (and of the [SPEC] leaf that followed it in the last verify
forward) and expands a tree. The verify forward returns every row's hidden state
(``CaptureHiddenMode.FULL``) and the method keeps the accepted ones (:mod:`sgl_longgen.methods.owl`).

[SPEC] never touches the model's weights: a forward hook on the target's input embedding puts
the drafter checkpoint's vector on the [SPEC] rows (:class:`SpecEmbedding`), so no vocabulary row
is sacrificed and a [SPEC] can never be sampled. The hook reads a fixed mask buffer, so it is
captured with SGLang's verify CUDA graphs (SGLang's own ``replace_embeds`` override is never
replayed from a graph). Its KV slots are never accepted, so the commit drops them with the other
rejected nodes.

The next step's beam is expanded as soon as a step was observed, on a stream of its own
(:mod:`.pipeline`): it reads only the committed states, so it computes while SGLang's scheduler is
between steps instead of at the start of the next step, which would wait for it. The next step
takes it if its batch and its requests' routes are the ones it was expanded for.

With ``[owl] weights = "fp8"`` in the drafter directory's ``longgen.toml`` the drafter's
projections and head are quantized once here (:mod:`sgl_longgen.core.fp8`) and every beam, the
graphed fused one included, multiplies by them through the device's fp8 GEMM
(:mod:`sgl_longgen.kernels.fp8_linear`; lossless: only the drafts change).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

from ..core.owl import GraphedExpand, load_drafter, quantize_fp8, verify_width
from ..core.verify import Verdict
from ..errors import LonggenError
from ..kernels import fp8_linear  # noqa: F401 (installs the fp8 GEMM of the device for the drafter's fp8 matrices)
from ..methods import Draft, Howl, Owl
from .draft_dir import inspect_owl_draft_dir
from .drafter import Drafter, Shadow
from .pipeline import DraftPipeline, batch_key, likely_finishes
from .requests import PenaltyDefaults, StepRequest

SPEC_INPUT_ID = 0  # any valid id: the row's embedding is replaced by the [SPEC] vector


class SpecEmbedding:
    """The [SPEC] vector on chosen rows of the target's input embeddings, inside its forward.

    ``mask[i]`` marks row i of the next forward; the hook keeps every other row as it is. The
    mask is one device buffer, so graphs captured with the hook in place read the step's rows.
    It is cleared right behind the verify forward on the same stream: a prefill never sees it.
    Forwards longer than the buffer (long prefills) carry no [SPEC] rows and pass untouched.
    """

    def __init__(self, embedding: torch.nn.Module, vector: torch.Tensor, max_tokens: int, staging):
        self.vector = vector
        self.mask = torch.zeros(max_tokens, dtype=torch.bool, device=vector.device)
        self.staging = staging
        embedding.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        n = output.shape[0]
        if n > self.mask.shape[0]:
            return None
        return torch.where(self.mask[:n, None], self.vector.to(output.dtype), output)

    def set_rows(self, rows: list[int], n: int) -> None:
        host = self.staging("spec_rows", n, torch.bool)
        flags = host.numpy()
        flags[:] = False
        flags[rows] = True
        self.mask[:n].copy_(host, non_blocking=True)

    def clear(self) -> None:
        self.mask.zero_()


class OwlDrafter(Drafter):
    verify_capture = CaptureHiddenMode.FULL
    prefill_capture = CaptureHiddenMode.LAST

    def __init__(self, env):
        self.env = env
        sa = env.server_args
        draft = inspect_owl_draft_dir(sa.speculative_draft_model_path, sa.model_path)
        self.defaults = draft.defaults
        o = self.owl = draft.defaults.owl
        width = verify_width(o.tree_size, o.spec)
        if width > env.num_nodes:
            raise LonggenError(f"OWL trees of {o.tree_size} nodes need speculative_num_draft_tokens >= "
                               f"{width}, got {env.num_nodes}")
        model = env.runner.model
        dtype = next(model.parameters()).dtype
        self.drafter = load_drafter(draft.path).to(device=env.device, dtype=dtype)
        if o.weights == "fp8":  # before any graph captures them: the beams read the fp8 matrices
            quantize_fp8(self.drafter)
        self.spec = None
        if o.spec:  # before SGLang captures the target's graphs: the hook is part of them
            # Room for the largest verify batch SGLang may capture or run (graphs read the buffer).
            max_tokens = max(int(sa.max_running_requests or 0), int(getattr(sa, "cuda_graph_max_bs", 0) or 0), 512)
            max_tokens *= env.num_nodes
            self.spec = SpecEmbedding(model.get_input_embeddings(), self.drafter.spec_embedding.detach(), max_tokens,
                                      env.staging)
        # The beam replays as a CUDA graph on a GPU, whatever the target does (plain calls on CPU tensors).
        fused = None
        if env.device.type == "cuda" and o.beam == "fused":
            from ..kernels.owl_beam import fused_expand as fused
        self.beam = GraphedExpand(self.drafter, top_k=o.top_k, depth=o.depth, tree_size=o.tree_size, fast=fused,
                                  compile=o.beam == "compiled")
        self.method = self._method(draft.defaults, self.beam)
        self.pipeline = DraftPipeline(env.device)  # the next step's beam, expanded ahead
        self._draftable: tuple | None = None  # the batch after_commit readied a draft for (can_draft_ahead)
        sampling = draft.defaults.sampling
        self.penalty = PenaltyDefaults(sampling.penalty, sampling.penalty_window)
        self.prefill_states: dict[str, torch.Tensor] = {}
        self._hidden: torch.Tensor | None = None

    def _method(self, defaults, beam) -> Owl:
        return Owl(defaults.owl, beam, SPEC_INPUT_ID)

    # -- per request -------------------------------------------------------------------------------

    def after_extend(self, batch, result) -> None:
        hidden = result.logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("the prefill forward returned no hidden states for OWL")
        for b, req in enumerate(batch.reqs):
            self.prefill_states[req.rid] = hidden[b].detach().clone()

    def start(self, step: StepRequest):
        # A missing state (a request we never saw prefilled) costs root-only steps until its first commit.
        return self.method.start(step.rid, step.history, self.prefill_states.pop(step.rid, None))

    def finish(self, rid: str) -> None:
        self.prefill_states.pop(rid, None)
        self.method.finish(rid)

    # -- the step --------------------------------------------------------------------------------

    def _routes(self, steps: list[StepRequest]) -> list:
        chain = self.env.num_nodes - 1  # a linear round's chain fills the verify width
        return [None if step.blocker is not None
                else self.method.route(step.state.method, step.rid, step.history, chain) for step in steps]

    @torch.no_grad()
    def draft(self, batch, steps: list[StepRequest], shadow: Shadow, max_nodes: int) -> list[Draft]:
        clock = self.env.clock
        queued = self.pipeline.take(batch_key(steps))
        shadow()
        routes = self._routes(steps)
        beam = None
        if queued is not None:
            rows, beam = queued.candidates
            if rows != self.method.tree_rows(routes):  # a request's route changed since: expand afresh
                beam = None
            elif queued.done is not None:
                torch.cuda.current_stream().wait_event(queued.done)
        clock.note("draft_queued_ahead", float(beam is not None))
        clock.note("linear_steps", float(sum(r is not None and r.linear for r in routes)))
        return self.method.propose([s.rid for s in steps], [s.state.method for s in steps], [s.root for s in steps],
                                   routes, max_nodes, beam)

    def rows(self, max_nodes: int) -> int:
        return verify_width(max_nodes - 1, self.owl.spec)

    def can_draft_ahead(self, key: tuple) -> bool:
        # Only where after_commit expanded that batch's beam, or its steps need none (HOWL's linear
        # rounds): expanding one here could capture the beam's graph for a new number of tree rows
        # on the run-ahead stream.
        return key == self._draftable

    def before_verify(self, batch, steps: list[StepRequest], drafts: list[Draft]) -> None:
        n = batch.spec_info.draft_token_num  # the step's verify width
        rows = [b * n + leaf for b, draft in enumerate(drafts) for leaf in draft.leaves]
        if rows:
            self.spec.set_rows(rows, len(drafts) * n)

    def after_verify(self, steps: list[StepRequest], drafts: list[Draft], logits_output) -> None:
        if self.spec is not None:
            self.spec.clear()
        hidden = logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("the verify forward returned no hidden states for OWL")
        self._hidden = hidden.view(len(steps), -1, hidden.shape[-1])  # the step's verify width

    def observe(self, steps: list[StepRequest], drafts: list[Draft], verdicts: list[Verdict]) -> None:
        hidden, self._hidden = self._hidden, None
        for b, (step, draft, verdict) in enumerate(zip(steps, drafts, verdicts)):
            last = verdict.nodes[-1]
            h_spec = hidden[b, draft.leaves[last]].clone() if draft.leaves else None
            self.method.observe(step.state.method, step.rid, draft, verdict, hidden[b, last].clone(), h_spec)

    @torch.no_grad()
    def after_commit(self, batch, steps: list[StepRequest], verdicts: list[Verdict]) -> None:
        """Expand the next step's beam now, on the draft stream: it reads only the states just
        observed, so it computes while SGLang's scheduler is between steps (the next step takes it
        if its batch and routes are the same). Not for a request about to finish, nor on a GPU
        before the beam's graph of this size exists (no capture on that stream)."""
        self.pipeline.drop()
        self._draftable = None
        if any(likely_finishes(step.req, verdict.tokens) for step, verdict in zip(steps, verdicts)):
            return
        nxt = [replace(step, seq_len=step.seq_len + len(v.tokens)) for step, v in zip(steps, verdicts)]
        routes = self._routes(nxt)
        rows = self.method.tree_rows(routes)
        stream = self.pipeline.stream
        if not rows:
            self._draftable = batch_key(nxt)  # no beam to expand
            return
        if stream is not None and not self.beam.ready(len(rows)):
            return
        states, roots = [s.state.method for s in nxt], [s.root for s in nxt]
        done = None
        if stream is None:
            beam = self.method.beam(states, roots, routes)
        else:
            stream.wait_stream(torch.cuda.current_stream())  # the observed states are written there
            with torch.cuda.stream(stream):
                beam = self.method.beam(states, roots, routes)
            done = torch.cuda.Event()
            done.record(stream)
        self.pipeline.keep(batch_key(nxt), ((rows, beam), done, None))
        self._draftable = batch_key(nxt)

    def before_forward(self) -> None:
        self.pipeline.wait()

    def drop_queued(self) -> None:
        self._draftable = None
        self.pipeline.reset()

    def reset(self) -> None:
        self._draftable = None
        self.pipeline.reset()
        self.method.reset()


class HowlDrafter(OwlDrafter):
    """OWL trees, or SuffixDecoding chains when they are expected to accept more than ``c`` tokens."""

    def _method(self, defaults, beam) -> Howl:
        return Howl(defaults.owl, beam, SPEC_INPUT_ID, defaults.suffix, defaults.howl)

    def prepare(self, rid: str, history, sampling) -> None:
        self.method.prepare(rid, history)

    def hint(self, step: StepRequest) -> float | None:
        return self.method.history_hint(step.state.method, step.rid, step.history, self.env.num_nodes - 1)
