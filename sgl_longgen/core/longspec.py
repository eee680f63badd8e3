"""LongSpec's memory-constant drafter: the block, and the checkpoint it writes.

The drafter (LongSpec, arXiv 2502.17421, after GliDe) is one decoder block of the target's shape:

    h = e + SelfAttn(Norm_in(e))         over a sliding window of the drafter's own tokens
    h = h + CrossAttn(Norm_self(h))      queries from the drafter, K/V = the target's last-layer cache
    h = h + MLP(Norm_cross(h))
    logits = LMHead_target(Norm_out(h))  with e = Embed_target(token)

The token embedding and the LM head are the target's own (not stored in the checkpoint: for a
128K vocabulary they would dwarf the block). ``Norm_out`` is the drafter's (LongSpec feeds the head
the raw block output; a learned RMSNorm, started at the target's final norm, gives the shared head
inputs on the scale it was trained for, at d parameters).

**Why the memory is constant.** The self-attention keys and values of a token depend on nothing
but its id and position (the block's input is the shared embedding), so the drafter's own KV is a
ring of the last ``window`` tokens (:class:`~.longspec_beam.WindowCache`; in an engine a row of a
:class:`~sgl_longgen.kernels.longspec_step.RingPool`), refilled from the token ids whenever the
history grows. The cross-attention reads the target's last-layer K/V *in place*: the cache the
target keeps anyway, and only its committed positions ``[0, L)`` (never a verify tree's slots, so
a draft never sees in-flight KV). The queries carry RoPE at the drafter token's own position with
the target's frequencies (:mod:`.longspec_rope`), which is why a checkpoint records and checks the
target's RoPE settings.

A drafter writes its checkpoint (:meth:`LongSpecDrafter.save`: ``longspec.json`` and
``longspec.safetensors``); :mod:`.longspec_checkpoint` checks one against its target and loads it.
The rest of LongSpec sits beside this module, one job each: where the queries sit and how they are
rotated (:mod:`.longspec_rope`), the matrices a beam reads (:mod:`.longspec_weights`: the head of a
reduced draft vocabulary, fp8 copies, fused projections) and the beam tree (:mod:`.longspec_beam`).
An engine's batched step, graphable and on the device's kernels, is
:mod:`sgl_longgen.kernels.longspec_step`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from .draft_vocab import DraftVocabulary, token_map_problem
from .longspec_rope import apply_rope
from .nn import RMSNorm

FORMAT = "sgl-longgen.longspec-drafter"
VERSION = 1
CONFIG_FILE = "longspec.json"
WEIGHTS_FILE = "longspec.safetensors"
DEFAULT_WINDOW = 512


def _heads(x: torch.Tensor, n: int, d: int) -> torch.Tensor:
    """``[..., T, n * d]`` -> ``[..., n, T, d]``."""
    return x.view(*x.shape[:-1], n, d).transpose(-3, -2)


def _merge(x: torch.Tensor) -> torch.Tensor:
    """``[..., n, T, d]`` -> ``[..., T, n * d]``."""
    x = x.transpose(-3, -2)
    return x.reshape(*x.shape[:-2], -1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
            causal: bool = False) -> torch.Tensor:
    """SDPA with GQA; ``mask``: ``[..., T, S]`` booleans shared by the heads (None: all visible)."""
    if mask is not None:
        mask = mask.unsqueeze(-3)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                          enable_gqa=k.shape[-3] != q.shape[-3])


class SelfAttention(nn.Module):
    """Attention over the drafter's own tokens (the caller restricts the keys to the window)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.scale = 1.0 / math.sqrt(head_dim)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (with RoPE) and values ``[..., Hkv, T, D]`` of normed inputs ``x``."""
        k = apply_rope(_heads(self.k_proj(x), self.kv_heads, self.head_dim), cos, sin)
        return k, _heads(self.v_proj(x), self.kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor | None,
                ctx_v: torch.Tensor | None, mask: torch.Tensor | None, own_mask: torch.Tensor | None = None,
                causal: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows ``x`` attend to the context keys ``ctx_k`` then their own keys.

        ``mask``: ``[..., T, S_ctx + T]`` (or, with no context, ``[..., T, T]``); ``causal`` instead
        of a mask for a context-free causal pass. Returns the output and the rows' own K/V.
        """
        q = apply_rope(_heads(self.q_proj(x), self.heads, self.head_dim), cos, sin)
        k, v = self.kv(x, cos, sin)
        keys = k if ctx_k is None else torch.cat([ctx_k, k], dim=-2)
        values = v if ctx_v is None else torch.cat([ctx_v, v], dim=-2)
        out = _attend(q, keys, values, mask, self.scale, causal=causal and mask is None)
        return self.o_proj(_merge(out)), k, v


class CrossAttention(nn.Module):
    """Queries from the drafter into the target's last-layer K/V (no K/V projections of its own)."""

    def __init__(self, hidden: int, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.scale = 1.0 / math.sqrt(head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor, mask: torch.Tensor | None = None, lag: int = 0) -> torch.Tensor:
        """``keys``/``values``: ``[..., Hkv, C, D]`` target K/V (RoPE already in the keys).

        ``lag`` (training, flash noisy training): row t sees target positions ``<= t - lag`` only,
        as at inference, where a draft token ``lag`` steps past the committed length sees the
        target's KV up to that length. Computed as LongSpec does: the first ``lag`` queries and
        the last ``lag`` keys are dropped, an ordinary causal attention runs, the output is
        left-padded with ``lag`` zero rows (rows that would see no key at all).
        """
        q = apply_rope(_heads(self.q_proj(x), self.heads, self.head_dim), cos, sin)
        if lag:
            T, C = q.shape[-2], keys.shape[-2]
            if T != C:
                raise ValueError(f"a lagged cross-attention needs one key per query ({T} queries, {C} keys)")
            out = _attend(q[..., lag:, :], keys[..., : C - lag, :], values[..., : C - lag, :], None, self.scale,
                          causal=True)
            out = torch.cat([out.new_zeros(*out.shape[:-2], lag, out.shape[-1]), out], dim=-2)
        else:
            out = _attend(q, keys, values, mask, self.scale)
        return self.o_proj(_merge(out))

    def forward_with(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     attend: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """:meth:`forward` with the attention supplied by the caller: ``attend(q)``, ``q``
        ``[..., H, T, D]`` with RoPE, returns the attention over the target's committed K/V. An
        engine reads those where its cache keeps them (a paged pool) instead of handing them over."""
        q = apply_rope(_heads(self.q_proj(x), self.heads, self.head_dim), cos, sin)
        return self.o_proj(_merge(attend(q)))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LongSpecDrafter(DraftVocabulary, nn.Module):
    """The block. ``num_heads``/``num_kv_heads``/``head_dim``: the target's (the cross-attention
    reads its K/V heads; the self-attention uses the same shape). ``window``: tokens of its own
    the self-attention sees, itself included. ``rope_theta``/``rope_scaling``: the target's,
    recorded so a checkpoint is refused by a target whose keys carry another RoPE.
    ``draft_vocab_size``: the target tokens the drafter scores (default: all of them); below
    ``vocab_size`` they are listed by the ``token_map`` buffer (draft id -> target id)."""

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate_size: int, window: int = DEFAULT_WINDOW, rope_theta: float = 10000.0,
                 rope_scaling: dict | None = None, norm_eps: float = 1e-6, draft_vocab_size: int | None = None):
        super().__init__()
        if min(hidden_size, vocab_size, num_heads, num_kv_heads, head_dim, intermediate_size, window) < 1:
            raise ValueError("every size of a LongSpec drafter must be positive")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if draft_vocab_size is not None and not 1 <= draft_vocab_size <= vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {vocab_size}], got {draft_vocab_size}")
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        # The whole vocabulary needs no map: a full drafter keeps the checkpoint format of before.
        self.draft_vocab_size = vocab_size if draft_vocab_size is None else draft_vocab_size
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.intermediate_size, self.window, self.norm_eps = intermediate_size, window, norm_eps
        self.rope_theta, self.rope_scaling = float(rope_theta), rope_scaling
        self.input_layernorm = RMSNorm(hidden_size, norm_eps)
        self.self_attn = SelfAttention(hidden_size, num_heads, num_kv_heads, head_dim)
        self.post_self_attention_layernorm = RMSNorm(hidden_size, norm_eps)
        self.cross_attn = CrossAttention(hidden_size, num_heads, head_dim)
        self.post_cross_attention_layernorm = RMSNorm(hidden_size, norm_eps)
        self.mlp = MLP(hidden_size, intermediate_size)
        self.norm = RMSNorm(hidden_size, norm_eps)
        self.token_map: torch.Tensor | None
        if self.reduced:
            # Draft id -> target id; a placeholder until set_token_map (or a checkpoint) fills it.
            self.register_buffer("token_map", torch.arange(self.draft_vocab_size, dtype=torch.long))
        else:
            self.token_map = None

    @classmethod
    def for_target(cls, cfg, intermediate_size: int = 0, window: int = DEFAULT_WINDOW,
                   draft_vocab_size: int | None = None) -> LongSpecDrafter:
        """A drafter shaped for a target (a runtime ``ModelConfig``); ``intermediate_size`` 0: the target's."""
        return cls(cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads, cfg.n_kv_heads, cfg.dim_head,
                   intermediate_size or cfg.intermediate_size, window, cfg.rope_theta, cfg.rope_scaling,
                   cfg.rms_norm_eps, draft_vocab_size)

    # -- the reduced draft vocabulary ----------------------------------------------------------

    def with_token_map(self, token_map: torch.Tensor | Sequence[int]) -> LongSpecDrafter:
        """A copy of this drafter's block scoring only ``token_map``'s target ids (its head is still
        the target's, so any drafter, trained with the full head or not, can be given a map)."""
        ids = torch.as_tensor(token_map)
        c = self.config()
        out = build_drafter({**c, "draft_vocab_size": int(ids.numel())}).to(next(self.parameters()))
        state = {k: v for k, v in self.state_dict().items() if k != "token_map"}
        out.load_state_dict(state, strict=False)
        if out.reduced:
            out.set_token_map(ids.to(out.token_map.device))
        elif not torch.equal(ids.sort().values.cpu(), torch.arange(self.vocab_size)):
            raise ValueError(f"token map {token_map_problem(ids, self.vocab_size, self.vocab_size)}")
        return out.train(self.training)

    def reset_parameters(self, generator: torch.Generator | None = None, final_norm: torch.Tensor | None = None,
                         std: float | None = None) -> None:
        """Matrices ~ N(0, 1/fan_in) (``std`` overrides), output projections at a tenth of that so the
        block starts close to the identity of the embedding; norms at 1, the output norm at the
        target's final norm (``final_norm``) so the shared head starts on familiar inputs."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    s = std if std is not None else 1.0 / math.sqrt(p.shape[1])
                    if name.endswith(("o_proj.weight", "down_proj.weight")):
                        s = s * 0.1
                    p.normal_(0.0, s, generator=generator)
                else:
                    p.fill_(1.0)
            if final_norm is not None:
                self.norm.weight.copy_(final_norm.detach().to(self.norm.weight))

    # -- the forward ---------------------------------------------------------------------------

    def window_kv(self, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The self-attention K/V of tokens (``embeds``: their shared embeddings): a function of
        the token ids and positions alone, so a ring of them can be refilled from the history."""
        return self.self_attn.kv(self.input_layernorm(embeds), cos, sin)

    def forward(self, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor | None,
                ctx_v: torch.Tensor | None, self_mask: torch.Tensor | None, cross_k: torch.Tensor,
                cross_v: torch.Tensor, cross_mask: torch.Tensor | None = None, lag: int = 0, causal: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed output states (for the shared head) and the rows' own self-attention K/V."""
        a, k, v = self.self_attn(self.input_layernorm(embeds), cos, sin, ctx_k, ctx_v, self_mask, causal=causal)
        h = embeds + a
        h = h + self.cross_attn(self.post_self_attention_layernorm(h), cos, sin, cross_k, cross_v, cross_mask, lag)
        h = h + self.mlp(self.post_cross_attention_layernorm(h))
        return self.norm(h), k, v

    def forward_with(self, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
                     ctx_v: torch.Tensor, self_mask: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`forward` with the cross-attention's attention supplied (see :meth:`CrossAttention.forward_with`)."""
        a, k, v = self.self_attn(self.input_layernorm(embeds), cos, sin, ctx_k, ctx_v, self_mask)
        h = embeds + a
        h = h + self.cross_attn.forward_with(self.post_self_attention_layernorm(h), cos, sin, attend)
        h = h + self.mlp(self.post_cross_attention_layernorm(h))
        return self.norm(h), k, v

    # -- checkpoint ----------------------------------------------------------------------------

    def config(self) -> dict:
        return {
            "format": FORMAT, "version": VERSION, "hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
            "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size, "window": self.window, "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling, "norm_eps": self.norm_eps,
            # absent: the full vocabulary, as in checkpoints that predate the field
            **({"draft_vocab_size": self.draft_vocab_size} if self.reduced else {}),
        }

    def save(self, directory: str | Path, **extra) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: (v.detach().to(torch.float32) if v.is_floating_point() else v.detach()).contiguous().cpu()
                 for k, v in self.state_dict().items()}  # the token map stays int64
        save_file(state, str(directory / WEIGHTS_FILE))
        (directory / CONFIG_FILE).write_text(json.dumps({**self.config(), **extra}, indent=2) + "\n")
        return directory


def build_drafter(cfg: dict) -> LongSpecDrafter:
    """The (untrained) block a ``longspec.json`` describes."""
    return LongSpecDrafter(cfg["hidden_size"], cfg["vocab_size"], cfg["num_heads"], cfg["num_kv_heads"],
                           cfg["head_dim"], cfg["intermediate_size"], cfg["window"], float(cfg["rope_theta"]),
                           cfg.get("rope_scaling"), float(cfg["norm_eps"]), cfg.get("draft_vocab_size"))
