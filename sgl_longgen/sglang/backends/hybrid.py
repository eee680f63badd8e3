"""SGLang attention backend ``longgen``: FlashInfer everywhere, hybrid tree attention for verify.

SGLang's FlashInfer backend verifies a draft tree with one masked prefill over prefix + tree,
which re-reads the long prefix for every query tile: at long context a 64-token tree costs
several AR decode steps. This backend is SGLang 0.5.17's ``FlashInferAttnBackend`` with two
changes: TARGET_VERIFY batches go through :class:`~sgl_longgen.kernels.hybrid.HybridTreeAttention`
(prefix read once, tree mask on the tree block only, exact LSE merge), and on Hopper a plain
prefill (``EXTEND`` without speculative input) goes through SGLang's own FA3 backend, the one its
plain servers use there (a speculative server's time to first token is then a plain server's,
where FlashInfer's paged prefill is slower).
Decode, draft decodes with custom ``kv_indices`` and every other mode are the parent's, unchanged.

The hybrid path relies on what every SGLang tree verifier provides: each request has ``N`` draft
tokens whose K/V are written at ``out_cache_loc`` (passed to the layer as ``k``/``v``), every
draft token sees the request's whole committed prefix, and ``spec_info.custom_mask`` holds the
tree in SGLang's flat ``[N, seq_len + N]`` layout. Models the hybrid kernels do not cover
(sliding windows, encoder-decoder, logit soft-capping, quantized KV caches, unequal QK/V head
dims) keep the FlashInfer verify path, with a warning.

A width-1 verify (a plain step of adaptive speculation) is a decode step: its prefix slots
include the token's own (its K/V are in the pool before attention runs), so the hybrid path runs
one prefix pass, no tree kernel and no merge (``own_kv_in_prefix``), and writes no selection scores.

Cascade across requests: requests with a common prompt (n samples of one prompt, a shared
document) hold the same pool slots over it (SGLang's radix cache), so an eager verify of two or
more requests whose shortest committed prefix reaches ``CASCADE_MIN_SHARED`` tokens (opt-in) finds the
longest common prefix of their slot rows on the device (no sync) and plans the hybrid attention
as a cascade: the shared slots read once for the batch, each request's own slots, the tree, one
LSE merge (exact; ``HybridTreeAttention``). Captured verify graphs of two or more requests and
at most :data:`GRAPH_CASCADE_MAX_TREE` rows each (plain steps included) are captured with the
shared part and replayed with each batch's shared length, 0 where it shares nothing or is padded
to the graph's batch size (a padding row's prefix is one slot).

CUDA graphs: verify metadata goes into persistent buffers in ``init_forward_metadata_out_graph``
(prefix slots, tree blocks) and the kernels' launch shapes depend only on the batch size, so
captured graphs replay with new lengths and masks.

Under TOKENSWIFT's ``[tokenswift.partial_kv] policy = "verify"`` two more things, both
graph-safe: every verify also writes each layer's selection scores of the prefix keys
(``HybridTreeAttention.run(scores=...)``: fused into the Triton prefix pass, a key-only pass
beside FA3 or the folded decode) into the persistent :class:`~sgl_longgen.sglang.capture.VerifyScores`
buffer; and a draft decode whose input carries one slot list per layer
(``PartialDraftInput.layer_kv_indices``) copies layer ``l``'s list into the indices its FlashInfer
decode wrapper reads before layer ``l`` attends (in a CUDA graph the copy is captured too, from the
draft graph's persistent per-layer buffer), so each layer reads exactly its own selection.

Environment:
    SGLANG_LONGGEN_PREFIX_BACKEND=auto|triton|flashinfer_fold   prefix path (default auto)
    SGLANG_LONGGEN_PREFILL_BACKEND=auto|flashinfer   prefills through FA3 where it serves the model
        (auto, the default) or through FlashInfer's prefill
    SGLANG_LONGGEN_CASCADE_MIN_SHARED=N   shared prefix (tokens) from which an eager verify of
        several requests cascades (default 0: never)
    SGLANG_LONGGEN_VERIFY_CHECK=1   eager only: also run FlashInfer's masked verify on every layer
        and raise if the outputs differ by more than 2e-2 (relative to max(1, |ref|)).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend, PrefillMetadata
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.runtime_context import get_parallel

from ... import env
from .. import compat
from ..capture import VerifyScores
from ...kernels.folded_decode import fold_supported, workspace_bytes
from ...kernels.fa3_prefix import fa3_supported
from ...kernels.prefix_slots import prefix_slots
from ...kernels.hybrid import DEFAULT_FOLD_MAX_TREE, DEFAULT_FOLD_WORKSPACE_MB, HybridTreeAttention
from ...kernels.verify_metadata import (
    copy_tree_blocks,
    custom_mask_layout,
    prefix_kv_indices,
    shared_prefix_length,
    tree_mask_from_custom_mask,
)

logger = logging.getLogger(__name__)

CHECK_TOLERANCE = 2e-2


def _cascade_min_shared() -> int:
    """``SGLANG_LONGGEN_CASCADE_MIN_SHARED``, read when a backend is built: the shared prefix
    length (tokens) from which a verify of several requests cascades (0, the default: never).

    Opt-in: the cascade saves the shared prefix's re-reads, not its arithmetic, so
    what it buys depends on the GPU and the tree size; ``python -m sgl_longgen.bench.kernels --mode
    cascade`` shows it, and a few thousand tokens (e.g. 2048) is the sensible threshold where it pays.

    A cascade adds one launch (the shared part) and merge states, and reads the shared slots once
    instead of once per request. Below a few thousand shared tokens the re-reads it saves cost less
    than that: a 2K-token prefix is about 8 MB of bf16 K/V per layer at Llama-3.1-8B's shape, a few
    microseconds of HBM traffic per extra request. The comparison of the rows runs only when the
    shortest prefix reaches this length, and a common prefix shorter than it is taken as none.
    """
    raw = env.get("CASCADE_MIN_SHARED", "0")
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{env.name('CASCADE_MIN_SHARED')} must be a token count >= 0 (0: no cascade), got {raw!r}")
    return value


GRAPH_CASCADE_MAX_TREE = 16
"""The widest verify whose captured graphs (of two or more requests) include the cascade's shared
part when ``CASCADE_MIN_SHARED`` is set. A graph holds one launch sequence, so such a graph runs
the shared part at every replay, over no slots when its batch shares nothing (about two small
launches per layer). Measured per layer in graphs (docs/performance.md): the cascade gains most
at 1 and 4 rows, where a batch's attention is bound by reading the shared prefix; at 16 rows FA3's
path (the one Hopper takes) still gained and Triton's lost; at 64 rows the attention is
arithmetic-bound and neither gained.
"""


def _tree_blocks(spec_info) -> Optional[torch.Tensor]:
    """``spec_info.tree_mask`` when the verify input carries its ``[bs, N, N]`` tree blocks."""
    tree_mask = getattr(spec_info, "tree_mask", None)
    return tree_mask if isinstance(tree_mask, torch.Tensor) and tree_mask.dim() == 3 else None


@dataclass
class HybridVerifyMetadata:
    """Forward metadata of a TARGET_VERIFY batch served by the hybrid path."""

    attn: HybridTreeAttention
    # FlashInfer's own verify metadata, kept only in check mode.
    reference: Optional[PrefillMetadata] = None
    # Selection scores [bs, layers, kv_heads, ctx] this verify writes (partial_kv.policy = "verify").
    scores: Optional[torch.Tensor] = None
    score_rows: int = 0


def hybrid_unsupported_reason(model_runner, backend: FlashInferAttnBackend) -> Optional[str]:
    """Why the hybrid verify path cannot serve this model (``None`` if it can)."""
    cfg = model_runner.model_config
    if backend.skip_prefill:
        return "draft backend without prefill wrappers"
    if model_runner.sliding_window_size is not None or backend.use_sliding_window_kv_pool:
        return "sliding-window attention"
    if cfg.is_encoder_decoder:
        return "encoder-decoder model"
    if backend.is_dllm_model:
        return "diffusion LM"
    if backend.flashinfer_kv_cache_dtype != model_runner.dtype:
        return f"KV cache dtype {backend.flashinfer_kv_cache_dtype} differs from the model dtype"
    if model_runner.dtype not in (torch.float16, torch.bfloat16):
        return f"model dtype {model_runner.dtype}"
    hf = cfg.hf_config
    if getattr(hf, "attn_logit_softcapping", None):
        return "attention logit soft-capping"
    if getattr(cfg, "v_head_dim", cfg.head_dim) != cfg.head_dim:
        return "different QK and V head dims"
    return None


PREFILL_BACKENDS = ("auto", "flashinfer")


class Fa3Prefill:
    """Marks ``forward_metadata`` of a prefill planned by the FA3 backend (its own metadata)."""


def fa3_prefill_backend(model_runner, disabled: Optional[str]):
    """SGLang's FA3 backend for this runner's prefills, where it serves them (None: FlashInfer's).

    Where SGLang itself would pick FA3 (a Hopper GPU, 16-bit KV of the model's dtype, a head size
    FA3 was built for) and the hybrid path serves the model (``disabled`` None: the models FA3's
    prefill would need special handling for, sliding windows, soft-capping, encoder-decoder, are
    the ones the hybrid path refuses too). ``SGLANG_LONGGEN_PREFILL_BACKEND=flashinfer`` keeps
    FlashInfer's prefill.
    """
    choice = env.get("PREFILL_BACKEND", "auto")
    if choice not in PREFILL_BACKENDS:
        raise ValueError(f"{env.name('PREFILL_BACKEND')} must be one of {', '.join(PREFILL_BACKENDS)}, got {choice!r}")
    if choice != "auto" or disabled is not None:
        return None
    compat.require_fields("prefill_runner", model_runner)
    cfg = model_runner.model_config
    if model_runner.page_size != 1:
        return None
    if not fa3_supported(cfg.head_dim, model_runner.dtype, model_runner.dtype, torch.device(model_runner.device)):
        return None
    from sglang.srt.layers.attention.flashattention_backend import FlashAttentionBackend

    return FlashAttentionBackend(model_runner)


def _plain_prefill(forward_batch) -> bool:
    """A prefill chunk of prompts alone (no draft or verify input, no decode mixed in)."""
    return forward_batch.forward_mode == ForwardMode.EXTEND and forward_batch.spec_info is None


class LongGenAttnBackend(FlashInferAttnBackend):
    """``FlashInferAttnBackend`` whose TARGET_VERIFY attention is the hybrid tree attention (and
    whose plain prefills are FA3's on Hopper)."""

    verify_scores: Optional[VerifyScores] = None  # where verifies write selection scores (if asked)
    _prefill = None  # SGLang's FA3 backend serving plain prefills (None: FlashInfer's prefill)
    _no_shared: Optional[torch.Tensor] = None  # a captured cascade's shared length where none is shared

    def __init__(self, model_runner, **kwargs):
        super().__init__(model_runner, **kwargs)
        attn_tp = get_parallel().attn_tp_size
        cfg = model_runner.model_config
        self._num_qo_heads = cfg.get_max_num_attention_heads() // attn_tp
        self._num_kv_heads = cfg.get_num_kv_heads(attn_tp)
        self._head_dim = cfg.head_dim
        self._dtype = model_runner.dtype
        self._device = torch.device(model_runner.device)
        self._check = env.get("VERIFY_CHECK", "0") == "1"
        self._disabled = hybrid_unsupported_reason(model_runner, self)
        if self._disabled:
            logger.warning("longgen attention: hybrid verify disabled (%s); using FlashInfer's", self._disabled)
        self._eager_attn: Optional[HybridTreeAttention] = None
        self._cascade_min_shared = _cascade_min_shared()
        # CUDA-graph state, created on the first captured verify batch.
        self._graph_max_bs: Optional[int] = None
        self._graph_attn: Dict[int, HybridTreeAttention] = {}
        self._graph_kv_indptr: Optional[torch.Tensor] = None
        self._graph_tree_mask: Optional[torch.Tensor] = None
        self._graph_fold_workspace: Optional[torch.Tensor] = None
        self._graph_page_table: Optional[torch.Tensor] = None  # FA3 prefix path
        self._graph_seq_lens: Optional[torch.Tensor] = None
        self._max_context = model_runner.model_config.context_len
        self._prefill = None if self.skip_prefill else fa3_prefill_backend(model_runner, self._disabled)
        self.verify_scores = VerifyScores.of(model_runner)
        if self.verify_scores is not None and self._disabled:  # only the hybrid path scores
            raise ValueError(f"TOKENSWIFT's [tokenswift.partial_kv] policy = \"verify\" takes the partial KV from the "
                             f"longgen backend's hybrid verify, which cannot serve this model ({self._disabled}); use "
                             f"policy = \"tokenswift\" or --attention-backend longgen_torch")

    # ----------------------------------------------------------- dispatch
    def reads_tree_blocks(self) -> bool:
        """TARGET_VERIFY needs only ``spec_info.tree_mask`` (``[bs, N, N]``), not a FULL custom mask.

        False when FlashInfer's own verify serves instead (unsupported model) or check mode
        compares against it: both read the FULL mask.
        """
        return self._disabled is None and not self._check

    def _serves(self, forward_batch) -> bool:
        spec_info = forward_batch.spec_info
        return (
            self._disabled is None
            and forward_batch.forward_mode.is_target_verify()
            and spec_info is not None
            and (getattr(spec_info, "custom_mask", None) is not None or _tree_blocks(spec_info) is not None)
            and getattr(spec_info, "ragged_verify_layout", None) is None
        )

    @staticmethod
    def _tree_size(forward_batch) -> int:
        spec_info = forward_batch.spec_info
        n = getattr(spec_info, "draft_token_num", None)
        if not n or n <= 0:
            n = getattr(spec_info, "num_tokens_per_req", -1)
        if not n or n <= 0:
            raise ValueError("TARGET_VERIFY batch without draft_token_num / num_tokens_per_req")
        return int(n)

    # ------------------------------------------------------ eager metadata
    def init_forward_metadata(self, forward_batch):
        if self._prefill is not None and _plain_prefill(forward_batch):
            self._prefill.init_forward_metadata(forward_batch)
            self.forward_metadata = Fa3Prefill
            return None
        if not self._serves(forward_batch):
            return super().init_forward_metadata(forward_batch)
        reference = None
        if self._check and getattr(forward_batch.spec_info, "custom_mask", None) is not None:
            super().init_forward_metadata(forward_batch)
            reference = self.forward_metadata
        bs = forward_batch.batch_size
        tree_size = self._tree_size(forward_batch)
        own = int(tree_size == 1)  # a width-1 verify attends its own slot as part of the prefix
        seq_lens = forward_batch.seq_lens[:bs]
        seq_lens_cpu = forward_batch.seq_lens_cpu
        lens_host = [int(x) + own for x in seq_lens_cpu[:bs].tolist()] if seq_lens_cpu is not None else None
        total = sum(lens_host) if lens_host is not None else int(forward_batch.seq_lens_sum) + own * bs
        kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=self._device)
        kv_indices = torch.empty(max(total, 1), dtype=torch.int32, device=self._device)
        self._fill_prefix_indices(forward_batch.req_pool_indices[:bs], seq_lens + own if own else seq_lens,
                                  kv_indptr, kv_indices, total, max(lens_host) if lens_host else None)
        spec_info = forward_batch.spec_info
        tree_mask = _tree_blocks(spec_info)
        if tree_mask is None:
            custom_mask = spec_info.custom_mask
            layout = custom_mask_layout(custom_mask.numel(), bs, tree_size, total - own * bs)
            tree_mask = tree_mask_from_custom_mask(custom_mask, seq_lens, tree_size, layout=layout)
        elif tuple(tree_mask.shape) != (bs, tree_size, tree_size):
            raise ValueError(f"spec_info.tree_mask {tuple(tree_mask.shape)} is not [{bs}, {tree_size}, {tree_size}]")
        else:
            tree_mask = tree_mask.to(self._device, non_blocking=True)
        if self._eager_attn is None:
            self._eager_attn = HybridTreeAttention(
                self._num_qo_heads, self._num_kv_heads, self._head_dim, self._device
            )
        scores = self.verify_scores.begin(bs, tree_size) if self.verify_scores is not None and not own else None
        rows = self.verify_scores.rows if scores is not None else 0
        shared = self._shared_prefix(forward_batch.req_pool_indices[:bs], seq_lens, lens_host, own)
        self._eager_attn.plan(
            kv_indptr, kv_indices, tree_mask,
            q_dtype=self._dtype, kv_dtype=self._dtype, prefix_lens_host=lens_host, score_rows=rows,
            own_kv_in_prefix=bool(own), shared_prefix_len=shared,
        )
        self.forward_metadata = HybridVerifyMetadata(self._eager_attn, reference, scores, rows)

    def _shared_prefix(self, req_pool_indices, seq_lens, lens_host, own) -> torch.Tensor | None:
        """The batch's shared prefix length as a device tensor when a cascade may pay (two or
        more requests, the shortest committed prefix at least ``CASCADE_MIN_SHARED``), else None.

        Only committed slots are compared: a width-1 verify's own slot (``own``) is the request's.
        """
        min_shared = self._cascade_min_shared
        if min_shared <= 0 or lens_host is None or len(lens_host) < 2:
            return None
        width = min(lens_host) - own
        if width < min_shared:
            return None
        return shared_prefix_length(self.req_to_token_pool.req_to_token, req_pool_indices, seq_lens, width,
                                    min_shared=min_shared)

    def _fill_prefix_indices(self, req_pool_indices, seq_lens, kv_indptr, kv_indices, total=None,
                             max_len: int | None = None) -> None:
        """Prefix slots of each request into ``kv_indptr``/``kv_indices``: on a GPU a grid over
        (request, chunk) (:mod:`sgl_longgen.kernels.prefix_slots`), as wide as ``max_len``, a host
        bound of the lengths (None: the table's row width, which bounds every prefix)."""
        req_to_token = self.req_to_token_pool.req_to_token
        if req_to_token.device.type != "cuda":
            if total is None:
                total = int(seq_lens.sum())
            prefix_kv_indices(req_to_token, req_pool_indices, seq_lens, total, kv_indptr=kv_indptr, kv_indices=kv_indices)
            return
        prefix_slots(req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices,
                     max_len if max_len is not None else req_to_token.shape[1])

    # --------------------------------------------------- CUDA-graph metadata
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, kv_indices_buf: Optional[torch.Tensor] = None):
        super().init_cuda_graph_state(max_bs, max_num_tokens, kv_indices_buf=kv_indices_buf)
        self._graph_max_bs = max_bs

    def _graph_buffers(self, tree_size: int) -> None:
        if self._graph_kv_indptr is not None:
            return
        max_bs = self._graph_max_bs
        self._graph_kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=self._device)
        self._graph_tree_mask = torch.ones(max_bs * tree_size * tree_size, dtype=torch.uint8, device=self._device)
        # One scratch space for the folded FlashInfer path, shared by every captured batch size
        # (graphs replay one at a time), sized for the largest batch within the budget.
        prefix_backend = env.get("PREFIX_BACKEND", "auto")
        if prefix_backend in ("auto", "fa3") and fa3_supported(self._head_dim, self._dtype, self._dtype, self._device):
            # As SGLang's own FA3 backend: one page-table row per request, as wide as the context.
            self._graph_page_table = torch.zeros(max_bs, self._max_context, dtype=torch.int32, device=self._device)
            self._graph_seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=self._device)
            return
        if prefix_backend != "triton" and fold_supported(
            self._num_qo_heads, self._num_kv_heads, self._head_dim, tree_size, self._dtype, self._dtype, self._device
        ) and (prefix_backend == "flashinfer_fold" or tree_size <= DEFAULT_FOLD_MAX_TREE):
            num_sms = torch.cuda.get_device_properties(self._device).multi_processor_count
            need = workspace_bytes(max_bs, self._num_qo_heads, self._num_kv_heads, self._head_dim, tree_size, num_sms)
            need_one = workspace_bytes(1, self._num_qo_heads, self._num_kv_heads, self._head_dim, tree_size, num_sms)
            size = min(need, DEFAULT_FOLD_WORKSPACE_MB << 20)
            if size >= need_one:
                self._graph_fold_workspace = torch.zeros(size, dtype=torch.uint8, device=self._device)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        if not self._serves(forward_batch):
            return super().init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
        bs = forward_batch.batch_size
        tree_size = self._tree_size(forward_batch)
        self._graph_buffers(tree_size)
        kv_indptr = self._graph_kv_indptr[: bs + 1]
        kv_indices = self.cuda_graph_kv_indices[0]  # the parent's graph buffer; verify never plans it
        seq_lens = forward_batch.seq_lens[:bs]
        own = int(tree_size == 1)  # a width-1 verify (a plain step) attends its own slot as prefix
        seq_lens_cpu = forward_batch.seq_lens_cpu
        max_len = int(seq_lens_cpu[:bs].max()) + own if seq_lens_cpu is not None and not in_capture else None
        self._fill_prefix_indices(forward_batch.req_pool_indices[:bs], seq_lens + own if own else seq_lens,
                                  kv_indptr, kv_indices, max_len=max_len)
        tree_mask = self._graph_tree_mask[: bs * tree_size * tree_size].view(bs, tree_size, tree_size)
        blocks = _tree_blocks(forward_batch.spec_info)
        if blocks is not None:
            copy_tree_blocks(blocks, tree_mask)
        else:  # SGLang's GPU verify inputs use the full layout
            tree_mask_from_custom_mask(forward_batch.spec_info.custom_mask, seq_lens, tree_size, layout="full", out=tree_mask)
        shared = None
        if self._cascade_min_shared > 0 and bs >= 2 and tree_size <= GRAPH_CASCADE_MAX_TREE:
            # Every replay of this graph runs the shared part: the batch's shared slots, or none.
            lens_host = None if in_capture or seq_lens_cpu is None else [int(x) + own for x in seq_lens_cpu[:bs].tolist()]
            shared = self._shared_prefix(forward_batch.req_pool_indices[:bs], seq_lens, lens_host, own)
            if shared is None:
                if self._no_shared is None:
                    self._no_shared = torch.zeros(1, dtype=torch.int32, device=self._device)
                shared = self._no_shared
        attn = self._graph_attn.get(bs)
        if attn is None:
            if not in_capture:
                raise RuntimeError(f"no captured verify graph for batch size {bs}")
            attn = HybridTreeAttention(
                self._num_qo_heads, self._num_kv_heads, self._head_dim, self._device,
                use_cuda_graph=True,
                graph_kv_indptr_buf=kv_indptr,
                graph_kv_indices_buf=kv_indices,
                fold_workspace=self._graph_fold_workspace,
                graph_page_table_buf=self._graph_page_table,
                graph_seq_lens_buf=self._graph_seq_lens,
            )
            self._graph_attn[bs] = attn
        total = forward_batch.seq_lens_sum
        planned_indices = kv_indices[: total + own * bs] if total is not None else kv_indices
        scores = None
        if self.verify_scores is not None and not own:  # the persistent buffer: captured graphs write there
            scores = self.verify_scores.begin(bs, tree_size, graph_rows=self._graph_max_bs)
        rows = self.verify_scores.rows if scores is not None else 0
        attn.plan(kv_indptr, planned_indices, tree_mask, q_dtype=self._dtype, kv_dtype=self._dtype,
                  max_prefix_len=max_len, score_rows=rows, own_kv_in_prefix=bool(own), shared_prefix_len=shared)
        self.forward_metadata = HybridVerifyMetadata(attn, scores=scores, score_rows=rows)

    # ------------------------------------------------------------- forward
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        metadata = self.forward_metadata
        if metadata is Fa3Prefill:
            return self._prefill.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        if not isinstance(metadata, HybridVerifyMetadata) or not forward_batch.forward_mode.is_target_verify():
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        if layer.logit_cap and layer.logit_cap > 0:
            raise NotImplementedError("longgen hybrid verify does not implement logit soft-capping")
        if layer.tp_q_head_num != self._num_qo_heads or layer.qk_head_dim != layer.v_head_dim:
            raise NotImplementedError("longgen hybrid verify needs uniform head counts and QK/V head dims")
        num_heads, head_dim = layer.tp_q_head_num, layer.head_dim
        cache_loc = forward_batch.out_cache_loc
        if k is not None and save_kv_cache:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(cache_loc, None), k, v, *self._kv_write_scales(layer))
        k_buffer, v_buffer = self.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        if k is None:  # K/V already in the pool (e.g. written by a fused kernel): read the tree back
            k_tree, v_tree = k_buffer[cache_loc], v_buffer[cache_loc]
        else:
            k_tree = k.view(-1, layer.tp_k_head_num, head_dim)
            v_tree = v.view(-1, layer.tp_v_head_num, head_dim)
        q3 = q.contiguous().view(-1, num_heads, head_dim)
        scores = metadata.scores[:, layer.layer_id] if metadata.scores is not None else None
        o = metadata.attn.run(q3, k_buffer, v_buffer, k_tree, v_tree, sm_scale=layer.scaling,
                              scores=scores, score_rows=metadata.score_rows)
        if metadata.reference is not None:
            self._check_against_flashinfer(o, q, k, v, layer, forward_batch, metadata)
        return o.view(-1, num_heads * head_dim)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        per_layer = getattr(forward_batch.spec_info, "layer_kv_indices", None)
        if per_layer is not None:
            # One plan serves every layer (the lengths agree); only the slots differ, and the
            # wrapper reads them from its indices buffer when it runs.
            wrapper = self.forward_metadata.decode_wrappers[self._get_wrapper_idx(layer)]
            buf = getattr(wrapper, "_paged_kv_indices_buf", None)
            if buf is None:
                compat.require_fields("decode_wrapper", wrapper)
                raise RuntimeError("a per-layer draft decode on a decode wrapper that was not planned")
            # A graph's row is as wide as its largest draft (the tail is never read); an eager
            # wrapper reads the input's own kv_indices, exactly as long as the draft.
            n = min(per_layer.shape[1], buf.numel())
            buf[:n].copy_(per_layer[layer.layer_id, :n], non_blocking=True)
        return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)

    def _check_against_flashinfer(self, o, q, k, v, layer, forward_batch, metadata) -> None:
        self.forward_metadata = metadata.reference
        try:
            ref = super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache=False)
        finally:
            self.forward_metadata = metadata
        ref = ref.view_as(o).float()
        err = (o.float() - ref).abs().max().item()
        scale = max(1.0, ref.abs().max().item())
        logger.info("longgen verify check layer %d path %s: max|hybrid - flashinfer| = %.3g",
                    layer.layer_id, metadata.attn.path, err)
        if not err <= CHECK_TOLERANCE * scale:
            raise RuntimeError(
                f"longgen hybrid verify differs from FlashInfer on layer {layer.layer_id}: "
                f"max abs err {err:.4g} (scale {scale:.3g}, path {metadata.attn.path})"
            )
