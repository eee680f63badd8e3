"""Train LongSpec's drafter on a frozen target (LongSpec §3.2 and App. G).

Data: the target's own continuations of prompt chunks, as for OWL (self-distilled, sampled at
``generation.temperature`` with ``top_k``; the same on-disk cache as ``train owl``, so both
trainers with the same data settings share one generated set). Each training sequence goes
through the frozen target once, without gradients, for its **last layer's K/V**; the drafter then
reads each token's shared embedding, attends causally over its own window and cross-attends to
those K/V, and the frozen LM head scores its next-token prediction (cross-entropy).

* **Anchor-Offset Indices.** A sequence no longer than ``anchor_offset.max_length`` runs at
  positions ``0 .. a-1, a + o, a + o + 1, ..`` with one offset ``o`` per sequence, uniform up to
  ``min(max_offset, context - length)``: the target's K/V and the drafter's queries carry the
  same shifted RoPE, so short samples train the drafter at the large positions a long generation
  reaches. Longer sequences keep vanilla positions (the released code's rule).
* **Flash noisy training.** At inference a draft token ``j`` steps past the committed length
  sees the target's K/V only up to that length. Each step draws one lag ``j`` uniform in
  ``[1, noisy.max_lag]`` and lets query t see target positions ``<= t - j`` (the first ``j`` rows
  see nothing: a zero cross-attention output), by dropping queries and keys instead of a mask.
  With ``max_lag`` at least the tree depth every lag the beam meets is trained.
* **Reduced draft vocabulary** (``drafter.draft_vocab`` N, ``--draft-vocab``; 0: the full head).
  The map is the N most frequent tokens of the generated training sequences (ties to the lower id,
  written sorted by id; :mod:`.draft_vocab`, shared with ``train owl``), and training runs on the
  reduced head the drafter drafts with: the frozen LM head's rows at the map, a softmax over those
  N logits, targets outside the map left out of the cross-entropy (the drafter can never propose
  them; accuracy still counts them as misses). So the trained objective is exactly the
  distribution the beam ranks by, and nothing new is trained: the head stays the target's. The
  summary and ``longspec.json``'s provenance record the share of training tokens the map covers.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path
from typing import Annotated

import msgspec
import torch
import torch.nn.functional as F
from msgspec import Meta

from ..config import Strict
from ..core.longspec import LongSpecDrafter
from ..core.longspec_rope import apply_rope, rope_tables, sample_anchor_offset
from ..errors import LonggenError
from ..runtime.checkpoint import load_model
from ..runtime.embedded import DEFAULTS_FILE, cache_root, resolve_model
from ..runtime.model import Transformer
from . import loop as loop_mod
from .config import DataConfig, LoopConfig, NonNegInt, OptimConfig, PosInt, to_dict
from .data import collect_documents, split_documents, tokenize_corpus
from .device import autocast, describe
from .draft_vocab import (
    check_draft_vocab,
    draft_cross_entropy,
    frequent_tokens,
    map_coverage,
)
from .lm import full_precision
from .owl import OwlDataConfig, distilled_sequences


class LongSpecShape(Strict):
    """The block: MLP width (0: the target's), the self-attention window (tokens, itself included)
    and the draft vocabulary (the N most frequent training tokens; 0: the whole vocabulary)."""

    intermediate_size: NonNegInt = 0
    window: PosInt = 512
    draft_vocab: NonNegInt = 0


class AnchorOffsetConfig(Strict):
    """Anchor-Offset Indices: ``anchors`` sink positions kept, the rest shifted by a random offset."""

    enabled: bool = True
    anchors: NonNegInt = 4
    max_offset: NonNegInt = 30000
    max_length: PosInt = 1200  # longer sequences keep vanilla positions


class NoisyConfig(Strict):
    """Flash noisy training: the cross-attention lags the queries by ``j`` in ``[1, max_lag]`` (0: off)."""

    max_lag: Annotated[int, Meta(ge=0, le=64)] = 5


class LongSpecOptimConfig(OptimConfig):
    lr: Annotated[float, Meta(gt=0.0)] = 2e-3
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: NonNegInt = 30
    min_lr_ratio: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0


class LongSpecLoopConfig(LoopConfig):
    steps: PosInt = 600
    batch_size: PosInt = 16
    seq_len: PosInt = 256  # generated tokens per sequence
    log_every: PosInt = 50
    eval_every: NonNegInt = 200
    save_every: NonNegInt = 200


class LongSpecTrainConfig(Strict):
    """``sgl-longgen train longspec``: the LongSpec drafter for a frozen target."""

    model: str = ""
    out: str = ""
    drafter: LongSpecShape = msgspec.field(default_factory=LongSpecShape)
    anchor_offset: AnchorOffsetConfig = msgspec.field(default_factory=AnchorOffsetConfig)
    noisy: NoisyConfig = msgspec.field(default_factory=NoisyConfig)
    generation: OwlDataConfig = msgspec.field(default_factory=OwlDataConfig)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    optim: LongSpecOptimConfig = msgspec.field(default_factory=LongSpecOptimConfig)
    loop: LongSpecLoopConfig = msgspec.field(default_factory=LongSpecLoopConfig)


# ----------------------------------------------------------------------------------------------
# the frozen target's last-layer K/V


@torch.no_grad()
def last_layer_kv(model: Transformer, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's last-layer keys (with RoPE) and values ``[B, Hkv, T, D]`` of a causal pass of
    ``ids`` at the positions behind ``cos``/``sin`` (``[B, T, D]``), as its KV cache would hold them."""
    x = model.model.embed_tokens(ids)
    layers = model.model.layers
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        a = layer.input_layernorm(x)
        k = apply_rope(a_heads(attn.k_proj(a), attn.n_kv, attn.d), cos, sin)
        v = a_heads(attn.v_proj(a), attn.n_kv, attn.d)
        if i == len(layers) - 1:
            return k, v
        q = apply_rope(a_heads(attn.q_proj(a), attn.n_heads, attn.d), cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale,
                                             enable_gqa=attn.n_kv != attn.n_heads)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], attn.n_heads * attn.d))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    raise LonggenError("the target has no layers")


def a_heads(x: torch.Tensor, n: int, d: int) -> torch.Tensor:
    """``[B, T, n * d]`` -> ``[B, n, T, d]``."""
    return x.view(*x.shape[:2], n, d).transpose(1, 2)


def window_mask(T: int, window: int, device) -> torch.Tensor | None:
    """``[T, T]``: causal within ``window`` tokens (None when the window covers the sequence: plain causal)."""
    if T <= window:
        return None
    i = torch.arange(T, device=device)
    d = i[:, None] - i[None, :]
    return (d >= 0) & (d < window)


def positions_for(cfg: AnchorOffsetConfig | None, B: int, T: int, max_position: int,
                  generator: torch.Generator | None) -> torch.Tensor:
    """``[B, T]`` positions: anchor-offset per row when enabled and the rows are short enough."""
    if cfg is None or not cfg.enabled or T > cfg.max_length:
        return torch.arange(T).expand(B, T)
    return torch.stack([sample_anchor_offset(T, max_position, cfg.anchors, cfg.max_offset, generator)
                        for _ in range(B)])


def longspec_loss(model: Transformer, drafter: LongSpecDrafter, ids: torch.Tensor, positions: torch.Tensor,
                  lag: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean next-token cross-entropy of the drafter over ``ids`` ``[B, T]`` (and top-1 accuracy);
    a reduced drafter's over its mapped tokens (:func:`.draft_vocab.draft_cross_entropy`)."""
    T = ids.shape[1]
    positions = positions.to(ids.device)
    dt = model.model.embed_tokens.weight.dtype
    cos, sin = rope_tables(model.inv_freq, positions, torch.float64 if dt == torch.float64 else torch.float32)
    k, v = last_layer_kv(model, ids, cos, sin)
    with torch.no_grad():
        embeds = model.model.embed_tokens(ids)
    mask = window_mask(T, drafter.window, ids.device)
    h, _, _ = drafter(embeds, cos, sin, None, None, mask, k, v, lag=lag, causal=mask is None)
    if drafter.reduced:  # the frozen head's mapped rows: what the beam scores with
        logits = full_precision(F.linear(h[:, :-1], model.lm_head.weight.index_select(0, drafter.token_map)))
    else:
        logits = full_precision(model.lm_head(h[:, :-1]))
    loss, acc = draft_cross_entropy(drafter, logits, ids[:, 1:])
    return loss, {"loss": loss.detach(), "acc": acc}


@torch.no_grad()
def evaluate_longspec(model: Transformer, drafter: LongSpecDrafter, sequences: torch.Tensor,
                      cfg: LongSpecTrainConfig, device: torch.device) -> dict[str, float]:
    """Validation loss and accuracy at vanilla positions for lag 1 (the root's view) and the
    largest lag trained (the deepest level's)."""
    if sequences.shape[0] == 0:
        return {}
    was_training = drafter.training
    drafter.eval()
    lags = sorted({1, max(1, cfg.noisy.max_lag)}) if cfg.noisy.max_lag else [0]
    sums: dict[str, float] = {}
    batches = 0
    for lo in range(0, sequences.shape[0], cfg.loop.batch_size):
        ids = sequences[lo : lo + cfg.loop.batch_size].to(device).long()
        pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
        for lag in lags:
            with autocast(device):
                _, m = longspec_loss(model, drafter, ids, pos, lag)
            for key, value in m.items():
                name = f"val_{key}_lag{lag}"
                sums[name] = sums.get(name, 0.0) + float(value)
        batches += 1
    drafter.train(was_training)
    return {k: v / batches for k, v in sorted(sums.items())}


def defaults_toml(max_lag: int) -> str:
    """``longgen.toml`` beside the checkpoint: a beam no deeper than the lags it was trained for
    (a level-i node's cross-attention lags its position by i; LongSpec's widths otherwise)."""
    depth = max_lag or 1
    widths = [4] + [16] * (depth - 1)
    return ("# Defaults for LongSpec runs with this drafter; any --config file or flag overrides them.\n"
            f"[longspec]\nwidths = {widths}\n")


def train_longspec(cfg: LongSpecTrainConfig, resume: bool = False, command: str = "") -> dict:
    """Load the frozen target, distil the data, train and save the drafter; returns the summary."""
    if not cfg.model:
        raise LonggenError("train longspec needs a target model (--model NAME|DIR)")
    out, device = loop_mod.start_run("train longspec", cfg.out, resume, cfg.loop)
    model_dir = resolve_model(cfg.model)
    loaded = load_model(model_dir, "float32", str(device))
    if loaded.tokenizer is None:
        raise LonggenError(f"model directory {model_dir} has no tokenizer.json to tokenize the prompts")
    T = cfg.loop.seq_len
    ctx = loaded.config.max_position_embeddings
    if cfg.generation.prompt_len + T > ctx:
        raise LonggenError(f"prompt length {cfg.generation.prompt_len} + --seq-len {T} exceeds the model's context ({ctx})")
    if T < 2 + cfg.noisy.max_lag:
        raise LonggenError(f"--seq-len {T} is too short for a cross-attention lag of {cfg.noisy.max_lag}")
    vocab = loaded.config.vocab_size
    check_draft_vocab(cfg.drafter.draft_vocab, vocab)  # before generating any data

    docs = collect_documents(cfg.data)
    train_docs, val_docs = split_documents(docs, cfg.data.val_fraction)
    cache_dir = Path(cfg.data.cache_dir) if cfg.data.cache_dir else cache_root() / "tokens"
    corpus = tokenize_corpus(train_docs, val_docs, model_dir, cache_dir)
    print(f"corpus: {corpus.describe()}", file=sys.stderr)
    model = loaded.model
    train_seqs, val_seqs = distilled_sequences(model, model_dir, corpus, cfg, device, cache_dir)

    n = cfg.drafter.draft_vocab
    reduced = 0 < n < vocab
    drafter = LongSpecDrafter.for_target(loaded.config, cfg.drafter.intermediate_size, cfg.drafter.window,
                                         draft_vocab_size=n if reduced else None)
    if reduced:
        drafter.set_token_map(frequent_tokens(train_seqs, vocab, n))
    drafter.reset_parameters(torch.Generator().manual_seed(cfg.loop.seed), final_norm=model.model.norm.weight)
    drafter = drafter.to(device).train()
    n_params = sum(p.numel() for p in drafter.parameters())
    coverage = map_coverage(train_seqs, drafter.token_map, vocab) if reduced else 1.0
    head = (f"draft vocabulary {n} of {vocab} ({coverage:.1%} of the training tokens)" if reduced
            else f"full vocabulary ({vocab})")
    print(f"LongSpec drafter: window {drafter.window}, MLP {drafter.intermediate_size}, {head} "
          f"({n_params / 1e6:.2f}M parameters; embedding and head shared) on {describe(device)}; "
          f"target {model_dir} frozen", file=sys.stderr)

    train_tokens = train_seqs.to(device)
    meta = {
        "trainer": "longspec", "command": command, "base_model": str(cfg.model), "parameters": n_params,
        "device": describe(device), "torch": torch.__version__, "python": platform.python_version(),
        "corpus": corpus.describe(), "sequences": {"train": int(train_seqs.shape[0]), "val": int(val_seqs.shape[0])},
        "draft_vocab": drafter.draft_vocab_size, "draft_vocab_coverage": round(coverage, 6), "config": to_dict(cfg),
    }

    def save(directory: Path, progress: loop_mod.Progress) -> None:
        drafter.save(directory, base_model=str(cfg.model), training={**meta, **progress.summary(), "log": progress.log})
        (directory / DEFAULTS_FILE).write_text(defaults_toml(cfg.noisy.max_lag))

    def batch(gen: torch.Generator) -> torch.Tensor:
        rows = torch.randint(0, train_tokens.shape[0], (cfg.loop.batch_size,), generator=gen)
        return train_tokens[rows.to(device)].long()

    aux = torch.Generator().manual_seed(cfg.loop.seed + 3)  # positions and lags

    def loss(ids: torch.Tensor):
        pos = positions_for(cfg.anchor_offset, ids.shape[0], ids.shape[1], ctx, aux)
        lag = int(torch.randint(1, cfg.noisy.max_lag + 1, (), generator=aux)) if cfg.noisy.max_lag else 0
        return longspec_loss(model, drafter, ids, pos, lag)

    task = loop_mod.Task(
        name="longspec",
        module=drafter,
        loss=loss,
        batch=batch,
        evaluate=lambda: evaluate_longspec(model, drafter, val_seqs, cfg, device),
        save=save,
        out=out,
        tokens_per_batch=cfg.loop.batch_size * T,
    )
    progress = loop_mod.run(task, cfg.optim, cfg.loop, device, resume=resume, config=to_dict(cfg))
    return {**meta, **progress.summary(), "out": str(out)}
