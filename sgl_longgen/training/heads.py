"""Train TokenSwift's draft heads against a frozen base model (the TokenSwift paper's recipe).

The base model (embeddings, decoder, final norm, LM head) never changes; its pre-final-norm hidden
states h0 come from one causal forward without gradients. Head i (1-based) reads the chain
``h_i = h_{i-1} + A_i(norm(h_{i-1}))`` and is scored, through the shared frozen LM head, on the
ground-truth token ``1 + i`` positions ahead; the loss is the unweighted sum of the three
cross-entropies (shifts +2, +3, +4), as upstream. Top-1 accuracy per head is logged because it
is what bounds the acceptance of the [1,3,3,3] tree's leading path.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from ..core.heads import TokenSwiftHeads
from ..errors import LonggenError
from ..runtime.checkpoint import load_model
from ..runtime.embedded import cache_root, resolve_model
from ..runtime.model import Transformer
from . import loop as loop_mod
from .config import HeadsTrainConfig, to_dict
from .data import check_length, collect_documents, sample_windows, split_documents, tokenize_corpus
from .device import autocast, describe
from .forward import causal_hidden
from .lm import full_precision, validation_windows


def heads_loss(model: Transformer, heads: TokenSwiftHeads, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sum over heads of CE(head i at position t, ids[t + 1 + i]); per-head loss and top-1 accuracy."""
    with torch.no_grad():
        h0 = causal_hidden(model, ids)
    T = ids.shape[1]
    total = None
    metrics: dict[str, torch.Tensor] = {}
    for i, state in enumerate(heads(h0), 1):
        shift = 1 + i
        if shift >= T:
            raise LonggenError(f"--seq-len {T} is too short for head {i} (needs more than {shift} tokens)")
        logits = full_precision(model.lm_head(state[:, : T - shift]))
        targets = ids[:, shift:]
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        total = loss if total is None else total + loss
        with torch.no_grad():
            metrics[f"loss{i}"] = loss.detach()
            metrics[f"acc{i}"] = (logits.argmax(-1) == targets).float().mean()
    return total, {"loss": total.detach(), **metrics}


@torch.no_grad()
def evaluate_heads(model: Transformer, heads: TokenSwiftHeads, windows: torch.Tensor, batch_size: int,
                   device: torch.device) -> dict[str, float]:
    """Validation loss/accuracy per head, plus the base head's own top-1 accuracy (``acc0``) for scale."""
    if windows.shape[0] == 0:
        return {}
    sums: dict[str, float] = {}
    n = 0
    for lo in range(0, windows.shape[0], batch_size):
        ids = windows[lo : lo + batch_size]
        with autocast(device):
            _, m = heads_loss(model, heads, ids)
            base = model.logits(causal_hidden(model, ids[:, :-1])).argmax(-1)
        m = {k: v for k, v in m.items() if k != "loss"}
        m["acc0"] = (base == ids[:, 1:]).float().mean()
        for k, v in m.items():
            sums[f"val_{k}"] = sums.get(f"val_{k}", 0.0) + float(v)
        n += 1
    order = sorted(sums, key=lambda k: (not k.startswith("val_acc"), k))
    return {k: sums[k] / n for k in order}


def train_heads(cfg: HeadsTrainConfig, resume: bool = False, command: str = "") -> dict:
    """Load the frozen base, tokenize the data with its tokenizer, train and save the heads."""
    if not cfg.model:
        raise LonggenError("train heads needs a base model (--model NAME|DIR)")
    out, device = loop_mod.start_run("train heads", cfg.out, resume, cfg.loop)
    model_dir = resolve_model(cfg.model)
    loaded = load_model(model_dir, "float32", str(device))
    if loaded.tokenizer is None:
        raise LonggenError(f"model directory {model_dir} has no tokenizer.json to tokenize the training data")
    T = cfg.loop.seq_len
    if T > loaded.config.max_position_embeddings:
        raise LonggenError(f"--seq-len {T} exceeds the model's context ({loaded.config.max_position_embeddings})")

    docs = collect_documents(cfg.data)
    train_docs, val_docs = split_documents(docs, cfg.data.val_fraction)
    cache_dir = Path(cfg.data.cache_dir) if cfg.data.cache_dir else cache_root() / "tokens"
    corpus = tokenize_corpus(train_docs, val_docs, model_dir, cache_dir)
    print(f"corpus: {corpus.describe()}", file=sys.stderr)
    check_length(corpus.train, T, "training")

    model = loaded.model
    heads = TokenSwiftHeads(loaded.config.hidden_size, cfg.num_heads, loaded.config.rms_norm_eps)
    heads.reset_parameters(torch.Generator().manual_seed(cfg.loop.seed), std=cfg.init_std)
    heads = heads.to(device).train()
    n_params = sum(p.numel() for p in heads.parameters())
    print(f"heads: {cfg.num_heads} x d={loaded.config.hidden_size} ({n_params / 1e6:.2f}M parameters) on "
          f"{describe(device)}; base {model_dir} frozen", file=sys.stderr)

    train_tokens = corpus.train.to(device)
    val_windows = validation_windows(corpus.val, cfg.loop.eval_batches * cfg.loop.batch_size, T).to(device)
    meta = {
        "trainer": "heads", "command": command, "base_model": str(cfg.model), "parameters": n_params,
        "device": describe(device), "torch": torch.__version__, "python": platform.python_version(),
        "corpus": corpus.describe(), "config": to_dict(cfg),
    }

    def save(directory: Path, progress: loop_mod.Progress) -> None:
        heads.save(directory, training={**meta, **progress.summary(), "log": progress.log})

    task = loop_mod.Task(
        name="heads",
        module=heads,
        loss=lambda ids: heads_loss(model, heads, ids),
        batch=lambda gen: sample_windows(train_tokens, cfg.loop.batch_size, T, gen),
        evaluate=lambda: evaluate_heads(model, heads, val_windows, cfg.loop.batch_size, device),
        save=save,
        out=out,
        tokens_per_batch=cfg.loop.batch_size * T,
    )
    progress = loop_mod.run(task, cfg.optim, cfg.loop, device, resume=resume, config=to_dict(cfg))
    return {**meta, **progress.summary(), "out": str(out)}
