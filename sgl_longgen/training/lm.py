"""Train a small Llama-architecture language model from scratch.

The model is the runtime's own :class:`Transformer` built from an HF config, initialised like
GPT-2/Llama (normal(0, 0.02), residual output projections scaled by 1/sqrt(2 * layers)) and
trained with next-token cross-entropy on random windows of the tokenized corpus. Checkpoints are
complete HF directories (config, weights, tokenizer) that ``load_model``, transformers and
SGLang load as they are.
"""

from __future__ import annotations

import json
import math
import platform
import sys
from pathlib import Path

import msgspec
import torch
import torch.nn.functional as F

from ..errors import LonggenError
from ..runtime.embedded import cache_root
from ..runtime.model import ModelConfig, Transformer
from ..runtime.tokenizer import Tokenizer
from . import loop as loop_mod
from .config import LMTrainConfig, to_dict
from .data import check_length, collect_documents, fixed_windows, sample_windows, split_documents, tokenize_corpus
from .device import autocast, describe
from .export import hf_config, parameter_count, save_hf_model
from .forward import causal_hidden
from .tokenizer import check_tokenizer_dir, train_tokenizer

SUMMARY_FILE = "training.json"


def build_model(config: dict, device: torch.device, seed: int, std: float) -> Transformer:
    """A freshly initialised fp32 model for an HF config dict."""
    cfg = msgspec.convert(config, ModelConfig)
    cfg.validate("model config")
    torch.manual_seed(seed)
    model = Transformer(cfg)
    init_weights(model, std, torch.Generator().manual_seed(seed))
    return model.to(device)


def init_weights(model: Transformer, std: float, generator: torch.Generator) -> None:
    residual_std = std / math.sqrt(2 * model.config.num_hidden_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
                p.normal_(0.0, residual_std, generator=generator)
            else:
                p.normal_(0.0, std, generator=generator)


def full_precision(logits: torch.Tensor) -> torch.Tensor:
    """Logits for the softmax: at least float32 (bf16 under autocast), float64 kept."""
    return logits if logits.dtype == torch.float64 else logits.float()


def lm_loss(model: Transformer, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean next-token cross-entropy over ``ids[:, 1:]`` given ``ids[:, :-1]``, and top-1 accuracy."""
    inputs, targets = ids[:, :-1], ids[:, 1:]
    logits = full_precision(model.logits(causal_hidden(model, inputs)))
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    with torch.no_grad():
        acc = (logits.argmax(-1) == targets).float().mean()
    return loss, {"loss": loss.detach(), "acc": acc}


@torch.no_grad()
def evaluate_lm(model: Transformer, windows: torch.Tensor, batch_size: int, device: torch.device) -> dict[str, float]:
    if windows.shape[0] == 0:
        return {}
    losses, accs = [], []
    for lo in range(0, windows.shape[0], batch_size):
        with autocast(device):
            loss, m = lm_loss(model, windows[lo : lo + batch_size])
        losses.append(float(loss))
        accs.append(float(m["acc"]))
    return {"val_loss": sum(losses) / len(losses), "val_acc": sum(accs) / len(accs)}


def validation_windows(tokens: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """Fixed validation windows; shorter ones when the validation split is small."""
    if tokens.numel() < length:
        length = tokens.numel() if tokens.numel() >= 64 else 0
    return fixed_windows(tokens, count, length) if length else torch.zeros(0, 0, dtype=torch.long)


def prepare_tokenizer(cfg: LMTrainConfig, out: Path, train_docs, resume: bool) -> Path:
    """The tokenizer directory: given, reused on resume, or trained on the training split."""
    if cfg.tokenizer_dir:
        check_tokenizer_dir(Path(cfg.tokenizer_dir))
        return Path(cfg.tokenizer_dir)
    if resume:
        check_tokenizer_dir(out)
        return out
    print(f"training a byte-level BPE tokenizer (vocab {cfg.tokenizer.vocab_size}) on {len(train_docs)} documents",
          file=sys.stderr)
    return train_tokenizer((d.text for d in train_docs), cfg.tokenizer, out, cfg.model.max_position_embeddings,
                           num_texts=len(train_docs))


def train_lm(cfg: LMTrainConfig, resume: bool = False, command: str = "") -> dict:
    """Tokenizer, tokenized corpus, model, training loop; returns the run's summary."""
    out, device = loop_mod.start_run("train lm", cfg.out, resume, cfg.loop)
    docs = collect_documents(cfg.data)
    train_docs, val_docs = split_documents(docs, cfg.data.val_fraction)
    out.mkdir(parents=True, exist_ok=True)
    tok_dir = prepare_tokenizer(cfg, out, train_docs, resume)
    cache_dir = Path(cfg.data.cache_dir) if cfg.data.cache_dir else cache_root() / "tokens"
    corpus = tokenize_corpus(train_docs, val_docs, tok_dir, cache_dir)
    print(f"corpus: {corpus.describe()}", file=sys.stderr)
    T = cfg.loop.seq_len
    if T > cfg.model.max_position_embeddings:
        raise LonggenError(f"--seq-len {T} exceeds max_position_embeddings {cfg.model.max_position_embeddings}")
    check_length(corpus.train, T + 1, "training")

    tokenizer = Tokenizer.from_dir(tok_dir)
    if tokenizer.bos_id is None or tokenizer.eos_id is None:
        raise LonggenError(f"the tokenizer in {tok_dir} lacks BOS/EOS tokens (tokenizer_config.json)")
    config = hf_config(cfg.model, tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id, cfg.save_dtype)
    model = build_model(config, device, cfg.loop.seed, cfg.model.init_std)
    n_params = parameter_count(model)
    print(f"model: {n_params / 1e6:.2f}M parameters on {describe(device)}", file=sys.stderr)

    train_tokens = corpus.train.to(device)
    val_windows = validation_windows(corpus.val, cfg.loop.eval_batches * cfg.loop.batch_size, T + 1).to(device)
    meta = {
        "trainer": "lm", "command": command, "parameters": n_params, "device": describe(device),
        "torch": torch.__version__, "python": platform.python_version(), "corpus": corpus.describe(),
        "config": to_dict(cfg),
    }

    def save(directory: Path, progress: loop_mod.Progress) -> None:
        save_hf_model(model, config, directory, cfg.save_dtype, tok_dir)
        (directory / SUMMARY_FILE).write_text(json.dumps({**meta, **progress.summary(), "log": progress.log}, indent=2) + "\n")

    task = loop_mod.Task(
        name="lm",
        module=model,
        loss=lambda ids: lm_loss(model, ids),
        batch=lambda gen: sample_windows(train_tokens, cfg.loop.batch_size, T + 1, gen),
        evaluate=lambda: evaluate_lm(model, val_windows, cfg.loop.batch_size, device),
        save=save,
        out=out,
        tokens_per_batch=cfg.loop.batch_size * T,
    )
    progress = loop_mod.run(task, cfg.optim, cfg.loop, device, resume=resume, config=to_dict(cfg))
    return {**meta, **progress.summary(), "out": str(out)}
