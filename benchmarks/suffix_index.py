"""The suffix index behind SUFFIX (and HOWL's chains, TOKENSWIFT's suffix path) at long contexts:
update and query time per step, and memory, at 4K, 32K, 100K and 200K indexed tokens.

    python benchmarks/suffix_index.py [--sizes 4096 32768 100000 200000] [--steps 200] [--json out.json]

For each size and kind of text, a request's history of that many tokens is indexed in one go (a
prompt, as the prefill's shadow indexes it), then a serving loop is replayed: each step commits
1 to 6 tokens of the same text (the update: only the new tokens are indexed) and drafts SUFFIX's
tree of at most 64 nodes from the request's own index (the query), and HOWL's chain for
comparison. Printed: the prompt's indexing time, the median and worst update and query times,
the index's bytes per token (its arrays, spare room included) and the tree's mean size.

Kinds of text: ``text`` (a Zipf vocabulary of 32K tokens with copied passages, as prose and code
repeat themselves), ``loop`` (a greedy model's loop of period 2 from the start: every position
an occurrence of the context's last token, the worst case of a query, bounded by
``suffix.max_occurrences``) and ``random`` (uniform over 128K tokens: matches are short and rare).

Times are this machine's (one process; numpy may use several threads unless OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from sgl_longgen.config import SuffixConfig
from sgl_longgen.core.suffix import SuffixIndex
from sgl_longgen.core.suffix_tree import tree_draft


def text(kind: str, n: int, rng: np.random.Generator) -> list[int]:
    if kind == "loop":
        return [7, 8] * (n // 2 + 1)
    if kind == "random":
        return rng.integers(0, 128_000, n).tolist()
    out: list[int] = []
    while len(out) < n:
        if out and rng.random() < 0.3:  # a passage copied from earlier
            start = int(rng.integers(0, len(out)))
            out.extend(out[start : start + int(rng.integers(8, 200))])
        else:
            out.extend((rng.zipf(1.2, int(rng.integers(20, 200))) % 32_000).tolist())
    return out


def measure(kind: str, size: int, steps: int, config: SuffixConfig, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    tokens = text(kind, size + 8 * steps, rng)
    index = SuffixIndex.for_config(config)
    t = time.perf_counter()
    index.extend(tokens[:size])
    prompt_s = time.perf_counter() - t
    n = size
    update, query, chain, nodes = [], [], [], []
    for _ in range(steps):
        k = int(rng.integers(1, 7))
        t = time.perf_counter()
        index.extend(tokens[n : n + k])
        update.append(time.perf_counter() - t)
        n += k
        history = tokens[:n]
        t = time.perf_counter()
        tree = tree_draft(index, history, config, own=True)
        query.append(time.perf_counter() - t)
        nodes.append(len(tree))
        t = time.perf_counter()
        index.draft(history, config, own=True)
        chain.append(time.perf_counter() - t)

    def ms(values: list[float]) -> tuple[float, float]:
        return round(statistics.median(values) * 1e3, 4), round(max(values) * 1e3, 4)

    return {"kind": kind, "tokens": size, "prompt_index_ms": round(prompt_s * 1e3, 2),
            "update_ms": ms(update), "tree_query_ms": ms(query), "chain_query_ms": ms(chain),
            "bytes_per_token": round(index.nbytes / len(index), 1), "tree_nodes": round(statistics.mean(nodes), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 32768, 100_000, 200_000])
    parser.add_argument("--kinds", nargs="+", default=["text", "loop", "random"], choices=["text", "loop", "random"])
    parser.add_argument("--steps", type=int, default=200, help="serving steps replayed per size (update + query each)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    config = SuffixConfig()
    print(f"max_spec_tokens {config.max_spec_tokens}, max_depth {config.max_depth}, "
          f"max_occurrences {config.max_occurrences}; times: median / worst of {args.steps} steps")
    header = (f"{'text':<7}{'tokens':>8}{'prompt ms':>11}{'update ms':>18}{'tree query ms':>18}"
              f"{'chain query ms':>18}{'B/token':>9}{'nodes':>7}")
    print(header)
    rows = []
    for kind in args.kinds:
        for size in args.sizes:
            r = measure(kind, size, args.steps, config)
            rows.append(r)
            print(f"{kind:<7}{size:>8}{r['prompt_index_ms']:>11.2f}"
                  f"{'%.3f / %.3f' % r['update_ms']:>18}{'%.3f / %.3f' % r['tree_query_ms']:>18}"
                  f"{'%.3f / %.3f' % r['chain_query_ms']:>18}{r['bytes_per_token']:>9.1f}{r['tree_nodes']:>7.1f}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
