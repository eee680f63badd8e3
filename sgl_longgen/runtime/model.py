"""A compact Llama / Qwen2 decoder with an explicit KV cache (batch 1).

Module and parameter names follow Hugging Face, so a ``model.safetensors`` loads as is. One
forward covers the three shapes the algorithms need:

* a *full* forward of T tokens at arbitrary positions, writing their KV at ``[start, start+T)``
  and attending to all of ``[0, start)`` plus the new tokens through a ``[T, T]`` mask (causal for
  prefill, ancestor mask for tree verification);
* a *partial* (draft) forward that attends only to given cached positions (per KV head) plus the
  new tokens, and writes nothing to the cache;
* optional importance scores of one query row against a range of cached keys (TokenSwift Eq. 2),
  in either kind of forward;
* optional mean pre-softmax logits of chosen query rows against a range of cached keys
  (verification-guided selection, :mod:`sgl_longgen.core.verify_scores`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from ..core.nn import RMSNorm
from ..core.partial_kv import gqa_importance
from ..core.rope_config import DEFAULT_THETA, rope_settings
from ..core.verify_scores import mean_logits
from ..errors import LonggenError
from .kv_cache import KVCache

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
ROPE_TYPES = ("default", "llama3")
QWEN2_MAX_WINDOW_LAYERS = 28  # transformers' default: Qwen2 layers from this index on slide, when sliding is on


class ModelConfig(msgspec.Struct, kw_only=True):
    """The subset of a HF ``config.json`` this runtime reads.

    RoPE comes in either spelling (:mod:`sgl_longgen.core.rope_config`): after parsing,
    ``rope_theta`` and ``rope_scaling`` hold the model's settings whether transformers 4 wrote them
    at the top level or transformers 5 in ``rope_parameters`` (folded into them, then cleared, so
    the two fields are the one place to read or change; ``rope_origin`` remembers which field
    held them, for error messages). The fields after ``eos_token_id`` are read only so that
    :meth:`validate` can refuse a model whose math this runtime would get wrong by ignoring them.
    """

    architectures: list[str] = msgspec.field(default_factory=lambda: ["LlamaForCausalLM"])
    model_type: str = "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = DEFAULT_THETA
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    partial_rotary_factor: float | None = None
    use_sliding_window: bool | None = None
    sliding_window: int | None = None
    max_window_layers: int | None = None
    layer_types: list[str] | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    quantization_config: dict[str, Any] | None = None
    rope_origin: str = "rope_scaling"  # not a HF field: where the RoPE table came from

    def __post_init__(self) -> None:
        if self.rope_parameters:
            self.rope_origin = "rope_parameters"
        self.rope_theta, self.rope_scaling = rope_settings(self)
        self.rope_parameters = None

    @property
    def n_kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def qkv_bias(self) -> bool:
        return self.model_type == "qwen2" or self.attention_bias

    @property
    def o_proj_bias(self) -> bool:
        """Llama's ``attention_bias`` covers the output projection too; Qwen2's never has one."""
        return self.model_type == "llama" and self.attention_bias

    @property
    def eos_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    def validate(self, source: str) -> None:
        arch = (self.architectures or ["?"])[0]
        if arch not in ARCHITECTURES:
            raise LonggenError(f"{source}: unsupported architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})")
        if self.num_attention_heads % self.n_kv_heads:
            raise LonggenError(f"{source}: num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_act != "silu":
            raise LonggenError(f"{source}: unsupported hidden_act {self.hidden_act!r}")
        problem = self.unsupported_field()
        if problem is not None:
            field_name, value, what = problem
            raise LonggenError(f"{source}: {field_name} = {value!r} is not supported by the reference runtime ({what})")

    def unsupported_field(self) -> tuple[str, Any, str] | None:
        """The first field whose value changes the model's math in a way this runtime does not
        compute: ``(field, value, what it would change)``, or None."""
        table = self.rope_origin
        rope = self.rope_scaling or {}
        kind = rope.get("rope_type", "default")
        if kind not in ROPE_TYPES:
            return f"{table}.rope_type", kind, f"supported RoPE types: {', '.join(ROPE_TYPES)}"
        if kind == "llama3" and "factor" not in rope:
            return f"{table}.factor", None, "rope_type 'llama3' needs its scaling factor"
        rotary = rope.get("partial_rotary_factor")
        field_name = f"{table}.partial_rotary_factor"
        if rotary is None:
            rotary, field_name = self.partial_rotary_factor, "partial_rotary_factor"
        if rotary is not None and float(rotary) != 1.0:
            return field_name, rotary, "RoPE on part of each head"
        if self.quantization_config:
            method = self.quantization_config.get("quant_method")
            if method:
                return "quantization_config.quant_method", method, "quantized weights; give an unquantized checkpoint"
            return "quantization_config", self.quantization_config, "quantized weights; give an unquantized checkpoint"
        for i, layer_type in enumerate(self.layer_types or []):
            if layer_type != "full_attention":
                return f"layer_types[{i}]", layer_type, "every layer attends to the whole context here"
        first_sliding = QWEN2_MAX_WINDOW_LAYERS if self.max_window_layers is None else self.max_window_layers
        if self.model_type == "qwen2" and self.use_sliding_window and self.sliding_window is not None \
                and first_sliding < self.num_hidden_layers:
            return "use_sliding_window", True, f"sliding-window attention (sliding_window = {self.sliding_window})"
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(self, name) is not None:
                return name, getattr(self, name), "logit soft-capping"
        return None


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies, with Llama-3.1's piecewise long-context scaling when configured."""
    d = cfg.dim_head
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device="cpu") / d))
    rs = cfg.rope_scaling or {}
    if rs.get("rope_type", rs.get("type")) != "llama3":
        return inv
    factor = rs["factor"]
    low, high = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
    old_ctx = rs.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@dataclass
class ForwardSpec:
    """How the new tokens of one forward attend.

    ``start``: cache length before the forward (the new tokens' KV goes to ``[start, start+T)``
    unless ``visible`` is set). ``mask``: ``[T, T]`` among the new tokens (None: causal).
    ``visible``: ``[groups, n]`` cached positions for a partial (draft) forward, groups being
    ``layers * kv_heads``, ``layers`` (one set per layer) or 1. ``score``: ``(row, lo, hi)`` asks
    for Eq. 2 scores of query ``row`` against cached positions ``[lo, hi)``, returned per layer in
    ``scores``. ``prefix_logits``: ``(rows, lo, hi)`` asks for the pre-softmax logits of the first
    ``rows`` query rows against cached positions ``[lo, hi)`` (committed before this forward),
    averaged over those rows and each KV head's query heads: ``[kv_heads, hi - lo]`` per layer
    in ``prefix_scores`` (:func:`sgl_longgen.core.verify_scores.mean_logits`).
    """

    start: int
    mask: torch.Tensor | None = None
    visible: torch.Tensor | None = None
    score: tuple[int, int, int] | None = None
    scores: list[torch.Tensor] = field(default_factory=list)
    prefix_logits: tuple[int, int, int] | None = None
    prefix_scores: list[torch.Tensor] = field(default_factory=list)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.n_kv, self.d = cfg.num_attention_heads, cfg.n_kv_heads, cfg.dim_head
        bias = cfg.qkv_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.d, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.d, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.d, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.d, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.scale = 1.0 / math.sqrt(self.d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, spec: ForwardSpec) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.n_heads, self.d)
        k = self.k_proj(x).view(T, self.n_kv, self.d)
        v = self.v_proj(x).view(T, self.n_kv, self.d)
        q = q * cos[:, None] + _rotate_half(q) * sin[:, None]
        k = k * cos[:, None] + _rotate_half(k) * sin[:, None]
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, T, D]
        kc, vc = cache.k[self.layer_id], cache.v[self.layer_id]
        new_mask = spec.mask if spec.mask is not None else torch.ones(T, T, dtype=torch.bool, device=x.device).tril()

        if spec.visible is None:
            s = spec.start
            kc[:, s : s + T] = k
            vc[:, s : s + T] = v
            keys, values = kc[:, : s + T], vc[:, : s + T]
            mask = torch.cat([torch.ones(T, s, dtype=torch.bool, device=x.device), new_mask], dim=1)
        else:
            vis = spec.visible
            if vis.shape[0] > 1:
                per_layer = vis.shape[0] // cache.k.shape[0]  # kv_heads or 1
                vis = vis[self.layer_id * per_layer : (self.layer_id + 1) * per_layer]
            vis = vis.expand(self.n_kv, -1).to(x.device)
            idx = vis[..., None].expand(-1, -1, self.d)
            keys = torch.cat([kc.gather(1, idx), k], dim=1)
            values = torch.cat([vc.gather(1, idx), v], dim=1)
            mask = torch.cat([torch.ones(T, vis.shape[1], dtype=torch.bool, device=x.device), new_mask], dim=1)
        if spec.score is not None:
            row, lo, hi = spec.score
            spec.scores.append(gqa_importance(q[row], kc[:, lo:hi], self.scale))
        if spec.prefix_logits is not None:
            rows, lo, hi = spec.prefix_logits
            spec.prefix_scores.append(mean_logits(q[:rows], kc[:, lo:hi], self.scale))

        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask, scale=self.scale, enable_gqa=True
        )[0].transpose(0, 1)  # [T, Hq, D]
        return self.o_proj(out.reshape(T, self.n_heads * self.d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_id)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache, spec):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, spec)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # A plain attribute, not a buffer: it must stay float64 on the CPU whatever the weights
        # are converted to (and survive construction on the meta device).
        self.inv_freq = rope_inv_freq(cfg)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def new_cache(self, capacity: int) -> KVCache:
        c = self.config
        return KVCache(c.num_hidden_layers, c.n_kv_heads, c.dim_head, capacity, self.dtype, self.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, spec: ForwardSpec,
                extra_embeddings: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after the last decoder layer, *before* the final norm (``[T, d]``).

        ``extra_embeddings`` (``[n, d]``) gives input-only tokens past the vocabulary: id
        ``vocab_size + i`` embeds as row i (OWL's [SPEC] token). The LM head never outputs them.
        """
        inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.to(torch.float64)[:, None] * inv_freq[None]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        x = self.embed(input_ids, extra_embeddings)
        for layer in self.model.layers:
            x = layer(x, cos, sin, cache, spec)
        return x

    def embed(self, input_ids: torch.Tensor, extra_embeddings: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings; ids from ``vocab_size`` on select rows of ``extra_embeddings``."""
        if extra_embeddings is None:
            return self.model.embed_tokens(input_ids)
        V = self.config.vocab_size
        extra = extra_embeddings.to(device=input_ids.device, dtype=self.model.embed_tokens.weight.dtype)
        base = self.model.embed_tokens(input_ids.clamp(max=V - 1))
        rows = extra[(input_ids - V).clamp(min=0, max=extra.shape[0] - 1)]
        return torch.where((input_ids >= V)[..., None], rows, base)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Base LM head on pre-norm hidden states."""
        return self.lm_head(self.model.norm(hidden))
