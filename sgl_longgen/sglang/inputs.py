"""``SpecInput`` objects our workers hand to SGLang.

SGLang's ``SpecInputType`` enum is closed, so each class takes the member whose meaning matches
what the attention backends must do (see :mod:`.compat`): the tree verify input *is* an
NGRAM-style verify input (a padded tree per request with explicit positions), which lets
SGLang's CUDA-graph capture and its custom-mask verify planning serve it unchanged; the draft
forward's input is what SGLang's EAGLE draft decode is to its backends, a DECODE over explicit
``kv_indptr``/``kv_indices``.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.speculative.ngram_info import NgramVerifyInput
from sglang.srt.speculative.spec_info import SpecInput, SpecInputType


class TreeVerifyInput(NgramVerifyInput):
    """TARGET_VERIFY of one padded trie of ``draft_token_num`` nodes per request.

    ``tree_mask`` (``[bs, N, N]``, ancestor-or-self) is what our own backends read;
    ``custom_mask`` is the same in SGLang's FULL layout (``[N, prefix + N]`` per request,
    flattened) for FlashInfer / Triton, or None when the backend does not need it.
    """

    def __init__(
        self,
        *,
        draft_token: torch.Tensor,
        positions: torch.Tensor,
        tree_mask: torch.Tensor,
        custom_mask: torch.Tensor | None,
        draft_token_num: int,
        capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL,
    ):
        # The base takes its device from the custom mask, which our own backends do without.
        super().__init__(draft_token=draft_token, custom_mask=tree_mask, positions=positions,
                         draft_token_num=draft_token_num)
        self.custom_mask = custom_mask
        self.tree_mask = tree_mask
        self.capture_hidden_mode = capture_hidden_mode
        self.kv_indptr = self.kv_indices = None


class PartialDraftInput(SpecInput):
    """DECODE of one root token per request over an explicit subset of cached slots.

    Attention backends that honour ``kv_indptr``/``kv_indices`` in decode (FlashInfer, Triton,
    ours) attend exactly to those slots: TokenSwift's partial KV without copying any KV.
    ``score_ranges[b]`` asks for importance scores of request b's root query over its committed
    positions ``[lo, hi)`` (partial-KV re-selection); ``scores[b]`` receives them.

    ``layer_kv_indices`` (``[layers, len(kv_indices)]``, under ``partial_kv.policy = "verify"``):
    one slot list per layer, laid out alike (``kv_indptr`` holds for every row): layer ``l``
    attends exactly to row ``l``. Our backends read it (``longgen_torch`` directly; ``longgen``
    copies row ``l`` into the indices its decode wrapper reads before layer ``l``); ``kv_indices``
    is then a scratch copy of row 0 that plans the decode and may be overwritten.
    """

    def __init__(self, *, positions: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                 score_ranges: list[tuple[int, int] | None] | None = None,
                 layer_kv_indices: torch.Tensor | None = None):
        super().__init__(SpecInputType.EAGLE_DRAFT)
        self.score_ranges = score_ranges or []
        self.scores: dict[int, torch.Tensor] = {}
        self.positions = positions
        self.kv_indptr = kv_indptr
        self.kv_indices = kv_indices
        self.layer_kv_indices = layer_kv_indices
        self.custom_mask = None
        self.hidden_states = None
        self.capture_hidden_mode = CaptureHiddenMode.NULL
        self.num_tokens_per_req = self.num_tokens_for_logprob_per_req = 1
        self.draft_token_num = 1

    @property
    def wants_scores(self) -> bool:
        return any(r is not None for r in self.score_ranges)


def relay_input(draft_token_num: int, new_seq_lens: torch.Tensor, accept_tokens: torch.Tensor,
                accept_lens: torch.Tensor) -> NgramVerifyInput:
    """What the scheduler carries between rounds (our per-request state lives in the worker)."""
    return NgramVerifyInput(draft_token_num=draft_token_num, new_seq_lens=new_seq_lens,
                            accept_tokens=accept_tokens, accept_lens=accept_lens)


@contextmanager
def restored(batch, *names: str):
    """The batch's fields ``names`` put back as they were on leaving: a forward of ours sets the
    batch's inputs for itself (a draft, a verify queued for the next call), and SGLang's scheduler
    must find the batch as its own step left it."""
    saved = [getattr(batch, name) for name in names]
    try:
        yield
    finally:
        for name, value in zip(names, saved):
            setattr(batch, name, value)
