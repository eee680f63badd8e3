"""SUFFIX in the reference runtime is lossless against plain decoding (the oracle).

Greedy: token-identical output on Llama and Qwen2 proxies, several prompts, with and without the
contextual penalty, every step speculative or with SUFFIX's defaults (adaptive speculation and
verify widths on), with the shared corpus of past outputs; the KV cache after a run is a fresh
prefill's. Sampled: with the corpus of earlier runs' outputs the drafts are branching trees, and
the emitted tokens follow the exact distribution computed from a micro model.
"""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from sgl_longgen.config import load_generate_config
from sgl_longgen.runtime import SuffixDecoder, build_decoder

from runtime_oracle import PROMPT, ar_output, config, model

torch.set_num_threads(1)

NEW_TOKENS = 256
PROMPTS = [PROMPT, list(b"class Stack:\n    def push(self, x):\n"), list(b"1, 2, 3, 1, 2, 3, 1, 2,")]


def plain(name: str, prompt: list[int], n: int, **kw) -> list[int]:
    return build_decoder(model(name), config("ar", **kw)).generate(prompt, n).output_ids


@pytest.mark.parametrize("name,penalty,window", [("tiny-random", 1.0, 1024), ("tiny-random", 1.2, 64),
                                                 ("tiny-qwen2", 1.0, 1024)])
def test_greedy_suffix_equals_plain_decoding(name, penalty, window):
    cfg = config("suffix", sampling__penalty=penalty, sampling__penalty_window=window)
    result = build_decoder(model(name), cfg).generate(PROMPT, NEW_TOKENS)
    assert result.finish_reason == "length" and result.error is None
    assert tuple(result.output_ids) == ar_output(name, penalty, window, NEW_TOKENS)
    # It speculated and drafts were accepted (fewer under the penalty: the text repeats itself less).
    assert result.stats.plain_steps == 0 and result.stats.accepted > 30 and result.accept_length > 1.15


@pytest.mark.parametrize("prompt", range(1, len(PROMPTS)))
def test_other_prompts_with_suffixs_defaults(prompt):
    """SUFFIX's own defaults: adaptive speculation on, the verify width chosen per step."""
    cfg = load_generate_config(None, {"method": "suffix", "ignore_eos": True})
    assert cfg.adaptive.enabled and cfg.adaptive.widths == [4, 16]
    dec = build_decoder(model("tiny"), cfg)
    result = dec.generate(PROMPTS[prompt], NEW_TOKENS)
    assert result.output_ids == plain("tiny", PROMPTS[prompt], NEW_TOKENS)
    assert dec.controller is not None and result.stats.steps - result.stats.plain_steps > 0


def test_a_second_generation_drafts_from_the_first_ones_output():
    dec = build_decoder(model("tiny"), config("suffix", suffix__global_requests=4))
    first = dec.generate(PROMPTS[1], 128)
    again = dec.generate(PROMPTS[1], 128)
    assert first.output_ids == again.output_ids == plain("tiny", PROMPTS[1], 128)
    assert again.accept_length > max(8.0, first.accept_length)  # its own output is in the corpus


# ------------------------------------------------------------------------------------------------
# sampled: exact distribution


@pytest.mark.slow
def test_sampled_suffix_follows_the_exact_distribution():
    """The OWL tests' micro model and prompt, the law of tokens 2 and 3. One decoder, a new seed
    per generation: the shared corpus holds the earlier generations' outputs, so a step's tree
    branches over the continuations they took, weighted by how often (six tokens each, so that
    the corpus holds contexts like the prompt's last token and the first)."""
    import test_owl_lossless as base

    lm, _ = base.micro()
    runs = 2500
    cfg = msgspec.structs.replace(
        config("suffix", suffix__global_requests=runs, suffix__max_spec_factor=8.0, suffix__min_token_prob=0.0),
        sampling=base.SAMPLING,
    )
    dec = SuffixDecoder(lm, cfg)
    counts = np.zeros((8, 8))
    accepted = branching = 0
    real = dec.method.propose

    def propose(*args):
        draft = real(*args)
        nonlocal branching
        branching += len(set(draft.tree.parents[1:])) < len(draft.tree) - 1  # some node has two children
        return draft

    dec.method.propose = propose
    for seed in range(runs):
        dec.config = msgspec.structs.replace(cfg, seed=seed)
        r = dec.generate(base.MICRO_PROMPT, 6)
        counts[r.output_ids[1], r.output_ids[2]] += 1
        accepted += r.stats.accepted
    assert accepted > runs and branching > runs // 2  # branching drafts were accepted often enough to matter
    expected = base.exact_pair_distribution(lm).ravel() * runs
    keep = expected > 0
    assert counts.ravel()[~keep].sum() == 0
    assert chisquare(counts.ravel()[keep], expected[keep]).pvalue > 1e-3


def test_the_command_line_runs_suffix_without_a_draft_directory(cli, tmp_path):
    records = {}
    for method in ("ar", "suffix"):
        out = tmp_path / f"{method}.jsonl"
        res = cli("generate", "--model", "tiny-random", "--method", method, "--max-new-tokens", "64",
                  "--temperature", "0", "--ignore-eos", "--out", str(out))
        assert res.returncode == 0, res.stderr
        records[method] = json.loads(out.read_text())
    assert records["suffix"]["output_ids"] == records["ar"]["output_ids"]
    assert records["suffix"]["accept_length"] > 1.0
    res = cli("demo", "--model", "tiny-random", "--method", "suffix", "--max-new-tokens", "64")
    assert res.returncode == 0, res.stderr
    assert next(line for line in res.stdout.splitlines() if line.startswith("suffix")).split()[-1] == "yes"
