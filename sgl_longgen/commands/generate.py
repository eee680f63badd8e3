"""``sgl-longgen generate``: one or more long generations on the reference runtime."""

from __future__ import annotations

import argparse
import json
import sys
import typing
from pathlib import Path
from typing import Any

from ..config import GenerateConfig, Method, load_toml, merge
from ..errors import LonggenError
from ..runtime import build_decoder, draft_dirs, layered_config, load_model, resolve_model
from ..runtime.embedded import names as embedded_names
from .progress import TokenProgress

DEFAULT_PROMPT = "def fibonacci(n):\n    "
METHODS = list(typing.get_args(Method))  # ar (plain decoding) and every speculative method


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help=f"embedded model ({', '.join(embedded_names())}) or an HF checkpoint directory")
    p.add_argument("--heads", type=Path, help="TokenSwift heads directory (default: the model's own tokenswift-heads/)")
    p.add_argument("--drafter", type=Path, help="OWL drafter directory for owl/howl (default: the model's own owl-drafter/)")
    p.add_argument("--longspec-drafter", type=Path,
                   help="LongSpec drafter directory for longspec (default: the model's own longspec-drafter/)")
    p.add_argument("--config", type=Path, help="TOML config file (see configs/)")
    p.add_argument("--dtype", choices=["float32", "float64", "bfloat16"], help="reference runtime dtype")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (the target distribution)")
    g.add_argument("--temperature", type=float, help="0 = greedy")
    g.add_argument("--top-p", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--min-p", type=float)
    g.add_argument("--eta", type=float, help="eta-sampling epsilon")
    g.add_argument("--min-tokens-to-keep", type=int)
    g.add_argument("--penalty", type=float, help="contextual penalty theta (1.0 = off)")
    g.add_argument("--penalty-window", type=int, help="contextual penalty window W (tokens)")
    g.add_argument("--seed", type=int)
    g.add_argument("--ignore-eos", action="store_true", default=None)
    t = p.add_argument_group("tokenswift")
    t.add_argument("--budget", type=int, help="partial KV budget B (tokens)")
    t.add_argument("--sinks", type=int, help="partial KV sink tokens S")
    a = p.add_argument_group("adaptive speculation")
    a.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=None,
                   help="take a plain decode step whenever speculating is not expected to pay "
                        "(lossless; default: [adaptive] enabled, off except for suffix)")


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help=f"generate with the reference runtime ({', '.join(METHODS)})")
    add_model_args(p)
    p.add_argument("--method", choices=METHODS, help="suffix needs no draft checkpoint")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="a text file (one prompt) or JSONL ({'id', 'prompt'|'input_ids'})")
    p.add_argument("--max-new-tokens", type=int)
    add_sampling_args(p)
    p.add_argument("--out", type=Path, help="JSONL output (default: print the text)")
    p.set_defaults(run=run)


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Only the flags the user gave: they override the config file, which overrides defaults."""
    flat = {
        ("method",): getattr(args, "method", None),
        ("max_new_tokens",): getattr(args, "max_new_tokens", None),
        ("seed",): args.seed,
        ("ignore_eos",): args.ignore_eos,
        ("sampling", "temperature"): args.temperature,
        ("sampling", "top_p"): args.top_p,
        ("sampling", "top_k"): args.top_k,
        ("sampling", "min_p"): args.min_p,
        ("sampling", "eta"): args.eta,
        ("sampling", "min_tokens_to_keep"): args.min_tokens_to_keep,
        ("sampling", "penalty"): args.penalty,
        ("sampling", "penalty_window"): args.penalty_window,
        ("tokenswift", "partial_kv", "budget"): args.budget,
        ("tokenswift", "partial_kv", "sinks"): args.sinks,
        ("adaptive", "enabled"): getattr(args, "adaptive", None),
        ("runtime", "dtype"): getattr(args, "dtype", None),
    }
    out: dict[str, Any] = {}
    for path, value in flat.items():
        if value is None:
            continue
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def resolve_config(args: argparse.Namespace, model_dir: Path,
                   method: str | None = None) -> tuple[GenerateConfig, dict[str, Path | None]]:
    """Defaults < the heads' longgen.toml < (owl/howl, longspec) the drafter's longgen.toml < --config < flags.

    Returns the config and the draft directories by field (``heads``, ``drafter``, ``longspec_drafter``).
    """
    overrides = overrides_from_args(args)
    if method is not None:
        overrides["method"] = method
    config_file = load_toml(args.config) if args.config is not None else {}
    dirs = args_draft_dirs(args, model_dir)
    return layered_config(dirs, merge(config_file, overrides), "from the command line"), dirs


def args_draft_dirs(args: argparse.Namespace, model_dir: Path) -> dict[str, Path | None]:
    """``--heads``, ``--drafter``, ``--longspec-drafter``, each else the model's own."""
    return draft_dirs(model_dir, {f: getattr(args, f, None) for f in ("heads", "drafter", "longspec_drafter")})


def read_prompts(args: argparse.Namespace, tokenizer) -> list[dict[str, Any]]:
    """``[{'id', 'input_ids', 'prompt'}]`` from --prompt / --prompt-file (default prompt otherwise)."""
    def encode(text: str) -> list[int]:
        if tokenizer is None:
            raise LonggenError("the model directory has no tokenizer.json; give token ids in a JSONL prompt file")
        return tokenizer.encode(text)

    if args.prompt_file is None:
        text = args.prompt if args.prompt is not None else DEFAULT_PROMPT
        return [{"id": "0", "prompt": text, "input_ids": encode(text)}]
    path: Path = args.prompt_file
    if not path.is_file():
        raise LonggenError(f"prompt file not found: {path}")
    if path.suffix != ".jsonl":
        text = path.read_text()
        return [{"id": path.stem, "prompt": text, "input_ids": encode(text)}]
    prompts = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            ids = rec["input_ids"] if "input_ids" in rec else encode(rec["prompt"])
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise LonggenError(f"{path}:{lineno}: bad prompt record ({type(exc).__name__}: {exc})") from None
        prompts.append({"id": str(rec.get("id", lineno)), "prompt": rec.get("prompt"), "input_ids": ids})
    if not prompts:
        raise LonggenError(f"prompt file {path} has no prompts")
    return prompts


def run(args: argparse.Namespace) -> int:
    model_dir = resolve_model(args.model)
    config, dirs = resolve_config(args, model_dir)
    loaded = load_model(model_dir, config.runtime.dtype, config.runtime.device)
    if config.runtime.threads:
        import torch

        torch.set_num_threads(config.runtime.threads)
    decoder = build_decoder(loaded, config, dirs["heads"], dirs["drafter"], dirs["longspec_drafter"])
    prompts = read_prompts(args, loaded.tokenizer)

    out = open(args.out, "w") if args.out else None
    failed = 0
    try:
        for item in prompts:
            with TokenProgress(config.max_new_tokens, desc=f"{config.method} {item['id']}") as bar:
                result = decoder.generate(item["input_ids"], config.max_new_tokens, bar.update)
            record = {
                "id": item["id"],
                "model": str(args.model),
                "method": config.method,
                **result.record(),
                "text": loaded.tokenizer.decode(result.output_ids) if loaded.tokenizer else None,
            }
            if out is not None:
                out.write(json.dumps(record) + "\n")
                out.flush()
            else:
                sys.stdout.write(record["text"] if record["text"] is not None else json.dumps(result.output_ids))
                sys.stdout.write("\n")
            if result.error:
                failed += 1
                print(f"sgl-longgen: error: generation {item['id']} stopped after {result.num_new_tokens} tokens "
                      f"({result.error}); what was generated is saved", file=sys.stderr)
    finally:
        if out is not None:
            out.close()
    return 1 if failed else 0
