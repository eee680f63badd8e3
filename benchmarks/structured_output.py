"""Structured-output requests (JSON schema, regex, EBNF) on SGLang's CPU engine: milliseconds per
output token and accepted tokens per verify, plain decoding against each algorithm, on the tiny
model with its shipped drafters. Outputs are checked equal to plain decoding's (greedy).

    SGLANG_USE_CPU_ENGINE=1 python benchmarks/structured_output.py [--tokens 128] [--algorithms TOKENSWIFT OWL]

Each engine serves one warm-up round first (it compiles the grammar backend's mask kernel), then
the timed round. The tiny model is trained on this project's own text: acceptance here says that
speculation continues under a grammar, not what a real model accepts.
"""

from __future__ import annotations

import argparse
import json
import time

DRAFTS = {"TOKENSWIFT": "tokenswift-heads", "OWL": "owl-drafter", "HOWL": "owl-drafter",
          "LONGSPEC": "longspec-drafter"}
SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                     "required": ["name", "age"]})
REQUESTS = {
    "json": ("Tell me about a person:", {"json_schema": SCHEMA}),
    "regex": ("Write a list of words:", {"regex": r"([a-z]+, ){3,}[a-z]+\."}),
    "ebnf": ("Answer:", {"ebnf": 'root ::= ("yes" | "no" | "maybe") (", " ("yes" | "no" | "maybe"))*'}),
}


def run(algorithm: str, tokens: int) -> dict:
    import sglang as sgl

    from sgl_longgen.runtime import resolve_model

    tiny = resolve_model("tiny")
    args = dict(model_path=str(tiny), device="cpu", dtype="float32", attention_backend="longgen_torch",
                disable_cuda_graph=True, mem_fraction_static=0.05, max_total_tokens=16384, max_running_requests=4,
                context_length=2048, random_seed=0, log_level="error", grammar_backend="llguidance")
    if algorithm != "plain":
        args.update(speculative_algorithm=algorithm, speculative_draft_model_path=str(tiny / DRAFTS[algorithm]))
    engine = sgl.Engine(**args)
    try:
        results = {}
        for name, (prompt, constraint) in REQUESTS.items():
            params = {"max_new_tokens": tokens, "temperature": 0, **constraint}
            engine.generate(prompt=prompt, sampling_params=params)  # warm-up
            start = time.perf_counter()
            out = engine.generate(prompt=prompt, sampling_params=params)
            seconds = time.perf_counter() - start
            meta = out["meta_info"]
            results[name] = {"ids": out["output_ids"], "ms_per_token": 1000 * seconds / meta["completion_tokens"],
                             "tokens": meta["completion_tokens"], "accept": meta.get("spec_accept_length")}
        return results
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--algorithms", nargs="*", default=list(DRAFTS))
    args = parser.parse_args()
    plain = run("plain", args.tokens)
    print(f"{'algorithm':<11} {'request':<6} {'tokens':>6} {'ms/token':>9} {'x plain':>8} {'accept':>7} same")
    for algorithm in ["plain", *args.algorithms]:
        got = plain if algorithm == "plain" else run(algorithm, args.tokens)
        for name, row in got.items():
            base = plain[name]
            accept = "-" if row["accept"] is None else f"{row['accept']:.2f}"
            print(f"{algorithm:<11} {name:<6} {row['tokens']:>6} {row['ms_per_token']:>9.2f} "
                  f"{row['ms_per_token'] / base['ms_per_token']:>8.2f} {accept:>7} {row['ids'] == base['ids']}",
                  flush=True)


if __name__ == "__main__":
    main()
