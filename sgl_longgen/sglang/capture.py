"""Reading what SGLang's model forward does not return: the pre-norm state and Eq. 2 scores.

Both are torch module hooks installed on *our* worker's model when the worker is built, so a
server that does not run our algorithms pays nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from ..core.partial_kv import gqa_importance
from ..errors import LonggenError
from .inputs import PartialDraftInput

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
