"""GPU check: requests that run to the end of the context, beside others, for every algorithm.

A small Llama-shaped model with SGLang's dummy weights (bf16, CUDA graphs), context 4096: six
requests in one batch, three of which end at the context's last token (prompt + max_new_tokens =
context) and three short neighbours. Each algorithm's outputs and finish reasons are compared
with plain decoding's, then a second batch checks that the engine still serves (SGLang's pool
leak checker runs whenever the scheduler idles between the two).

    python benchmarks/gpu_context_end.py --out context_end.json [--algorithms TOKENSWIFT OWL HOWL LONGSPEC]

Dummy weights give flat distributions: where an output differs from plain decoding's, the plain
run's top-2 log-probability gap at the first difference is printed (a bf16-level near-tie is kernel
rounding, not the method).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from sgl_longgen.bench.engine_bench import first_difference, top2_gap
from sgl_longgen.bench.gpu_check import make_checkpoints, make_longspec_drafter, make_owl_drafter
from sgl_longgen.sglang.engine import open_engine, stop_engine

CONTEXT = 4096
SMALL = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000, hidden_size=1024,
    intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
    max_position_embeddings=CONTEXT, rms_norm_eps=1e-5, rope_theta=10000.0, torch_dtype="bfloat16",
    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, hidden_act="silu",
)


def batch(seed: int) -> tuple[list[list[int]], list[dict]]:
    """Three requests ending at the context's last token (a few widths apart), three short ones."""
    rng = random.Random(seed)
    prompts, params = [], []
    for room in (5, 70, 150):  # new tokens left to the end of the context
        prompts.append([rng.randrange(3, 32000) for _ in range(CONTEXT - room)])
        params.append({"max_new_tokens": room, "temperature": 0, "ignore_eos": True})
    for n in (200, 300, 400):
        prompts.append([rng.randrange(3, 32000) for _ in range(64)])
        params.append({"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
    return prompts, params


def run(model: Path, algorithm: str | None, draft: Path | None) -> dict:
    kw = dict(model_path=str(model), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              context_length=CONTEXT, random_seed=0, mem_fraction_static=0.5, max_running_requests=8,
              cuda_graph_backend_prefill="disabled", log_level="warning")
    if algorithm is not None:
        kw.update(speculative_algorithm=algorithm, speculative_draft_model_path=str(draft))
    engine = open_engine(**kw)
    try:
        rounds = []
        for seed in (0, 1):
            prompts, params = batch(seed)
            start = time.perf_counter()
            outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=algorithm is None,
                                   top_logprobs_num=2 if algorithm is None else None)
            rounds.append({"seconds": time.perf_counter() - start,
                           "ids": [o["output_ids"] for o in outs],
                           "finish": [o["meta_info"]["finish_reason"] for o in outs],
                           "meta": [o["meta_info"] for o in outs] if algorithm is None else None})
        return {"rounds": rounds}
    finally:
        stop_engine(engine)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("context_end.json"))
    parser.add_argument("--algorithms", nargs="*", default=["TOKENSWIFT", "OWL", "HOWL", "LONGSPEC"])
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    model, heads = make_checkpoints(root, budget=1024, config=SMALL, name="small")
    drafts = {"TOKENSWIFT": heads, "OWL": make_owl_drafter(root, 1024, 0, config=SMALL),
              "LONGSPEC": make_longspec_drafter(root, config=SMALL)}
    drafts["HOWL"] = drafts["OWL"]
    report = {"plain": run(model, None, None)}
    plain = report["plain"]["rounds"]
    for algorithm in args.algorithms:
        try:
            report[algorithm] = got = run(model, algorithm, drafts[algorithm])
        except Exception as exc:  # noqa: BLE001 - reported, the next algorithm still runs
            report[algorithm] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"{algorithm}: FAILED {type(exc).__name__}: {exc}", flush=True)
            continue
        for r, (want, have) in enumerate(zip(plain, got["rounds"])):
            for i, (w, h) in enumerate(zip(want["ids"], have["ids"])):
                diff = first_difference(w, h)
                gap = None if diff is None else top2_gap(want["meta"][i], diff)
                same_finish = want["finish"][i] == have["finish"][i]
                print(f"{algorithm} round {r} request {i}: {len(h)}/{len(w)} tokens, "
                      f"{'equal' if diff is None else f'first difference at {diff} (plain top-2 gap {gap})'}, "
                      f"finish {'equal' if same_finish else (want['finish'][i], have['finish'][i])}", flush=True)
    for entry in report.values():
        for r in entry.get("rounds", []):
            r.pop("meta", None)
    args.out.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
