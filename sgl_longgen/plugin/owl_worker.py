"""OWL and HOWL as SGLang speculative workers.

OWL needs no draft forward of the target: its LSTM drafter reads the post-final-norm hidden state
of the last committed token (and of the [SPEC] leaf that followed it in the last verify forward)
and expands a tree. The tree, with one [SPEC] leaf per node, is verified by
:class:`TreeSpecWorker` in one TARGET_VERIFY forward that also returns every row's hidden state.

[SPEC] never touches the model's weights: its rows go through the forward with SGLang's input
embedding override (``replace_embeds`` / ``replace_positions``) set to the drafter checkpoint's
vector, so no vocabulary row is sacrificed and a [SPEC] can never be sampled. Its KV slots are
never accepted, so the commit drops them with the other rejected nodes.

HOWL adds SuffixDecoding: when a request's linear suffix draft is expected to beat OWL's best case,
that chain is verified instead (no [SPEC]; the next tree uses the drafter's null state).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

from ..core.howl import HowlPolicy, HowlState, Route
from ..core.owl import GraphedExpand, attach_spec_leaves, beam_trees, expand, load_drafter, verify_width
from ..core.suffix import SuffixCache
from ..core.tree import DraftTree, Source
from ..core.verify import Verdict
from ..errors import LonggenError
from .draft_dir import inspect_owl_draft_dir
from .requests import PenaltyDefaults
from .tree_worker import StepRequest, TreeSpecWorker

SPEC_INPUT_ID = 0  # any valid id: the row's embedding is replaced by the [SPEC] vector


@dataclass
class OwlState:
    h_last: torch.Tensor | None  # post-norm hidden state of the last committed token
    h_spec: torch.Tensor | None = None  # post-norm hidden state of the [SPEC] that followed it
    howl: HowlState | None = None


class OwlWorker(TreeSpecWorker):
    capture_hidden_mode = CaptureHiddenMode.FULL
    prefill_capture_mode = CaptureHiddenMode.LAST

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker, **kwargs):
        super().__init__(server_args, gpu_id, nccl_port, target_worker, **kwargs)
        draft = inspect_owl_draft_dir(server_args.speculative_draft_model_path, server_args.model_path)
        self.owl = draft.defaults.owl
        width = verify_width(self.owl.tree_size, self.owl.spec)
        if width > self.num_nodes:
            raise LonggenError(f"OWL trees of {self.owl.tree_size} nodes need speculative_num_draft_tokens >= "
                               f"{width}, got {self.num_nodes}")
        dtype = next(self.model.parameters()).dtype
        self.drafter = load_drafter(draft.path).to(device=self.device, dtype=dtype)
        self.spec_vector = self.drafter.spec_embedding.detach() if self.owl.spec else None
        o = self.owl
        if server_args.disable_cuda_graph:
            self.expand = lambda h, roots, h_spec, has_spec: expand(
                self.drafter, h, roots, h_spec, torch.tensor(has_spec), top_k=o.top_k, depth=o.depth, tree_size=o.tree_size)
        else:  # CUDA graph of the beam on GPU (plain calls on CPU tensors)
            from ..kernels.owl_beam import fused_expand

            self.expand = GraphedExpand(self.drafter, top_k=o.top_k, depth=o.depth, tree_size=o.tree_size,
                                        fast=fused_expand if o.beam == "fused" else None,
                                        compile=o.beam == "compiled")
        sampling = draft.defaults.sampling
        self.set_penalty_defaults(PenaltyDefaults(sampling.penalty, sampling.penalty_window))
        self.defaults = draft.defaults
        self.prefill_states: dict[str, torch.Tensor] = {}
        self._routes: list[Route | None] = []
        self._leaves: list[list[int]] = []
        self._hidden: torch.Tensor | None = None

    # -- per-request state -------------------------------------------------------------------------

    def after_extend(self, batch, result) -> None:
        hidden = result.logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("the prefill forward returned no hidden states for OWL")
        for b, req in enumerate(batch.reqs):
            self.prefill_states[req.rid] = hidden[b].detach().clone()

    def new_method_state(self, step: StepRequest) -> OwlState:
        # A missing state (a request we never saw prefilled) costs one root-only step.
        return OwlState(self.prefill_states.pop(step.req.rid, None))

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        super().note_request_finished(rid=rid, natural_stop=natural_stop)
        self.prefill_states.pop(rid, None)

    # -- drafting ---------------------------------------------------------------------------------

    def route(self, step: StepRequest) -> Route | None:
        """How this request drafts this step (None: root only)."""
        state: OwlState = step.state.method_state
        if step.blocker is not None or state.h_last is None:
            return None
        spec = self.owl.spec
        return Route(linear=False, use_spec=spec and state.h_spec is not None, attach_spec=spec)

    def linear_draft(self, step: StepRequest) -> list[int]:
        return []

    @torch.no_grad()
    def draft(self, batch, steps: list[StepRequest]) -> list[DraftTree]:
        self._routes = [self.route(step) for step in steps]
        trees = [DraftTree(step.root) for step in steps]
        lstm = [b for b, r in enumerate(self._routes) if r is not None and not r.linear]
        if lstm:
            states = [steps[b].state.method_state for b in lstm]
            h_last = torch.stack([s.h_last for s in states])
            has_spec = [self._routes[b].use_spec for b in lstm]
            h_spec = None
            if any(has_spec):
                h_spec = torch.stack([s.h_spec if use else torch.zeros_like(s.h_last) for s, use in zip(states, has_spec)])
            beam = self.expand(h_last, [steps[b].root for b in lstm], h_spec, has_spec)
            for b, tree in zip(lstm, beam_trees(beam, [steps[b].root for b in lstm])):
                trees[b] = tree
        for b, (step, route) in enumerate(zip(steps, self._routes)):
            if route is not None and route.linear:
                trees[b].add_path(self.linear_draft(step)[: self.num_nodes - 1], Source.SUFFIX)
        self._leaves = [
            attach_spec_leaves(tree, SPEC_INPUT_ID) if route is not None and route.attach_spec else []
            for tree, route in zip(trees, self._routes)
        ]
        return trees

    def prepare_verify(self, batch, steps: list[StepRequest], trees: list[DraftTree]) -> None:
        rows = [b * self.num_nodes + leaf for b, leaves in enumerate(self._leaves) for leaf in leaves]
        if rows:
            batch.replace_positions = torch.tensor(rows, dtype=torch.int64, device=self.device)
            batch.replace_embeds = self.spec_vector.expand(len(rows), -1).contiguous()

    # -- after verification ---------------------------------------------------------------------

    def after_verify_forward(self, steps, spec, logits_output) -> None:
        hidden = logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("the verify forward returned no hidden states for OWL")
        self._hidden = hidden.view(len(steps), self.num_nodes, -1)

    def after_commit(self, steps: list[StepRequest], verdicts: list[Verdict]) -> None:
        for b, (step, verdict) in enumerate(zip(steps, verdicts)):
            state: OwlState = step.state.method_state
            last = verdict.nodes[-1]
            leaves = self._leaves[b]
            state.h_last = self._hidden[b, last].clone()
            state.h_spec = self._hidden[b, leaves[last]].clone() if leaves else None
        self._hidden = None


class HowlWorker(OwlWorker):
    """OWL trees, or SuffixDecoding chains when they are expected to accept more than ``c`` tokens."""

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker, **kwargs):
        super().__init__(server_args, gpu_id, nccl_port, target_worker, **kwargs)
        self.policy = HowlPolicy(self.defaults.howl, spec=self.owl.spec)
        self.suffix = SuffixCache(self.defaults.suffix)
        self._drafts: dict[str, list[int]] = {}

    def new_method_state(self, step: StepRequest) -> OwlState:
        state = super().new_method_state(step)
        state.howl = HowlState(has_spec=False)
        self.suffix.start_request(step.req.rid, step.history)
        return state

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        super().note_request_finished(rid=rid, natural_stop=natural_stop)
        self.suffix.stop_request(rid)

    def clear_cache_pool(self):
        super().clear_cache_pool()
        self.suffix = SuffixCache(self.defaults.suffix)

    def route(self, step: StepRequest) -> Route | None:
        state: OwlState = step.state.method_state
        if step.blocker is not None:
            return None
        draft = self.suffix.speculate(step.req.rid, step.history)
        if state.h_last is None and draft.score <= self.policy.threshold:
            return None
        state.howl.has_spec = state.h_spec is not None
        route = self.policy.route(draft.score, state.howl)
        if route.linear:
            self._drafts[step.req.rid] = list(draft.tokens)
        return route

    def linear_draft(self, step: StepRequest) -> list[int]:
        return self._drafts.pop(step.req.rid, [])

    def after_commit(self, steps: list[StepRequest], verdicts: list[Verdict]) -> None:
        super().after_commit(steps, verdicts)
        for step, verdict, route in zip(steps, verdicts, self._routes):
            state: OwlState = step.state.method_state
            if route is not None:
                self.policy.update(state.howl, route)
            self.suffix.extend(step.req.rid, verdict.tokens)
