"""LongSpec's memory-constant drafter, its checkpoint format and its beam tree.

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
ring of the last ``window`` tokens (:class:`WindowCache`; in an engine a row of a
:class:`RingPool`), refilled from the token ids whenever the history grows. The cross-attention reads the target's last-layer K/V *in place*: the cache the
target keeps anyway, and only its committed positions ``[0, L)`` (never a verify tree's slots, so
a draft never sees in-flight KV). The queries carry RoPE at the drafter token's own position with
the target's frequencies, which is why a checkpoint records and checks the target's RoPE settings.

**Anchor-Offset Indices** (:func:`anchor_offset_positions`): training positions ``0 .. a-1`` are
kept as attention sinks and every later one is shifted by one random offset, so a drafter trained
on short samples sees the large positions it meets in a long generation. The target computes its
K/V with the same positions (only its loss, not its weights, sees them).

**The beam tree** (:func:`expand`): per-level widths ``[w1, .., wD]`` (LongSpec's
``[4, 16, 16, 16, 16]``); level 1 is the root's top ``w1`` tokens, level i the ``wi`` best
(parent, token) pairs over *all* children of level i - 1 by cumulative log-probability. The pool
is then cut to the ``tree_size`` best nodes (closed under ancestors: a parent scores at least as
much as its child and wins ties by coming first). Which nodes are drafted never changes the
output: every committed token is drawn by the shared per-node walk (:mod:`.verify`).
:func:`expand_batch` is the same beam for a batch of requests (an engine's step: one block
forward per level for all of them), the cross-attention handed in by the engine, which reads the
target's K/V where its cache keeps them; row b is what :func:`expand` builds for request b. There
the rings are rows of one :class:`RingPool`, the step's host input is one packed int64 row per
request (:class:`BeamPlan`, which also holds every tensor that depends only on the beam's shape),
and :func:`expand_rings` feeds the step's few new tokens into the rings and runs the beam with
fixed shapes and no host reads, so an engine replays the whole step as one CUDA graph; only a
longer feed (a request's first draft) goes through :func:`feed_rings` before it.

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

import itertools
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from ..errors import LonggenError
from .draft_vocab import DraftVocabulary, check_token_map_file, token_map_problem
from .fp8 import Fp8Linear, linear, quantize_linears
from .nn import RMSNorm
from .owl import DraftBeam
from .tree import DraftTree, Source, add_beam
from .weights import (
    check_shapes,
    expected_shapes,
    header_shapes,
    read_config,
    read_weights,
)

FORMAT = "sgl-longgen.longspec-drafter"
VERSION = 1
CONFIG_FILE = "longspec.json"
WEIGHTS_FILE = "longspec.safetensors"
DEFAULT_WINDOW = 512
DEFAULT_WIDTHS = (4, 16, 16, 16, 16)

# What ``weights = "fp8"`` quantizes in the block (its head: :func:`draft_head`).
FP8_LAYERS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "cross_attn.q_proj",
              "cross_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")

# The target's settings a drafter must share: the shapes it reads (embedding rows, K/V heads of
# the last layer) and the RoPE its queries must carry to meet the target's keys.
TARGET_FIELDS = ("hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim", "rope_theta", "rope_scaling")


# ----------------------------------------------------------------------------------------------
# positions


def anchor_offset_positions(length: int, anchors: int, offset: int) -> torch.Tensor:
    """``[0, .., a-1, a + offset, .., length - 1 + offset]`` (LongSpec Alg. 1; ``a = anchors``).

    The first ``anchors`` positions stay where the target's attention sinks expect them; the rest
    keep their spacing (RoPE sees relative distances) but sit ``offset`` further out.
    """
    if length < 0 or anchors < 0 or offset < 0:
        raise ValueError("length, anchors and offset must be non-negative")
    pos = torch.arange(length, dtype=torch.long)
    pos[anchors:] += offset
    return pos


def sample_anchor_offset(length: int, max_position: int, anchors: int, max_offset: int,
                         generator: torch.Generator | None = None) -> torch.Tensor:
    """Anchor-offset positions with an offset uniform in ``[0, min(max_offset, max_position - length)]``.

    ``max_position``: the target's context (positions stay below it).
    """
    high = max(0, min(max_offset, max_position - length))
    offset = int(torch.randint(0, high + 1, (), generator=generator))
    return anchor_offset_positions(length, min(anchors, length), offset)


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[..., T, head_dim]`` for ``positions`` (float64 angles, as the target computes them)."""
    freqs = positions.to(torch.float64)[..., None] * inv_freq.to(device=positions.device, dtype=torch.float64)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x``: ``[..., H, T, D]``; ``cos``/``sin``: ``[..., T, D]`` (broadcast over heads)."""
    cos, sin = cos.unsqueeze(-3).to(x.dtype), sin.unsqueeze(-3).to(x.dtype)
    return x * cos + _rotate_half(x) * sin


# ----------------------------------------------------------------------------------------------
# the block


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
        out = _build({**c, "draft_vocab_size": int(ids.numel())}).to(next(self.parameters()))
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


def target_settings(cfg) -> dict:
    """What a drafter must share with a target (a runtime ``ModelConfig``), keyed as in ``longspec.json``."""
    return {"hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size, "num_heads": cfg.num_attention_heads,
            "num_kv_heads": cfg.n_kv_heads, "head_dim": cfg.dim_head, "rope_theta": float(cfg.rope_theta),
            "rope_scaling": cfg.rope_scaling}


def rope_scaling_key(scaling) -> dict | None:
    """A RoPE scaling table in one spelling, for comparing a checkpoint's with a target's: ``type``
    read as ``rope_type``, a ``rope_theta`` folded in (transformers 5 keeps it in
    ``rope_parameters``) dropped, and no scaling at all (None, empty, ``rope_type = "default"``
    alone) as None."""
    if not scaling:
        return None
    out = {k: v for k, v in dict(scaling).items() if k not in ("rope_theta", "type")}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default" and not set(out) - {"rope_type"}:
        return None
    out["rope_type"] = kind
    return {k: float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for k, v in out.items()}


def rope_settings(config) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling)`` of a HF config, a mapping or an object, in either spelling:
    top-level ``rope_theta``/``rope_scaling``, or ``rope_parameters`` holding both (transformers 5)."""
    get = config.get if isinstance(config, dict) else (lambda key, default=None: getattr(config, key, default))
    params = get("rope_parameters")
    if isinstance(params, dict) and params:
        return float(params.get("rope_theta", get("rope_theta", 10000.0) or 10000.0)), rope_scaling_key(params)
    return float(get("rope_theta", 10000.0) or 10000.0), rope_scaling_key(get("rope_scaling"))


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def read_drafter_config(directory: str | Path) -> dict:
    cfg = read_config(directory, CONFIG_FILE, FORMAT, VERSION, "LongSpec drafter")
    cfg_path = Path(directory) / CONFIG_FILE
    for key in ("hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "window"):
        if not _positive_int(cfg.get(key)):
            raise LonggenError(f"{cfg_path}: '{key}' must be a positive integer")
    if cfg["num_heads"] % cfg["num_kv_heads"]:
        raise LonggenError(f"{cfg_path}: 'num_heads' must be a multiple of 'num_kv_heads'")
    for key in ("rope_theta", "norm_eps"):
        value = cfg.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise LonggenError(f"{cfg_path}: '{key}' must be a positive number")
    if cfg.get("rope_scaling") is not None and not isinstance(cfg["rope_scaling"], dict):
        raise LonggenError(f"{cfg_path}: 'rope_scaling' must be a table or null")
    if "draft_vocab_size" in cfg and not (_positive_int(cfg["draft_vocab_size"])
                                          and cfg["draft_vocab_size"] <= cfg["vocab_size"]):
        raise LonggenError(f"{cfg_path}: 'draft_vocab_size' must be an integer in [1, vocab_size = "
                           f"{cfg['vocab_size']}], got {cfg['draft_vocab_size']!r}")
    return cfg


def check_target(directory: str | Path, cfg: dict, target: dict) -> None:
    """The drafter (``cfg``: its ``longspec.json``) was built for ``target`` (see
    :func:`target_settings`): its queries meet the target's last-layer keys, so the shapes and the
    RoPE must be the target's (theta as a number, scaling in one spelling). One error naming the file."""
    for key, want in target.items():
        have = cfg.get(key)
        if key == "rope_theta":
            same = have is not None and want is not None and float(have) == float(want)
        elif key == "rope_scaling":
            same = rope_scaling_key(have) == rope_scaling_key(want)
        else:
            same = have == want
        if not same:
            raise LonggenError(f"LongSpec drafter in {directory} was built for {key} = {have!r} but the model's is "
                               f"{want!r} ({Path(directory) / CONFIG_FILE})")


def check_drafter(directory: str | Path, target: dict | None = None) -> dict:
    """Validate a drafter checkpoint (file headers only) and, given ``target`` (see
    :func:`target_settings`), that it was built for that target: one error naming the file."""
    directory = Path(directory)
    cfg = read_drafter_config(directory)
    cfg_path = directory / CONFIG_FILE
    check_target(directory, cfg, target or {})
    weights = directory / WEIGHTS_FILE
    check_shapes(header_shapes(weights), expected_shapes(lambda: _build(cfg)), weights, cfg_path, exact=True)
    check_token_map_file(weights, cfg, cfg_path)
    return cfg


def _build(cfg: dict) -> LongSpecDrafter:
    return LongSpecDrafter(cfg["hidden_size"], cfg["vocab_size"], cfg["num_heads"], cfg["num_kv_heads"],
                           cfg["head_dim"], cfg["intermediate_size"], cfg["window"], float(cfg["rope_theta"]),
                           cfg.get("rope_scaling"), float(cfg["norm_eps"]), cfg.get("draft_vocab_size"))


def load_drafter(directory: str | Path, target: dict | None = None, dtype: torch.dtype = torch.float32
                 ) -> LongSpecDrafter:
    """Load a drafter checkpoint after :func:`check_drafter`."""
    directory = Path(directory)
    cfg = check_drafter(directory, target)
    drafter = _build(cfg)
    drafter.load_state_dict(read_weights(directory / WEIGHTS_FILE))
    return drafter.to(dtype).eval().requires_grad_(False)


def quantize_fp8(drafter: LongSpecDrafter) -> LongSpecDrafter:
    """The block with its projections and MLP as :class:`~.fp8.Fp8Linear` (in place, once its
    device and dtype are set; a later ``.to`` moves them without recasting), fused again if they
    were (:func:`fuse_projections`). Only the fp8 copies are kept; its head is :func:`draft_head`'s."""
    fused = _fused(drafter) is not None
    if hasattr(drafter, "_fused_projections"):  # its full-precision matrices would outlive the layers
        del drafter._fused_projections
    quantize_linears(drafter, FP8_LAYERS)
    if fused:
        fuse_projections(drafter)
    return drafter


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


def _draft_width(drafter: LongSpecDrafter, logits: torch.Tensor) -> int:
    """Logit columns of the head the beam was handed: the drafter's vocabulary, or a clear error."""
    V = logits.shape[-1]
    if drafter.reduced and V != drafter.draft_vocab_size:
        raise ValueError(f"the drafter scores {drafter.draft_vocab_size} mapped tokens but its head gave {V} "
                         "logits: pass draft_head(drafter, ...)")
    return V


# ----------------------------------------------------------------------------------------------
# the window ring


class WindowCache:
    """The drafter's own K/V for one request: a ring of ``window`` slots, position p in slot p % window.

    Its size is fixed when the request starts, whatever the context grows to: this is all the
    memory the drafter adds (the cross-attention reads the target's cache in place).
    """

    def __init__(self, kv_heads: int, window: int, head_dim: int, dtype: torch.dtype, device):
        self.window = window
        self.k = torch.zeros(kv_heads, window, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.pos = torch.full((window,), -1, dtype=torch.long, device=device)  # -1: empty slot

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.pos))

    def reset(self) -> None:
        self.pos.fill_(-1)

    def write(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """K/V ``[Hkv, T, D]`` of ascending ``positions``; only the last ``window`` can matter."""
        positions, k, v = positions[-self.window :], k[:, -self.window :], v[:, -self.window :]
        slots = positions % self.window
        self.k[:, slots] = k
        self.v[:, slots] = v
        self.pos[slots] = positions

    def visible(self, query_positions: torch.Tensor) -> torch.Tensor:
        """``[T, window]``: slot s holds a position inside query t's window ``(p_t - window, p_t]``."""
        p = self.pos[None, :]
        q = query_positions[:, None]
        return (p >= 0) & (p <= q) & (p > q - self.window)


# ----------------------------------------------------------------------------------------------
# the beam tree


def pool_size(widths: Sequence[int]) -> int:
    """Draft nodes the beam creates before the cut."""
    return sum(widths)


def verify_width(widths: Sequence[int], tree_size: int) -> int:
    """Rows of one verify forward: the root and at most ``tree_size`` draft nodes."""
    return min(tree_size, pool_size(widths)) + 1


def select_nodes(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                 n: int) -> DraftBeam:
    """The ``n`` best pool nodes of one request (``[P]`` each, parents before children), in creation
    order, parents renumbered. A stable descending sort keeps a parent ahead of a child of equal
    score, so the cut is closed under ancestors."""
    P = scores.shape[0]
    n = min(n, P)
    best = torch.sort(scores, descending=True, stable=True).indices[:n]
    sel = best.sort().values
    slot = torch.full((P,), -1, dtype=torch.long, device=scores.device)
    slot[sel] = torch.arange(n, device=scores.device)
    par = parents[sel]
    new_par = torch.where(par >= 0, slot[par.clamp(min=0)], par)
    if bool((new_par[par >= 0] < 0).any()):
        raise AssertionError("the cut tree is not closed under ancestors")
    return DraftBeam(tokens[sel][None], new_par[None], depths[sel][None], scores[sel][None])


@torch.no_grad()
def expand(drafter: LongSpecDrafter, embed: Callable[[torch.Tensor], torch.Tensor],
           head: Callable[[torch.Tensor], torch.Tensor], inv_freq: torch.Tensor, ring: WindowCache,
           target_k: torch.Tensor, target_v: torch.Tensor, pending: Sequence[int], start: int,
           widths: Sequence[int] = DEFAULT_WIDTHS, tree_size: int = 63) -> DraftBeam:
    """One request's beam tree (``[1, N]`` tensors).

    ``pending``: the history tokens the ring lacks, from position ``start``, the root (the last
    sampled token, at position ``L``) last; they join the ring first. ``target_k``/``target_v``:
    the target's last-layer K/V ``[Hkv, >= L, D]``; only positions ``[0, L)`` are read, the
    committed ones. ``embed``/``head``: the target's embedding and LM head (for a reduced-vocabulary
    drafter, :func:`draft_head`'s: the beam picks among its N logits and proposes the mapped target ids).
    """
    if not pending:
        raise ValueError("the drafter needs at least the root token")
    dev = ring.k.device
    dt = ring.k.dtype
    W = drafter.window
    L = start + len(pending) - 1
    cross_k, cross_v = target_k[:, :L], target_v[:, :L]
    feed = list(pending)[-W:]
    pos = torch.arange(L - len(feed) + 1, L + 1, device=dev)
    cos, sin = rope_tables(inv_freq, pos, dt)
    k, v = drafter.window_kv(embed(torch.tensor(feed, dtype=torch.long, device=dev)).to(dt), cos, sin)
    ring.write(pos, k, v)

    # The root: its window is the ring (its own slot included, so no own keys are added twice).
    root_pos = pos[-1:]
    x = embed(torch.tensor(feed[-1:], dtype=torch.long, device=dev)).to(dt)
    q_cos, q_sin = cos[-1:], sin[-1:]
    mask = ring.visible(root_pos) & (ring.pos != L)[None]
    h, _, _ = drafter(x, q_cos, q_sin, ring.k, ring.v, torch.cat([mask, torch.ones(1, 1, dtype=torch.bool, device=dev)], 1),
                      cross_k, cross_v)
    logp = torch.log_softmax(head(h).to(torch.float64 if dt == torch.float64 else torch.float32), dim=-1)[0]
    V = _draft_width(drafter, logp)
    w = min(widths[0], V)
    score, token = logp.topk(w)
    pool_s, pool_t = [score], [drafter.to_target(token)]
    pool_p = [torch.full((w,), -1, dtype=torch.long, device=dev)]
    pool_d = [torch.ones(w, dtype=torch.long, device=dev)]
    # anc[i, j]: pool node j is an ancestor of pool node i, or i itself (grown level by level)
    anc = torch.eye(w, dtype=torch.bool, device=dev)
    front = torch.arange(w, device=dev)  # pool indices of the frontier
    done_k = done_v = None  # self-attention K/V of the tree nodes already run, in pool order of ``done``
    done = torch.zeros(0, dtype=torch.long, device=dev)
    size = w
    for level in range(2, len(widths) + 1):
        n = front.shape[0]
        fpos = torch.full((n,), L + level - 1, dtype=torch.long, device=dev)
        f_cos, f_sin = rope_tables(inv_freq, fpos, dt)
        x = embed(torch.cat(pool_t)[front]).to(dt)
        ring_mask = ring.visible(fpos)
        parts_k, parts_v, masks = [ring.k], [ring.v], [ring_mask]
        if done_k is not None:
            parts_k.append(done_k)
            parts_v.append(done_v)
            # tree ancestors inside the window (always, unless the window is shallower than the tree)
            near = (level - 1 - torch.cat(pool_d)[done]) < W
            masks.append(anc[front][:, done] & near[None])
        masks.append(torch.eye(n, dtype=torch.bool, device=dev))
        h, fk, fv = drafter(x, f_cos, f_sin, torch.cat(parts_k, dim=1), torch.cat(parts_v, dim=1),
                            torch.cat(masks, dim=1), cross_k, cross_v)
        done_k = fk if done_k is None else torch.cat([done_k, fk], dim=1)
        done_v = fv if done_v is None else torch.cat([done_v, fv], dim=1)
        done = torch.cat([done, front])
        logp = torch.log_softmax(head(h).to(score.dtype), dim=-1)  # [n, V]
        w = min(widths[level - 1], n * V)
        score, pick, row = best_children(torch.cat(pool_s)[front], logp, w)
        parent = front[row]
        pool_s.append(score)
        pool_t.append(drafter.to_target(pick))
        pool_p.append(parent)
        pool_d.append(torch.full((w,), level, dtype=torch.long, device=dev))
        grown = torch.zeros(size + w, size + w, dtype=torch.bool, device=dev)
        grown[:size, :size] = anc
        grown[size:, :size] = anc[parent]
        grown[size:, size:] = torch.eye(w, dtype=torch.bool, device=dev)
        anc = grown
        front = torch.arange(size, size + w, device=dev)
        size += w
    return select_nodes(torch.cat(pool_s), torch.cat(pool_t), torch.cat(pool_p), torch.cat(pool_d), tree_size)


def best_children(parent_scores: torch.Tensor, logp: torch.Tensor, width: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``width`` best (parent, token) pairs of a level: ``parent_scores`` ``[..., n]`` (the
    frontier's cumulative log-probabilities), ``logp`` ``[..., n, V]`` (its rows' next-token
    log-probabilities). Returns their scores, draft ids and parent rows (``[..., width]``).

    Each row's top ``min(width, V)`` first, then the best of those ``n * min(width, V)``: a pair in
    the global top ``width`` is in its own row's top ``width`` (its row holds fewer better
    tokens than the whole level does), so this is the top ``width`` over all ``n * V`` children
    while the second top-k reads ``n * width`` candidates, not ``n * V``. The scores are the same
    sums (``parent + logp``), bit for bit. Only ties at the cut may be broken otherwise than one
    top-k over the flattened level would (both are best-``width`` sets; which one is drafted never
    changes what is committed); :func:`best_of_rows` breaks them the same way on every call.
    """
    return best_of_rows(parent_scores, *logp.topk(min(width, logp.shape[-1]), dim=-1), width)


def best_of_rows(parent_scores: torch.Tensor, top: torch.Tensor, ids: torch.Tensor, width: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`best_children` from each row's top ``k = min(width, V)`` log-probabilities ``top``
    and their draft ids ``ids`` (``[..., n, k]``, however they were found): best first, equal scores
    the lower row first, then the row's earlier candidate (a stable sort of a few hundred sums), the
    order of the GPU's one-launch pick (``kernels/longspec_topk.py``), whose twin this is."""
    k = top.shape[-1]
    cand = (parent_scores.unsqueeze(-1) + top).flatten(-2)
    flat = torch.sort(cand, dim=-1, descending=True, stable=True).indices[..., :width]
    return cand.gather(-1, flat), ids.flatten(-2).gather(-1, flat), torch.div(flat, k, rounding_mode="floor")


# positions [...] -> (cos, sin) [..., head_dim]: the target's RoPE at those positions
Rope = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# q [B, T, H, D] (RoPE applied) -> [B, T, H, D]: each request's queries over its committed target K/V
Attend = Callable[[torch.Tensor], torch.Tensor]

# Tokens per request the fixed-shape step feeds its ring (the root and what the last verify
# committed: at most the tree depth plus one); a longer feed (a request's first draft) first
# goes through :func:`feed_rings`.
DEFAULT_FEED = 8


def _window_visible(ring_pos: torch.Tensor, query_pos: torch.Tensor, window: int) -> torch.Tensor:
    """:meth:`WindowCache.visible` of stacked rings: ``ring_pos [B, W]``, ``query_pos [B, T]`` -> ``[B, T, W]``."""
    p, q = ring_pos[:, None, :], query_pos[:, :, None]
    return (p >= 0) & (p <= q) & (p > q - window)


class RingPool:
    """The window rings of an engine's drafting requests: one row of a shared tensor each.

    A request takes a row at its first draft and gives it back when it leaves, so its memory is
    still one ring of ``window`` tokens (position p in slot p % window), whatever its context.
    One tensor for every ring lets the step write the feed and read the batch's rings at fixed
    addresses (inside a CUDA graph, through row indices the host passes in) instead of stacking
    per-request rings and copying them into a graph's inputs each step. The last row is scratch:
    a feed's padding entries are written there, and no request reads it. A full pool doubles;
    ``version`` then changes, and a graph that captured the old tensors must be captured again.
    """

    def __init__(self, kv_heads: int, window: int, head_dim: int, dtype: torch.dtype, device, capacity: int = 8):
        if capacity < 1:
            raise ValueError("a ring pool holds at least one ring")
        self.window = window
        self.version = 0
        self.k = torch.zeros(capacity + 1, kv_heads, window, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.pos = torch.full((capacity + 1, window), -1, dtype=torch.long, device=device)  # -1: empty slot
        self.free = list(range(capacity - 1, -1, -1))  # pop() hands out the lowest row first

    @property
    def capacity(self) -> int:
        return self.k.shape[0] - 1

    @property
    def scratch(self) -> int:
        """The row padding entries write to (never a request's)."""
        return self.capacity

    @property
    def ring_nbytes(self) -> int:
        """One request's share: its K/V ring and the ring's positions."""
        return 2 * self.k[0].numel() * self.k.element_size() + self.pos[0].numel() * self.pos.element_size()

    def take(self) -> int:
        """An empty ring for a new request (the pool grows when none is free)."""
        if not self.free:
            self._grow()
        row = self.free.pop()
        self.pos[row].fill_(-1)
        return row

    def give(self, row: int) -> None:
        self.free.append(row)

    def clear(self) -> None:
        """Every ring free and empty (the engine dropped all its requests)."""
        self.pos.fill_(-1)
        self.free = list(range(self.capacity - 1, -1, -1))

    def held(self, row: int) -> int:
        """Positions ring ``row`` holds (a host read)."""
        return int((self.pos[row] >= 0).sum())

    def _grow(self) -> None:
        old = self.capacity
        k = self.k.new_zeros(2 * old + 1, *self.k.shape[1:])
        v = torch.zeros_like(k)
        pos = self.pos.new_full((2 * old + 1, self.window), -1)
        k[:old], v[:old], pos[:old] = self.k[:old], self.v[:old], self.pos[:old]
        self.k, self.v, self.pos = k, v, pos
        self.free.extend(range(2 * old - 1, old - 1, -1))
        self.version += 1


def _feed_row(tokens: Sequence[int], start: int, ring: int, width: int, scratch: int, window: int) -> list[int]:
    """One request's feed, right-aligned in ``width`` entries: token ids, the ring row and slot
    each K/V goes to, the position the slot records, the position its RoPE is taken at. Padding
    (in front) repeats the last token and position and is written to the scratch ring."""
    n, pad = len(tokens), width - len(tokens)
    positions = list(range(start, start + n))
    last_token, last_pos = (tokens[-1], positions[-1]) if n else (0, 0)
    return ([last_token] * pad + list(tokens) + [scratch] * pad + [ring] * n
            + [0] * pad + [p % window for p in positions] + [-1] * pad + positions + [last_pos] * pad + positions)


class BeamPlan:
    """What a batch's beam needs that follows from its widths, the draft vocabulary, the window,
    the feed width and the drafter's shapes alone: built once on the beam's device and read by
    every step (a CUDA graph captures it at fixed addresses) instead of rebuilt per level. The
    batch size enters by broadcasting only, so one plan serves every batch size.

    ``widths``: the levels' widths clamped to what the vocabulary allows (``w1 <= V``,
    ``wi <= w(i-1) * V``). Pool order: level 1's nodes, then level 2's, ...; ``offsets[i]``: the
    first node of level i + 1. Only levels 1 .. D-1 are forwarded (their rows draft the next
    level), so the tree's own K/V columns and the ancestor matrix cover those ``forwarded`` nodes.

    The step's input is one int64 row per request (:meth:`pack`, one host-to-device copy): its
    feed (``feed`` entries of token, ring row, slot, recorded position, RoPE position), the RoPE
    positions of the tree levels, and its ring row.
    """

    def __init__(self, widths: Sequence[int], tree_size: int, vocab: int, window: int, feed: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device, fused_topk: bool = True, fused_window: bool = True):
        if not widths or min(widths) < 1:
            raise ValueError(f"beam widths must be positive, got {list(widths)}")
        w = [min(widths[0], vocab)]
        for x in widths[1:]:
            w.append(min(x, w[-1] * vocab))
        self.widths, self.depth = tuple(w), len(w)
        self.tree_size, self.vocab, self.window = tree_size, vocab, window
        self.fused_topk = fused_topk  # on a GPU, each row's top-k through the Triton kernel
        self.fused_window = fused_window  # on a GPU, a level's rows join the window buffers inside its attention
        self.feed = max(1, min(feed, window))  # two positions of one ring slot never share a feed
        self.offsets = tuple(itertools.accumulate(w, initial=0))
        self.forwarded = P = self.offsets[-1] - w[-1]
        self.depths = torch.cat([torch.full((x,), level, dtype=torch.long) for level, x in enumerate(w, 1)]).to(device)
        self.first_parents = torch.full((w[0],), -1, dtype=torch.long, device=device)
        # ancestors (or self) of each forwarded node among the forwarded nodes: level 1's rows are
        # theirs alone; a later level's rows are their parents' plus their own column
        anc = torch.zeros(P, P, dtype=torch.bool)
        if P:
            anc[: w[0], : w[0]] = torch.eye(w[0], dtype=torch.bool)
        self.ancestors0 = anc.to(device)
        self.own = {level: torch.eye(P, dtype=torch.bool)[self.offsets[level - 1] : self.offsets[level]].to(device)
                    for level in range(2, self.depth)}
        # tree nodes within the window of level l's queries (all of them unless the window is
        # shallower than the tree): None where nothing is out of reach
        depth = self.depths[:P].cpu()
        near = {level: (level - 1 - depth) < window for level in range(2, self.depth + 1)}
        self.near = {level: None if bool(m.all()) else m.to(device) for level, m in near.items()}
        self.tree_pad = torch.zeros(1, kv_heads, P, head_dim, dtype=dtype, device=device)
        half = head_dim // 2
        sign = torch.cat([-torch.ones(half, dtype=torch.float64), torch.ones(head_dim - half, dtype=torch.float64)])
        self.sign = {t: sign.to(device=device, dtype=t)
                     for t in (torch.float64, torch.float32, torch.bfloat16, torch.float16)}

    @classmethod
    def for_drafter(cls, drafter: LongSpecDrafter, widths: Sequence[int], tree_size: int, feed: int,
                    dtype: torch.dtype, device, fused_topk: bool = True, fused_window: bool = True) -> BeamPlan:
        return cls(widths, tree_size, drafter.draft_vocab_size, drafter.window, feed, drafter.num_kv_heads,
                   drafter.head_dim, dtype, device, fused_topk, fused_window)

    @property
    def columns(self) -> int:
        """Int64 entries of one request's :meth:`pack` row."""
        return 5 * self.feed + self.depth

    def pack(self, pending: Sequence[Sequence[int]], starts: Sequence[int], rings: Sequence[int], scratch: int
             ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Host lists -> ``(pre, step)`` CPU int64 tensors: ``step`` ``[B, columns]`` the step's
        input (the last ``feed`` tokens of each request's feed, the root last); ``pre``
        ``[B, 5 * F']`` the earlier tokens of feeds longer than that (a request's first draft),
        for :func:`feed_rings`, or None. Only a feed's last ``window`` tokens can matter."""
        if not rings or len(rings) != len(pending) or len(pending) != len(starts):
            raise ValueError("one ring, one pending list and one start per request")
        if any(not p for p in pending):
            raise ValueError("the drafter needs at least the root token")
        W, Fw = self.window, self.feed
        feeds = [list(p)[-W:] for p in pending]
        firsts = [s + len(p) - len(f) for s, p, f in zip(starts, pending, feeds)]
        heads = [f[:-Fw] for f in feeds]
        pre = None
        width = max(len(h) for h in heads)
        if width:
            pre = torch.tensor([_feed_row(h, s, r, width, scratch, W) for h, s, r in zip(heads, firsts, rings)],
                               dtype=torch.long)
        rows = []
        for f, s, h, r in zip(feeds, firsts, heads, rings):
            last = s + len(f) - 1  # L: the root's position, the request's committed length
            rows.append(_feed_row(f[len(h):], s + len(h), r, Fw, scratch, W)
                        + [last + i for i in range(1, self.depth)] + [r])
        return pre, torch.tensor(rows, dtype=torch.long)

    def ancestors(self, batch: int) -> torch.Tensor:
        """The step's ``[B, P, P]`` ancestor matrix, level 1's rows filled (writable where later
        levels add rows)."""
        anc = self.ancestors0.expand(batch, -1, -1)
        return anc.clone() if self.depth > 2 else anc

    def tree_mask(self, ancestors: torch.Tensor, level: int) -> torch.Tensor:
        """``[B, n, lo + n]``: which forwarded nodes (those made so far) the frontier of ``level``
        (level - 1's nodes ``lo .. lo + n``) sees: its ancestors and itself, inside the window."""
        lo, n = self.offsets[level - 2], self.widths[level - 2]
        mask = ancestors[:, lo : lo + n, : lo + n]
        near = self.near[level]
        return mask if near is None else mask & near[: lo + n]

    def add_ancestors(self, ancestors: torch.Tensor, parents: torch.Tensor, level: int) -> None:
        """Level ``level``'s rows of the ancestor matrix: each node's parent's row and its own column."""
        lo, n = self.offsets[level - 1], self.widths[level - 1]
        rows = ancestors.gather(1, parents[:, :, None].expand(-1, -1, ancestors.shape[2]))
        ancestors[:, lo : lo + n] = rows | self.own[level]

    def rope_rows(self, rope: Rope, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin ``[..., 1, head_dim]`` (broadcast over heads) in ``dtype`` (see :func:`_rope`)."""
        cos, sin = rope(positions)
        return cos.to(dtype).unsqueeze(-2), (sin * self.sign[sin.dtype]).to(dtype).unsqueeze(-2)


# -- the step's block, functional: fused projections, fused norms, token-major rows [B, T, ...]


def fuse_projections(drafter: LongSpecDrafter) -> None:
    """Make the self-attention's q/k/v matrices one matrix and the MLP's gate/up one, the block's
    own weights becoming views of them (no second copy): a beam level then runs one GEMM where
    the block ran three (two), the small K/V projections no longer a launch and a poorly used
    GEMM each. Idempotent; a drafter moved or reloaded afterwards simply runs unfused (the
    step checks that the views are still its weights). FP8 layers (:func:`quantize_fp8`) fuse
    into one :class:`~.fp8.Fp8Linear`, their row scales with their rows."""
    if _fused(drafter) is not None:
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


def _fused(drafter: LongSpecDrafter) -> list | None:
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


def _project(x: torch.Tensor, whole: torch.Tensor | Fp8Linear | None, layers: Sequence[nn.Module]) -> torch.Tensor:
    if whole is not None:
        return linear(x, whole)
    return torch.cat([lin(x) for lin in layers], dim=-1)


def _norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """:class:`RMSNorm` as one fused op on a GPU (statistics in float32; the scale is applied
    before the cast back rather than after, a rounding apart)."""
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` for token-major ``x`` ``[..., heads, D]``, with ``sin_signed`` = sin with
    its first half negated: ``rotate_half(x) * sin`` = (the halves of ``x`` swapped) * ``sin_signed``,
    bit for bit, one flip where ``rotate_half`` took a negation and a concatenation."""
    swapped = x.unflatten(-1, (2, x.shape[-1] // 2)).flip(-2).flatten(-2)
    return x * cos + swapped * sin_signed


def _rotated_qkv(drafter: LongSpecDrafter, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The self-attention's queries and keys (RoPE'd together: ``[B, T, H + Hkv, D]``, queries
    first) and values ``[B, T, Hkv, D]`` of embeddings ``x`` ``[B, T, d]``."""
    a = drafter.self_attn
    fused = _fused(drafter)
    qkv = _project(_norm(drafter.input_layernorm, x), fused and fused[0], (a.q_proj, a.k_proj, a.v_proj))
    split = (a.heads + a.kv_heads) * a.head_dim
    qk = qkv[..., :split].unflatten(-1, (a.heads + a.kv_heads, a.head_dim))
    return _rope(qk, cos, sin_signed), qkv[..., split:].unflatten(-1, (a.kv_heads, a.head_dim))


def _on_kernels(x: torch.Tensor) -> bool:
    """Whether the step's Triton kernels take ``x``: on a GPU, and not in float64 (the CPU oracle's
    precision, which the kernels' twins serve)."""
    return x.is_cuda and x.dtype != torch.float64


def _self_attend(drafter: LongSpecDrafter, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
    """Rows ``q`` ``[B, T, H, D]`` over ``keys``/``values`` ``[B, Hkv, S, D]`` where ``mask``
    ``[B, T, S]`` allows; ``[B, T, H * D]``. On a GPU one Triton launch that reads the mask as it
    is (``kernels/masked_attention.py``); elsewhere SDPA, its twin."""
    if _on_kernels(q):
        from ..kernels.custom_ops import masked_attention  # one node of a torch.compile'd step

        return masked_attention(q, keys, values, mask, drafter.self_attn.scale)
    from ..kernels.masked_attention import masked_attention_reference

    return masked_attention_reference(q, keys, values, mask, drafter.self_attn.scale)


def _self_attend_into(drafter: LongSpecDrafter, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      new_k: torch.Tensor, new_v: torch.Tensor, at: int, ring_mask: torch.Tensor,
                      tree_mask: torch.Tensor, plan: BeamPlan) -> torch.Tensor:
    """A level's rows ``q`` ``[B, n, H, D]`` join the buffers (their K/V ``new_k``/``new_v``
    ``[B, n, Hkv, D]`` written at columns ``at .. at + n``) and attend over columns ``0 .. at + n``
    under the ring's ``[B, W]`` and the tree's ``[B, n, at + n - W]`` masks; ``[B, n, H * D]``. On a
    GPU (unless the plan says otherwise, or the level is wider than the kernel's one tile of new
    rows) one Triton launch that writes the buffers in place (``kernels/masked_attention.py``);
    elsewhere the writes, the masks concatenated and :func:`_self_attend`."""
    from ..kernels.masked_attention import MAX_NEW_ROWS, join_rows

    if plan.fused_window and _on_kernels(q) and q.shape[1] <= MAX_NEW_ROWS:
        from ..kernels.custom_ops import masked_attention_into  # one node of a torch.compile'd step

        return masked_attention_into(q, keys, values, new_k, new_v, at, ring_mask, tree_mask,
                                     drafter.self_attn.scale)

    mask = join_rows(keys, values, new_k, new_v, at, ring_mask, tree_mask)
    n = q.shape[1]
    return _self_attend(drafter, q, keys[:, :, : at + n], values[:, :, : at + n], mask)


def _block_tail(drafter: LongSpecDrafter, x: torch.Tensor, a: torch.Tensor, cos: torch.Tensor,
                sin_signed: torch.Tensor, attend: Attend) -> torch.Tensor:
    """The block past its self-attention (``x``: the rows' embeddings, ``a``: their self-attention
    ``[B, T, H * D]``): the normed states the head reads."""
    h = x + drafter.self_attn.o_proj(a)
    c = drafter.cross_attn
    q = c.q_proj(_norm(drafter.post_self_attention_layernorm, h)).unflatten(-1, (c.heads, c.head_dim))
    h = h + c.o_proj(attend(_rope(q, cos, sin_signed)).flatten(-2))
    m = drafter.mlp
    fused = _fused(drafter)
    gate, up = _project(_norm(drafter.post_cross_attention_layernorm, h), fused and fused[1],
                        (m.gate_proj, m.up_proj)).chunk(2, dim=-1)
    h = h + m.down_proj(F.silu(gate) * up)
    return _norm(drafter.norm, h)


def _row_top(head: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, k: int, plan: BeamPlan
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``k`` best next tokens: their log-probabilities (float32; float64 for a float64
    drafter) and draft ids. On a GPU one Triton pass over the logits (``kernels/longspec_topk.py``:
    the log-sum-exp and the top ``k`` per row, ties lowest id first) instead of a vocabulary-wide
    log-softmax and ``torch.topk``'s multi-block radix select; elsewhere those two."""
    logits = head(h)
    if logits.shape[-1] != plan.vocab:
        raise ValueError(f"the beam was planned for {plan.vocab} draft tokens but the head gave {logits.shape[-1]} "
                         "logits: pass draft_head(drafter, ...)")
    if _topk_kernels(plan, logits, k):
        from ..kernels.custom_ops import log_softmax_topk  # one node of a torch.compile'd step

        return log_softmax_topk(logits, k)
    logp = F.log_softmax(logits, dim=-1, dtype=torch.float64 if h.dtype == torch.float64 else torch.float32)
    return logp.topk(k, dim=-1)


def _best_of_level(parent_scores: torch.Tensor, top: torch.Tensor, ids: torch.Tensor, width: int, plan: BeamPlan
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`best_of_rows`; on a GPU one Triton launch (``kernels/longspec_topk.py``) where
    ``torch.topk`` of the level's few hundred candidates is a sort and a gather (the plan's widths
    leave every level at least ``width`` candidates)."""
    if _topk_kernels(plan, top, width):
        from ..kernels.custom_ops import best_of_rows as best_of_rows_kernel

        return best_of_rows_kernel(parent_scores, top, ids, width)
    return best_of_rows(parent_scores, top, ids, width)


def _topk_kernels(plan: BeamPlan, x: torch.Tensor, k: int) -> bool:
    """Whether a level's selections of ``k`` from ``x`` run the Triton kernels: on a GPU, unless the
    plan says otherwise, for a float32/bf16 beam (a float64 one is the CPU oracle's precision) and
    ``k`` within their unrolled selections."""
    if not (plan.fused_topk and _on_kernels(x)):
        return False
    from ..kernels.longspec_topk import MAX_K

    return k <= MAX_K


def _store(pool: tuple[torch.Tensor, torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor,
           rows: torch.Tensor) -> None:
    """Fed K/V ``[B, T, Hkv, D]`` into their rings; ``rows`` ``[B, 3T]``: ring row, slot, recorded position."""
    pool_k, pool_v, pool_pos = pool
    ring, slot, pos = rows.chunk(3, dim=1)
    pool_k[ring, :, slot] = k
    pool_v[ring, :, slot] = v
    pool_pos[ring, slot] = pos


@torch.no_grad()
def feed_rings(drafter: LongSpecDrafter, embed: Callable[[torch.Tensor], torch.Tensor], rope: Rope,
               pool: RingPool, pre: torch.Tensor, plan: BeamPlan) -> None:
    """The eager part of a long feed (``pre`` from :meth:`BeamPlan.pack`, on the pool's device):
    those tokens' window K/V into their rings, one projection for the batch. A steady step never
    needs it (its few tokens are fed inside :func:`expand_rings`)."""
    Fw = pre.shape[1] // 5
    dt = pool.k.dtype
    cos, sin = plan.rope_rows(rope, pre[:, 4 * Fw :], dt)
    qk, v = _rotated_qkv(drafter, embed(pre[:, :Fw]).to(dt), cos, sin)
    _store((pool.k, pool.v, pool.pos), qk[:, :, drafter.num_heads :], v, pre[:, Fw : 4 * Fw])


@torch.no_grad()
def expand_batch(drafter: LongSpecDrafter, embed: Callable[[torch.Tensor], torch.Tensor],
                 head: Callable[[torch.Tensor], torch.Tensor], rope: Rope, pool: RingPool, rings: Sequence[int],
                 attend: Attend, pending: Sequence[Sequence[int]], starts: Sequence[int],
                 widths: Sequence[int] = DEFAULT_WIDTHS, tree_size: int = 63, feed: int = DEFAULT_FEED,
                 plan: BeamPlan | None = None) -> DraftBeam:
    """:func:`expand` for a batch of requests, one drafter forward per level for all of them.

    Every request's beam has the same shape (the same widths, the same vocabulary), so a level is
    one ``[B, n]`` forward: its self-attention keys are each request's ring, its earlier tree nodes
    and its own rows (masks per request), its cross-attention is ``attend`` (each request's
    queries over the target's K/V of its committed positions ``[0, L_b)``, read however the
    engine keeps them). ``rope``: the target's cos/sin at given positions. ``rings[b]``: request
    b's row of ``pool``; ``pending[b]``, ``starts[b]``: as ``pending``, ``start`` of :func:`expand`.
    Returns ``[B, N]`` tensors, row b the tree :func:`expand` builds for request b.

    Three parts: :meth:`BeamPlan.pack` (host lists -> one int64 row per request),
    :func:`feed_rings` (only for feeds longer than ``feed`` tokens) and :func:`expand_rings` (the
    last ``feed`` tokens join their rings, then the beam: fixed shapes, no value read back, so an
    engine replays it as a CUDA graph).
    """
    if plan is None:
        plan = BeamPlan.for_drafter(drafter, widths, tree_size, feed, pool.k.dtype, pool.k.device)
    pre, step = plan.pack(pending, starts, rings, pool.scratch)
    if pre is not None:
        feed_rings(drafter, embed, rope, pool, pre.to(pool.k.device), plan)
    beam, broken = beam_of_rows(*expand_rings(drafter, embed, head, rope, (pool.k, pool.v, pool.pos),
                                              step.to(pool.k.device), attend, plan))
    if bool(broken.any()):
        raise AssertionError("the cut tree is not closed under ancestors")
    return beam


@torch.no_grad()
def expand_rings(drafter: LongSpecDrafter, embed: Callable[[torch.Tensor], torch.Tensor],
                 head: Callable[[torch.Tensor], torch.Tensor], rope: Rope,
                 pool: tuple[torch.Tensor, torch.Tensor, torch.Tensor], step: torch.Tensor, attend: Attend,
                 plan: BeamPlan) -> tuple[DraftBeam, torch.Tensor]:
    """A batch's step from its :meth:`BeamPlan.pack` rows ``step`` ``[B, columns]``: the last
    ``feed`` tokens of each request join its ring (``pool``: a :class:`RingPool`'s ``k``, ``v``,
    ``pos``, written in place), then the beam. Every shape follows from ``B`` and the plan and
    nothing is read back to the host: one CUDA graph per batch size can replay it. Returns the
    ``[B, N]`` beam as the two tensors the host reads (:func:`beam_rows`: its int64 fields and a
    flag of rows whose cut was not closed under ancestors, never set, checked by the caller once
    the beam is on the host anyway; the scores).

    The root is the feed's last token: its queries come from the feed's own projection and its
    keys are its ring, where the feed just wrote its K/V. Each later level writes its rows' K/V
    after the ring in one ``[B, Hkv, W + forwarded, D]`` buffer and attends over the columns
    written so far, masked by the window (ring) and the ancestor matrix (tree).
    """
    B, dt = step.shape[0], pool[0].dtype
    Fw, D, W, H = plan.feed, plan.depth, plan.window, drafter.num_heads
    tokens, writes = step[:, :Fw], step[:, Fw : 4 * Fw]
    positions = step[:, 4 * Fw : 5 * Fw + D - 1]  # the feed's, then levels 2 .. D's (L + 1 ..)
    ring = step[:, -1]
    cos, sin = plan.rope_rows(rope, positions, dt)  # [B, F + D - 1, 1, hd]
    x = embed(tokens).to(dt)
    qk, v = _rotated_qkv(drafter, x, cos[:, :Fw], sin[:, :Fw])
    _store(pool, qk[:, :, H:], v, writes)

    keys, values, ring_pos = pool[0][ring], pool[1][ring], pool[2][ring]  # [B, Hkv, W, D], [B, W]
    if plan.forwarded:
        pad = plan.tree_pad.expand(B, -1, -1, -1)
        keys, values = torch.cat([keys, pad], dim=2), torch.cat([values, pad], dim=2)
    visible = _window_visible(ring_pos, positions[:, Fw - 1 :], W)  # [B, D, W]: query positions L .. L + D - 1

    # The root (position L): its window is its ring.
    root = slice(Fw - 1, Fw)
    a = _self_attend(drafter, qk[:, root, :H], keys[:, :, :W], values[:, :, :W], visible[:, :1])
    h = _block_tail(drafter, x[:, root], a, cos[:, root], sin[:, root], attend)
    score, pick = (t[:, 0] for t in _row_top(head, h, plan.widths[0], plan))
    levels = [(score, drafter.to_target(pick), plan.first_parents.expand(B, -1))]
    ancestors = plan.ancestors(B)
    for level in range(2, D + 1):
        lo, n = plan.offsets[level - 2], plan.widths[level - 2]  # the frontier: level - 1's nodes
        at = slice(Fw + level - 2, Fw + level - 1)  # its position, L + level - 1
        x = embed(levels[-1][1]).to(dt)
        qk, v = _rotated_qkv(drafter, x, cos[:, at], sin[:, at])
        a = _self_attend_into(drafter, qk[:, :, :H], keys, values, qk[:, :, H:], v, W + lo, visible[:, level - 1],
                              plan.tree_mask(ancestors, level), plan)
        h = _block_tail(drafter, x, a, cos[:, at], sin[:, at], attend)
        width = plan.widths[level - 1]
        score, pick, row = _best_of_level(levels[-1][0], *_row_top(head, h, min(width, plan.vocab), plan), width, plan)
        parent = row + lo
        if level < D:
            plan.add_ancestors(ancestors, parent, level)
        levels.append((score, drafter.to_target(pick), parent))
    scores, tokens, parents = (torch.cat([lv[i] for lv in levels], dim=1) for i in range(3))
    return _cut_rows(scores, tokens, parents, plan)


def _cut_rows(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, plan: BeamPlan
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`beam_rows` of :func:`select_nodes_batched`; on a GPU (unless the plan's selections run
    in PyTorch) one Triton launch (``kernels/longspec_topk.py``, ``cut_beam``) where the two sorts,
    the scatter, the gathers and the concatenation took eight."""
    if plan.fused_topk and _on_kernels(scores):
        from ..kernels.longspec_topk import MAX_CUT_NODES

        if scores.shape[1] <= MAX_CUT_NODES:
            from ..kernels.custom_ops import cut_beam

            return cut_beam(scores, tokens, parents, plan.depths, plan.tree_size)
    return beam_rows(*select_nodes_batched(scores, tokens, parents, plan.depths, plan.tree_size))


def select_nodes_batched(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                         n: int) -> tuple[DraftBeam, torch.Tensor]:
    """:func:`select_nodes` for every row of ``[B, P]`` pools at once (``depths`` ``[P]``, shared),
    without reading anything back: the beam and a ``[B]`` flag of rows whose cut lost a parent
    (a stable descending sort keeps a parent ahead of a child of equal score, so it stays False)."""
    B, P = scores.shape
    n = min(n, P)
    best = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :n]
    sel = best.sort(dim=1).values  # [B, n], creation order
    slot = torch.full((B, P), -1, dtype=torch.long, device=scores.device)
    slot.scatter_(1, sel, torch.arange(n, device=scores.device).expand(B, n))
    par = parents.gather(1, sel)
    new_par = torch.where(par >= 0, slot.gather(1, par.clamp(min=0)), par)
    broken = ((par >= 0) & (new_par < 0)).any(dim=1)
    return DraftBeam(tokens.gather(1, sel), new_par, depths[sel], scores.gather(1, sel)), broken


def beam_rows(beam: DraftBeam, broken: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's beam and its ``broken`` flags (:func:`expand_rings`) as the two tensors a host
    reads them from: int64 ``[B, 3N + 1]`` (tokens, parents, depths, the flag) and the scores
    ``[B, N]``, two device-to-host copies where the fields are five. :func:`beam_of_rows` undoes it."""
    ints = [t.to(torch.int64) for t in (beam.tokens, beam.parents, beam.depths, broken[:, None])]
    return torch.cat(ints, dim=1), beam.scores


def beam_of_rows(ints: torch.Tensor, scores: torch.Tensor) -> tuple[DraftBeam, torch.Tensor]:
    """:func:`beam_rows`'s beam and flags (views of ``ints`` and ``scores``)."""
    n = scores.shape[1]
    return DraftBeam(ints[:, :n], ints[:, n : 2 * n], ints[:, 2 * n : 3 * n], scores), ints[:, 3 * n].bool()


def beam_tree(beam: DraftBeam, root: int, row: int = 0, max_nodes: int | None = None) -> DraftTree:
    """Row ``row`` of a beam as a trie; draft node i becomes tree node i + 1, tagged ``Source.LONGSPEC``.

    ``max_nodes``: the trie cut to its first that many nodes (the root included), in creation
    order (the beam's shallow levels first, closed under ancestors).
    """
    return add_beam(DraftTree(root), beam.tokens[row].tolist(), beam.parents[row].tolist(), Source.LONGSPEC,
                    max_nodes, row)
