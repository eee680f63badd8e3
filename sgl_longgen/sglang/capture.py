"""Reading what SGLang's model forward does not return: the pre-norm state, Eq. 2 scores, and
the verify forward's selection scores.

The first two are torch module hooks installed on *our* worker's model when the worker is built,
so a server that does not run our algorithms pays nothing. The verify's scores are written by
our attention backends into :class:`VerifyScores`, which exists only on a server whose draft
directory asks for ``[tokenswift.partial_kv] policy = "verify"``.
"""

from __future__ import annotations

import logging
import weakref
from pathlib import Path

import torch
from torch import nn

from ..core.partial_kv import gqa_importance
from ..core.verify_scores import score_rows
from ..errors import LonggenError
from .inputs import PartialDraftInput

logger = logging.getLogger(__name__)

SCORE_CHUNK = 32768


def final_norm(model: nn.Module) -> nn.Module:
    """The decoder's final norm (``model.model.norm`` in SGLang's Llama/Qwen/Mistral families)."""
    inner = getattr(model, "model", None)
    norm = getattr(inner, "norm", None)
    if not isinstance(norm, nn.Module):
        raise LonggenError(
            f"{type(model).__name__} has no model.norm: TokenSwift heads need the hidden state before the final norm"
        )
    return norm


class PreNormCapture:
    """Captures ``hidden + residual`` entering the final norm, and its output, while armed.

    SGLang fuses the last residual add into the final RMSNorm call, so the raw residual stream
    that TokenSwift's heads read exists only as the sum of the norm's two inputs. The output
    (``normed``) is what the LM head reads, so the base head can share the heads' GEMM.
    """

    def __init__(self, model: nn.Module):
        self.value: torch.Tensor | None = None
        self.normed: torch.Tensor | None = None
        self.armed = False
        norm = final_norm(model)
        norm.register_forward_pre_hook(self._hook)
        norm.register_forward_hook(self._out_hook)

    def _hook(self, module, args):
        if not self.armed:
            return None
        x = args[0]
        residual = args[1] if len(args) > 1 else None
        self.value = x + residual if residual is not None else x.clone()
        return None

    def _out_hook(self, module, args, output):
        if self.armed:
            self.normed = output[0] if isinstance(output, tuple) else output
        return None

    def __enter__(self) -> "PreNormCapture":
        self.value, self.normed, self.armed = None, None, True
        return self

    def __exit__(self, *exc) -> None:
        self.armed = False


class ImportanceScorer:
    """Scores committed positions for partial-KV re-selection during a draft forward.

    After each attention layer, for every request whose :class:`PartialDraftInput` asks for it,
    the root token's query is scored against the request's committed keys with the GQA-summed
    q.k of TokenSwift's Eq. 2, softmax-normalised per KV head (one selection is shared by all
    layers and heads in the engine), and accumulated over layers. Scoring steps run the draft forward
    eagerly (see :mod:`.draft_graph`), so these hooks fire; other steps may replay a CUDA graph.
    With tensor parallelism each rank scores its own heads: :meth:`total` sums the ranks' scores,
    so every rank selects the same positions (those of one rank holding every head).
    """

    def __init__(self, model_runner):
        from sglang.srt.layers.radix_attention import RadixAttention

        self.runner = model_runner
        self.layers = [m for m in model_runner.model.modules() if isinstance(m, RadixAttention)]
        for layer in self.layers:
            layer.register_forward_hook(self._hook, with_kwargs=True)
        from sglang.srt.distributed.parallel_state import get_attn_tp_group

        group = get_attn_tp_group()  # the ranks the attention heads are split over
        self.group = group if group.world_size > 1 else None

    def total(self, scores: torch.Tensor) -> torch.Tensor:
        """A request's scores over every attention head (collective: every TP rank calls it alike)."""
        return scores if self.group is None else self.group.all_reduce(scores)

    @staticmethod
    def _arg(args, kwargs, index: int, name: str):
        return args[index] if len(args) > index else kwargs.get(name)

    def _hook(self, layer, args, kwargs, output):
        forward_batch = self._arg(args, kwargs, 3, "forward_batch")
        spec = getattr(forward_batch, "spec_info", None)
        if not isinstance(spec, PartialDraftInput) or not spec.wants_scores:
            return None
        if getattr(layer, "is_cross_attention", False):
            return None
        q = self._arg(args, kwargs, 0, "q")
        q = q.reshape(q.shape[0], layer.tp_q_head_num, layer.qk_head_dim)
        k_buffer = self.runner.token_to_kv_pool.get_key_buffer(layer.layer_id)
        req_to_token = self.runner.req_to_token_pool.req_to_token
        for b, rng in enumerate(spec.score_ranges):
            if rng is None:
                continue
            lo, hi = rng
            slots = req_to_token[forward_batch.req_pool_indices[b], lo:hi].long()
            root_q = q[b]
            # Chunked gather: a 100K-token context would otherwise copy every key at once.
            s = torch.cat([
                gqa_importance(root_q, k_buffer[chunk].transpose(0, 1), layer.scaling).float()
                for chunk in slots.split(SCORE_CHUNK)
            ], dim=-1)
            acc = torch.softmax(s, dim=-1).sum(dim=0)
            spec.scores[b] = acc if b not in spec.scores else spec.scores[b] + acc
        return None


def verify_policy_requested(server_args) -> bool:
    """The server runs TOKENSWIFT with ``[tokenswift.partial_kv] policy = "verify"`` (its draft
    directory's ``longgen.toml``, checked at startup by the plugin)."""
    if (getattr(server_args, "speculative_algorithm", None) or "").upper() != "TOKENSWIFT":
        return False
    path = getattr(server_args, "speculative_draft_model_path", None)
    if not path or not Path(path).is_dir():
        return False
    from .draft_dir import read_defaults

    try:
        return read_defaults(Path(path)).tokenswift.partial_kv.policy == "verify"
    except LonggenError:
        return False  # refused at startup already; the drafter says so again


class VerifyScores:
    """Where a verify forward leaves its per-layer selection scores (SpecAttn's verification-guided
    partial KV, :mod:`sgl_longgen.core.verify_scores`).

    The attention backends write, per layer, the mean pre-softmax logit of the verify's first
    :func:`~sgl_longgen.core.verify_scores.score_rows` rows of each request against every key of its
    committed prefix, per KV head of this rank: ``[bs, layers, kv_heads, context_len]`` fp32
    (entries past a request's prefix are stale). TOKENSWIFT's drafter takes them once the verify is
    queued and ranks them on the device (:func:`sgl_longgen.sglang.tokenswift.verified_selection`).

    One store per model runner, shared by every backend built on it (adaptive speculation's width-1
    graphs have a backend of their own), so the drafter finds the last verify's scores whichever
    backend ran it. CUDA graphs write into one persistent buffer sized by the graphs' largest batch
    and the context length (an 8B Llama at 128K context: 128 MiB per request), allocated when the
    first graph is captured and never moved afterwards; eager verifies reuse it when it is large
    enough.
    """

    _by_runner: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def __init__(self, num_layers: int, num_kv_heads: int, context_len: int, device):
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.context_len = context_len
        self.device = torch.device(device)
        self.buffer: torch.Tensor | None = None
        self.fixed = False  # a CUDA graph writes into ``buffer``: it never moves again
        self.current: torch.Tensor | None = None  # the last verify's [bs, layers, kv_heads, ctx]
        self.rows = 0  # its score rows

    @classmethod
    def of(cls, model_runner) -> "VerifyScores | None":
        """The runner's store when its server asks for verify scores (None otherwise)."""
        try:
            return cls._by_runner[model_runner]
        except KeyError:
            pass
        store = None
        if verify_policy_requested(model_runner.server_args):
            from sglang.srt.distributed.parallel_state import get_attn_tp_group

            cfg = model_runner.model_config
            layers = getattr(cfg, "num_attention_layers", None) or cfg.num_hidden_layers
            store = cls(layers, cfg.get_num_kv_heads(get_attn_tp_group().world_size), cfg.context_len,
                        model_runner.device)
        cls._by_runner[model_runner] = store
        return store

    def _allocate(self, rows: int) -> torch.Tensor:
        shape = (rows, self.num_layers, self.num_kv_heads, self.context_len)
        logger.info("verify selection scores: %d x %d layers x %d KV heads x %d positions (%.0f MiB)",
                    *shape, 4 * rows * self.num_layers * self.num_kv_heads * self.context_len / 2**20)
        return torch.zeros(shape, dtype=torch.float32, device=self.device)

    def begin(self, batch_size: int, tree_size: int, graph_rows: int | None = None) -> torch.Tensor:
        """This verify's output, ``[batch_size, layers, kv_heads, context_len]``; it also becomes
        what :meth:`take` returns. ``graph_rows``: a CUDA graph is being captured or replayed with
        batches up to that many requests, so the persistent buffer is used (allocated now if
        needed: call this outside the capture)."""
        buf = self.buffer
        if graph_rows is not None:
            if buf is None or (buf.shape[0] < graph_rows and not self.fixed):
                buf = self.buffer = self._allocate(max(graph_rows, batch_size))
            if buf.shape[0] < batch_size:
                raise RuntimeError(f"verify scores for {batch_size} requests, the graphs' buffer holds {buf.shape[0]}")
            self.fixed = True
        elif buf is None or buf.shape[0] < batch_size:
            if self.fixed:  # a batch larger than any graph's: a buffer of its own for this step
                buf = self._allocate(batch_size)
            else:
                buf = self.buffer = self._allocate(batch_size)
        self.current = buf[:batch_size]
        self.rows = score_rows(tree_size)
        return self.current

    def take(self, batch_size: int) -> torch.Tensor | None:
        """The last verify's scores for its first ``batch_size`` requests, once (None: none since)."""
        current, self.current = self.current, None
        return None if current is None else current[:batch_size]
