"""LONGSPEC's drafter on SGLang: one drafter block whose memory per request does not grow with the context.

Per step the requests that draft go through one batched beam (:func:`sgl_longgen.kernels.longspec_step.expand_rings`,
one block forward per level for the whole batch), run by the shared method
(:class:`sgl_longgen.methods.LongSpec`: what each request's ring must be fed, the trie from the beam):

* the **self-attention** reads each request's window ring (a row of the drafter's
  :class:`~sgl_longgen.kernels.longspec_step.RingPool`, ``window`` tokens, taken at its first draft and
  given back when it leaves): the drafter's only memory per request, fixed whatever the context
  grows to. A step's few new tokens are written into the rings inside the step itself; only a
  longer feed (a request's first draft) is written eagerly before it;
* the **cross-attention** reads the target's last-layer K/V *in place* in SGLang's KV pool, through the
  request's slot row ``req_to_token[req_pool_idx, :L]``, ``L`` its committed length: never a verify
  window's slots, so no draft sees in-flight KV. SGLang's Llama/Qwen2 write their keys after RoPE,
  as the reference runtime's cache holds them, so the keys are used as they lie; the queries get
  the target's RoPE at the draft token's position from the target's own rotary module (its
  ``cos_sin_cache``: the same table, Llama-3.1 scaling included, that rotated the keys). On a GPU the
  whole prefix is read once per level for all queries of a request (the Triton prefix kernel,
  ``sgl_longgen.kernels.prefix_attention``); elsewhere the committed K/V are gathered once per step
  and attended with PyTorch's SDPA (the kernel's twin);
* the embedding and the LM head are the target's (the first ``vocab_size`` logits: SGLang pads the
  head's rows); a drafter with a reduced draft vocabulary scores only its ``token_map``'s tokens,
  through those rows of the target's head gathered once when the worker starts (a tensor of its
  own, which the graphed beam reads at a fixed address), and proposes the mapped target ids;
* with ``[longspec] weights = "fp8"`` (the draft directory's ``longgen.toml``) the block's
  matrices are quantized once here and the head is an fp8 copy of the target's (or of its mapped
  rows) that the drafter owns, the target keeping its own; the graphed step multiplies by them
  through the device's fp8 GEMM (:mod:`sgl_longgen.kernels.fp8_linear`).

While the step computes, the host does what the verify needs that the tries do not change (the
worker's shadow) and warms the trie building on the last beam; then it waits once for the beam's
two read-back tensors and builds the tries.

Lossless whatever the drafter proposes: the trie only decides which tokens the verifier may
accept; every committed token is drawn by the worker's per-node walk.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core.longspec_beam import beam_of_rows, beam_tree
from ..core.longspec_checkpoint import check_target, load_drafter
from ..core.longspec_weights import draft_head, fuse_projections, quantize_fp8
from ..core.owl import DraftBeam
from ..errors import LonggenError
from ..kernels.longspec_step import DEFAULT_FEED, Attend, BeamPlan, RingPool, expand_rings, feed_rings
from ..methods import Draft, LongSpec, LongSpecState
from . import compat
from .buffers import Staging
from .draft_dir import inspect_longspec_draft_dir, longspec_target
from .drafter import Drafter, Shadow
from .requests import PenaltyDefaults, StepRequest

logger = logging.getLogger(__name__)

KERNEL_DTYPES = (torch.bfloat16, torch.float16)  # what the Triton prefix kernel reads


def check_server_args(server_args) -> None:
    """Settings LONGSPEC cannot run with, refused before a scheduler starts."""
    tp = int(getattr(server_args, "tp_size", 1) or 1)
    pp = int(getattr(server_args, "pp_size", 1) or 1)
    if tp > 1 or pp > 1:
        # Each rank would hold a share of the last layer's KV heads (or none of its layers).
        raise LonggenError(f"runs with --tp-size 1 and --pp-size 1 for now (its drafter reads every KV head of the "
                           f"target's last layer on one rank), got --tp-size {tp} --pp-size {pp}")
    kv = str(getattr(server_args, "kv_cache_dtype", None) or "auto")
    if kv.startswith(("fp8", "fp4", "int")):
        raise LonggenError(f"reads the target's last-layer KV cache as its cross-attention keys and values, so it "
                           f"needs them unquantized: --kv-cache-dtype auto, not {kv}")


# -- the target's pieces ---------------------------------------------------------------------------


def target_rotary(model, head_dim: int):
    """The target's rotary module, if its table is what the drafter's queries can use.

    The drafter rotates with full-width, NeoX-style RoPE (``rotate_half``), cos/sin taken from
    the module's ``cos_sin_cache`` rows; modules that rotate some other way (partial or
    interleaved rotary, multimodal or per-length tables) are refused.
    """
    from sglang.srt.layers.rotary_embedding import RotaryEmbedding

    found = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    if not found:
        raise LonggenError("LONGSPEC needs a target with SGLang's RotaryEmbedding; this model has none")
    rotary = found[-1]
    plain = type(rotary).forward_native is RotaryEmbedding.forward_native
    if not plain or rotary.rotary_dim != head_dim or rotary.head_size != head_dim or not rotary.is_neox_style:
        raise LonggenError(f"LONGSPEC needs full-width NeoX-style RoPE from one cos/sin table; this model's is "
                           f"{type(rotary).__name__} (rotary_dim {rotary.rotary_dim} of head size "
                           f"{rotary.head_size}, neox {rotary.is_neox_style})")
    return rotary


class TargetRope:
    """cos/sin ``[..., head_dim]`` at given positions from the target's own table (``cos_sin_cache``
    rows ``[cos | sin]`` of half width), read per call: SGLang may grow or recast the table."""

    def __init__(self, rotary):
        self.rotary = rotary

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        table = self.rotary.cos_sin_cache
        rows = table.index_select(0, positions.reshape(-1).to(table.device)).view(*positions.shape, -1)
        cos, sin = rows.chunk(2, dim=-1)
        return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)

    @property
    def positions(self) -> int:
        return int(self.rotary.cos_sin_cache.shape[0])


class FrozenRope:
    """A :class:`TargetRope` over a private copy of the table taken at the first call."""

    def __init__(self, rope: TargetRope):
        self.source = rope
        self.table: torch.Tensor | None = None

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.table is None:
            self.table = self.source.rotary.cos_sin_cache.float().clone()
        rows = self.table.index_select(0, positions.reshape(-1).to(self.table.device)).view(*positions.shape, -1)
        cos, sin = rows.chunk(2, dim=-1)
        return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)

    @property
    def positions(self) -> int:
        return self.source.positions


def last_attention_layer(model) -> int:
    """The layer id (in SGLang's KV pool) of the target's last attention layer."""
    from sglang.srt.layers.radix_attention import RadixAttention

    ids = [m.layer_id for m in model.modules() if isinstance(m, RadixAttention)]
    if not ids:
        raise LonggenError("LONGSPEC needs a target whose attention is SGLang's RadixAttention; this model has none")
    return max(ids)


def committed_attention(k_buffer: torch.Tensor, v_buffer: torch.Tensor, rows: Sequence[torch.Tensor], scale: float,
                        kernel: bool) -> Attend:
    """Each request's queries over the target K/V in pool slots ``rows[b]`` (its committed
    tokens, any order: attention over them is unmasked), read where the pool keeps them.

    ``k_buffer``/``v_buffer``: ``[slots, Hkv, D]`` (SGLang's layout at page size 1). ``kernel``:
    the Triton prefix kernel, every query row of a KV head on each K/V tile, so a level reads the
    prefix once; otherwise each request's K/V are gathered once here and every level attends with
    SDPA (the kernel's twin, and the CPU path).
    """
    if kernel:
        indptr, indices = slot_lists(rows, k_buffer.device)
        return kernel_attention(k_buffer, v_buffer, indptr, indices, scale)

    keys = [k_buffer[r.long()].transpose(0, 1) for r in rows]  # [Hkv, L, D]
    values = [v_buffer[r.long()].transpose(0, 1) for r in rows]

    def attend(q: torch.Tensor) -> torch.Tensor:  # [B, T, H, D]
        return torch.stack([F.scaled_dot_product_attention(q[b].transpose(0, 1), keys[b].to(q.dtype),
                                                           values[b].to(q.dtype), scale=scale,
                                                           enable_gqa=keys[b].shape[0] != q.shape[2]).transpose(0, 1)
                            for b in range(q.shape[0])])

    return attend


def slot_lists(rows: Sequence[torch.Tensor], device, capacity: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_indptr`` ``[B+1]`` and ``kv_indices`` (int32) of the requests' slot rows; ``capacity``:
    pad the indices to that many entries (a fixed shape for a CUDA graph; the tail is never read)."""
    indptr = torch.tensor(list(itertools.accumulate((r.numel() for r in rows), initial=0)), dtype=torch.int32,
                          device=device)
    indices = (rows[0] if len(rows) == 1 else torch.cat(list(rows))).to(device=device, dtype=torch.int32)
    if capacity is not None:
        padded = torch.zeros(capacity, dtype=torch.int32, device=device)
        padded[: indices.numel()] = indices
        indices = padded
    return indptr, indices


def kernel_attention(k_buffer: torch.Tensor, v_buffer: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
                     scale: float) -> Attend:
    """The Triton prefix kernel over each request's slots ``indices[indptr[b]:indptr[b+1]]``: every
    query row of a KV head on each K/V tile, the prefix read once per level. Its launch shape depends
    only on the batch and the query rows, so a CUDA graph replays it with other slots."""
    from ..kernels.custom_ops import prefix_attention  # one node of a torch.compile'd step

    def attend(q: torch.Tensor) -> torch.Tensor:  # [B, T, H, D], token-major as the kernel reads it
        B, T, H, D = q.shape
        out, _ = prefix_attention(q.reshape(B * T, H, D).contiguous(), k_buffer, v_buffer, indptr, indices, scale)
        return out.view(B, T, H, D)

    return attend


class GraphedBeam:
    """A batch's step (``fn``: :func:`~sgl_longgen.kernels.longspec_step.expand_rings` over fixed-shape
    inputs: the steady ring feed and the beam) replayed as one CUDA graph per batch size: the eager
    step is some hundred small kernel launches and host work per level, its time set by launches,
    not by the context.

    A batch size's first replay is checked against the eager beam on the same inputs (the same
    kernels run, so the first output, :func:`~sgl_longgen.core.longspec_beam.beam_rows`'s tokens,
    parents, depths and flags, must agree exactly); a failed capture or a disagreement is logged
    once and the eager beam serves from then on. Lossless either way: the beam only proposes.

    A replay returns the graph's own outputs, which the next replay overwrites: the drafter
    queues their copy to the host before anything else can replay the graph.
    """

    def __init__(self, fn):
        from ..core.cuda_graph import GraphedFunction

        self.fn = fn
        self.graphed = GraphedFunction(fn, static_inputs=True)  # the drafter's input buffers, filled in place
        self.checked: set[int] = set()
        self.enabled = True

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not self.enabled:
            return self.fn(*args)
        bs = int(args[0].shape[0])
        try:
            out = self.graphed(*args)
        except Exception as exc:  # the eager beam still drafts
            logger.error("LONGSPEC: capturing the beam as a CUDA graph failed (%s: %s); drafting eagerly",
                         type(exc).__name__, exc, exc_info=exc)
            self.enabled = False
            return self.fn(*args)
        if bs not in self.checked:
            ref = self.fn(*args)
            if not torch.equal(out[0], ref[0]):
                logger.error("LONGSPEC: the beam's CUDA graph disagrees with the eager beam at batch size %d; "
                             "drafting eagerly", bs)
                self.enabled = False
                return ref
            self.checked.add(bs)
        return out


# -- the drafter ------------------------------------------------------------------------------------


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on ``device``: through pinned memory without waiting on a GPU (a pageable
    copy would block the host until the device is idle); as is elsewhere."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class LongSpecRequest:
    """One request's drafting: the method's state (its ring is the pool row the drafter keeps for
    its rid, taken at its first draft: ``window`` tokens, whatever its context)."""

    method: LongSpecState


@dataclass
class _Batch:
    rings: list[int]  # each request's row of the ring pool
    max_nodes: int  # each trie's cut (the root included)
    attend: Attend | None  # the eager beam's cross-attention
    # The graphed beam's cross-attention: each request's committed length (its slots are in a
    # buffer per batch size, kv_indptr travels with the step's input).
    lengths: list[int] | None = None


class LongSpecDrafter(Drafter):
    def __init__(self, env):
        self.env = env
        sa = env.server_args
        draft = inspect_longspec_draft_dir(sa.speculative_draft_model_path, sa.model_path)
        self.defaults = draft.defaults
        c = draft.defaults.longspec
        runner = env.runner
        compat.require_fields("model_config", runner.model_config)
        target = longspec_target(runner.model_config.hf_text_config)
        target["vocab_size"] = int(runner.model_config.vocab_size)
        check_target(draft.path, draft.checkpoint, target)
        model = runner.model
        if getattr(model.lm_head, "tp_size", 1) > 1:
            raise LonggenError("LONGSPEC runs with --tp-size 1 for now")
        self.dtype = next(model.parameters()).dtype
        self.drafter = load_drafter(draft.path, dtype=self.dtype).to(env.device)
        fp8 = c.weights == "fp8"
        if fp8:  # before fusing: the fused matrices are then the fp8 ones
            quantize_fp8(self.drafter)
        fuse_projections(self.drafter)
        self.rope = TargetRope(target_rotary(model, self.drafter.head_dim))
        reach = int(runner.model_config.context_len) + len(c.widths) + 1
        if self.rope.positions < reach:
            raise LonggenError(f"LONGSPEC: the target's RoPE table holds {self.rope.positions} positions, fewer than "
                               f"the context length plus the tree depth ({reach})")
        self.layer_id = last_attention_layer(model)
        self.embedding = model.get_input_embeddings()
        self.lm_head = model.lm_head
        # A reduced draft vocabulary: its head rows gathered once, here (SGLang pads the head's rows).
        self._head = draft_head(self.drafter, self.lm_head.weight[: env.vocab_size], self._full_head, fp8)
        self.widths = list(c.widths)
        # Trees are cut to what a verify forward holds (lossless: the cut only drops candidates).
        self.tree_size = min(c.tree_size, env.num_nodes - 1)
        if self.tree_size < 1:
            raise LonggenError(f"LONGSPEC needs speculative_num_draft_tokens >= 2, got {env.num_nodes}")
        self.method = LongSpec(c, self._expand, self.drafter.window)
        sampling = draft.defaults.sampling
        self.penalty = PenaltyDefaults(sampling.penalty, sampling.penalty_window)
        self._pool_checked = False
        self._batch: _Batch | None = None
        self._shadow: Shadow | None = None  # the step's shadow, until it is called
        self._last: tuple[DraftBeam, int] | None = None  # the last beam (a copy) and its max_nodes
        self.staging = Staging(env.device)  # the beam's read-back
        self.context_len = int(runner.model_config.context_len)
        d = self.drafter
        # Every request's window ring, one pool row each (kept from its first draft to its end).
        self.pool = RingPool(d.num_kv_heads, d.window, d.head_dim, self.dtype, env.device)
        self.rings: dict[str, int] = {}
        self.plan = BeamPlan.for_drafter(d, self.widths, self.tree_size, DEFAULT_FEED, self.dtype, env.device)
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # the pool's last-layer K/V
        self._slots: dict[int, torch.Tensor] = {}  # batch size -> the graphed beam's kv_indices
        self._step_in: dict[int, torch.Tensor] = {}  # batch size -> the graphed beam's input (step rows, kv_indptr)
        # On a GPU the step replays as CUDA graphs; its RoPE then reads a table of its own (a graph
        # keeps addresses: SGLang may recast its table, the copy never moves).
        self._graphed = None
        self._graph_version = self.pool.version
        self._compile = c.beam == "compiled"
        if env.device.type == "cuda":
            self.rope = FrozenRope(self.rope)
            self._graphed = self._graph_of_step()

    def can_draft_ahead(self, key: tuple) -> bool:
        # The graphed step exists for this batch size (and the pool it holds): no capture ahead.
        graphed = self._graphed
        return (graphed is None or not graphed.enabled
                or (self._graph_version == self.pool.version and len(key) in graphed.checked))

    # -- per request -----------------------------------------------------------------------------

    def start(self, step: StepRequest) -> LongSpecRequest:
        ring = self.rings.get(step.rid)
        if ring is not None:  # the request starts over (its state was dropped): so does its ring
            self.pool.pos[ring].fill_(-1)
        return LongSpecRequest(self.method.start(step.rid, step.history))

    def finish(self, rid: str) -> None:
        self.method.finish(rid)
        ring = self.rings.pop(rid, None)
        if ring is not None:
            self.pool.give(ring)

    def reset(self) -> None:
        self._last = None
        self.method.reset()
        self.rings.clear()  # every request's state is dropped with the cache: so are the rings
        self.pool.clear()

    def _ring(self, rid: str) -> int:
        ring = self.rings.get(rid)
        if ring is None:
            ring = self.rings[rid] = self.pool.take()
        return ring

    # -- the step --------------------------------------------------------------------------------

    @torch.no_grad()
    def draft(self, batch, steps: list[StepRequest], shadow: Shadow, max_nodes: int) -> list[Draft]:
        """The batch's beam launched, the worker's ``shadow`` (and a rehearsal of the tries) run on
        the host while it computes, then its one read-back and the tries."""
        drafts = [Draft.root_only(s.root) for s in steps]
        self._shadow = shadow
        try:
            index = [i for i, s in enumerate(steps) if s.blocker is None]
            if index:
                active = [steps[i] for i in index]
                self._batch = self._inputs(batch, active, max_nodes)
                proposed = self.method.propose([s.rid for s in active], [s.state.method.method for s in active],
                                               [s.history for s in active], max_nodes)
                for i, draft in zip(index, proposed):
                    drafts[i] = draft
                clock = self.env.clock
                clock.section("draft_tree")
                if clock.active:  # what the drafter holds per request, next to the context it read
                    clock.note("longspec_ring_bytes", float(self.pool.ring_nbytes))
                    clock.note("longspec_ring_tokens", float(max(self.pool.held(r) for r in self._batch.rings)))
                    clock.note("longspec_cross_tokens", float(max(s.seq_len for s in active)))
        finally:
            self._batch = None
            self._in_shadow()  # where nothing drafted, or the beam raised before its shadow
        return drafts

    def _in_shadow(self) -> None:
        """While the beam computes: the worker's verify inputs that the tries do not change, then
        the tries built once more from the last beam and dropped. From the beam's read-back to the
        verify's launch the GPU waits for the tries' Python, which runs several times faster warm
        than cold (after SGLang's scheduler has been through its own data); here the host waits
        for the beam anyway."""
        shadow, self._shadow = self._shadow, None
        if shadow is None:
            return
        shadow()
        last = self._last
        if last is not None:
            beam, max_nodes = last
            for b in range(beam.tokens.shape[0]):
                beam_tree(beam, 0, b, max_nodes)

    def _inputs(self, batch, active: list[StepRequest], max_nodes: int) -> _Batch:
        pool = self.env.runner.token_to_kv_pool
        if not self._pool_checked:
            compat.require_fields("kv_pool", pool)
            if pool.dtype != self.dtype:
                raise LonggenError(f"LONGSPEC reads the target's KV cache in the model's dtype ({self.dtype}); "
                                   f"the pool holds {pool.dtype}")
            self._pool_checked = True
        table = batch.req_to_token_pool.req_to_token
        rows = []
        for s in active:
            if s.seq_len != len(s.history) - 1:
                raise RuntimeError(f"request {s.rid}: {s.seq_len} tokens in the KV cache but {len(s.history) - 1} "
                                   "committed before the root")
            rows.append(table[s.req.req_pool_idx, : s.seq_len])  # committed slots only: never the verify window
        k_buffer, v_buffer = pool.get_kv_buffer(self.layer_id)
        kernel = self.env.device.type == "cuda" and k_buffer.dtype in KERNEL_DTYPES
        rings = [self._ring(s.rid) for s in active]
        if kernel and self._graph() is not None:
            self._buffers = (k_buffer, v_buffer)
            return _Batch(rings, max_nodes, None, self._graph_slots(rows))
        attend = committed_attention(k_buffer, v_buffer, rows, self.drafter.cross_attn.scale, kernel)
        return _Batch(rings, max_nodes, attend)

    def _graph(self) -> GraphedBeam | None:
        """The graphed step, captured again after the ring pool grew (its graphs hold the old
        tensors); None where the eager step serves."""
        if self._graphed is None or not self._graphed.enabled:
            return None
        if self._graph_version != self.pool.version:
            self._graphed = self._graph_of_step()
            self._graph_version = self.pool.version
        return self._graphed

    def _graph_slots(self, rows: list[torch.Tensor]) -> list[int]:
        """The batch's committed slots into its batch size's kv_indices buffer (a fixed address a
        graph reads; one copy on the device); returns their lengths."""
        B = len(rows)
        buf = self._slots.get(B)
        if buf is None:
            buf = self._slots[B] = torch.zeros(B * self.context_len, dtype=torch.int32, device=self.env.device)
        total = sum(r.numel() for r in rows)
        if len(rows) == 1:
            buf[:total].copy_(rows[0])
        else:
            torch.cat([r.to(torch.int32) for r in rows], out=buf[:total])
        return [r.numel() for r in rows]

    def _expand(self, rids, pending, starts):
        """Long feeds join their rings eagerly (a request's first draft), then one step for the
        batch: the graphed one on a GPU (the steady feed and the beam), else eager over ``attend``;
        its rows queued to the host, the shadow run, then the beam as host tensors."""
        b = self._batch
        dev = self.env.device
        clock = self.env.clock
        pre, step = self.plan.pack(pending, starts, b.rings, self.pool.scratch)
        if pre is not None:
            feed_rings(self.drafter, self.embedding, self.rope, self.pool, to_device(pre, dev), self.plan)
        if b.lengths is None:
            clock.gpu_mark("draft_gpu")
            rows = expand_rings(self.drafter, self.embedding, self._head, self.rope,
                                (self.pool.k, self.pool.v, self.pool.pos), to_device(step, dev), b.attend, self.plan)
        else:
            step_in, indptr = self._graph_input(step, b.lengths)
            clock.gpu_mark("draft_gpu")
            rows = self._graphed(step_in, indptr)
        clock.gpu_mark("draft_gpu")
        host = [self.staging(name, t.numel(), t.dtype).view(t.shape).copy_(t, non_blocking=True)
                for name, t in zip(("beam_ints", "beam_scores"), rows)]
        done = None
        if dev.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        clock.section("draft_launch")
        self._in_shadow()
        clock.section("draft_shadow")
        if done is not None:
            done.synchronize()
        clock.section("draft_wait")
        beam, broken = beam_of_rows(*host)
        if bool(broken.any()):
            raise AssertionError("the cut tree is not closed under ancestors")
        # the staging buffers take the next beam while the next shadow rehearses this one
        self._last = (beam_of_rows(host[0].clone(), host[1].clone())[0], b.max_nodes)
        return beam

    def _graph_input(self, step: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's rows and kv_indptr (int64) in the batch size's input buffer, the graph's own
        input: written into one page-locked buffer and copied over once (no copies at the replay)."""
        B, C = step.shape
        buf = self._step_in.get(B)
        if buf is None:
            buf = self._step_in[B] = torch.zeros(B * C + B + 1, dtype=torch.long, device=self.env.device)
        host = self.staging("step_in", buf.numel(), torch.long)
        ints = host.numpy()
        ints[: B * C] = step.numpy().reshape(-1)
        ints[B * C :] = list(itertools.accumulate(lengths, initial=0))
        buf.copy_(host, non_blocking=True)
        return buf[: B * C].view(B, C), buf[B * C :]

    def _graph_of_step(self) -> GraphedBeam:
        """The step's graphs; ``beam = "compiled"``: of the step ``torch.compile``d, traced during
        the first capture's warm-up runs of each batch size, its kernels single nodes of the
        trace (:mod:`sgl_longgen.kernels.custom_ops`)."""
        return GraphedBeam(torch.compile(self._beam, dynamic=False) if self._compile else self._beam)

    def _beam(self, step, kv_indptr):
        """The graphed step's body: fixed shapes for a batch size; the ring pool, the batch size's
        kv_indices and the pool's last-layer K/V read (and the rings written) in place."""
        k_buffer, v_buffer = self._buffers
        attend = kernel_attention(k_buffer, v_buffer, kv_indptr.to(torch.int32), self._slots[step.shape[0]],
                                  self.drafter.cross_attn.scale)
        return expand_rings(self.drafter, self.embedding, self._head, self.rope,
                            (self.pool.k, self.pool.v, self.pool.pos), step, attend, self.plan)

    def _full_head(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.lm_head.weight[: self.env.vocab_size])  # SGLang pads the head's rows

    def observe(self, steps: list[StepRequest], drafts, verdicts) -> None:
        for step, verdict in zip(steps, verdicts):
            if isinstance(step.state.method, LongSpecRequest):
                self.method.observe(step.state.method.method, len(step.history))
