"""GPU check of a batch that shares its prompt (n samples of one long prompt, a batch job's usual
shape): plain decoding against a method's engine whose plain steps cascade over the shared slots.

SGLang's radix cache gives requests with the same prompt the same KV slots over it, but its decode
reads them once per request. The ``longgen`` backend's cascade (``SGLANG_LONGGEN_CASCADE_MIN_SHARED``)
reads them once for the batch, in eager verifies and in captured graphs of up to 16 rows, so the
plain steps of adaptive speculation (sampled text, where drafts do not pay) read the prompt once per
step for all ``--samples`` requests. Per engine (radix cache on, dummy 8B-shaped weights):

* ``tokens_per_s``: ``--samples`` sampled requests (temperature 1) of one ``--context``-token prompt,
  submitted together, ``2N`` tokens each less an ``N``-token run (prefill and set-up cancel out);
* ``greedy_equal``: the same batch greedy, with speculation off on the method's engines, token for
  token plain decoding's.

Engines: ``plain`` (SGLang's default backend), then each ``--algorithms`` method with adaptive
speculation, with the cascade (``<METHOD>+cascade``) and, with ``--no-cascade-too``, without.

    python -m sgl_longgen.bench.shared_prompt --out shared.json --algorithms TOKENSWIFT --no-cascade-too
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

from .. import env
from ..sglang.engine import open_engine, stop_engine
from .gpu_check import make_checkpoints


def engine(model: Path, algorithm: str | None, draft: Path | None, args):
    kw = dict(model_path=str(model), load_format="dummy", skip_tokenizer_init=True, mem_fraction_static=0.8,
              context_length=131072, log_level="warning", random_seed=0, chunked_prefill_size=16384,
              max_running_requests=max(4, args.samples), cuda_graph_max_bs_decode=max(4, args.samples),
              cuda_graph_backend_prefill="disabled")
    if algorithm is not None:
        kw.update(speculative_algorithm=algorithm, speculative_num_draft_tokens=args.draft_tokens,
                  disable_overlap_schedule=True, speculative_draft_model_path=str(draft))
    return open_engine(**kw)


def batch_seconds(eng, prompt: list[int], samples: int, params: dict, n: int) -> tuple[float, list[list[int]]]:
    t = time.time()
    out = eng.generate(input_ids=[prompt] * samples, sampling_params=[{**params, "max_new_tokens": n}] * samples)
    return time.time() - t, [o["output_ids"] for o in out]


def measure(eng, spec: bool, prompt: list[int], args) -> dict:
    off = {"custom_params": {"longgen_speculation": "off"}} if spec else {}
    sampled = {"temperature": 1.0, "ignore_eos": True}
    eng.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1})  # the prompt in the radix cache
    batch_seconds(eng, prompt, args.samples, sampled, 16)  # warm-up at this batch size
    short, _ = batch_seconds(eng, prompt, args.samples, sampled, args.tokens + 1)
    long, _ = batch_seconds(eng, prompt, args.samples, sampled, 2 * args.tokens + 1)
    steady = (long - short) / args.tokens
    _, greedy = batch_seconds(eng, prompt, args.samples, {"temperature": 0.0, "ignore_eos": True, **off}, args.tokens)
    return {"tokens_per_s": round(args.samples / steady, 1), "ms_per_step": round(steady * 1e3, 3),
            "greedy": greedy}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("shared_prompt.json"))
    p.add_argument("--algorithms", nargs="*", default=["TOKENSWIFT"], choices=("TOKENSWIFT",))
    p.add_argument("--samples", type=int, default=8, help="requests of the one prompt, submitted together")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--draft-tokens", type=int, default=64)
    p.add_argument("--cascade-min-shared", type=int, default=2048)
    p.add_argument("--no-cascade-too", action="store_true", help="also each method without the cascade")
    args = p.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="longgen_shared_"))
    model, heads = make_checkpoints(root, 4096)
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 127000) for _ in range(args.context)]
    runs = [(None, None)] + [(a, c) for a in args.algorithms for c in ([True, False] if args.no_cascade_too else [True])]
    report: dict = {"samples": args.samples, "context": args.context}
    for algorithm, cascade in runs:
        name = "plain" if algorithm is None else algorithm + ("+cascade" if cascade else "")
        print(f"{name}:", flush=True)
        if algorithm is not None:
            os.environ[env.name("ADAPTIVE")] = "1"
            os.environ[env.name("CASCADE_MIN_SHARED")] = str(args.cascade_min_shared if cascade else 0)
        try:
            eng = engine(model, algorithm, heads if algorithm == "TOKENSWIFT" else None, args)
        finally:
            os.environ.pop(env.name("ADAPTIVE"), None)
            os.environ.pop(env.name("CASCADE_MIN_SHARED"), None)
        try:
            row = measure(eng, algorithm is not None, prompt, args)
        finally:
            stop_engine(eng)
        greedy = row.pop("greedy")
        if algorithm is None:
            report["plain_greedy"] = greedy
        else:
            row["greedy_equal"] = greedy == report.get("plain_greedy")
        report[name] = row
        print(f"  {row}", flush=True)
        args.out.write_text(json.dumps({k: v for k, v in report.items() if k != "plain_greedy"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
