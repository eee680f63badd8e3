"""End-to-end check of the ``longgen`` attention backend inside ``sglang.Engine`` (GPU host).

Runs SGLang's NGRAM speculative decoding on a small dummy-weight Llama (head dim 128, GQA 4) with
``attention_backend="longgen"``:

1. eager (no decode CUDA graph) with ``SGLANG_LONGGEN_VERIFY_CHECK=1``: on every TARGET_VERIFY layer
   the backend also runs SGLang's FlashInfer verify attention on the same inputs and fails the
   step if the two differ by more than 2e-2 (relative to max(1, |ref|));
2. with decode CUDA graphs: captured verify graphs replayed with new lengths and masks; its
   greedy output must start like the eager run's.

The scheduler runs in subprocesses, which learn about ``longgen`` through the project's SGLang
plugin entry point (``sglang.srt.plugins``), so the project must be pip-installed. The prefix
path is set with ``SGLANG_LONGGEN_PREFIX_BACKEND`` (from ``--prefix-backend``). Prints one line
per stage and ``ENGINE CHECK OK`` at the end; exits non-zero on failure.

    python -m sgl_longgen.bench.engine_check --draft-tokens 8 --prefix-backend auto
    python -m sgl_longgen.bench.engine_check --draft-tokens 64 --prefix-backend triton
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from .. import env
from ..sglang import backends
from ..sglang.engine import open_engine

TINY_LLAMA = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000, hidden_size=1024,
    intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
    max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=500000.0, torch_dtype="bfloat16",
    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, hidden_act="silu",
)


def plugin_registers_longgen() -> bool:
    """Whether some installed ``sglang.srt.plugins`` entry point registers ``longgen``."""
    from importlib.metadata import entry_points

    # SGLang's own registry, read directly: the question is whether the *installed* entry points
    # (what the scheduler subprocesses load) register the backend, which no helper of ours that
    # registers it itself (sgl_longgen.sglang.backends.register) could answer.
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    for ep in entry_points(group="sglang.srt.plugins"):
        try:
            ep.load()()
        except Exception as exc:  # report, keep looking
            print(f"plugin {ep.name} failed: {exc!r}", flush=True)
    return backends.HYBRID in ATTENTION_BACKENDS


def prompts():
    pattern = [1] + list(range(100, 164)) * 4  # repetitive: NGRAM finds drafts
    long = [1] + [(i * 7919) % 30000 + 10 for i in range(1500)] * 2  # ~3K tokens, a repeated half
    return [pattern, [1, 5, 6, 7, 8] * 20, long]


def run_engine(model_dir, draft_tokens, cuda_graph, max_new_tokens):
    graph = dict(cuda_graph_bs_decode=[1, 2, 4]) if cuda_graph else dict(cuda_graph_backend_decode="disabled")
    t = time.time()
    llm = open_engine(
        model_path=model_dir, load_format="dummy", skip_tokenizer_init=True, attention_backend=backends.HYBRID,
        speculative_algorithm="NGRAM", speculative_num_draft_tokens=draft_tokens,
        mem_fraction_static=0.5, max_total_tokens=65536, log_level="warning", random_seed=0,
        cuda_graph_backend_prefill="disabled", disable_radix_cache=True, **graph,
    )
    up = time.time() - t
    try:
        out = llm.generate(input_ids=prompts(), sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True})
    finally:
        llm.shutdown()
    ids = [o["output_ids"] for o in out]
    accept = [o["meta_info"].get("spec_accept_length") for o in out]
    print(f"engine cuda_graph={cuda_graph}: up in {up:.0f} s, accept lengths {accept}", flush=True)
    return ids


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draft-tokens", type=int, default=8)
    parser.add_argument("--prefix-backend", default="auto", choices=("auto", "fa3", "triton", "flashinfer_fold"))
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--skip-graph", action="store_true", help="only the eager, FlashInfer-checked run")
    args = parser.parse_args(argv)

    os.environ[env.name("PREFIX_BACKEND")] = args.prefix_backend  # read by the scheduler processes
    if not plugin_registers_longgen():
        print(f"no installed sglang.srt.plugins entry point registers {backends.HYBRID!r} (pip install -e . "
              "installs sgl_longgen.sglang:register, which registers it)", flush=True)
        return 3
    model_dir = tempfile.mkdtemp()
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(TINY_LLAMA, f)

    os.environ[env.name("VERIFY_CHECK")] = "1"
    eager = run_engine(model_dir, args.draft_tokens, False, args.max_new_tokens)
    print("eager run: every verify layer matched FlashInfer within tolerance", flush=True)
    os.environ[env.name("VERIFY_CHECK")] = "0"
    if not args.skip_graph:
        graphed = run_engine(model_dir, args.draft_tokens, True, args.max_new_tokens)
        same = [sum(1 for a, b in zip(x, y) if a == b) for x, y in zip(eager, graphed)]
        lead = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(eager, graphed)]
        print(f"graph vs eager: equal tokens {same} of {[len(x) for x in eager]}, first difference at {lead}", flush=True)
        if min(lead) < 4:
            print("CUDA-graph output diverges from the eager run within 4 tokens", flush=True)
            return 1
    print("ENGINE CHECK OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
