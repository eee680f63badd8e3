"""``sgl-longgen train``: train drafters and models (``train lm``, ``train heads``, ``train proxy``,
``train owl``, ``train longspec``) and make their self-distilled text (``train distill``).

Each trainer is one entry of ``TRAINERS``: a function that adds its sub-parser. Settings layer
like ``generate``'s: the trainer's typed defaults < ``--config FILE.toml`` < flags.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..runtime.embedded import names as embedded_names
from ..training.command import command_line
from ..training.config import HeadsLoopConfig, HeadsOptimConfig, LoopConfig, OptimConfig


def overrides(args: argparse.Namespace, mapping: dict[str, tuple[str, ...]]) -> dict[str, Any]:
    """Nested config overrides from the flags the user gave (None = not given)."""
    out: dict[str, Any] = {}
    for dest, path in mapping.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def _add_loop_args(p: argparse.ArgumentParser, loop: LoopConfig | None = None, optim: OptimConfig | None = None) -> None:
    """Loop, optimizer and data flags; ``loop``/``optim``: the trainer's default structs, for the help."""
    loop, optim = loop or LoopConfig(), optim or OptimConfig()
    g = p.add_argument_group("loop")
    g.add_argument("--steps", type=int, help=f"optimizer steps (default {loop.steps})")
    g.add_argument("--batch-size", type=int, help=f"windows per step (default {loop.batch_size})")
    g.add_argument("--seq-len", type=int, help=f"tokens per window (default {loop.seq_len})")
    g.add_argument("--lr", type=float, help=f"peak learning rate (default {optim.lr:g})")
    g.add_argument("--warmup-steps", type=int, help=f"default {optim.warmup_steps}")
    g.add_argument("--weight-decay", type=float, help=f"default {optim.weight_decay:g}")
    g.add_argument("--max-minutes", type=float, help="wall-time budget: fewer steps if the asked ones do not fit")
    g.add_argument("--log-every", type=int, help=f"default {loop.log_every}")
    g.add_argument("--eval-every", type=int, help=f"validation every N steps (0: only at the end; default {loop.eval_every})")
    g.add_argument("--save-every", type=int, help=f"checkpoint every N steps (0: only at the end; default {loop.save_every})")
    g.add_argument("--seed", type=int)
    g.add_argument("--device", help="auto (default: cuda if available), cpu, cuda, cuda:N")
    g.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice)")
    g.add_argument("--compile", action="store_true", default=None, help="torch.compile the forward (GPU)")
    g.add_argument("--resume", action="store_true", help="continue from OUT/trainer_state.pt")
    d = p.add_argument_group("data")
    d.add_argument("--data", nargs="+", metavar="SRC", help="files, directories or 'stdlib' (default: stdlib)")
    d.add_argument("--glob", help="file pattern inside data directories (default *.py)")
    d.add_argument("--val-fraction", type=float)
    d.add_argument("--cache-dir", help="tokenized-corpus cache (default $SGLANG_LONGGEN_HOME/tokens)")
    p.add_argument("--config", type=Path, help="TOML file with the trainer's settings (flags override it)")


LOOP_FLAGS = {
    "steps": ("loop", "steps"), "batch_size": ("loop", "batch_size"), "seq_len": ("loop", "seq_len"),
    "max_minutes": ("loop", "max_minutes"), "log_every": ("loop", "log_every"),
    "eval_every": ("loop", "eval_every"), "save_every": ("loop", "save_every"), "seed": ("loop", "seed"),
    "device": ("loop", "device"), "threads": ("loop", "threads"), "compile": ("loop", "compile"),
    "lr": ("optim", "lr"), "warmup_steps": ("optim", "warmup_steps"), "weight_decay": ("optim", "weight_decay"),
    "data": ("data", "sources"), "glob": ("data", "glob"), "val_fraction": ("data", "val_fraction"),
    "cache_dir": ("data", "cache_dir"),
}


def _print_summary(summary: dict) -> None:
    keys = ("out", "steps", "tokens", "seconds", "tokens_per_second", "train", "val", "draft_vocab",
            "draft_vocab_coverage")  # the last two: drafters with a reduced draft vocabulary
    keep = {k: summary[k] for k in keys if k in summary}
    print(json.dumps(keep))


# ----------------------------------------------------------------------------------------------
# train lm


def _add_lm(tsub) -> None:
    p = tsub.add_parser("lm", help="a tokenizer and a small Llama-architecture LM from scratch (HF checkpoint)")
    p.add_argument("--out", help="output checkpoint directory")
    p.add_argument("--tokenizer", help="reuse this directory's tokenizer.json instead of training one")
    p.add_argument("--vocab-size", type=int, help="BPE vocabulary size (default 8192)")
    p.add_argument("--save-dtype", choices=["float32", "bfloat16", "float16"], help="weights dtype on disk (default bfloat16)")
    m = p.add_argument_group("model shape (HF config.json fields)")
    m.add_argument("--hidden-size", type=int)
    m.add_argument("--layers", type=int)
    m.add_argument("--heads", type=int, help="attention (query) heads")
    m.add_argument("--kv-heads", type=int)
    m.add_argument("--head-dim", type=int)
    m.add_argument("--intermediate-size", type=int)
    m.add_argument("--max-position-embeddings", type=int)
    m.add_argument("--rope-theta", type=float)
    _add_loop_args(p, LoopConfig(), OptimConfig())
    p.set_defaults(run=_run_lm)


def _run_lm(args: argparse.Namespace) -> int:
    from ..training.config import LMTrainConfig, load_train_config
    from ..training.lm import train_lm

    flags = {
        **LOOP_FLAGS, "out": ("out",), "tokenizer": ("tokenizer_dir",), "vocab_size": ("tokenizer", "vocab_size"),
        "save_dtype": ("save_dtype",), "hidden_size": ("model", "hidden_size"), "layers": ("model", "num_hidden_layers"),
        "heads": ("model", "num_attention_heads"), "kv_heads": ("model", "num_key_value_heads"),
        "head_dim": ("model", "head_dim"), "intermediate_size": ("model", "intermediate_size"),
        "max_position_embeddings": ("model", "max_position_embeddings"), "rope_theta": ("model", "rope_theta"),
    }
    cfg = load_train_config(LMTrainConfig, args.config, overrides(args, flags))
    _print_summary(train_lm(cfg, resume=args.resume, command=command_line(args, ("train", "lm"))))
    return 0


# ----------------------------------------------------------------------------------------------
# train heads


def _add_heads(tsub) -> None:
    p = tsub.add_parser("heads", help="TokenSwift's draft heads on a frozen base model")
    p.add_argument("--model", help=f"base model: embedded ({', '.join(embedded_names())}) or an HF checkpoint directory")
    p.add_argument("--out", help="heads checkpoint directory (heads.json + heads.safetensors)")
    p.add_argument("--num-heads", type=int, help="draft heads (default 3)")
    _add_loop_args(p, HeadsLoopConfig(), HeadsOptimConfig())
    p.set_defaults(run=_run_heads)


def _run_heads(args: argparse.Namespace) -> int:
    from ..training.config import HeadsTrainConfig, load_train_config
    from ..training.heads import train_heads

    flags = {**LOOP_FLAGS, "model": ("model",), "out": ("out",), "num_heads": ("num_heads",)}
    cfg = load_train_config(HeadsTrainConfig, args.config, overrides(args, flags))
    _print_summary(train_heads(cfg, resume=args.resume, command=command_line(args, ("train", "heads"))))
    return 0


# ----------------------------------------------------------------------------------------------
# train proxy


def _add_proxy(tsub) -> None:
    from ..training.proxy import add_arguments

    p = tsub.add_parser("proxy", help="tokenizer + LM + heads end to end: the embedded proxy model")
    add_arguments(p)
    p.set_defaults(run=_run_proxy)


def _run_proxy(args: argparse.Namespace) -> int:
    from ..training.proxy import run

    return run(args, command=command_line(args, ("train", "proxy")))


# ----------------------------------------------------------------------------------------------
# train owl


def _add_owl(tsub) -> None:
    p = tsub.add_parser("owl", help="OWL's LSTM drafter and [SPEC] embedding on a frozen target (self-distilled data)")
    p.add_argument("--model", help=f"target model: embedded ({', '.join(embedded_names())}) or an HF checkpoint directory")
    p.add_argument("--out", help="drafter checkpoint directory (owl.json + owl.safetensors + longgen.toml)")
    p.add_argument("--width", type=int, help="LSTM width (default: the target's hidden size)")
    p.add_argument("--n-steps", type=int, help="draft steps unrolled in training (default 8; the tree depth)")
    p.add_argument("--draft-vocab", type=int, metavar="N",
                   help="drafter head over the N most frequent tokens of the generated data (default 0: full vocabulary)")
    p.add_argument("--no-spec", action="store_true", default=None, help="train without [SPEC] (plain D_nospec)")
    p.add_argument("--spec-dropout", type=float, help="share of rows trained on the null [SPEC] state (default 0.3)")
    p.add_argument("--spec-target", choices=["next", "beyond"], help="[SPEC] auxiliary target: x_k (Eq. 9) or x_{k+1}")
    p.add_argument("--spec-weight", type=float, help="weight of the [SPEC] auxiliary cross-entropy (default 1)")
    g = p.add_argument_group("self-distilled data (--seq-len: generated tokens per sequence, default 256)")
    g.add_argument("--sequences", type=int, help="generated training sequences (default 4096)")
    g.add_argument("--val-sequences", type=int, help="generated validation sequences (default 64)")
    g.add_argument("--prompt-len", type=int, help="prompt chunk length (default 64)")
    g.add_argument("--gen-temperature", type=float, help="target sampling temperature (0 = greedy; default 1)")
    g.add_argument("--gen-top-k", type=int, help="target sampling top-k (default 10; 0 = off)")
    g.add_argument("--gen-batch-size", type=int, help="sequences generated at once (default 256)")
    _add_loop_args(p)
    p.set_defaults(run=_run_owl)


def _run_owl(args: argparse.Namespace) -> int:
    from ..training.config import load_train_config
    from ..training.owl import OwlTrainConfig, train_owl

    flags = {
        **LOOP_FLAGS, "model": ("model",), "out": ("out",), "width": ("drafter", "width"),
        "n_steps": ("drafter", "n_steps"), "draft_vocab": ("drafter", "draft_vocab"), "spec_dropout": ("spec_dropout",),
        "spec_target": ("spec_target",), "spec_weight": ("spec_weight",), "sequences": ("generation", "sequences"),
        "val_sequences": ("generation", "val_sequences"), "prompt_len": ("generation", "prompt_len"),
        "gen_temperature": ("generation", "temperature"), "gen_top_k": ("generation", "top_k"),
        "gen_batch_size": ("generation", "batch_size"),
    }
    given = overrides(args, flags)
    if args.no_spec:
        given.setdefault("drafter", {})["spec"] = False
    cfg = load_train_config(OwlTrainConfig, args.config, given)
    _print_summary(train_owl(cfg, resume=args.resume, command=command_line(args, ("train", "owl"))))
    return 0


# ----------------------------------------------------------------------------------------------
# train longspec


def _add_longspec(tsub) -> None:
    from ..training.longspec import LongSpecLoopConfig, LongSpecOptimConfig

    p = tsub.add_parser("longspec", help="LongSpec's drafter (window self-attention + cross-attention into the "
                                         "target's KV) on a frozen target, with anchor-offset indices and flash "
                                         "noisy training (self-distilled data)")
    p.add_argument("--model", help=f"target model: embedded ({', '.join(embedded_names())}) or an HF checkpoint directory")
    p.add_argument("--out", help="drafter checkpoint directory (longspec.json + longspec.safetensors + longgen.toml)")
    p.add_argument("--window", type=int, help="self-attention window in tokens (default 512)")
    p.add_argument("--intermediate-size", type=int, help="MLP width (default: the target's)")
    p.add_argument("--draft-vocab", type=int, metavar="N",
                   help="draft over the N most frequent tokens of the generated data only, through those rows of "
                        "the target's LM head (default 0: full vocabulary)")
    p.add_argument("--anchors", type=int, help="anchor-offset indices: sink positions kept (default 4)")
    p.add_argument("--max-offset", type=int, help="anchor-offset indices: largest offset (default 30000)")
    p.add_argument("--no-anchor-offset", action="store_true", default=None, help="train at vanilla positions")
    p.add_argument("--max-lag", type=int, help="flash noisy training: largest cross-attention lag (default 5; 0: off)")
    g = p.add_argument_group("self-distilled data (--seq-len: generated tokens per sequence, default 256)")
    g.add_argument("--sequences", type=int, help="generated training sequences (default 4096)")
    g.add_argument("--val-sequences", type=int, help="generated validation sequences (default 64)")
    g.add_argument("--prompt-len", type=int, help="prompt chunk length (default 64)")
    g.add_argument("--gen-temperature", type=float, help="target sampling temperature (0 = greedy; default 1)")
    g.add_argument("--gen-top-k", type=int, help="target sampling top-k (default 10; 0 = off)")
    g.add_argument("--gen-batch-size", type=int, help="sequences generated at once (default 256)")
    _add_loop_args(p, LongSpecLoopConfig(), LongSpecOptimConfig())
    p.set_defaults(run=_run_longspec)


def _run_longspec(args: argparse.Namespace) -> int:
    from ..training.config import load_train_config
    from ..training.longspec import LongSpecTrainConfig, train_longspec

    flags = {
        **LOOP_FLAGS, "model": ("model",), "out": ("out",), "window": ("drafter", "window"),
        "intermediate_size": ("drafter", "intermediate_size"), "draft_vocab": ("drafter", "draft_vocab"),
        "anchors": ("anchor_offset", "anchors"),
        "max_offset": ("anchor_offset", "max_offset"), "max_lag": ("noisy", "max_lag"),
        "sequences": ("generation", "sequences"), "val_sequences": ("generation", "val_sequences"),
        "prompt_len": ("generation", "prompt_len"), "gen_temperature": ("generation", "temperature"),
        "gen_top_k": ("generation", "top_k"), "gen_batch_size": ("generation", "batch_size"),
    }
    given = overrides(args, flags)
    if args.no_anchor_offset:
        given.setdefault("anchor_offset", {})["enabled"] = False
    cfg = load_train_config(LongSpecTrainConfig, args.config, given)
    _print_summary(train_longspec(cfg, resume=args.resume, command=command_line(args, ("train", "longspec"))))
    return 0


# ----------------------------------------------------------------------------------------------
# train distill


def _add_distill(tsub) -> None:
    p = tsub.add_parser("distill", help="training text: built-in real prompts answered by the model itself (JSONL "
                                        "for --data), or an evaluation set rendered for --prompt-file")
    p.add_argument("--model", required=True, help=f"the model: embedded ({', '.join(embedded_names())}) or a directory")
    p.add_argument("--out", type=Path, required=True, help="JSONL to write (and OUT.json: what made it)")
    p.add_argument("--prompts", type=Path, help="JSONL prompts ({'id', 'prompt'|'messages'}) instead of the built-in ones")
    p.add_argument("--exclude", type=Path, nargs="+", default=[], metavar="JSONL",
                   help="evaluation sets the prompts must not overlap (same format as --prompts)")
    p.add_argument("--render", type=Path, metavar="JSONL",
                   help="only render this prompt set ({'id', 'prompt'|'messages'}) into OUT as "
                        "{'id', 'prompt', 'input_ids'} lines for generate/eval --prompt-file")
    p.add_argument("--chat", type=int, default=480, help="built-in chat prompts (default 480)")
    p.add_argument("--code", type=int, default=480, help="built-in code prompts (default 480)")
    p.add_argument("--prose", type=int, default=240, help="built-in prose prompts (default 240)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--batch-size", type=int, default=64, help="answers generated at once (default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda")
    p.set_defaults(run=_run_distill)


def _run_distill(args: argparse.Namespace) -> int:
    from ..training.distill import distill, render_prompt_file

    if args.render is not None:
        n = render_prompt_file(args.model, args.render, args.out)
        print(f"{n} prompts rendered into {args.out}")
        return 0
    summary = distill(args.model, args.out, args.prompts, args.exclude, args.chat, args.code, args.prose,
                      args.max_new_tokens, args.temperature, args.top_p, args.batch_size, args.seed, args.device,
                      command=command_line(args, ("train", "distill")))
    print(json.dumps(summary))
    return 0


TRAINERS = (_add_lm, _add_heads, _add_proxy, _add_owl, _add_longspec, _add_distill)


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train drafters and models (lm, heads, proxy, owl, longspec)")
    tsub = p.add_subparsers(dest="trainer", required=True, metavar="WHAT")
    for add in TRAINERS:
        add(tsub)
