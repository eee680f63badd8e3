"""Train OWL's LSTM drafter and the [SPEC] embedding on a frozen target (the OWL paper's recipe).

Data is self-distilled, as in the reference recipe: prompts are non-overlapping ``prompt_len``-token
chunks cut from the tokenized data files; the target continues each with ``seq_len`` tokens
(greedy, or sampled at ``temperature`` with ``top_k``), and only the generated tokens are kept, so
the drafter learns the target's own distribution. The generated set is cached on disk.

One training sequence ``x_0 .. x_{T-1}`` goes through the frozen target twice per step:

* the real tokens, causal and without gradients: post-norm states ``h_k``;
* T [SPEC] tokens, the j-th after ``x_0 .. x_j`` at position j + 1 (it attends to those real tokens
  and itself), with gradients flowing only into the [SPEC] input embedding: post-norm ``hS_j``.
  Splitting the packed 2T-token layout this way computes the same states and backpropagates
  through the target only for the [SPEC] half.

The drafter is unrolled n steps under teacher forcing from every start k: inputs ``x_k``,
``h_{k-1}``, ``hS_{k-1}``; step j predicts ``x_{k+j}``. With probability ``spec_dropout`` a row
uses the learned null vector instead of ``hS`` (so the same checkpoint works right after a linear
HOWL step). With ``draft_vocab`` N the drafter's head covers only the N most frequent tokens of
the generated training sequences (ties to the lower id); targets outside that map are left out of
the drafter's cross-entropy (the drafter can never propose them; :mod:`.draft_vocab`, shared with
``train longspec``). Loss = mean over steps of the
cross-entropy, plus ``spec_weight`` times the auxiliary
cross-entropy of the frozen LM head on ``hS_{k-1}`` against ``x_k`` (Eq. 9 read literally,
``spec_target = "next"``) or ``x_{k+1}`` (``"beyond"``). AdamW with warmup + cosine, bf16 autocast
on a GPU, fp32 on a CPU; the shared loop (``loop.py``) owns progress bars, checkpoints and resume.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import torch
import torch.nn.functional as F
from msgspec import Meta
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ..config import Strict
from ..core.owl import OwlDrafter
from ..errors import LonggenError
from ..runtime.checkpoint import load_model
from ..runtime.embedded import DEFAULTS_FILE, cache_root, resolve_model
from ..runtime.model import Attention, Transformer
from . import loop as loop_mod
from .config import (
    DataConfig,
    Fraction,
    LoopConfig,
    NonNegInt,
    OptimConfig,
    PosInt,
    to_dict,
)
from .data import collect_documents, split_documents, tokenize_corpus
from .device import autocast, describe
from .draft_vocab import (
    check_draft_vocab,
    draft_cross_entropy,
    frequent_tokens,
    map_coverage,
)
from .forward import _rotate_half, rope_tables
from .lm import full_precision


class OwlShape(Strict):
    """The drafter: LSTM width (0: the target's hidden size), unroll steps n, [SPEC] on/off, and the
    head's draft vocabulary (0: the target's whole vocabulary; N: its N most frequent tokens)."""

    width: NonNegInt = 0
    n_steps: Annotated[int, Meta(ge=1, le=32)] = 8
    spec: bool = True
    draft_vocab: NonNegInt = 0


class OwlDataConfig(Strict):
    """Self-distilled sequences: ``sequences`` prompts of ``prompt_len`` tokens, each continued by the
    target for ``loop.seq_len`` tokens (``temperature`` 0: greedy); ``val_sequences`` more from the
    validation split (or held out of the training prompts when it is too small)."""

    prompt_len: PosInt = 64
    sequences: PosInt = 4096
    val_sequences: NonNegInt = 64
    temperature: Annotated[float, Meta(ge=0.0)] = 1.0
    top_k: NonNegInt = 10
    batch_size: PosInt = 256


class OwlOptimConfig(OptimConfig):
    """The reference recipe: AdamW (0.9, 0.999), weight decay 0.1, lr 1e-3, cosine to 0."""

    lr: Annotated[float, Meta(gt=0.0)] = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: NonNegInt = 50
    min_lr_ratio: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0


class OwlLoopConfig(LoopConfig):
    steps: PosInt = 1000
    batch_size: PosInt = 64
    seq_len: PosInt = 256  # generated tokens per sequence
    log_every: PosInt = 50
    eval_every: NonNegInt = 250
    save_every: NonNegInt = 250


class OwlTrainConfig(Strict):
    """``sgl-longgen train owl``: the OWL drafter (and [SPEC] embedding) for a frozen target."""

    model: str = ""
    out: str = ""
    drafter: OwlShape = msgspec.field(default_factory=OwlShape)
    spec_dropout: Fraction = 0.3
    spec_weight: Annotated[float, Meta(ge=0.0)] = 1.0
    spec_target: Literal["next", "beyond"] = "next"
    generation: OwlDataConfig = msgspec.field(default_factory=OwlDataConfig)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    optim: OwlOptimConfig = msgspec.field(default_factory=OwlOptimConfig)
    loop: OwlLoopConfig = msgspec.field(default_factory=OwlLoopConfig)


# ----------------------------------------------------------------------------------------------
# the frozen target: batched generation with a KV cache, and the [SPEC] states


def _qkv(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    B, T, _ = x.shape
    q = attn.q_proj(x).view(B, T, attn.n_heads, attn.d).transpose(1, 2)
    k = attn.k_proj(x).view(B, T, attn.n_kv, attn.d).transpose(1, 2)
    v = attn.v_proj(x).view(B, T, attn.n_kv, attn.d).transpose(1, 2)
    cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v


def _sdpa(attn: Attention, q, k, v, mask=None, causal=False) -> torch.Tensor:
    if attn.n_kv != attn.n_heads:
        group = attn.n_heads // attn.n_kv
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=attn.scale)
    B, _, T, _ = out.shape
    return attn.o_proj(out.transpose(1, 2).reshape(B, T, attn.n_heads * attn.d))


@torch.no_grad()
def generate(model: Transformer, prompts: torch.Tensor, new_tokens: int, temperature: float, top_k: int,
             generator: torch.Generator) -> torch.Tensor:
    """``[B, new_tokens]`` continuations of equal-length ``prompts`` (KV cache; one token per step)."""
    B, P = prompts.shape
    dev = prompts.device
    total = P + new_tokens
    cos, sin = rope_tables(model, total, dev)
    layers = model.model.layers
    kv_shape = (B, layers[0].self_attn.n_kv, total, layers[0].self_attn.d)
    caches = [(torch.empty(kv_shape, device=dev, dtype=cos.dtype), torch.empty(kv_shape, device=dev, dtype=cos.dtype))
              for _ in layers]

    def forward(ids: torch.Tensor, start: int) -> torch.Tensor:
        T = ids.shape[1]
        x = model.model.embed_tokens(ids)
        for layer, (kc, vc) in zip(layers, caches):
            attn = layer.self_attn
            q, k, v = _qkv(attn, layer.input_layernorm(x), cos[start : start + T], sin[start : start + T])
            kc[:, :, start : start + T] = k.to(kc.dtype)
            vc[:, :, start : start + T] = v.to(vc.dtype)
            keys, values = kc[:, :, : start + T].to(q.dtype), vc[:, :, : start + T].to(q.dtype)
            x = x + _sdpa(attn, q, keys, values, causal=T > 1)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return model.logits(x[:, -1])

    def sample(logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        if temperature == 0:
            return logits.argmax(-1)
        logits = logits / temperature
        if top_k:
            kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).squeeze(-1)

    out = torch.empty(B, new_tokens, dtype=torch.long, device=dev)
    tok = sample(forward(prompts, 0))
    for t in range(new_tokens):
        out[:, t] = tok
        if t + 1 < new_tokens:
            tok = sample(forward(tok[:, None], P + t))
    return out


def target_states(model: Transformer, ids: torch.Tensor, spec_embedding: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Post-final-norm states of the real tokens (no gradient) and of the T [SPEC] tokens.

    [SPEC]_j follows ``ids[:, :j + 1]`` at position j + 1 and sees those tokens and itself; only
    ``spec_embedding`` receives gradients.
    """
    B, T = ids.shape
    dev = ids.device
    cos, sin = rope_tables(model, T + 1, dev)
    norm = model.model.norm
    with torch.no_grad():
        x = model.model.embed_tokens(ids)
        kv = []
        for layer in model.model.layers:
            q, k, v = _qkv(layer.self_attn, layer.input_layernorm(x), cos[:T], sin[:T])
            kv.append((k, v))
            x = x + _sdpa(layer.self_attn, q, k, v, causal=True)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        h_real = norm(x)
    if spec_embedding is None:
        return h_real, None
    # [SPEC]_j sees real tokens 0..j and itself (the diagonal of the second block).
    mask = torch.cat([torch.ones(T, T, dtype=torch.bool, device=dev).tril(),
                      torch.eye(T, dtype=torch.bool, device=dev)], dim=1)
    s = spec_embedding.to(model.model.embed_tokens.weight.dtype).expand(B, T, -1)
    for layer, (k_real, v_real) in zip(model.model.layers, kv):
        q, k, v = _qkv(layer.self_attn, layer.input_layernorm(s), cos[1:], sin[1:])
        keys = torch.cat([k_real.to(k.dtype), k], dim=2)
        values = torch.cat([v_real.to(v.dtype), v], dim=2)
        s = s + _sdpa(layer.self_attn, q, keys, values, mask=mask)
        s = s + layer.mlp(layer.post_attention_layernorm(s))
    return h_real, norm(s)


# ----------------------------------------------------------------------------------------------
# the loss


def owl_loss(model: Transformer, drafter: OwlDrafter, ids: torch.Tensor, spec_dropout: float, spec_weight: float,
             spec_target: str, generator: torch.Generator | None = None, force_spec: bool | None = None
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Eq. 9: mean over the n steps of CE(step j at start k, x_{k+j}) + spec_weight * CE([SPEC]).

    ``force_spec`` (evaluation): True conditions every row on its [SPEC] state, False on the null
    vector; None applies ``spec_dropout``.
    """
    B, T = ids.shape
    n = drafter.n_steps
    K = T - 1 - n  # starts k = 1 .. T-1-n
    if K < 1:
        raise LonggenError(f"--seq-len {T} is too short for {n} draft steps (needs at least {n + 2} tokens)")
    h_real, h_spec = target_states(model, ids, drafter.spec_embedding if drafter.spec else None)
    tokens = torch.stack([ids[:, j : j + K] for j in range(1, n + 1)], dim=-1)  # step j+1 consumes x_{k+j}
    has_spec = None
    if drafter.spec:
        if force_spec is None:
            keep = torch.rand(B, K, generator=generator).to(ids.device) >= spec_dropout
        else:
            keep = torch.full((B, K), bool(force_spec), device=ids.device)
        has_spec = keep
    states = drafter.unroll(h_real[:, :K], tokens, h_spec[:, :K] if h_spec is not None else None, has_spec)
    metrics: dict[str, torch.Tensor] = {}
    draft_loss = None
    for j, state in enumerate(states, 1):
        logits = full_precision(drafter.head(state))
        ce, metrics[f"acc{j}"] = draft_cross_entropy(drafter, logits, ids[:, j + 1 : j + 1 + K])
        draft_loss = ce if draft_loss is None else draft_loss + ce
    loss = draft_loss / n
    metrics["draft_loss"] = loss.detach()
    if h_spec is not None:
        shift = 1 if spec_target == "next" else 2
        logits = full_precision(model.lm_head(h_spec[:, : T - shift]))
        target = ids[:, shift:]
        spec_ce = F.cross_entropy(logits.flatten(0, 1), target.flatten())
        loss = loss + spec_weight * spec_ce
        with torch.no_grad():
            metrics["spec_loss"] = spec_ce.detach()
            metrics["spec_acc"] = (logits.argmax(-1) == target).float().mean()
    return loss, {"loss": loss.detach(), **metrics}


def new_drafter(hidden_size: int, vocab_size: int, width: int, n_steps: int, spec: bool, draft_vocab: int,
                sequences: torch.Tensor) -> OwlDrafter:
    """An untrained drafter; with ``draft_vocab`` (0: full) its map is the most frequent tokens of ``sequences``."""
    check_draft_vocab(draft_vocab, vocab_size)
    reduced = 0 < draft_vocab < vocab_size
    drafter = OwlDrafter(hidden_size, vocab_size, width, n_steps, spec, draft_vocab_size=draft_vocab if reduced else None)
    if reduced:
        drafter.set_token_map(frequent_tokens(sequences, vocab_size, draft_vocab))
    return drafter


@torch.no_grad()
def evaluate_owl(model: Transformer, drafter: OwlDrafter, sequences: torch.Tensor, cfg: OwlTrainConfig,
                 device: torch.device) -> dict[str, float]:
    """Per-step top-1 accuracy with the [SPEC] state (``val_acc*``) and with the null vector."""
    if sequences.shape[0] == 0:
        return {}
    was_training = drafter.training
    drafter.eval()
    sums: dict[str, float] = {}
    batches = 0
    modes = [("", True), ("nospec_", False)] if drafter.spec else [("", None)]
    for lo in range(0, sequences.shape[0], cfg.loop.batch_size):
        ids = sequences[lo : lo + cfg.loop.batch_size].to(device).long()
        for prefix, force in modes:
            with autocast(device):
                _, m = owl_loss(model, drafter, ids, cfg.spec_dropout, cfg.spec_weight, cfg.spec_target, force_spec=force)
            for k, v in m.items():
                if prefix and not k.startswith("acc"):
                    continue
                key = f"val_{prefix}{k}"
                sums[key] = sums.get(key, 0.0) + float(v)
        batches += 1
    drafter.train(was_training)
    order = sorted(sums, key=lambda k: (not k.startswith("val_acc"), k))
    return {k: sums[k] / batches for k in order}


# ----------------------------------------------------------------------------------------------
# self-distilled data


def _prompt_chunks(tokens: torch.Tensor, length: int) -> torch.Tensor:
    n = tokens.numel() // length
    return tokens[: n * length].view(n, length).long()


def distill(model: Transformer, prompts: torch.Tensor, cfg: OwlTrainConfig, device: torch.device,
            seed: int, desc: str) -> torch.Tensor:
    """Generated continuations (``[len(prompts), seq_len]``, CPU int32), in batches."""
    g = cfg.generation
    generator = torch.Generator(device=device).manual_seed(seed)
    out = []
    with tqdm(total=prompts.shape[0], desc=desc, unit="seq", dynamic_ncols=True, leave=False) as bar:
        for lo in range(0, prompts.shape[0], g.batch_size):
            batch = prompts[lo : lo + g.batch_size].to(device)
            with autocast(device):
                out.append(generate(model, batch, cfg.loop.seq_len, g.temperature, g.top_k, generator).cpu())
            bar.update(batch.shape[0])
    return torch.cat(out).to(torch.int32)


def distilled_sequences(model: Transformer, model_dir: Path, corpus, cfg: OwlTrainConfig, device: torch.device,
                        cache_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Training and validation sequences, from the on-disk cache when this exact set was made before."""
    g = cfg.generation
    key_src = json.dumps({
        "model": str(model_dir.resolve()), "config": (model_dir / "config.json").read_text(),
        "weights": sorted((p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in model_dir.glob("*.safetensors")),
        "corpus": corpus.key, "generation": to_dict(g), "seq_len": cfg.loop.seq_len, "seed": cfg.loop.seed,
        "device": device.type,
    }, sort_keys=True)
    path = cache_dir / f"owl-data-{hashlib.sha256(key_src.encode()).hexdigest()[:20]}.safetensors"
    if path.is_file():
        try:
            t = load_file(str(path))
            return t["train"], t["val"]
        except (SafetensorError, OSError, KeyError):
            pass  # rebuilt below
    chunks = _prompt_chunks(corpus.train, g.prompt_len)
    if chunks.shape[0] == 0:
        raise LonggenError(f"the training data has {corpus.train.numel()} tokens, fewer than one prompt of "
                           f"{g.prompt_len} (give more data or a smaller prompt length)")
    gen = torch.Generator().manual_seed(cfg.loop.seed)
    val_chunks = _prompt_chunks(corpus.val, g.prompt_len)
    if val_chunks.shape[0] >= g.val_sequences:
        val_prompts = val_chunks[torch.randperm(val_chunks.shape[0], generator=gen)[: g.val_sequences]]
    else:  # hold some training prompts out instead
        held = min(g.val_sequences, chunks.shape[0] // 10)
        order = torch.randperm(chunks.shape[0], generator=gen)
        val_prompts, chunks = chunks[order[:held]], chunks[order[held:]]
    if chunks.shape[0] >= g.sequences:
        train_prompts = chunks[torch.randperm(chunks.shape[0], generator=gen)[: g.sequences]]
    else:  # fewer distinct prompts than asked: reuse them (sampling makes the continuations differ)
        train_prompts = chunks[torch.randint(0, chunks.shape[0], (g.sequences,), generator=gen)]
    print(f"generating {train_prompts.shape[0]} + {val_prompts.shape[0]} sequences of {cfg.loop.seq_len} tokens "
          f"from {g.prompt_len}-token prompts (temperature {g.temperature:g}, top-k {g.top_k})", file=sys.stderr)
    train = distill(model, train_prompts, cfg, device, cfg.loop.seed, "distill train")
    val = distill(model, val_prompts, cfg, device, cfg.loop.seed + 1, "distill val") if val_prompts.shape[0] \
        else torch.zeros(0, cfg.loop.seq_len, dtype=torch.int32)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".owl-data-", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file({"train": train.contiguous(), "val": val.contiguous()}, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return train, val


# ----------------------------------------------------------------------------------------------
# the run


def defaults_toml(drafter: OwlDrafter) -> str:
    """``longgen.toml`` beside the checkpoint: what generation should default to with it."""
    lines = ["# Defaults for OWL/HOWL runs with this drafter; any --config file or flag overrides them.",
             "[owl]", f"depth = {drafter.n_steps}"]
    if not drafter.spec:
        lines.append("spec = false  # trained without [SPEC]")
    return "\n".join(lines) + "\n"


def train_owl(cfg: OwlTrainConfig, resume: bool = False, command: str = "") -> dict:
    """Load the frozen target, distil the data, train and save the drafter; returns the summary."""
    if not cfg.model:
        raise LonggenError("train owl needs a target model (--model NAME|DIR)")
    out, device = loop_mod.start_run("train owl", cfg.out, resume, cfg.loop)
    model_dir = resolve_model(cfg.model)
    loaded = load_model(model_dir, "float32", str(device))
    if loaded.tokenizer is None:
        raise LonggenError(f"model directory {model_dir} has no tokenizer.json to tokenize the prompts")
    T = cfg.loop.seq_len
    if cfg.generation.prompt_len + T > loaded.config.max_position_embeddings:
        raise LonggenError(f"prompt length {cfg.generation.prompt_len} + --seq-len {T} exceeds the model's context "
                           f"({loaded.config.max_position_embeddings})")
    if T < cfg.drafter.n_steps + 2:
        raise LonggenError(f"--seq-len {T} is too short for {cfg.drafter.n_steps} draft steps")
    check_draft_vocab(cfg.drafter.draft_vocab, loaded.config.vocab_size)  # before generating any data

    docs = collect_documents(cfg.data)
    train_docs, val_docs = split_documents(docs, cfg.data.val_fraction)
    cache_dir = Path(cfg.data.cache_dir) if cfg.data.cache_dir else cache_root() / "tokens"
    corpus = tokenize_corpus(train_docs, val_docs, model_dir, cache_dir)
    print(f"corpus: {corpus.describe()}", file=sys.stderr)
    model = loaded.model
    train_seqs, val_seqs = distilled_sequences(model, model_dir, corpus, cfg, device, cache_dir)

    shape = cfg.drafter
    width = shape.width or loaded.config.hidden_size
    vocab = loaded.config.vocab_size
    drafter = new_drafter(loaded.config.hidden_size, vocab, width, shape.n_steps, shape.spec, shape.draft_vocab,
                          train_seqs)
    drafter.reset_parameters(torch.Generator().manual_seed(cfg.loop.seed), model.model.embed_tokens.weight)
    drafter = drafter.to(device).train()
    n_params = sum(p.numel() for p in drafter.parameters())
    coverage = map_coverage(train_seqs, drafter.token_map, vocab) if drafter.reduced else 1.0
    head = (f"draft vocabulary {drafter.draft_vocab_size} of {vocab} ({coverage:.1%} of the training tokens)"
            if drafter.reduced else f"full vocabulary ({vocab})")
    print(f"OWL drafter: width {width}, {shape.n_steps} steps, [SPEC] {'on' if shape.spec else 'off'}, {head} "
          f"({n_params / 1e6:.2f}M parameters) on {describe(device)}; target {model_dir} frozen", file=sys.stderr)

    train_tokens = train_seqs.to(device)
    meta = {
        "trainer": "owl", "command": command, "base_model": str(cfg.model), "parameters": n_params,
        "device": describe(device), "torch": torch.__version__, "python": platform.python_version(),
        "corpus": corpus.describe(), "sequences": {"train": int(train_seqs.shape[0]), "val": int(val_seqs.shape[0])},
        "spec_target": cfg.spec_target, "spec_dropout": cfg.spec_dropout,
        "draft_vocab": drafter.draft_vocab_size, "draft_vocab_coverage": round(coverage, 6), "config": to_dict(cfg),
    }

    def save(directory: Path, progress: loop_mod.Progress) -> None:
        drafter.save(directory, base_model=str(cfg.model), training={**meta, **progress.summary(), "log": progress.log})
        (directory / DEFAULTS_FILE).write_text(defaults_toml(drafter))

    def batch(gen: torch.Generator) -> torch.Tensor:
        rows = torch.randint(0, train_tokens.shape[0], (cfg.loop.batch_size,), generator=gen)
        return train_tokens[rows.to(device)].long()

    dropout_gen = torch.Generator().manual_seed(cfg.loop.seed + 2)
    task = loop_mod.Task(
        name="owl",
        module=drafter,
        loss=lambda ids: owl_loss(model, drafter, ids, cfg.spec_dropout, cfg.spec_weight, cfg.spec_target, dropout_gen),
        batch=batch,
        evaluate=lambda: evaluate_owl(model, drafter, val_seqs, cfg, device),
        save=save,
        out=out,
        tokens_per_batch=cfg.loop.batch_size * T,
    )
    progress = loop_mod.run(task, cfg.optim, cfg.loop, device, resume=resume, config=to_dict(cfg))
    return {**meta, **progress.summary(), "out": str(out)}
