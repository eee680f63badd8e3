"""Hybrid tree attention: read the long prefix once, mask only the draft tree, merge by LSE.

Tree verification attends each of the ``T`` draft tokens of a request to the committed prefix
(every draft token sees all of it) and to its ancestors in the draft tree. The mask only matters
on the ``T x T`` tree block, so the attention splits exactly into

1. the prefix part, unmasked, where all ``T*G`` query rows of a KV head share each KV tile:
   FA3's paged kernel on Hopper (``fa3_prefix``), elsewhere the Triton split-KV kernel
   (``prefix_attention``) or, for small trees, FlashInfer's tensor-core decode with the tree
   folded into the GQA group (``folded_decode``);
2. the tree part, ``T`` queries over ``T`` keys with the ancestor mask (``tree_attention``);
3. an exact log-sum-exp merge in base 2 (``merge``).

``HybridTreeAttention`` follows FlashInfer's plan/run pattern: ``plan`` takes the per-step
metadata (prefix slots, tree mask) once for all layers, ``run`` is called per layer. The launch
shapes depend only on the batch size and tree size unless the host prefix lengths are given, so
the same object serves CUDA-graph capture and replay (plan outside the graph, run inside).

Cascade across requests: requests that share a long prefix (samples of one prompt, one
document) hold the same pool slots over it, and reading those slots once per request repeats
the same bytes ``bs`` times. With ``plan(shared_prefix_len=S)`` each request's prefix splits into
the shared part ``[0, S)`` (request 0's first ``S`` slots, the same for every request) and its
own part ``[S, len)``. The shared part is computed once for the whole batch: every request's
``T*G`` rows of a KV head stacked as one request of ``bs*T`` tokens against the shared slots
(FA3: batch 1, ``seqlen_q = bs*T``; Triton: one KV range), so the shared KV is read once per
step. The own parts run as without cascade (an own part that is empty is the "no keys" state,
LSE ``-inf``), then the tree part, and the three states merge exactly by LSE: the key sets are
disjoint and their union is the row's keys, so the result is the same softmax.

Conventions: ``q [bs*T, Hq, D]``; KV pool ``k_buffer``/``v_buffer [num_slots, Hkv, D]``; request
``b``'s prefix is ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``; ``k_tree``/``v_tree [bs*T, Hkv, D]``
are the draft tokens' own K/V; ``tree_mask [bs, T, T]`` is True where token ``i`` sees token ``j``
(include the diagonal). Query head ``h`` uses KV head ``h // (Hq // Hkv)``.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple, Union

import torch

from .. import env
from .fa3_prefix import Fa3Prefix, fa3_supported
from .folded_decode import FoldedPrefixDecode, fold_supported, workspace_bytes
from .merge import folded_strides, merge_split_states, merge_two_states_strided, token_head_strides
from .prefix_attention import PrefixKernelConfig, prefix_attention_partials, prefix_kernel_config
from .tree_attention import tree_attention
from .verify_scores import prefix_logit_scores

PREFIX_BACKENDS = ("auto", "fa3", "triton", "flashinfer_fold")

# "auto" folds trees up to this size into FlashInfer's decode (when it fits); larger ones use Triton.
DEFAULT_FOLD_MAX_TREE = int(env.get("FOLD_MAX_TREE", "32"))
# Upper bound of the scratch space the folded path may allocate (FlashInfer plans it generously).
DEFAULT_FOLD_WORKSPACE_MB = int(env.get("FOLD_WORKSPACE_MB", "1024"))

SCORED_TRITON_MAX_TREE = 16
"""With selection scores, "auto" takes the Triton prefix path up to this tree size although FA3 is
there: Triton fuses the scores into its prefix pass, the FA3 and folded paths need a separate
key-only pass over every prefix key. At 64 rows FA3 stays ahead all the same; the threshold is
where the per-layer measurements crossed (docs/performance.md)."""

ONE_ROW_TRITON_MAX_TREE = 1
"""Up to this tree size (one row per request) the "auto" rule takes the Triton path, with or
without a cascade. Measured per layer (docs/performance.md): without a cascade Triton was as fast
as FA3 or faster, and trailed it only within the 5% a path may trail; with a cascade Triton reads
the shared slots as one KV range for the whole batch's rows, merged in the same pass as the own
parts, against FA3's two launches and a separate merge; at four rows FA3's cascade was ahead."""


class HybridTreeAttention:
    """Plan/run wrapper for tree verification attention over a paged prefix.

    Args:
        num_qo_heads, num_kv_heads, head_dim: attention shape (``num_qo_heads % num_kv_heads == 0``).
        device: where the kernels run.
        prefix_backend: ``"fa3"``, ``"triton"``, ``"flashinfer_fold"`` or ``"auto"`` (FA3 where
            it serves the shape, on Hopper; else fold when FlashInfer can serve the shape, the
            tree has at most ``fold_max_tree_size`` tokens and the scratch space fits
            ``fold_workspace_mb``; Triton otherwise). Env default: ``SGLANG_LONGGEN_PREFIX_BACKEND``.
        use_cuda_graph: keep every launch shape independent of the prefix lengths; the folded
            path then needs ``graph_kv_indptr_buf``/``graph_kv_indices_buf``, the device buffers
            that ``plan`` will receive on every replay, and the FA3 path ``graph_page_table_buf``
            (``[>= bs, max prefix]`` int32) and ``graph_seq_lens_buf`` (``[>= bs]`` int32).
        fold_workspace: a fixed uint8 scratch buffer for the folded path (shared between
            CUDA-graph batch sizes); the path is used only when the plan fits in it.
    """

    def __init__(
        self,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: Union[str, torch.device] = "cuda",
        *,
        prefix_backend: Optional[str] = None,
        fold_max_tree_size: int = DEFAULT_FOLD_MAX_TREE,
        fold_workspace_mb: int = DEFAULT_FOLD_WORKSPACE_MB,
        use_cuda_graph: bool = False,
        graph_kv_indptr_buf: Optional[torch.Tensor] = None,
        graph_kv_indices_buf: Optional[torch.Tensor] = None,
        fold_workspace: Optional[torch.Tensor] = None,
        graph_page_table_buf: Optional[torch.Tensor] = None,
        graph_seq_lens_buf: Optional[torch.Tensor] = None,
    ) -> None:
        if num_qo_heads % num_kv_heads:
            raise ValueError("num_qo_heads must be a multiple of num_kv_heads")
        prefix_backend = prefix_backend or env.get("PREFIX_BACKEND", "auto")
        if prefix_backend not in PREFIX_BACKENDS:
            raise ValueError(f"prefix_backend must be one of {PREFIX_BACKENDS}, got {prefix_backend!r}")
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_qo_heads // num_kv_heads
        self.head_dim = head_dim
        self.device = torch.device(device)
        self.prefix_backend = prefix_backend
        self.fold_max_tree_size = fold_max_tree_size
        self.fold_workspace_bytes = fold_workspace_mb << 20
        self.use_cuda_graph = use_cuda_graph
        self._graph_bufs = (graph_kv_indptr_buf, graph_kv_indices_buf)
        self._fold_workspace = fold_workspace
        self._folded: Optional[FoldedPrefixDecode] = None
        self._fa3: Optional[Fa3Prefix] = None
        self._fa3_bufs = (graph_page_table_buf, graph_seq_lens_buf)
        self._planned = False
        self.path: Optional[str] = None  # "fa3", "triton" or "flashinfer_fold" after plan()
        self.prefix_config: Optional[PrefixKernelConfig] = None
        # Cascade state: [shared kv_indptr (2 entries), shared length], refilled by every plan (a
        # persistent buffer, so graphs captured with a cascade replay with new shared lengths).
        self.cascade = False
        self.shared_config: PrefixKernelConfig | None = None
        self._cascade_meta: torch.Tensor | None = None
        self._fa3_shared: Fa3Prefix | None = None

    # ------------------------------------------------------------------ plan
    def plan(
        self,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        tree_mask: torch.Tensor,
        *,
        sm_scale: Optional[float] = None,
        q_dtype: torch.dtype = torch.bfloat16,
        kv_dtype: Optional[torch.dtype] = None,
        prefix_lens_host: Optional[Sequence[int]] = None,
        prefix_config: Optional[PrefixKernelConfig] = None,
        max_prefix_len: Optional[int] = None,
        score_rows: int = 0,
        own_kv_in_prefix: bool = False,
        shared_prefix_len: int | torch.Tensor | None = None,
    ) -> str:
        """Fix the metadata of one verification step (shared by all layers).

        Args:
            kv_indptr: ``[bs+1]`` int32 device tensor; kv_indices: int32 pool slots.
            tree_mask: ``[bs, T, T]`` bool (or uint8) device tensor; kept by reference, so it
                may be a persistent buffer refilled before each CUDA-graph replay.
            prefix_lens_host: the prefix lengths on the host, if known without a sync: lets the
                split count adapt to the longest prefix and rules out the folded path for empty
                prefixes. Leave ``None`` under CUDA graphs.
            prefix_config: explicit Triton launch shape (benchmarks, tuning).
            max_prefix_len: a bound of the prefix lengths known on the host, also under CUDA
                graphs (no launch shape depends on it): the FA3 path refills its page table
                only that far.
            score_rows: the ``score_rows`` that ``run`` will be asked for selection scores with
                (0: none), so that the Triton path's first row tile holds those rows.
            own_kv_in_prefix: ``T = 1`` only: the prefix slots end with the token's own slot
                (its K/V already in the pool), so the row sees all its keys there. A width-1
                verify is then exactly a decode step: one prefix pass, no tree kernel and no
                merge (about 4 small launches per layer fewer: a plain step of adaptive
                speculation costs what SGLang's decode step costs).
            shared_prefix_len: cascade (module docstring): the first ``S`` slots of every
                request's prefix are the same pool slots (the caller's promise; request 0's
                are read), ``S`` at most the shortest prefix. A host int (0: no cascade) or a
                one-element int32 device tensor (no sync; 0 allowed: an empty shared part; under
                CUDA graphs the way to vary ``S`` between replays of a graph captured with a
                cascade). Runs on the FA3 or Triton path (a folded path is not taken: its rows
                are bounded by the fold, not ``bs*T*G``).

        Returns the chosen prefix path, ``"fa3"``, ``"triton"`` or ``"flashinfer_fold"``.
        """
        if tree_mask.dim() != 3 or tree_mask.shape[1] != tree_mask.shape[2]:
            raise ValueError(f"tree_mask must be [bs, T, T], got {tuple(tree_mask.shape)}")
        batch_size, tree_size = tree_mask.shape[0], tree_mask.shape[1]
        if own_kv_in_prefix and tree_size != 1:
            raise ValueError(f"own_kv_in_prefix needs a width-1 verify, got T = {tree_size}")
        if own_kv_in_prefix and score_rows:
            raise ValueError("own_kv_in_prefix: the prefix holds the row's own key, which selection scores must not see")
        if kv_indptr.numel() != batch_size + 1:
            raise ValueError("kv_indptr must have bs+1 entries")
        if kv_indptr.dtype != torch.int32 or kv_indices.dtype != torch.int32:
            raise ValueError("kv_indptr and kv_indices must be int32")
        kv_dtype = kv_dtype or q_dtype
        self.batch_size = batch_size
        self.tree_size = tree_size
        self.sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.kv_indptr = kv_indptr
        self.kv_indices = kv_indices
        self.tree_mask = tree_mask.view(torch.uint8) if tree_mask.dtype == torch.bool else tree_mask
        self.own_kv_in_prefix = own_kv_in_prefix
        shared_host = self._plan_cascade(kv_indptr, shared_prefix_len, prefix_lens_host)
        self.path = self._choose_path(batch_size, tree_size, q_dtype, kv_dtype, prefix_lens_host, score_rows)
        skip = self._cascade_meta[2:3] if self.cascade else None
        if self.path == "fa3":
            if max_prefix_len is None and prefix_lens_host:
                max_prefix_len = max(prefix_lens_host)
            own_width = max_prefix_len - (shared_host or 0) if max_prefix_len is not None else None
            self._fa3_prefix().plan(kv_indptr, kv_indices, tree_size, max_prefix_len=own_width, skip=skip,
                                    dtype=q_dtype)
            if self.cascade:
                shared_width = shared_host if shared_host is not None else max_prefix_len
                self._fa3_shared_prefix().plan(self._cascade_meta[0:2], kv_indices, batch_size * tree_size,
                                               max_prefix_len=shared_width, dtype=q_dtype)
        elif self.path == "flashinfer_fold":
            self._fold().plan(kv_indptr, kv_indices, tree_size, sm_scale=self.sm_scale, q_dtype=q_dtype, kv_dtype=kv_dtype)
        else:
            max_len = max(prefix_lens_host) if prefix_lens_host and not self.use_cuda_graph else None
            own_len = max_len - (shared_host or 0) if max_len is not None else None
            self.prefix_config = prefix_config or prefix_kernel_config(
                batch_size, self.num_kv_heads, tree_size * self.group, self.head_dim, self.device,
                max_prefix_len=own_len, min_block_m=score_rows * self.group,
            )
            if self.cascade:
                shared_len = None
                if not self.use_cuda_graph:
                    shared_len = shared_host if shared_host is not None else (min(prefix_lens_host) if prefix_lens_host else None)
                self.shared_config = prefix_kernel_config(
                    1, self.num_kv_heads, batch_size * tree_size * self.group, self.head_dim, self.device,
                    max_prefix_len=shared_len,
                )
        self._planned = True
        return self.path

    def _plan_cascade(self, kv_indptr, shared_prefix_len, prefix_lens_host) -> int | None:
        """Fill the cascade buffer for ``shared_prefix_len``; returns ``S`` when known on the host."""
        self.cascade = False
        if shared_prefix_len is None:
            return None
        if isinstance(shared_prefix_len, torch.Tensor):
            if shared_prefix_len.dtype != torch.int32 or shared_prefix_len.numel() != 1:
                raise ValueError("shared_prefix_len must be a host int or a one-element int32 tensor")
            shared_host = None
        else:
            shared_host = int(shared_prefix_len)
            if shared_host < 0:
                raise ValueError(f"shared_prefix_len must be >= 0, got {shared_host}")
            if prefix_lens_host is not None and prefix_lens_host and shared_host > min(prefix_lens_host):
                raise ValueError(f"shared_prefix_len {shared_host} exceeds the shortest prefix ({min(prefix_lens_host)})")
            if shared_host == 0:
                return None
        if self.prefix_backend == "flashinfer_fold":
            raise ValueError("a cascade runs on the FA3 or Triton prefix path, not flashinfer_fold")
        if self._cascade_meta is None:
            self._cascade_meta = torch.zeros(3, dtype=torch.int32, device=self.device)
        meta = self._cascade_meta
        if shared_host is None:
            meta[2:3].copy_(shared_prefix_len.view(1))
        else:
            meta[2:3].fill_(shared_host)
        meta[0:1].copy_(kv_indptr[:1])
        torch.add(kv_indptr[:1], meta[2:3], out=meta[1:2])
        self.cascade = True
        return shared_host

    def _choose_path(self, batch_size, tree_size, q_dtype, kv_dtype, prefix_lens_host, score_rows=0) -> str:
        if self.prefix_backend == "triton":
            return "triton"

        can_fa3 = fa3_supported(self.head_dim, q_dtype, kv_dtype, self.device) and (
            not self.use_cuda_graph or self._fa3_bufs[0] is not None
        )
        if self.prefix_backend == "fa3":
            if not can_fa3:
                raise ValueError(
                    f"the FA3 prefix path cannot serve D={self.head_dim}, {q_dtype}/{kv_dtype} on {self.device}"
                    + (" (no page-table buffer for CUDA graphs)" if self.use_cuda_graph else "")
                )
            return "fa3"
        if self.prefix_backend == "auto" and self._triton_measured_faster(tree_size, score_rows):
            return "triton"
        if self.prefix_backend == "auto" and can_fa3:
            return "fa3"
        can_fold = fold_supported(
            self.num_qo_heads, self.num_kv_heads, self.head_dim, tree_size, q_dtype, kv_dtype, self.device
        )
        if self.prefix_backend == "flashinfer_fold":
            if not can_fold:
                raise ValueError(
                    f"the folded FlashInfer path cannot serve T={tree_size}, G={self.group}, "
                    f"D={self.head_dim}, {q_dtype}/{kv_dtype} on {self.device}"
                )
            return "flashinfer_fold"
        if self.cascade or not can_fold or tree_size > self.fold_max_tree_size:
            return "triton"
        if prefix_lens_host is not None and min(prefix_lens_host) < 1:
            return "triton"  # FlashInfer's decode is not meant for empty KV
        if self.use_cuda_graph and (self._graph_bufs[0] is None or self._fold_workspace is None):
            return "triton"  # under graphs the folded path needs persistent buffers and scratch
        num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        need = workspace_bytes(batch_size, self.num_qo_heads, self.num_kv_heads, self.head_dim, tree_size, num_sms)
        limit = self.fold_workspace_bytes if self._fold_workspace is None else self._fold_workspace.numel()
        return "flashinfer_fold" if need <= limit else "triton"

    def _triton_measured_faster(self, tree_size: int, score_rows: int) -> bool:
        """Where the Triton path was measured ahead of FA3's: one row per request
        (:data:`ONE_ROW_TRITON_MAX_TREE`), selection scores on a small tree (:data:`SCORED_TRITON_MAX_TREE`)."""
        return tree_size <= ONE_ROW_TRITON_MAX_TREE or (bool(score_rows) and tree_size <= SCORED_TRITON_MAX_TREE)

    def _fa3_prefix(self) -> Fa3Prefix:
        if self._fa3 is None:
            table, lens = self._fa3_bufs
            self._fa3 = Fa3Prefix(self.num_qo_heads, self.num_kv_heads, self.head_dim, self.device,
                                  page_table_buf=table, seq_lens_buf=lens)
        return self._fa3

    def _fa3_shared_prefix(self) -> Fa3Prefix:
        if self._fa3_shared is None:
            table = lens = None
            if self.use_cuda_graph:
                table = torch.zeros(1, self._fa3_bufs[0].shape[1], dtype=torch.int32, device=self.device)
                lens = torch.zeros(1, dtype=torch.int32, device=self.device)
            self._fa3_shared = Fa3Prefix(self.num_qo_heads, self.num_kv_heads, self.head_dim, self.device,
                                         page_table_buf=table, seq_lens_buf=lens)
        return self._fa3_shared

    def _fold(self) -> FoldedPrefixDecode:
        if self._folded is None:
            indptr_buf, indices_buf = self._graph_bufs
            self._folded = FoldedPrefixDecode(
                self.num_qo_heads,
                self.num_kv_heads,
                self.head_dim,
                self.device,
                float_workspace=self._fold_workspace,
                use_cuda_graph=self.use_cuda_graph,
                kv_indptr_buf=indptr_buf,
                kv_indices_buf=indices_buf,
            )
        return self._folded

    # ------------------------------------------------------------------- run
    def run(
        self,
        q: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        k_tree: torch.Tensor,
        v_tree: torch.Tensor,
        *,
        out: Optional[torch.Tensor] = None,
        lse: Optional[torch.Tensor] = None,
        sm_scale: Optional[float] = None,
        scores: torch.Tensor | None = None,
        score_rows: int = 2,
    ) -> torch.Tensor:
        """Attention output ``[bs*T, Hq, D]`` (``q``'s dtype unless ``out`` is given).

        ``lse`` (fp32 ``[bs*T, Hq]``), when given, receives the base-2 LSE of the whole row.
        ``sm_scale`` overrides the planned scale on the Triton and FA3 paths (per-layer
        scales); the folded path bakes the scale into FlashInfer's plan, so there it must match.
        ``scores`` (fp32 ``[bs, Hkv, >= longest prefix]``), when given, receives the
        verification-guided selection scores of every prefix key (mean logit of the first
        ``score_rows`` tree rows over the KV head's query heads, see
        :mod:`sgl_longgen.kernels.verify_scores`): fused into the Triton prefix pass, a separate
        key-only pass on the FA3 and folded paths. The attention output does not change.
        """
        if not self._planned:
            raise RuntimeError("plan() must be called before run()")
        num_tokens = self.batch_size * self.tree_size
        if q.shape != (num_tokens, self.num_qo_heads, self.head_dim):
            raise ValueError(f"q must be [{num_tokens}, {self.num_qo_heads}, {self.head_dim}], got {tuple(q.shape)}")
        if out is None:
            out = torch.empty_like(q)
        if sm_scale is None:
            sm_scale = self.sm_scale
        if scores is not None and (self.path != "triton" or self.cascade):
            # A cascade's prefix passes see a part of each prefix: a key-only pass scores the whole.
            prefix_logit_scores(q, k_buffer, self.kv_indptr, self.kv_indices, scores, sm_scale, score_rows=score_rows)
        if self.path == "flashinfer_fold" and abs(sm_scale - self.sm_scale) > 1e-12 * max(1.0, abs(sm_scale)):
            raise ValueError("the folded path was planned with a different sm_scale")
        if self.own_kv_in_prefix:
            if scores is not None:
                raise ValueError("no selection scores from a width-1 verify planned with own_kv_in_prefix")
            return self._run_prefix_only(q, k_buffer, v_buffer, out, lse, sm_scale)
        if self.path == "flashinfer_fold":
            return self._run_folded(q, k_buffer, v_buffer, k_tree, v_tree, out, lse)
        if self.path == "fa3":
            return self._run_fa3(q, k_buffer, v_buffer, k_tree, v_tree, out, lse, sm_scale)
        if self.cascade:
            return self._run_triton_cascade(q, k_buffer, v_buffer, k_tree, v_tree, out, lse, sm_scale)
        return self._run_triton(q, k_buffer, v_buffer, k_tree, v_tree, out, lse, sm_scale, scores, score_rows)

    def _run_prefix_only(self, q, k_buffer, v_buffer, out, lse, sm_scale):
        """A width-1 verify whose prefix holds the row's own key: the prefix pass is the whole
        attention (T = 1, so FA3's and the folded decode's outputs are in ``q``'s row order)."""
        bs, hq, d = self.batch_size, self.num_qo_heads, self.head_dim
        if self.cascade and self.path == "fa3":
            o_own, lse_own = self._fa3.run(q, k_buffer, v_buffer, sm_scale)
            self._merge_shared(q, k_buffer, v_buffer, o_own, lse_own, out, lse, sm_scale)
            return out
        if self.cascade:
            return self._run_triton_cascade(q, k_buffer, v_buffer, None, None, out, lse, sm_scale)
        if self.path == "fa3":
            o, lse_prefix = self._fa3.run(q, k_buffer, v_buffer, sm_scale, return_lse=lse is not None)
        elif self.path == "flashinfer_fold":
            o, lse_prefix = self._folded.run(q, k_buffer, v_buffer)
        else:
            cfg = self.prefix_config
            part_o = torch.empty(bs, hq, cfg.num_splits, d, dtype=torch.float32, device=q.device)
            part_lse = torch.empty(bs, hq, cfg.num_splits, dtype=torch.float32, device=q.device)
            prefix_attention_partials(q, k_buffer, v_buffer, self.kv_indptr, self.kv_indices, 1,
                                      part_o, part_lse, sm_scale, cfg)
            merge_split_states(part_o, part_lse, out=out, out_lse=lse)
            return out
        out.copy_(o.reshape(bs, hq, d))
        if lse is not None:
            lse.copy_(lse_prefix.reshape(bs, hq))
        return out

    def _run_triton(self, q, k_buffer, v_buffer, k_tree, v_tree, out, lse, sm_scale, scores=None, score_rows=2):
        cfg = self.prefix_config
        num_tokens = q.shape[0]
        # One fp32 state per KV chunk plus the tree part in the last slot, reduced in one pass.
        part_o = torch.empty(
            num_tokens, self.num_qo_heads, cfg.num_splits + 1, self.head_dim, dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(num_tokens, self.num_qo_heads, cfg.num_splits + 1, dtype=torch.float32, device=q.device)
        prefix_attention_partials(
            q, k_buffer, v_buffer, self.kv_indptr, self.kv_indices, self.tree_size,
            part_o, part_lse, sm_scale, cfg, scores=scores, score_rows=score_rows,
        )
        tree_attention(
            q, k_tree, v_tree, self.tree_mask, sm_scale,
            out=part_o[:, :, cfg.num_splits], lse=part_lse[:, :, cfg.num_splits],
        )
        merge_split_states(part_o, part_lse, out=out, out_lse=lse)
        return out

    def _run_triton_cascade(self, q, k_buffer, v_buffer, k_tree, v_tree, out, lse, sm_scale):
        """Own parts, the tree part (unless the prefixes hold the rows' own keys) and the shared
        part as states along one split axis: the three-way LSE merge is the one reduction pass."""
        own_cfg, shared_cfg = self.prefix_config, self.shared_config
        with_tree = not self.own_kv_in_prefix
        n_own, n_tree = own_cfg.num_splits, int(with_tree)
        states = n_own + n_tree + shared_cfg.num_splits
        part_o = torch.empty(q.shape[0], self.num_qo_heads, states, self.head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(q.shape[0], self.num_qo_heads, states, dtype=torch.float32, device=q.device)
        meta = self._cascade_meta
        prefix_attention_partials(q, k_buffer, v_buffer, self.kv_indptr, self.kv_indices, self.tree_size,
                                  part_o, part_lse, sm_scale, own_cfg, kv_skip=meta[2:3])
        if with_tree:
            tree_attention(q, k_tree, v_tree, self.tree_mask, sm_scale,
                           out=part_o[:, :, n_own], lse=part_lse[:, :, n_own])
        # Every row of the batch as one request of bs*T tokens over the shared slots.
        rest = n_own + n_tree
        prefix_attention_partials(q, k_buffer, v_buffer, meta[0:2], self.kv_indices, q.shape[0],
                                  part_o[:, :, rest:], part_lse[:, :, rest:], sm_scale, shared_cfg)
        merge_split_states(part_o, part_lse, out=out, out_lse=lse)
        return out

    def _run_fa3(self, q, k_buffer, v_buffer, k_tree, v_tree, out, lse, sm_scale):
        T, G = self.tree_size, self.group
        if self.cascade:  # own parts + shared part first (fp32), then the tree as without cascade
            o_own, lse_own = self._fa3.run(q, k_buffer, v_buffer, sm_scale)  # lse [bs, Hq, T], base 2
            o_prefix = torch.empty(q.shape, dtype=torch.float32, device=q.device)
            lse_prefix = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
            self._merge_shared(q, k_buffer, v_buffer, o_own, lse_own, o_prefix, lse_prefix, sm_scale)
            strides = (token_head_strides(o_prefix, T, G), token_head_strides(lse_prefix, T, G))
            return self._merge_tree(q, k_tree, v_tree, o_prefix, lse_prefix, strides, out, lse, sm_scale)
        # FA3's natural-log LSE goes to the merge as it is: the merge converts it as it reads it.
        o_prefix, lse_prefix = self._fa3.run(q, k_buffer, v_buffer, sm_scale, natural=True)  # [bs, Hq, T]
        strides = (token_head_strides(o_prefix, T, G), _head_major_lse_strides(lse_prefix, G))
        return self._merge_tree(q, k_tree, v_tree, o_prefix, lse_prefix, strides, out, lse, sm_scale,
                                prefix_natural=True)

    def _merge_shared(self, q, k_buffer, v_buffer, o_own, lse_own, out, lse, sm_scale):
        """FA3's shared part (all ``bs*T`` rows as one request) merged with its own parts
        (``lse_own [bs, Hq, T]``) into ``out``/``lse``."""
        o_shared, lse_shared = self._fa3_shared.run(q, k_buffer, v_buffer, sm_scale)  # lse [1, Hq, bs*T]
        T, G = self.tree_size, self.group
        merge_two_states_strided(
            o_own, lse_own, (token_head_strides(o_own, T, G), _head_major_lse_strides(lse_own, G)),
            o_shared, lse_shared, (token_head_strides(o_shared, T, G),
                                   _head_major_lse_strides(lse_shared, G, req_stride=T * lse_shared.stride(2))),
            out, lse, T, G,
        )

    def _run_folded(self, q, k_buffer, v_buffer, k_tree, v_tree, out, lse):
        o_prefix, lse_prefix = self._folded.run(q, k_buffer, v_buffer)
        T, G = self.tree_size, self.group
        strides = (folded_strides(o_prefix, T, G), folded_strides(lse_prefix, T, G))
        return self._merge_tree(q, k_tree, v_tree, o_prefix, lse_prefix, strides, out, lse, self.sm_scale)

    def _merge_tree(self, q, k_tree, v_tree, o_prefix, lse_prefix, prefix_strides, out, lse, sm_scale,
                    prefix_natural=False):
        """The tree part, merged with a library's prefix state (addressed by ``prefix_strides``:
        (req, t, kv_head, g) strides of its output and of its LSE: base 2, or FA3's natural-log
        one where ``prefix_natural``) into ``out``/``lse``."""
        o_tree = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        o_tree, lse_tree = tree_attention(q, k_tree, v_tree, self.tree_mask, sm_scale, out=o_tree)
        T, G = self.tree_size, self.group
        merge_two_states_strided(
            o_prefix, lse_prefix, prefix_strides,
            o_tree, lse_tree, (token_head_strides(o_tree, T, G), token_head_strides(lse_tree, T, G)),
            out, lse, T, G, a_natural=prefix_natural,
        )
        return out


def _head_major_lse_strides(lse: torch.Tensor, group: int, req_stride: int | None = None) -> tuple[int, ...]:
    """(request, token, KV head, group member) strides of an FA3 LSE ``[R, Hq, N]``; ``req_stride``
    when the rows of several requests are stacked in one (the cascade's shared part)."""
    s_req, s_head, s_t = lse.stride()
    return (s_req if req_stride is None else req_stride, s_t, group * s_head, s_head)


def hybrid_tree_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    k_tree: torch.Tensor,
    v_tree: torch.Tensor,
    tree_mask: torch.Tensor,
    sm_scale: Optional[float] = None,
    *,
    prefix_backend: Optional[str] = None,
    prefix_lens_host: Optional[Sequence[int]] = None,
    prefix_config: Optional[PrefixKernelConfig] = None,
    return_lse: bool = False,
    shared_prefix_len: int | torch.Tensor | None = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """One-shot ``plan`` + ``run`` of :class:`HybridTreeAttention` (see the module docstring).

    Returns ``o [bs*T, Hq, D]`` in ``q``'s dtype, and the base-2 LSE ``[bs*T, Hq]`` if asked.
    """
    attn = HybridTreeAttention(q.shape[1], k_buffer.shape[1], q.shape[2], q.device, prefix_backend=prefix_backend)
    attn.plan(
        kv_indptr, kv_indices, tree_mask, sm_scale=sm_scale, q_dtype=q.dtype, kv_dtype=k_buffer.dtype,
        prefix_lens_host=prefix_lens_host, prefix_config=prefix_config, shared_prefix_len=shared_prefix_len,
    )
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device) if return_lse else None
    o = attn.run(q, k_buffer, v_buffer, k_tree, v_tree, lse=lse)
    return (o, lse) if return_lse else o
