"""The batched, cache-free causal forward used for training.

It runs the runtime :class:`~sgl_longgen.runtime.model.Transformer`'s own modules (same weights,
same parameter names) with plain causal attention over ``[batch, T]`` windows, so nothing about
inference changes and a trained model is saved straight from those modules. RoPE angles are
computed in float64 like the runtime's, then cast to the activations' dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..runtime.model import Attention, Transformer


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_tables(model: Transformer, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``[T, head_dim]`` for positions ``0..T-1`` (float32, or float64 for a float64 model)."""
    positions = torch.arange(length, dtype=torch.float64)
    freqs = positions[:, None] * model.inv_freq[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    dtype = torch.float64 if model.dtype == torch.float64 else torch.float32
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def _attention(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    B, T, _ = x.shape
    q = attn.q_proj(x).view(B, T, attn.n_heads, attn.d).transpose(1, 2)  # [B, H, T, D]
    k = attn.k_proj(x).view(B, T, attn.n_kv, attn.d).transpose(1, 2)
    v = attn.v_proj(x).view(B, T, attn.n_kv, attn.d).transpose(1, 2)
    cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    if attn.n_kv != attn.n_heads:
        # Query head h reads KV head h // group, as the runtime's enable_gqa does. Expanding here
        # keeps every SDPA backend (flash, cuDNN) available.
        group = attn.n_heads // attn.n_kv
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale)
    return attn.o_proj(out.transpose(1, 2).reshape(B, T, attn.n_heads * attn.d))


def causal_hidden(model: Transformer, input_ids: torch.Tensor) -> torch.Tensor:
    """Last decoder layer's output *before* the final norm, ``[B, T, d]`` (positions 0..T-1)."""
    cos, sin = rope_tables(model, input_ids.shape[1], input_ids.device)
    x = model.model.embed_tokens(input_ids)
    for layer in model.model.layers:
        x = x + _attention(layer.self_attn, layer.input_layernorm(x), cos, sin)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return x
