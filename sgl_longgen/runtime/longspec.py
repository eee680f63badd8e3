"""LongSpec in the reference runtime: one drafter beam and one target forward per step.

The method (:class:`~sgl_longgen.methods.LongSpec`) says which history tokens the drafter must be
fed; the drafter writes their window K/V into this decoder's ring (its only memory, fixed at
``window`` tokens whatever the context), expands the beam from the root with its cross-attention
reading the target cache's last layer at the committed positions ``[0, L)`` only (the slots past
``L`` hold the last verify's rejected nodes, never read), and the trie goes through the target
over the full KV with the ancestor mask. One draw per node and the walk decide what is
committed (:func:`~sgl_longgen.core.verify.verify_tree`), so the output is plain decoding's.
A drafter with a reduced draft vocabulary scores only its mapped tokens, through the target's LM
head rows gathered once here (:func:`~sgl_longgen.core.longspec_weights.draft_head`); that changes what is
drafted, never what is committed. So do ``[longspec] weights = "fp8"`` (the block's matrices and
its head quantized once here, multiplied through the fp8 twin on a CPU).
"""

from __future__ import annotations

import time

import torch

from ..config import GenerateConfig
from ..core.longspec import LongSpecDrafter
from ..core.longspec_beam import WindowCache, expand, verify_width
from ..core.longspec_checkpoint import target_settings
from ..core.longspec_weights import draft_head, quantize_fp8
from ..errors import LonggenError
from ..kernels import fp8_linear  # noqa: F401 (installs the fp8 GEMM of the device for the drafter's fp8 matrices)
from ..methods import LongSpec
from .checkpoint import LoadedModel
from .decoder import Decoder

RID = 0  # one request at a time


class LongSpecDecoder(Decoder):
    def __init__(self, loaded: LoadedModel, config: GenerateConfig, drafter: LongSpecDrafter):
        super().__init__(loaded, config)
        want = target_settings(loaded.config)
        have = {k: drafter.config()[k] for k in want}
        bad = [k for k in want if (float(have[k]) != float(want[k]) if k == "rope_theta" else have[k] != want[k])]
        if bad:
            k = bad[0]
            raise LonggenError(f"the LongSpec drafter was built for {k} = {have[k]!r} but the model's is {want[k]!r}")
        self.drafter = drafter.to(device=self.model.device, dtype=self.model.dtype).eval().requires_grad_(False)
        c = config.longspec
        fp8 = c.weights == "fp8"
        if fp8:  # in place: the drafter it was given keeps only the fp8 matrices
            quantize_fp8(self.drafter)
        self.ring = WindowCache(drafter.num_kv_heads, drafter.window, drafter.head_dim, self.model.dtype,
                                  self.model.device)
        self.method = LongSpec(c, self._expand, drafter.window)
        self.head = draft_head(self.drafter, self.model.lm_head.weight, self.model.lm_head, fp8)
        self.slack = self.full_nodes = verify_width(c.widths, c.tree_size)

    def _expand(self, rids, pending, starts):
        (tokens,), (start,) = pending, starts  # batch 1
        c = self.config.longspec
        last = self.model.config.num_hidden_layers - 1
        return expand(self.drafter, self.model.model.embed_tokens, self.head, self.model.inv_freq,
                      self.ring, self.cache.k[last], self.cache.v[last], tokens, start, c.widths, c.tree_size)

    def after_prefill(self) -> None:
        self.ring.reset()
        self.state = self.method.start(RID, self.history)

    def step(self) -> list[int]:
        t = time.perf_counter()
        (draft,) = self.method.propose([RID], [self.state], [self.history], self.max_nodes)
        t_draft = time.perf_counter()
        verdict = self.verify(draft)
        self.method.observe(self.state, len(self.history) + len(verdict.tokens))
        self.stats.draft_seconds += t_draft - t
        self.stats.verify_seconds += time.perf_counter() - t_draft
        self.step_source = "tree"
        return verdict.tokens

    @torch.inference_mode()
    def drafter_bytes(self) -> int:
        """Memory the drafter holds for the request: its window ring (its weights aside)."""
        return self.ring.nbytes
