"""OWL and HOWL in the reference runtime: one target forward per step.

The method (:class:`~sgl_longgen.methods.Owl` / :class:`~sgl_longgen.methods.Howl`) routes each
step and expands the drafter's tree from the last committed state (and the last [SPEC] state);
every tree node and the root get one [SPEC] leaf; the tree goes through the target over the full
KV with the ancestor mask; one draw per node and the walk decide what is committed. The accepted
path's last node gives the next round's ``h_last`` and its [SPEC] leaf gives ``h_S``; compaction
keeps only the root and the accepted nodes, so no [SPEC] KV survives. HOWL verifies a SuffixDecoding
chain instead (no [SPEC]) when its score exceeds the threshold.

[SPEC] is an input-only token: id ``vocab_size`` of the reference model, embedded as the drafter
checkpoint's vector. The prefill appends one after the prompt (at the position of the first new
token) so the first round already has a [SPEC] state; its KV slot is overwritten by the first step.
``[owl] weights = "fp8"`` quantizes the drafter's projections and head once here (the fp8 twin on
a CPU): it changes the drafts, never what is committed.
"""

from __future__ import annotations

import time
from functools import partial

import torch

from ..config import GenerateConfig
from ..core.owl import OwlDrafter, expand, quantize_fp8, verify_width
from ..core.verify import Verdict, verify_tree
from ..errors import LonggenError
from ..kernels import fp8_linear  # noqa: F401 (installs the fp8 GEMM of the device for the drafter's fp8 matrices)
from ..methods import Draft, Howl, Owl
from .checkpoint import LoadedModel
from .decoder import PREFILL_CHUNK, Decoder, GenerationResult, ProgressFn
from .model import ForwardSpec

RID = 0  # one request at a time: the methods key their per-request state by it


class OwlDecoder(Decoder):
    def __init__(self, loaded: LoadedModel, config: GenerateConfig, drafter: OwlDrafter):
        super().__init__(loaded, config)
        cfg = loaded.config
        if drafter.hidden_size != cfg.hidden_size:
            raise LonggenError(f"the OWL drafter reads hidden size {drafter.hidden_size} but the model's is {cfg.hidden_size}")
        if drafter.vocab_size != cfg.vocab_size:
            raise LonggenError(f"the OWL drafter has vocabulary {drafter.vocab_size} but the model's is {cfg.vocab_size}")
        o = config.owl
        if o.spec and not drafter.spec:
            raise LonggenError("the OWL drafter was trained without [SPEC]; set owl.spec = false")
        self.drafter = drafter.to(device=self.model.device, dtype=self.model.dtype).eval().requires_grad_(False)
        if o.weights == "fp8":  # in place: the drafter it was given keeps only the fp8 matrices
            quantize_fp8(self.drafter)
        beam = partial(expand, self.drafter, top_k=o.top_k, depth=o.depth, tree_size=o.tree_size)
        spec_id = cfg.vocab_size  # input-only: embedded as the checkpoint's [SPEC] vector
        self.method = self._method(config, lambda h, roots, h_spec, has_spec: beam(h, roots, h_spec, torch.tensor(has_spec)),
                                   spec_id)
        self.spec_rows = self.drafter.spec_embedding.detach()[None] if drafter.spec else None
        self.slack = verify_width(o.tree_size, o.spec)
        self.full_nodes = o.tree_size + 1

    def _method(self, config: GenerateConfig, beam, spec_id: int) -> Owl:
        return Owl(config.owl, beam, spec_id)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, progress: ProgressFn | None = None) -> GenerationResult:
        self._plain_tokens: list[int] = []  # drawn by plain steps since the last speculative one
        try:
            return super().generate(prompt_ids, max_new_tokens, progress)
        finally:
            if self._plain_tokens:  # HOWL's index of past outputs gets the whole output
                self._catch_up()
            self.method.finish(RID)

    # -- prefill -------------------------------------------------------------------------------

    def _prefill(self, prompt_ids: list[int]) -> torch.Tensor:
        """The prompt (plus one [SPEC] at position P when enabled); keeps ``h_last`` and ``h_S``."""
        dev = self.model.device
        o = self.method.config
        with_spec = o.spec and o.prefill_spec
        ids = list(prompt_ids) + ([self.method.spec_token] if with_spec else [])
        tail = None
        for lo in range(0, len(ids), PREFILL_CHUNK):
            hi = min(len(ids), lo + PREFILL_CHUNK)
            chunk = torch.tensor(ids[lo:hi], dtype=torch.long, device=dev)
            h = self.model(chunk, torch.arange(lo, hi, device=dev), self.cache, ForwardSpec(start=lo),
                           self.spec_rows if with_spec else None)
            tail = h[-2:] if tail is None else torch.cat([tail, h])[-2:]
        norm = self.model.model.norm
        if with_spec:
            self._prefill_states = norm(tail[-2]), norm(tail[-1])
            return self.model.logits(tail[-2:-1])
        self._prefill_states = norm(tail[-1]), None
        return self.model.logits(tail[-1:])

    def after_prefill(self) -> None:
        self.state = self.method.start(RID, self.history, *self._prefill_states)

    # -- one step ------------------------------------------------------------------------------

    def verify(self, draft: Draft) -> Verdict:
        """One target forward over the trie; commits the walk's result and updates the states."""
        dev = self.model.device
        tree, leaves = draft.tree, draft.leaves
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
        self.step_nodes = verdict.nodes
        last = verdict.nodes[-1]
        norm = self.model.model.norm
        self.method.observe(self.state, RID, draft, verdict, norm(h[last]), norm(h[leaves[last]]) if leaves else None)
        s = self.stats
        s.accepted += verdict.accepted
        s.verify_tokens += len(tree)
        s.drafted += draft.depth
        s.linear_steps += bool(draft.route is not None and draft.route.linear)
        return verdict

    def after_plain_step(self, h: torch.Tensor, token: int) -> None:
        """Kept for the next speculative step (:meth:`_catch_up`): nothing per plain step."""
        self._plain_h = h
        self._plain_tokens.append(token)

    def _catch_up(self) -> None:
        """After plain steps, as after verifying their roots alone: the next tree is drafted from the
        last root's state (no [SPEC] state: that round uses the drafter's null vector); HOWL indexes
        the tokens they drew."""
        root = self.history[-1 - len(self._plain_tokens)]
        self.method.observe(self.state, RID, Draft.root_only(root), Verdict(self._plain_tokens, [0]),
                            self.model.model.norm(self._plain_h[-1]), None)
        self._plain_tokens = []

    def step(self) -> list[int]:
        t = time.perf_counter()
        if self._plain_tokens:
            self._catch_up()
        width = self.max_nodes
        route = self.method.route(self.state, RID, self.history, None if width is None else width - 1)
        (draft,) = self.method.propose([RID], [self.state], [self.history[-1]], [route], width)
        t_draft = time.perf_counter()
        verdict = self.verify(draft)
        self.stats.draft_seconds += t_draft - t
        self.stats.verify_seconds += time.perf_counter() - t_draft
        self.step_source = None if route is None else ("linear" if route.linear else "tree")
        return verdict.tokens


class HowlDecoder(OwlDecoder):
    """OWL trees with [SPEC], or a linear suffix draft when SuffixDecoding expects more than c tokens.

    The suffix index (prompt + output) persists across ``generate`` calls only through its
    optional global index over past outputs (``suffix.global_requests``).
    """

    def __init__(self, loaded: LoadedModel, config: GenerateConfig, drafter: OwlDrafter):
        super().__init__(loaded, config, drafter)
        self.slack = max(self.slack, 1 + config.suffix.max_spec_tokens)
        self.full_nodes = max(self.full_nodes, 1 + config.suffix.max_spec_tokens)

    def _method(self, config: GenerateConfig, beam, spec_id: int) -> Howl:
        return Howl(config.owl, beam, spec_id, config.suffix, config.howl)

    def hint(self) -> float | None:
        """The suffix chain's score when the next step would verify it."""
        if self._plain_tokens:  # the suffix index must hold what the plain steps drew
            self._catch_up()
        return self.method.history_hint(self.state, RID, self.history)
