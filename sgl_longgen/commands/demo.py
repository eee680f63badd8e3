"""``sgl-longgen demo``: the embedded model, plain decoding vs a speculative method, side by side."""

from __future__ import annotations

import argparse

from ..runtime import build_decoder, load_model, resolve_model
from .generate import DEFAULT_PROMPT, METHODS, add_model_args, resolve_config
from .progress import TokenProgress


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="run ar and a speculative method (tokenswift) greedily on the embedded model "
                                    "and compare")
    add_model_args(p)
    p.add_argument("--method", default="tokenswift", choices=[m for m in METHODS if m != "ar"],
                   help="the speculative method beside plain decoding (default: tokenswift)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=2048)
    p.set_defaults(run=run, seed=None, ignore_eos=None, temperature=0.0, top_p=None, top_k=None, min_p=None,
                   eta=None, min_tokens_to_keep=None, penalty=None, penalty_window=None, budget=None, sinks=None)


def run(args: argparse.Namespace) -> int:
    model_dir = resolve_model(args.model)
    results = {}
    loaded = None
    for method in ("ar", args.method):
        config, dirs = resolve_config(args, model_dir, method=method)
        if loaded is None:
            loaded = load_model(model_dir, config.runtime.dtype, config.runtime.device)
            prompt_ids = loaded.tokenizer.encode(args.prompt)
        decoder = build_decoder(loaded, config, dirs["heads"], dirs["drafter"], dirs["longspec_drafter"])
        with TokenProgress(config.max_new_tokens, desc=method) as bar:
            results[method] = decoder.generate(prompt_ids, config.max_new_tokens, bar.update)

    ar, ts = results["ar"], results[args.method]
    same = ar.output_ids == ts.output_ids
    print(f"model: {args.model}  prompt tokens: {len(prompt_ids)}  temperature: 0")
    print(f"{'method':<12}{'tokens':>8}{'seconds':>10}{'tokens/s':>10}{'tau':>7}{'alpha':>7}  identical")
    for name, r in results.items():
        alpha = f"{r.acceptance_rate:.2f}" if name != "ar" else "-"
        ident = "-" if name == "ar" else ("yes" if same else "no")
        print(f"{name:<12}{r.num_new_tokens:>8}{r.decode_seconds:>10.2f}{r.tokens_per_second:>10.1f}"
              f"{r.accept_length:>7.2f}{alpha:>7}  {ident}")
    speed = ts.tokens_per_second / ar.tokens_per_second if ar.tokens_per_second else 0.0
    print(f"speedup: {speed:.2f}x")
    if loaded.tokenizer is not None:
        print("--- text (first 300 characters) ---")
        print(loaded.tokenizer.decode(ts.output_ids)[:300])
    return 0 if same else 1
