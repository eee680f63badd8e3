"""``longgen_torch``: a plain-PyTorch attention backend that understands draft trees.

SGLang's ``torch_native`` backend cannot run TARGET_VERIFY and ignores explicit decode KV
indices, and its CPU backend needs ``sgl_kernel``'s CPU build. This backend adds both, so our
workers (and SGLang's NGRAM) run on any device with plain PyTorch, per request:

* TARGET_VERIFY: the request's committed slots plus its draft nodes under the tree mask
  (``TreeVerifyInput.tree_mask``, or SGLang's FULL ``custom_mask`` layout for other inputs);
  under ``partial_kv.policy = "verify"`` also each layer's selection scores of the committed keys
  (:func:`sgl_longgen.core.verify_scores.mean_logits` of the first score rows, into
  :class:`~sgl_longgen.sglang.capture.VerifyScores`): the torch twin of the ``longgen`` backend's
  kernels;
* DECODE with ``spec_info.kv_indices``: exactly those slots (a partial-KV draft forward), per
  layer when the input carries ``layer_kv_indices``;
* everything else: ``torch_native``.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from torch.nn.functional import scaled_dot_product_attention as sdpa

from ...core.verify_scores import mean_logits
from ..capture import VerifyScores

NAME = "longgen_torch"


class LonggenTorchBackend(TorchNativeAttnBackend):
    verify_scores: VerifyScores | None = None  # where verifies write selection scores (if asked)

    def __init__(self, model_runner):
        super().__init__(model_runner)
        self.verify_scores = VerifyScores.of(model_runner)
        self._scores: torch.Tensor | None = None  # this verify's [bs, layers, kv_heads, ctx]

    def init_forward_metadata(self, forward_batch):
        super().init_forward_metadata(forward_batch)
        self._scores = None
        if self.verify_scores is not None and forward_batch.forward_mode.is_target_verify():
            self._scores = self.verify_scores.begin(forward_batch.batch_size, forward_batch.spec_info.draft_token_num)

    def reads_tree_blocks(self) -> bool:
        """TARGET_VERIFY reads ``spec_info.tree_mask``: workers need not build SGLang's FULL mask."""
        return True

    def _attend(self, q: torch.Tensor, layer, slots: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``q`` [T, Hq, D] against the KV at ``slots`` (``mask`` [T, len(slots)] or None)."""
        kc = self.token_to_kv_pool.get_key_buffer(layer.layer_id)[slots]
        vc = self.token_to_kv_pool.get_value_buffer(layer.layer_id)[slots]
        out = sdpa(
            q.transpose(0, 1)[None],
            kc.transpose(0, 1)[None].to(q.dtype),
            vc.transpose(0, 1)[None].to(q.dtype),
            attn_mask=mask,
            scale=layer.scaling,
            enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
        )
        return out[0].transpose(0, 1)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if not forward_batch.forward_mode.is_target_verify():
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        if save_kv_cache:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v)
        spec = forward_batch.spec_info
        n = spec.draft_token_num
        qh = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        out = qh.new_empty(qh.shape[0], layer.tp_q_head_num, layer.v_head_dim)
        req_to_token = self.req_to_token_pool.req_to_token
        tree_mask = getattr(spec, "tree_mask", None)
        scores, rows = self._scores, self.verify_scores.rows if self._scores is not None else 0
        offset = 0
        for i in range(forward_batch.batch_size):
            prefix = int(forward_batch.seq_lens[i])
            total = prefix + n
            slots = req_to_token[forward_batch.req_pool_indices[i], :total].long()
            if scores is not None and prefix:
                keys = self.token_to_kv_pool.get_key_buffer(layer.layer_id)[slots[:prefix]]
                scores[i, layer.layer_id, :, :prefix] = mean_logits(
                    qh[i * n : i * n + rows], keys.transpose(0, 1).to(qh.dtype), layer.scaling).float()
            if tree_mask is not None:
                mask = torch.cat([torch.ones(n, prefix, dtype=torch.bool, device=q.device), tree_mask[i]], dim=1)
            else:
                mask = spec.custom_mask[offset : offset + n * total].view(n, total)
                offset += n * total
            out[i * n : (i + 1) * n] = self._attend(qh[i * n : (i + 1) * n], layer, slots, mask)
        return out.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        spec = forward_batch.spec_info
        if spec is None or getattr(spec, "kv_indices", None) is None:
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        if save_kv_cache:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v)
        qh = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        out = qh.new_empty(qh.shape[0], layer.tp_q_head_num, layer.v_head_dim)
        indptr = spec.kv_indptr.tolist()
        per_layer = getattr(spec, "layer_kv_indices", None)
        indices = spec.kv_indices if per_layer is None else per_layer[layer.layer_id]
        for i in range(forward_batch.batch_size):
            slots = indices[indptr[i] : indptr[i + 1]].long()
            out[i : i + 1] = self._attend(qh[i : i + 1], layer, slots, None)
        return out.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)
