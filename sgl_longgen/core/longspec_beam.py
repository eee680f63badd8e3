"""LongSpec's beam tree: one request's draft over its window ring, and the cut of a batch's pools.

**The beam tree** (:func:`expand`): per-level widths ``[w1, .., wD]`` (LongSpec's
``[4, 16, 16, 16, 16]``); level 1 is the root's top ``w1`` tokens, level i the ``wi`` best
(parent, token) pairs over *all* children of level i - 1 by cumulative log-probability. The pool
is then cut to the ``tree_size`` best nodes (closed under ancestors: a parent scores at least as
much as its child and wins ties by coming first). Which nodes are drafted never changes the
output: every committed token is drawn by the shared per-node walk (:mod:`.verify`).

The same beam for a batch of requests, an engine's step, is
:func:`sgl_longgen.kernels.longspec_step.expand_batch`; its engine-agnostic parts are here: the
cut of a batch's pools (:func:`select_nodes_batched`), the two tensors a host reads a batch's beam
from (:func:`beam_rows`, :func:`beam_of_rows`) and a level's best children from each row's top
(:func:`best_of_rows`), the PyTorch twins of the step's kernels (``kernels/longspec_topk.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .longspec import LongSpecDrafter
from .longspec_rope import rope_tables
from .owl import DraftBeam
from .tree import DraftTree, Source, add_beam

DEFAULT_WIDTHS = (4, 16, 16, 16, 16)


# ----------------------------------------------------------------------------------------------
# the window ring


class WindowCache:
    """The drafter's own K/V for one request: a ring of ``window`` slots, position p in slot p % window.

    Its size is fixed when the request starts, whatever the context grows to: this is all the
    memory the drafter adds (the cross-attention reads the target's cache in place).
    """

    def __init__(self, kv_heads: int, window: int, head_dim: int, dtype: torch.dtype, device):
        self.window = window
        self.k = torch.zeros(kv_heads, window, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.pos = torch.full((window,), -1, dtype=torch.long, device=device)  # -1: empty slot

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.pos))

    def reset(self) -> None:
        self.pos.fill_(-1)

    def write(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """K/V ``[Hkv, T, D]`` of ascending ``positions``; only the last ``window`` can matter."""
        positions, k, v = positions[-self.window :], k[:, -self.window :], v[:, -self.window :]
        slots = positions % self.window
        self.k[:, slots] = k
        self.v[:, slots] = v
        self.pos[slots] = positions

    def visible(self, query_positions: torch.Tensor) -> torch.Tensor:
        """``[T, window]``: slot s holds a position inside query t's window ``(p_t - window, p_t]``."""
        p = self.pos[None, :]
        q = query_positions[:, None]
        return (p >= 0) & (p <= q) & (p > q - self.window)


# ----------------------------------------------------------------------------------------------
# the beam tree


def pool_size(widths: Sequence[int]) -> int:
    """Draft nodes the beam creates before the cut."""
    return sum(widths)


def verify_width(widths: Sequence[int], tree_size: int) -> int:
    """Rows of one verify forward: the root and at most ``tree_size`` draft nodes."""
    return min(tree_size, pool_size(widths)) + 1


def select_nodes(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                 n: int) -> DraftBeam:
    """The ``n`` best pool nodes of one request (``[P]`` each, parents before children), in creation
    order, parents renumbered. A stable descending sort keeps a parent ahead of a child of equal
    score, so the cut is closed under ancestors."""
    P = scores.shape[0]
    n = min(n, P)
    best = torch.sort(scores, descending=True, stable=True).indices[:n]
    sel = best.sort().values
    slot = torch.full((P,), -1, dtype=torch.long, device=scores.device)
    slot[sel] = torch.arange(n, device=scores.device)
    par = parents[sel]
    new_par = torch.where(par >= 0, slot[par.clamp(min=0)], par)
    if bool((new_par[par >= 0] < 0).any()):
        raise AssertionError("the cut tree is not closed under ancestors")
    return DraftBeam(tokens[sel][None], new_par[None], depths[sel][None], scores[sel][None])


@torch.no_grad()
def expand(drafter: LongSpecDrafter, embed: Callable[[torch.Tensor], torch.Tensor],
           head: Callable[[torch.Tensor], torch.Tensor], inv_freq: torch.Tensor, ring: WindowCache,
           target_k: torch.Tensor, target_v: torch.Tensor, pending: Sequence[int], start: int,
           widths: Sequence[int] = DEFAULT_WIDTHS, tree_size: int = 63) -> DraftBeam:
    """One request's beam tree (``[1, N]`` tensors).

    ``pending``: the history tokens the ring lacks, from position ``start``, the root (the last
    sampled token, at position ``L``) last; they join the ring first. ``target_k``/``target_v``:
    the target's last-layer K/V ``[Hkv, >= L, D]``; only positions ``[0, L)`` are read, the
    committed ones. ``embed``/``head``: the target's embedding and LM head (for a reduced-vocabulary
    drafter, :func:`~.longspec_weights.draft_head`'s: the beam picks among its N logits and proposes the mapped target ids).
    """
    if not pending:
        raise ValueError("the drafter needs at least the root token")
    dev = ring.k.device
    dt = ring.k.dtype
    W = drafter.window
    L = start + len(pending) - 1
    cross_k, cross_v = target_k[:, :L], target_v[:, :L]
    feed = list(pending)[-W:]
    pos = torch.arange(L - len(feed) + 1, L + 1, device=dev)
    cos, sin = rope_tables(inv_freq, pos, dt)
    k, v = drafter.window_kv(embed(torch.tensor(feed, dtype=torch.long, device=dev)).to(dt), cos, sin)
    ring.write(pos, k, v)

    # The root: its window is the ring (its own slot included, so no own keys are added twice).
    root_pos = pos[-1:]
    x = embed(torch.tensor(feed[-1:], dtype=torch.long, device=dev)).to(dt)
    q_cos, q_sin = cos[-1:], sin[-1:]
    mask = ring.visible(root_pos) & (ring.pos != L)[None]
    h, _, _ = drafter(x, q_cos, q_sin, ring.k, ring.v, torch.cat([mask, torch.ones(1, 1, dtype=torch.bool, device=dev)], 1),
                      cross_k, cross_v)
    logp = torch.log_softmax(head(h).to(torch.float64 if dt == torch.float64 else torch.float32), dim=-1)[0]
    V = _draft_width(drafter, logp)
    w = min(widths[0], V)
    score, token = logp.topk(w)
    pool_s, pool_t = [score], [drafter.to_target(token)]
    pool_p = [torch.full((w,), -1, dtype=torch.long, device=dev)]
    pool_d = [torch.ones(w, dtype=torch.long, device=dev)]
    # anc[i, j]: pool node j is an ancestor of pool node i, or i itself (grown level by level)
    anc = torch.eye(w, dtype=torch.bool, device=dev)
    front = torch.arange(w, device=dev)  # pool indices of the frontier
    done_k = done_v = None  # self-attention K/V of the tree nodes already run, in pool order of ``done``
    done = torch.zeros(0, dtype=torch.long, device=dev)
    size = w
    for level in range(2, len(widths) + 1):
        n = front.shape[0]
        fpos = torch.full((n,), L + level - 1, dtype=torch.long, device=dev)
        f_cos, f_sin = rope_tables(inv_freq, fpos, dt)
        x = embed(torch.cat(pool_t)[front]).to(dt)
        ring_mask = ring.visible(fpos)
        parts_k, parts_v, masks = [ring.k], [ring.v], [ring_mask]
        if done_k is not None:
            parts_k.append(done_k)
            parts_v.append(done_v)
            # tree ancestors inside the window (always, unless the window is shallower than the tree)
            near = (level - 1 - torch.cat(pool_d)[done]) < W
            masks.append(anc[front][:, done] & near[None])
        masks.append(torch.eye(n, dtype=torch.bool, device=dev))
        h, fk, fv = drafter(x, f_cos, f_sin, torch.cat(parts_k, dim=1), torch.cat(parts_v, dim=1),
                            torch.cat(masks, dim=1), cross_k, cross_v)
        done_k = fk if done_k is None else torch.cat([done_k, fk], dim=1)
        done_v = fv if done_v is None else torch.cat([done_v, fv], dim=1)
        done = torch.cat([done, front])
        logp = torch.log_softmax(head(h).to(score.dtype), dim=-1)  # [n, V]
        w = min(widths[level - 1], n * V)
        score, pick, row = best_children(torch.cat(pool_s)[front], logp, w)
        parent = front[row]
        pool_s.append(score)
        pool_t.append(drafter.to_target(pick))
        pool_p.append(parent)
        pool_d.append(torch.full((w,), level, dtype=torch.long, device=dev))
        grown = torch.zeros(size + w, size + w, dtype=torch.bool, device=dev)
        grown[:size, :size] = anc
        grown[size:, :size] = anc[parent]
        grown[size:, size:] = torch.eye(w, dtype=torch.bool, device=dev)
        anc = grown
        front = torch.arange(size, size + w, device=dev)
        size += w
    return select_nodes(torch.cat(pool_s), torch.cat(pool_t), torch.cat(pool_p), torch.cat(pool_d), tree_size)


def best_children(parent_scores: torch.Tensor, logp: torch.Tensor, width: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``width`` best (parent, token) pairs of a level: ``parent_scores`` ``[..., n]`` (the
    frontier's cumulative log-probabilities), ``logp`` ``[..., n, V]`` (its rows' next-token
    log-probabilities). Returns their scores, draft ids and parent rows (``[..., width]``).

    Each row's top ``min(width, V)`` first, then the best of those ``n * min(width, V)``: a pair in
    the global top ``width`` is in its own row's top ``width`` (its row holds fewer better
    tokens than the whole level does), so this is the top ``width`` over all ``n * V`` children
    while the second top-k reads ``n * width`` candidates, not ``n * V``. The scores are the same
    sums (``parent + logp``), bit for bit. Only ties at the cut may be broken otherwise than one
    top-k over the flattened level would (both are best-``width`` sets; which one is drafted never
    changes what is committed); :func:`best_of_rows` breaks them the same way on every call.
    """
    return best_of_rows(parent_scores, *logp.topk(min(width, logp.shape[-1]), dim=-1), width)


def best_of_rows(parent_scores: torch.Tensor, top: torch.Tensor, ids: torch.Tensor, width: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`best_children` from each row's top ``k = min(width, V)`` log-probabilities ``top``
    and their draft ids ``ids`` (``[..., n, k]``, however they were found): best first, equal scores
    the lower row first, then the row's earlier candidate (a stable sort of a few hundred sums), the
    order of the GPU's one-launch pick (``kernels/longspec_topk.py``), whose twin this is."""
    k = top.shape[-1]
    cand = (parent_scores.unsqueeze(-1) + top).flatten(-2)
    flat = torch.sort(cand, dim=-1, descending=True, stable=True).indices[..., :width]
    return cand.gather(-1, flat), ids.flatten(-2).gather(-1, flat), torch.div(flat, k, rounding_mode="floor")


def _draft_width(drafter: LongSpecDrafter, logits: torch.Tensor) -> int:
    """Logit columns of the head the beam was handed: the drafter's vocabulary, or a clear error."""
    V = logits.shape[-1]
    if drafter.reduced and V != drafter.draft_vocab_size:
        raise ValueError(f"the drafter scores {drafter.draft_vocab_size} mapped tokens but its head gave {V} "
                         "logits: pass draft_head(drafter, ...)")
    return V


# ----------------------------------------------------------------------------------------------
# a batch's beams: the cut of their pools, the host's read-back


def select_nodes_batched(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                         n: int) -> tuple[DraftBeam, torch.Tensor]:
    """:func:`select_nodes` for every row of ``[B, P]`` pools at once (``depths`` ``[P]``, shared),
    without reading anything back: the beam and a ``[B]`` flag of rows whose cut lost a parent
    (a stable descending sort keeps a parent ahead of a child of equal score, so it stays False)."""
    B, P = scores.shape
    n = min(n, P)
    best = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :n]
    sel = best.sort(dim=1).values  # [B, n], creation order
    slot = torch.full((B, P), -1, dtype=torch.long, device=scores.device)
    slot.scatter_(1, sel, torch.arange(n, device=scores.device).expand(B, n))
    par = parents.gather(1, sel)
    new_par = torch.where(par >= 0, slot.gather(1, par.clamp(min=0)), par)
    broken = ((par >= 0) & (new_par < 0)).any(dim=1)
    return DraftBeam(tokens.gather(1, sel), new_par, depths[sel], scores.gather(1, sel)), broken


def beam_rows(beam: DraftBeam, broken: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's beam and its ``broken`` flags (:func:`~sgl_longgen.kernels.longspec_step.expand_rings`)
    as the two tensors a host reads them from: int64 ``[B, 3N + 1]`` (tokens, parents, depths, the
    flag) and the scores ``[B, N]``, two device-to-host copies where the fields are five.
    :func:`beam_of_rows` undoes it."""
    ints = [t.to(torch.int64) for t in (beam.tokens, beam.parents, beam.depths, broken[:, None])]
    return torch.cat(ints, dim=1), beam.scores


def beam_of_rows(ints: torch.Tensor, scores: torch.Tensor) -> tuple[DraftBeam, torch.Tensor]:
    """:func:`beam_rows`'s beam and flags (views of ``ints`` and ``scores``)."""
    n = scores.shape[1]
    return DraftBeam(ints[:, :n], ints[:, n : 2 * n], ints[:, 2 * n : 3 * n], scores), ints[:, 3 * n].bool()


def beam_tree(beam: DraftBeam, root: int, row: int = 0, max_nodes: int | None = None) -> DraftTree:
    """Row ``row`` of a beam as a trie; draft node i becomes tree node i + 1, tagged ``Source.LONGSPEC``.

    ``max_nodes``: the trie cut to its first that many nodes (the root included), in creation
    order (the beam's shallow levels first, closed under ancestors).
    """
    return add_beam(DraftTree(root), beam.tokens[row].tolist(), beam.parents[row].tolist(), Source.LONGSPEC,
                    max_nodes, row)
