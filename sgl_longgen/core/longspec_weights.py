"""The matrices a LongSpec beam reads: its head (a reduced draft vocabulary, fp8), the block's fp8
copies and its fused projections.

**Reduced draft vocabulary.** Each beam level multiplies its rows by the whole LM head: for an 8B
target (128K rows, 1 GB in bf16 at width 4096) that memory traffic alone is most of the draft's
cost. With ``draft_vocab_size`` N < ``vocab_size`` in ``longspec.json`` the checkpoint carries a
``token_map`` (int64 ``[N]``, distinct target ids; the trainer writes them sorted by id, any order
loads: the order only numbers the draft ids) and the drafter scores only those N tokens: its head
is the target's LM head rows at ``token_map``, gathered once when the drafter is set up
(:func:`draft_head`; no trained weights of its own), and the beam maps its picks back to target
ids on the device (no host sync, CUDA-graph safe), so the trees, the scores' meaning and the next
level's inputs are as before, over a vocabulary that lacks the rarer tokens. The embedding stays
the target's full table (a root can be any token). Lossless as every drafting choice is: only the
draft changes, never the verification; a token outside the map is never proposed, and the shared
per-node walk (:mod:`.verify`) draws every committed token from the target distribution. The
softmax over the N logits is the full softmax with every other token at -inf, which a beam over
the full head with those tokens masked reproduces exactly. Without the field, a checkpoint is a
full-vocabulary drafter, files and behaviour as before.

**FP8 weights** (:func:`quantize_fp8`, ``[longspec] weights = "fp8"``): the block's projections
and MLP, about 772 MB per beam level of an 8B-shaped block in bf16 with a 32K-row head, stored
as e4m3 with one scale per row (:mod:`.fp8`), and the head with them (:func:`draft_head`): the
target's LM head (or its rows at the token map) becomes an fp8 copy the drafter owns, beside the
bf16 head the target keeps for itself. Half the memory traffic of a weight-bound level; only the
drafts change, never what verification commits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .fp8 import Fp8Linear, quantize_linears
from .longspec import LongSpecDrafter

# What ``weights = "fp8"`` quantizes in the block (its head: :func:`draft_head`).
FP8_LAYERS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "cross_attn.q_proj",
              "cross_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def quantize_fp8(drafter: LongSpecDrafter) -> LongSpecDrafter:
    """The block with its projections and MLP as :class:`~.fp8.Fp8Linear` (in place, once its
    device and dtype are set; a later ``.to`` moves them without recasting), fused again if they
    were (:func:`fuse_projections`). Only the fp8 copies are kept; its head is :func:`draft_head`'s."""
    fused = fused_matrices(drafter) is not None
    if hasattr(drafter, "_fused_projections"):  # its full-precision matrices would outlive the layers
        del drafter._fused_projections
    quantize_linears(drafter, FP8_LAYERS)
    if fused:
        fuse_projections(drafter)
    return drafter


def fuse_projections(drafter: LongSpecDrafter) -> None:
    """Make the self-attention's q/k/v matrices one matrix and the MLP's gate/up one, the block's
    own weights becoming views of them (no second copy): a beam level then runs one GEMM where
    the block ran three (two), the small K/V projections no longer a launch and a poorly used
    GEMM each. Idempotent; a drafter moved or reloaded afterwards simply runs unfused (the
    step checks that the views are still its weights). FP8 layers (:func:`quantize_fp8`) fuse
    into one :class:`~.fp8.Fp8Linear`, their row scales with their rows."""
    if fused_matrices(drafter) is not None:
        return
    a, m = drafter.self_attn, drafter.mlp
    with torch.no_grad():
        groups = ((a.q_proj, a.k_proj, a.v_proj), (m.gate_proj, m.up_proj))
        fused = []
        for layers in groups:
            fp8 = isinstance(layers[0], Fp8Linear)
            whole = torch.cat([lin.weight for lin in layers])
            scale = torch.cat([lin.scale for lin in layers]) if fp8 else None
            start = 0
            for lin in layers:
                rows = lin.weight.shape[0]
                if fp8:
                    lin.weight, lin.scale = whole[start : start + rows], scale[start : start + rows]
                else:
                    lin.weight = nn.Parameter(whole[start : start + rows], requires_grad=lin.weight.requires_grad)
                start += rows
            fused.append((Fp8Linear(whole, scale) if fp8 else whole, layers))
    drafter._fused_projections = fused


def fused_matrices(drafter: LongSpecDrafter) -> list | None:
    """The fused matrices (tensors, or :class:`~.fp8.Fp8Linear`), if the block's weights are still
    views of them. Inside ``torch.compile`` the storage check cannot be traced and is skipped: a
    compiled step is specialised to the drafter as it was fused when it was traced."""
    fused = getattr(drafter, "_fused_projections", None)
    if fused is None:
        return None
    if torch.compiler.is_compiling():
        return [matrix for matrix, _ in fused]
    for matrix, layers in fused:
        whole = matrix.weight if isinstance(matrix, Fp8Linear) else matrix
        start = 0
        for lin in layers:
            w = lin.weight
            if w.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr() or \
                    w.storage_offset() != whole.storage_offset() + start * whole.shape[1]:
                return None
            start += w.shape[0]
    return [matrix for matrix, _ in fused]


# ----------------------------------------------------------------------------------------------
# the drafter's head


class ReducedHead:
    """The target's LM head rows at a drafter's ``token_map``: ``[..., d] -> [..., N]`` draft logits.

    The rows are gathered once, here, into a tensor of their own that stays where it is (a CUDA
    graph of the beam reads it at a fixed address), so a beam level reads N rows instead of the
    whole head. Taken from the target's weights when the drafter is set up: an engine that later
    replaced the target's weights would draft from the old rows (still lossless, only less apt).
    """

    def __init__(self, weight: torch.Tensor, token_map: torch.Tensor):
        if weight.dim() != 2 or int(token_map.max()) >= weight.shape[0]:
            raise ValueError(f"the LM head ({tuple(weight.shape)}) lacks rows the token map lists "
                             f"(up to {int(token_map.max())})")
        with torch.no_grad():
            self.weight = weight.detach().index_select(0, token_map.to(weight.device)).contiguous()

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.weight)


def draft_head(drafter: LongSpecDrafter, weight: torch.Tensor,
               full: Callable[[torch.Tensor], torch.Tensor], fp8: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """The head a beam over ``drafter`` calls: ``full`` (the target's own) for a full-vocabulary
    drafter, else a :class:`ReducedHead` of ``weight`` (the target's LM head matrix, ``[>= V, d]``).

    ``fp8``: an :class:`~.fp8.Fp8Linear` of ``weight``'s first ``vocab_size`` rows (or of its rows
    at the token map), quantized a chunk of rows at a time: a copy the drafter owns, since the
    target keeps reading its own head in full precision."""
    if fp8:
        rows = drafter.token_map if drafter.reduced else None
        if rows is not None and int(rows.max()) >= weight.shape[0]:
            raise ValueError(f"the LM head ({tuple(weight.shape)}) lacks rows the token map lists "
                             f"(up to {int(rows.max())})")
        return Fp8Linear.quantize(weight if drafter.reduced else weight[: drafter.vocab_size], rows)
    return ReducedHead(weight, drafter.token_map) if drafter.reduced else full
