"""LongSpec's beam for a batch of requests as an engine runs it: one graphable step on the device's kernels.

:func:`expand_batch` is the beam of :mod:`sgl_longgen.core.longspec_beam` for a batch of requests
(an engine's step: one block forward per level for all of them), the cross-attention handed in by
the engine, which reads the target's K/V where its cache keeps them; row b is what
:func:`~sgl_longgen.core.longspec_beam.expand` builds for request b. There the rings are rows of
one :class:`RingPool`, the step's host input is one packed int64 row per request
(:class:`BeamPlan`, which also holds every tensor that depends only on the beam's shape), and
:func:`expand_rings` feeds the step's few new tokens into the rings and runs the beam with fixed
shapes and no host reads, so an engine replays the whole step as one CUDA graph; only a longer
feed (a request's first draft) goes through :func:`feed_rings` before it.

On a GPU the step's window attention, its selections and its fp8 matrices run this package's
kernels (``masked_attention.py``, ``longspec_topk.py``, the fp8 GEMM of :mod:`.fp8_linear`; single
nodes of a ``torch.compile``'d step through :mod:`.custom_ops`); elsewhere their PyTorch twins
serve, the core's among them. The SGLang worker's drafter (:mod:`sgl_longgen.sglang.longspec`)
runs it; the reference runtime drafts one request at a time with the eager beam.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..core.fp8 import Fp8Linear, linear
from ..core.longspec import LongSpecDrafter
from ..core.longspec_beam import DEFAULT_WIDTHS, beam_of_rows, beam_rows, best_of_rows, select_nodes_batched
from ..core.longspec_weights import fused_matrices
from ..core.nn import RMSNorm
from ..core.owl import DraftBeam
from . import fp8_linear  # noqa: F401 (installs the fp8 GEMM of the device: the step's fp8 matrices take it)

# positions [...] -> (cos, sin) [..., head_dim]: the target's RoPE at those positions
Rope = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# q [B, T, H, D] (RoPE applied) -> [B, T, H, D]: each request's queries over its committed target K/V
Attend = Callable[[torch.Tensor], torch.Tensor]

# Tokens per request the fixed-shape step feeds its ring (the root and what the last verify
# committed: at most the tree depth plus one); a longer feed (a request's first draft) first
# goes through :func:`feed_rings`.
DEFAULT_FEED = 8


def _window_visible(ring_pos: torch.Tensor, query_pos: torch.Tensor, window: int) -> torch.Tensor:
    """:meth:`~sgl_longgen.core.longspec_beam.WindowCache.visible` of stacked rings: ``ring_pos [B, W]``,
    ``query_pos [B, T]`` -> ``[B, T, W]``."""
    p, q = ring_pos[:, None, :], query_pos[:, :, None]
    return (p >= 0) & (p <= q) & (p > q - window)


class RingPool:
    """The window rings of an engine's drafting requests: one row of a shared tensor each.

    A request takes a row at its first draft and gives it back when it leaves, so its memory is
    still one ring of ``window`` tokens (position p in slot p % window), whatever its context.
    One tensor for every ring lets the step write the feed and read the batch's rings at fixed
    addresses (inside a CUDA graph, through row indices the host passes in) instead of stacking
    per-request rings and copying them into a graph's inputs each step. The last row is scratch:
    a feed's padding entries are written there, and no request reads it. A full pool doubles;
    ``version`` then changes, and a graph that captured the old tensors must be captured again.
    """

    def __init__(self, kv_heads: int, window: int, head_dim: int, dtype: torch.dtype, device, capacity: int = 8):
        if capacity < 1:
            raise ValueError("a ring pool holds at least one ring")
        self.window = window
        self.version = 0
        self.k = torch.zeros(capacity + 1, kv_heads, window, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.pos = torch.full((capacity + 1, window), -1, dtype=torch.long, device=device)  # -1: empty slot
        self.free = list(range(capacity - 1, -1, -1))  # pop() hands out the lowest row first

    @property
    def capacity(self) -> int:
        return self.k.shape[0] - 1

    @property
    def scratch(self) -> int:
        """The row padding entries write to (never a request's)."""
        return self.capacity

    @property
    def ring_nbytes(self) -> int:
        """One request's share: its K/V ring and the ring's positions."""
        return 2 * self.k[0].numel() * self.k.element_size() + self.pos[0].numel() * self.pos.element_size()

    def take(self) -> int:
        """An empty ring for a new request (the pool grows when none is free)."""
        if not self.free:
            self._grow()
        row = self.free.pop()
        self.pos[row].fill_(-1)
        return row

    def give(self, row: int) -> None:
        self.free.append(row)

    def clear(self) -> None:
        """Every ring free and empty (the engine dropped all its requests)."""
        self.pos.fill_(-1)
        self.free = list(range(self.capacity - 1, -1, -1))

    def held(self, row: int) -> int:
        """Positions ring ``row`` holds (a host read)."""
        return int((self.pos[row] >= 0).sum())

    def _grow(self) -> None:
        old = self.capacity
        k = self.k.new_zeros(2 * old + 1, *self.k.shape[1:])
        v = torch.zeros_like(k)
        pos = self.pos.new_full((2 * old + 1, self.window), -1)
        k[:old], v[:old], pos[:old] = self.k[:old], self.v[:old], self.pos[:old]
        self.k, self.v, self.pos = k, v, pos
        self.free.extend(range(2 * old - 1, old - 1, -1))
        self.version += 1


def _feed_row(tokens: Sequence[int], start: int, ring: int, width: int, scratch: int, window: int) -> list[int]:
    """One request's feed, right-aligned in ``width`` entries: token ids, the ring row and slot
    each K/V goes to, the position the slot records, the position its RoPE is taken at. Padding
    (in front) repeats the last token and position and is written to the scratch ring."""
    n, pad = len(tokens), width - len(tokens)
    positions = list(range(start, start + n))
    last_token, last_pos = (tokens[-1], positions[-1]) if n else (0, 0)
    return ([last_token] * pad + list(tokens) + [scratch] * pad + [ring] * n
            + [0] * pad + [p % window for p in positions] + [-1] * pad + positions + [last_pos] * pad + positions)


class BeamPlan:
    """What a batch's beam needs that follows from its widths, the draft vocabulary, the window,
    the feed width and the drafter's shapes alone: built once on the beam's device and read by
    every step (a CUDA graph captures it at fixed addresses) instead of rebuilt per level. The
    batch size enters by broadcasting only, so one plan serves every batch size.

    ``widths``: the levels' widths clamped to what the vocabulary allows (``w1 <= V``,
    ``wi <= w(i-1) * V``). Pool order: level 1's nodes, then level 2's, ...; ``offsets[i]``: the
    first node of level i + 1. Only levels 1 .. D-1 are forwarded (their rows draft the next
    level), so the tree's own K/V columns and the ancestor matrix cover those ``forwarded`` nodes.

    The step's input is one int64 row per request (:meth:`pack`, one host-to-device copy): its
    feed (``feed`` entries of token, ring row, slot, recorded position, RoPE position), the RoPE
    positions of the tree levels, and its ring row.
    """

    def __init__(self, widths: Sequence[int], tree_size: int, vocab: int, window: int, feed: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device, fused_topk: bool = True, fused_window: bool = True):
        if not widths or min(widths) < 1:
            raise ValueError(f"beam widths must be positive, got {list(widths)}")
        w = [min(widths[0], vocab)]
        for x in widths[1:]:
            w.append(min(x, w[-1] * vocab))
        self.widths, self.depth = tuple(w), len(w)
        self.tree_size, self.vocab, self.window = tree_size, vocab, window
        self.fused_topk = fused_topk  # on a GPU, each row's top-k through the Triton kernel
        self.fused_window = fused_window  # on a GPU, a level's rows join the window buffers inside its attention
        self.feed = max(1, min(feed, window))  # two positions of one ring slot never share a feed
        self.offsets = tuple(itertools.accumulate(w, initial=0))
        self.forwarded = P = self.offsets[-1] - w[-1]
        self.depths = torch.cat([torch.full((x,), level, dtype=torch.long) for level, x in enumerate(w, 1)]).to(device)
        self.first_parents = torch.full((w[0],), -1, dtype=torch.long, device=device)
        # ancestors (or self) of each forwarded node among the forwarded nodes: level 1's rows are
        # theirs alone; a later level's rows are their parents' plus their own column
        anc = torch.zeros(P, P, dtype=torch.bool)
        if P:
            anc[: w[0], : w[0]] = torch.eye(w[0], dtype=torch.bool)
        self.ancestors0 = anc.to(device)
        self.own = {level: torch.eye(P, dtype=torch.bool)[self.offsets[level - 1] : self.offsets[level]].to(device)
                    for level in range(2, self.depth)}
        # tree nodes within the window of level l's queries (all of them unless the window is
        # shallower than the tree): None where nothing is out of reach
        depth = self.depths[:P].cpu()
        near = {level: (level - 1 - depth) < window for level in range(2, self.depth + 1)}
        self.near = {level: None if bool(m.all()) else m.to(device) for level, m in near.items()}
        self.tree_pad = torch.zeros(1, kv_heads, P, head_dim, dtype=dtype, device=device)
        half = head_dim // 2
        sign = torch.cat([-torch.ones(half, dtype=torch.float64), torch.ones(head_dim - half, dtype=torch.float64)])
        self.sign = {t: sign.to(device=device, dtype=t)
                     for t in (torch.float64, torch.float32, torch.bfloat16, torch.float16)}

    @classmethod
    def for_drafter(cls, drafter: LongSpecDrafter, widths: Sequence[int], tree_size: int, feed: int,
                    dtype: torch.dtype, device, fused_topk: bool = True, fused_window: bool = True) -> BeamPlan:
        return cls(widths, tree_size, drafter.draft_vocab_size, drafter.window, feed, drafter.num_kv_heads,
                   drafter.head_dim, dtype, device, fused_topk, fused_window)

    @property
    def columns(self) -> int:
        """Int64 entries of one request's :meth:`pack` row."""
        return 5 * self.feed + self.depth

    def pack(self, pending: Sequence[Sequence[int]], starts: Sequence[int], rings: Sequence[int], scratch: int
             ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Host lists -> ``(pre, step)`` CPU int64 tensors: ``step`` ``[B, columns]`` the step's
        input (the last ``feed`` tokens of each request's feed, the root last); ``pre``
        ``[B, 5 * F']`` the earlier tokens of feeds longer than that (a request's first draft),
        for :func:`feed_rings`, or None. Only a feed's last ``window`` tokens can matter."""
        if not rings or len(rings) != len(pending) or len(pending) != len(starts):
            raise ValueError("one ring, one pending list and one start per request")
        if any(not p for p in pending):
            raise ValueError("the drafter needs at least the root token")
        W, Fw = self.window, self.feed
        feeds = [list(p)[-W:] for p in pending]
        firsts = [s + len(p) - len(f) for s, p, f in zip(starts, pending, feeds)]
        heads = [f[:-Fw] for f in feeds]
        pre = None
        width = max(len(h) for h in heads)
        if width:
            pre = torch.tensor([_feed_row(h, s, r, width, scratch, W) for h, s, r in zip(heads, firsts, rings)],
                               dtype=torch.long)
        rows = []
        for f, s, h, r in zip(feeds, firsts, heads, rings):
            last = s + len(f) - 1  # L: the root's position, the request's committed length
            rows.append(_feed_row(f[len(h):], s + len(h), r, Fw, scratch, W)
                        + [last + i for i in range(1, self.depth)] + [r])
        return pre, torch.tensor(rows, dtype=torch.long)

    def ancestors(self, batch: int) -> torch.Tensor:
        """The step's ``[B, P, P]`` ancestor matrix, level 1's rows filled (writable where later
        levels add rows)."""
        anc = self.ancestors0.expand(batch, -1, -1)
        return anc.clone() if self.depth > 2 else anc

    def tree_mask(self, ancestors: torch.Tensor, level: int) -> torch.Tensor:
        """``[B, n, lo + n]``: which forwarded nodes (those made so far) the frontier of ``level``
        (level - 1's nodes ``lo .. lo + n``) sees: its ancestors and itself, inside the window."""
        lo, n = self.offsets[level - 2], self.widths[level - 2]
        mask = ancestors[:, lo : lo + n, : lo + n]
        near = self.near[level]
        return mask if near is None else mask & near[: lo + n]

    def add_ancestors(self, ancestors: torch.Tensor, parents: torch.Tensor, level: int) -> None:
        """Level ``level``'s rows of the ancestor matrix: each node's parent's row and its own column."""
        lo, n = self.offsets[level - 1], self.widths[level - 1]
        rows = ancestors.gather(1, parents[:, :, None].expand(-1, -1, ancestors.shape[2]))
        ancestors[:, lo : lo + n] = rows | self.own[level]

    def rope_rows(self, rope: Rope, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin ``[..., 1, head_dim]`` (broadcast over heads) in ``dtype`` (see :func:`_rope`)."""
        cos, sin = rope(positions)
        return cos.to(dtype).unsqueeze(-2), (sin * self.sign[sin.dtype]).to(dtype).unsqueeze(-2)


# -- the step's block, functional: fused projections, fused norms, token-major rows [B, T, ...]


def _project(x: torch.Tensor, whole: torch.Tensor | Fp8Linear | None, layers: Sequence[nn.Module]) -> torch.Tensor:
    if whole is not None:
        return linear(x, whole)
    return torch.cat([lin(x) for lin in layers], dim=-1)


def _norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """:class:`RMSNorm` as one fused op on a GPU (statistics in float32; the scale is applied
    before the cast back rather than after, a rounding apart)."""
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """:func:`~sgl_longgen.core.longspec_rope.apply_rope` for token-major ``x`` ``[..., heads, D]``, with
    ``sin_signed`` = sin with its first half negated: ``rotate_half(x) * sin`` = (the halves of ``x``
    swapped) * ``sin_signed``, bit for bit, one flip where ``rotate_half`` took a negation and a
    concatenation."""
    swapped = x.unflatten(-1, (2, x.shape[-1] // 2)).flip(-2).flatten(-2)
    return x * cos + swapped * sin_signed


def _rotated_qkv(drafter: LongSpecDrafter, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The self-attention's queries and keys (RoPE'd together: ``[B, T, H + Hkv, D]``, queries
    first) and values ``[B, T, Hkv, D]`` of embeddings ``x`` ``[B, T, d]``."""
    a = drafter.self_attn
    fused = fused_matrices(drafter)
    qkv = _project(_norm(drafter.input_layernorm, x), fused and fused[0], (a.q_proj, a.k_proj, a.v_proj))
    split = (a.heads + a.kv_heads) * a.head_dim
    qk = qkv[..., :split].unflatten(-1, (a.heads + a.kv_heads, a.head_dim))
    return _rope(qk, cos, sin_signed), qkv[..., split:].unflatten(-1, (a.kv_heads, a.head_dim))


def _on_kernels(x: torch.Tensor) -> bool:
    """Whether the step's Triton kernels take ``x``: on a GPU, and not in float64 (the CPU oracle's
    precision, which the kernels' twins serve)."""
    return x.is_cuda and x.dtype != torch.float64


def _self_attend(drafter: LongSpecDrafter, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
    """Rows ``q`` ``[B, T, H, D]`` over ``keys``/``values`` ``[B, Hkv, S, D]`` where ``mask``
    ``[B, T, S]`` allows; ``[B, T, H * D]``. On a GPU one Triton launch that reads the mask as it
    is (``kernels/masked_attention.py``); elsewhere SDPA, its twin."""
    if _on_kernels(q):
        from .custom_ops import masked_attention  # one node of a torch.compile'd step

        return masked_attention(q, keys, values, mask, drafter.self_attn.scale)
    from .masked_attention import masked_attention_reference

    return masked_attention_reference(q, keys, values, mask, drafter.self_attn.scale)


def _self_attend_into(drafter: LongSpecDrafter, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      new_k: torch.Tensor, new_v: torch.Tensor, at: int, ring_mask: torch.Tensor,
                      tree_mask: torch.Tensor, plan: BeamPlan) -> torch.Tensor:
    """A level's rows ``q`` ``[B, n, H, D]`` join the buffers (their K/V ``new_k``/``new_v``
    ``[B, n, Hkv, D]`` written at columns ``at .. at + n``) and attend over columns ``0 .. at + n``
    under the ring's ``[B, W]`` and the tree's ``[B, n, at + n - W]`` masks; ``[B, n, H * D]``. On a
    GPU (unless the plan says otherwise, or the level is wider than the kernel's one tile of new
    rows) one Triton launch that writes the buffers in place (``kernels/masked_attention.py``);
    elsewhere the writes, the masks concatenated and :func:`_self_attend`."""
    from .masked_attention import MAX_NEW_ROWS, join_rows

    if plan.fused_window and _on_kernels(q) and q.shape[1] <= MAX_NEW_ROWS:
        from .custom_ops import masked_attention_into  # one node of a torch.compile'd step

        return masked_attention_into(q, keys, values, new_k, new_v, at, ring_mask, tree_mask,
                                     drafter.self_attn.scale)

    mask = join_rows(keys, values, new_k, new_v, at, ring_mask, tree_mask)
    n = q.shape[1]
    return _self_attend(drafter, q, keys[:, :, : at + n], values[:, :, : at + n], mask)


def _block_tail(drafter: LongSpecDrafter, x: torch.Tensor, a: torch.Tensor, cos: torch.Tensor,
                sin_signed: torch.Tensor, attend: Attend) -> torch.Tensor:
    """The block past its self-attention (``x``: the rows' embeddings, ``a``: their self-attention
    ``[B, T, H * D]``): the normed states the head reads."""
    h = x + drafter.self_attn.o_proj(a)
    c = drafter.cross_attn
    q = c.q_proj(_norm(drafter.post_self_attention_layernorm, h)).unflatten(-1, (c.heads, c.head_dim))
    h = h + c.o_proj(attend(_rope(q, cos, sin_signed)).flatten(-2))
    m = drafter.mlp
    fused = fused_matrices(drafter)
    gate, up = _project(_norm(drafter.post_cross_attention_layernorm, h), fused and fused[1],
                        (m.gate_proj, m.up_proj)).chunk(2, dim=-1)
    h = h + m.down_proj(F.silu(gate) * up)
    return _norm(drafter.norm, h)


def _row_top(head: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, k: int, plan: BeamPlan
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``k`` best next tokens: their log-probabilities (float32; float64 for a float64
    drafter) and draft ids. On a GPU one Triton pass over the logits (``kernels/longspec_topk.py``:
    the log-sum-exp and the top ``k`` per row, ties lowest id first) instead of a vocabulary-wide
    log-softmax and ``torch.topk``'s multi-block radix select; elsewhere those two."""
    logits = head(h)
    if logits.shape[-1] != plan.vocab:
        raise ValueError(f"the beam was planned for {plan.vocab} draft tokens but the head gave {logits.shape[-1]} "
                         "logits: pass draft_head(drafter, ...)")
    if _topk_kernels(plan, logits, k):
        from .custom_ops import log_softmax_topk  # one node of a torch.compile'd step

        return log_softmax_topk(logits, k)
    logp = F.log_softmax(logits, dim=-1, dtype=torch.float64 if h.dtype == torch.float64 else torch.float32)
    return logp.topk(k, dim=-1)


def _best_of_level(parent_scores: torch.Tensor, top: torch.Tensor, ids: torch.Tensor, width: int, plan: BeamPlan
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`best_of_rows`; on a GPU one Triton launch (``kernels/longspec_topk.py``) where
    ``torch.topk`` of the level's few hundred candidates is a sort and a gather (the plan's widths
    leave every level at least ``width`` candidates)."""
    if _topk_kernels(plan, top, width):
        from .custom_ops import best_of_rows as best_of_rows_kernel

        return best_of_rows_kernel(parent_scores, top, ids, width)
    return best_of_rows(parent_scores, top, ids, width)


def _topk_kernels(plan: BeamPlan, x: torch.Tensor, k: int) -> bool:
    """Whether a level's selections of ``k`` from ``x`` run the Triton kernels: on a GPU, unless the
    plan says otherwise, for a float32/bf16 beam (a float64 one is the CPU oracle's precision) and
    ``k`` within their unrolled selections."""
    if not (plan.fused_topk and _on_kernels(x)):
        return False
    from .longspec_topk import MAX_K

    return k <= MAX_K


def _store(pool: tuple[torch.Tensor, torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor,
           rows: torch.Tensor) -> None:
    """Fed K/V ``[B, T, Hkv, D]`` into their rings; ``rows`` ``[B, 3T]``: ring row, slot, recorded position."""
    pool_k, pool_v, pool_pos = pool
    ring, slot, pos = rows.chunk(3, dim=1)
    pool_k[ring, :, slot] = k
    pool_v[ring, :, slot] = v
    pool_pos[ring, slot] = pos


@torch.no_grad()
def feed_rings(drafter: LongSpecDrafter, embed: Callable[[torch.Tensor], torch.Tensor], rope: Rope,
               pool: RingPool, pre: torch.Tensor, plan: BeamPlan) -> None:
    """The eager part of a long feed (``pre`` from :meth:`BeamPlan.pack`, on the pool's device):
    those tokens' window K/V into their rings, one projection for the batch. A steady step never
    needs it (its few tokens are fed inside :func:`expand_rings`)."""
    Fw = pre.shape[1] // 5
    dt = pool.k.dtype
    cos, sin = plan.rope_rows(rope, pre[:, 4 * Fw :], dt)
    qk, v = _rotated_qkv(drafter, embed(pre[:, :Fw]).to(dt), cos, sin)
    _store((pool.k, pool.v, pool.pos), qk[:, :, drafter.num_heads :], v, pre[:, Fw : 4 * Fw])


@torch.no_grad()
def expand_batch(drafter: LongSpecDrafter, embed: Callable[[torch.Tensor], torch.Tensor],
                 head: Callable[[torch.Tensor], torch.Tensor], rope: Rope, pool: RingPool, rings: Sequence[int],
                 attend: Attend, pending: Sequence[Sequence[int]], starts: Sequence[int],
                 widths: Sequence[int] = DEFAULT_WIDTHS, tree_size: int = 63, feed: int = DEFAULT_FEED,
                 plan: BeamPlan | None = None) -> DraftBeam:
    """:func:`~sgl_longgen.core.longspec_beam.expand` for a batch of requests, one drafter forward per
    level for all of them.

    Every request's beam has the same shape (the same widths, the same vocabulary), so a level is
    one ``[B, n]`` forward: its self-attention keys are each request's ring, its earlier tree nodes
    and its own rows (masks per request), its cross-attention is ``attend`` (each request's
    queries over the target's K/V of its committed positions ``[0, L_b)``, read however the
    engine keeps them). ``rope``: the target's cos/sin at given positions. ``rings[b]``: request
    b's row of ``pool``; ``pending[b]``, ``starts[b]``: as ``pending``, ``start`` of
    :func:`~sgl_longgen.core.longspec_beam.expand`. Returns ``[B, N]`` tensors, row b the tree
    :func:`~sgl_longgen.core.longspec_beam.expand` builds for request b.

    Three parts: :meth:`BeamPlan.pack` (host lists -> one int64 row per request),
    :func:`feed_rings` (only for feeds longer than ``feed`` tokens) and :func:`expand_rings` (the
    last ``feed`` tokens join their rings, then the beam: fixed shapes, no value read back, so an
    engine replays it as a CUDA graph).
    """
    if plan is None:
        plan = BeamPlan.for_drafter(drafter, widths, tree_size, feed, pool.k.dtype, pool.k.device)
    pre, step = plan.pack(pending, starts, rings, pool.scratch)
    if pre is not None:
        feed_rings(drafter, embed, rope, pool, pre.to(pool.k.device), plan)
    beam, broken = beam_of_rows(*expand_rings(drafter, embed, head, rope, (pool.k, pool.v, pool.pos),
                                              step.to(pool.k.device), attend, plan))
    if bool(broken.any()):
        raise AssertionError("the cut tree is not closed under ancestors")
    return beam


@torch.no_grad()
def expand_rings(drafter: LongSpecDrafter, embed: Callable[[torch.Tensor], torch.Tensor],
                 head: Callable[[torch.Tensor], torch.Tensor], rope: Rope,
                 pool: tuple[torch.Tensor, torch.Tensor, torch.Tensor], step: torch.Tensor, attend: Attend,
                 plan: BeamPlan) -> tuple[DraftBeam, torch.Tensor]:
    """A batch's step from its :meth:`BeamPlan.pack` rows ``step`` ``[B, columns]``: the last
    ``feed`` tokens of each request join its ring (``pool``: a :class:`RingPool`'s ``k``, ``v``,
    ``pos``, written in place), then the beam. Every shape follows from ``B`` and the plan and
    nothing is read back to the host: one CUDA graph per batch size can replay it. Returns the
    ``[B, N]`` beam as the two tensors the host reads (:func:`beam_rows`: its int64 fields and a
    flag of rows whose cut was not closed under ancestors, never set, checked by the caller once
    the beam is on the host anyway; the scores).

    The root is the feed's last token: its queries come from the feed's own projection and its
    keys are its ring, where the feed just wrote its K/V. Each later level writes its rows' K/V
    after the ring in one ``[B, Hkv, W + forwarded, D]`` buffer and attends over the columns
    written so far, masked by the window (ring) and the ancestor matrix (tree).
    """
    B, dt = step.shape[0], pool[0].dtype
    Fw, D, W, H = plan.feed, plan.depth, plan.window, drafter.num_heads
    tokens, writes = step[:, :Fw], step[:, Fw : 4 * Fw]
    positions = step[:, 4 * Fw : 5 * Fw + D - 1]  # the feed's, then levels 2 .. D's (L + 1 ..)
    ring = step[:, -1]
    cos, sin = plan.rope_rows(rope, positions, dt)  # [B, F + D - 1, 1, hd]
    x = embed(tokens).to(dt)
    qk, v = _rotated_qkv(drafter, x, cos[:, :Fw], sin[:, :Fw])
    _store(pool, qk[:, :, H:], v, writes)

    keys, values, ring_pos = pool[0][ring], pool[1][ring], pool[2][ring]  # [B, Hkv, W, D], [B, W]
    if plan.forwarded:
        pad = plan.tree_pad.expand(B, -1, -1, -1)
        keys, values = torch.cat([keys, pad], dim=2), torch.cat([values, pad], dim=2)
    visible = _window_visible(ring_pos, positions[:, Fw - 1 :], W)  # [B, D, W]: query positions L .. L + D - 1

    # The root (position L): its window is its ring.
    root = slice(Fw - 1, Fw)
    a = _self_attend(drafter, qk[:, root, :H], keys[:, :, :W], values[:, :, :W], visible[:, :1])
    h = _block_tail(drafter, x[:, root], a, cos[:, root], sin[:, root], attend)
    score, pick = (t[:, 0] for t in _row_top(head, h, plan.widths[0], plan))
    levels = [(score, drafter.to_target(pick), plan.first_parents.expand(B, -1))]
    ancestors = plan.ancestors(B)
    for level in range(2, D + 1):
        lo, n = plan.offsets[level - 2], plan.widths[level - 2]  # the frontier: level - 1's nodes
        at = slice(Fw + level - 2, Fw + level - 1)  # its position, L + level - 1
        x = embed(levels[-1][1]).to(dt)
        qk, v = _rotated_qkv(drafter, x, cos[:, at], sin[:, at])
        a = _self_attend_into(drafter, qk[:, :, :H], keys, values, qk[:, :, H:], v, W + lo, visible[:, level - 1],
                              plan.tree_mask(ancestors, level), plan)
        h = _block_tail(drafter, x, a, cos[:, at], sin[:, at], attend)
        width = plan.widths[level - 1]
        score, pick, row = _best_of_level(levels[-1][0], *_row_top(head, h, min(width, plan.vocab), plan), width, plan)
        parent = row + lo
        if level < D:
            plan.add_ancestors(ancestors, parent, level)
        levels.append((score, drafter.to_target(pick), parent))
    scores, tokens, parents = (torch.cat([lv[i] for lv in levels], dim=1) for i in range(3))
    return _cut_rows(scores, tokens, parents, plan)


def _cut_rows(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, plan: BeamPlan
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`beam_rows` of :func:`select_nodes_batched`; on a GPU (unless the plan's selections run
    in PyTorch) one Triton launch (``kernels/longspec_topk.py``, ``cut_beam``) where the two sorts,
    the scatter, the gathers and the concatenation took eight."""
    if plan.fused_topk and _on_kernels(scores):
        from .longspec_topk import MAX_CUT_NODES

        if scores.shape[1] <= MAX_CUT_NODES:
            from .custom_ops import cut_beam

            return cut_beam(scores, tokens, parents, plan.depths, plan.tree_size)
    return beam_rows(*select_nodes_batched(scores, tokens, parents, plan.depths, plan.tree_size))
