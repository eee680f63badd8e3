"""Sampled generation behind ``sgl.Engine``: the speculative engines draw from the plain engine's law.

Greedy tests compare tokens one for one; a sampled run cannot, since our verifier spends the
request's randomness differently from SGLang's sampler. What must hold is the law: thousands of
requests that differ only in ``sampling_seed`` give, per engine, a sample of short continuations
of one prompt, and a two-sample test compares each speculative engine's sample with the plain
engine's. The first token is drawn by SGLang's prefill; the three after it by our verification,
with drafts accepted (which the tests check), so the tokens after the first are the ones on trial.

Two statistics, both must pass:

* the joint law of the four tokens (a chi-square homogeneity test): it sees gross errors, such as
  a token drawn from the wrong context or a sampling parameter ignored;
* how many of tokens 2-4 are the target's likeliest token after their prefix (the chi-square test
  for trend on that count): a verifier that leans toward the draft - and a drafter that works
  proposes the likeliest token - raises it. At these sample sizes only this one sees a 5% lean,
  as the last test shows on deliberately biased samples.

Temperature 1.5 with ``top_k`` 4 keeps the categories few while the likeliest token is not too
likely (about 0.4): the flatter the law, the more a lean toward it shows.

``TOKENSWIFT-adaptive`` runs TOKENSWIFT with adaptive speculation on: the batch's steps are a mix
of plain and speculative ones, decided from measured times, and the law must not change.
``TOKENSWIFT-plain-runs`` turns speculation off per request: tokens 2-4 come from one run of three
plain steps queued back to back, each fed the token the one before drew on the device.
``TOKENSWIFT-width-4`` speculates on every step with each trie cut to its first 4 nodes
(``longgen_width``, adaptive widths' narrow verify). ``SUFFIX`` shares the finished requests'
outputs (``[suffix] global_requests``): its trees branch over the continuations the earlier
requests took, weighted by how often; its requests speculate on every step.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter, defaultdict

import numpy as np
import pytest
import torch
from scipy.stats import chi2, chi2_contingency

from helpers import fit_drafter
from sgl_longgen.runtime import load_model
from sgl_longgen.runtime.model import ForwardSpec
from sglang_harness import engine_args, model_path, spec_args, stop, worker_settings

PROMPT = [256, 5, 6, 7, 8, 9, 5, 6, 7]
NEW_TOKENS = 4
SAMPLING = {"max_new_tokens": NEW_TOKENS, "temperature": 1.5, "top_k": 4, "ignore_eos": True}
PLAIN_RUNS = 12_000
RUNS = {"TOKENSWIFT": 4_000, "OWL": 1_500, "HOWL": 1_500, "TOKENSWIFT-adaptive": 1_500, "TOKENSWIFT-plain-runs": 1_500,
        "TOKENSWIFT-width-4": 1_500, "SUFFIX": 1_500}
# Disjoint seed ranges: the samples must be independent of one another.
FIRST_SEED = {"plain": 1_000_000, "fit": 2_000_000, "TOKENSWIFT": 0, "OWL": 100_000, "HOWL": 200_000,
              "TOKENSWIFT-adaptive": 300_000, "TOKENSWIFT-plain-runs": 400_000, "TOKENSWIFT-width-4": 500_000,
              "SUFFIX": 600_000}
BATCH = dict(max_running_requests=128, max_total_tokens=32768)
DRAFT_VOCAB = 48  # HOWL's reduced head, of the tiny model's 258 tokens
ALPHA = 1e-3
BIAS = 0.05


def sample(engine, runs: int, first_seed: int, **extra) -> tuple[np.ndarray, float, list[dict]]:
    """``runs`` continuations of the prompt (one row each), the mean acceptance length, the meta infos."""
    params = [{**SAMPLING, **extra, "sampling_seed": first_seed + i} for i in range(runs)]
    out = engine.generate(input_ids=[PROMPT] * runs, sampling_params=params)
    assert all(len(o["output_ids"]) == NEW_TOKENS for o in out)
    accept = float(np.mean([o["meta_info"].get("spec_accept_length", 1.0) for o in out]))
    return np.array([o["output_ids"] for o in out]), accept, [o["meta_info"] for o in out]


def step_kinds(metas: list[dict]) -> tuple[int, int]:
    """Speculative and plain steps over a sample (adaptive speculation's per-request report)."""
    def final(meta, key):
        return [v for v in meta[key] if v is not None][-1]

    return (sum(final(m, "longgen_spec_steps") for m in metas), sum(final(m, "longgen_plain_steps") for m in metas))


@contextlib.contextmanager
def running(**args):
    """An engine for one fixture: stopped as soon as it has answered, or it would share the 2 cores."""
    import sglang as sgl

    engine = sgl.Engine(**args)
    try:
        yield engine
    finally:
        stop(engine)


@pytest.fixture(scope="module")
def plain_run() -> tuple[np.ndarray, torch.Tensor]:
    """The plain engine's sample, and a few longer continuations (other seeds) to fit OWL's drafters on."""
    longer = [{**SAMPLING, "max_new_tokens": 16, "sampling_seed": FIRST_SEED["fit"] + i} for i in range(64)]
    with running(**engine_args(**BATCH)) as engine:
        samples, _, _ = sample(engine, PLAIN_RUNS, FIRST_SEED["plain"])
        out = engine.generate(input_ids=[PROMPT] * len(longer), sampling_params=longer)
    return samples, torch.tensor([PROMPT + o["output_ids"] for o in out])


@pytest.fixture(scope="module")
def plain(plain_run) -> np.ndarray:
    return plain_run[0]


@pytest.fixture(scope="module")
def target():
    return load_model(model_path(), "float64").model


@pytest.fixture(scope="module")
def likeliest(target):
    """The target's likeliest token after the prompt and a prefix: what a perfect drafter
    proposes. Computed by the reference model, not estimated from a sample, so that it favours
    neither sample in the count of likeliest tokens."""

    @functools.cache
    def after(prefix: tuple[int, ...]) -> int:
        seq = PROMPT + list(prefix)
        hidden = target(torch.tensor(seq), torch.arange(len(seq)), target.new_cache(len(seq)), ForwardSpec(start=0))
        return int(target.logits(hidden[-1:]).argmax())

    return after


@pytest.fixture(scope="module")
def speculative(plain_run, target, tmp_path_factory):
    """Samples and mean acceptance length of each speculative engine, run once per module.

    OWL and HOWL get a drafter fitted to the target's sampled continuations: a random one gets
    almost nothing accepted, and the verifier's draws would never be put to the test."""

    @functools.cache
    def run(algorithm: str) -> tuple[np.ndarray, float, list[dict]]:
        if algorithm.startswith("TOKENSWIFT-"):
            custom = {"longgen_report": True}
            if algorithm == "TOKENSWIFT-plain-runs":
                custom["longgen_speculation"] = "off"
            if algorithm == "TOKENSWIFT-width-4":
                custom.update(longgen_speculation="on", longgen_width=4)
            with worker_settings(ADAPTIVE="1"), running(**spec_args(**BATCH)) as engine:
                return sample(engine, RUNS[algorithm], FIRST_SEED[algorithm], custom_params=custom)
        if algorithm == "SUFFIX":
            settings = tmp_path_factory.mktemp("suffix")
            (settings / "longgen.toml").write_text("[suffix]\nglobal_requests = 4096\nmax_spec_factor = 8.0\n"
                                                   "min_token_prob = 0.0\n")
            args = engine_args(speculative_algorithm=algorithm, speculative_draft_model_path=str(settings), **BATCH)
            with running(**args) as engine:
                return sample(engine, RUNS[algorithm], FIRST_SEED[algorithm],
                              custom_params={"longgen_speculation": "on"})
        if algorithm == "TOKENSWIFT":
            args = spec_args(**BATCH)
        else:
            vocab = DRAFT_VOCAB if algorithm == "HOWL" else 0
            drafter = fit_drafter(target, plain_run[1], steps=12, draft_vocab=vocab)
            path = drafter.save(tmp_path_factory.mktemp(algorithm.lower()) / "drafter")
            args = engine_args(speculative_algorithm=algorithm, speculative_draft_model_path=str(path), **BATCH)
            args.pop("disable_overlap_schedule")  # the plugin turns it off for its synchronous workers
        with running(**args) as engine:
            return sample(engine, RUNS[algorithm], FIRST_SEED[algorithm])

    return run


# ------------------------------------------------------------------------------------------------
# statistics


def homogeneity_pvalue(a: list, b: list) -> float:
    """Chi-square test that two samples of categories share one law. Categories expected fewer
    than 5 times in the smaller sample are pooled into one, where the test's approximation holds."""
    ca, cb = Counter(a), Counter(b)
    keys = sorted(set(ca) | set(cb))
    table = np.array([[ca[k] for k in keys], [cb[k] for k in keys]], dtype=float)
    expected = table.sum(0) * table.sum(1).min() / table.sum()
    rare = expected < 5
    if rare.any():
        table = np.concatenate([table[:, ~rare], table[:, rare].sum(1, keepdims=True)], axis=1)
    return float(chi2_contingency(table, correction=False).pvalue)


def trend_pvalue(a: np.ndarray, b: np.ndarray) -> float:
    """The chi-square test for trend (1 degree of freedom) on two samples of counts: it asks only
    whether their means differ, so all its power goes to a shift of the count."""
    pooled = np.concatenate([a, b])
    z = (b.mean() - a.mean()) / (pooled.std() * np.sqrt(1 / len(a) + 1 / len(b)))
    return float(chi2.sf(z * z, 1))


def likeliest_count(samples: np.ndarray, likeliest) -> np.ndarray:
    """Per request: how many of tokens 2-4 (the verifier's draws) are the likeliest after their prefix."""
    return np.array([sum(int(row[t] == likeliest(tuple(row[:t]))) for t in range(1, NEW_TOKENS)) for row in samples])


def pvalues(plain: np.ndarray, other: np.ndarray, likeliest) -> dict[str, float]:
    return {
        "joint": homogeneity_pvalue(list(map(tuple, plain)), list(map(tuple, other))),
        "likeliest": trend_pvalue(likeliest_count(plain, likeliest), likeliest_count(other, likeliest)),
    }


def lean_toward_the_draft(samples: np.ndarray, likeliest, rng: np.random.Generator) -> np.ndarray:
    """What a verifier that leans toward the draft in ``BIAS`` of its draws would have written.

    Each draw (tokens 2-4, left to right) is, with probability ``BIAS``, replaced by the draft's
    token without the acceptance test, the draft being the likeliest token (a good drafter's
    proposal, the hardest lean to see: it only moves mass the token already has most of). What
    follows a replaced token is taken from another real sample that shares the new prefix, as the
    verifier would have gone on from there.
    """
    out = samples.copy()
    for t in range(1, NEW_TOKENS):
        sharing = defaultdict(list)
        for i, row in enumerate(samples):
            sharing[tuple(row[: t + 1])].append(i)
        for i in np.flatnonzero(rng.random(len(out)) < BIAS):
            draft = likeliest(tuple(out[i, :t]))
            if out[i, t] == draft:
                continue
            out[i, t] = draft
            donors = sharing[tuple(out[i, : t + 1])]
            if donors:
                out[i, t + 1 :] = samples[rng.choice(donors), t + 1 :]
    return out


# ------------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("algorithm", ["TOKENSWIFT", "OWL", "HOWL", "TOKENSWIFT-adaptive", "TOKENSWIFT-plain-runs",
                                       "TOKENSWIFT-width-4", "SUFFIX"])
def test_sampled_tokens_follow_the_plain_engines_law(algorithm, plain, speculative, likeliest):
    samples, accept, metas = speculative(algorithm)
    if algorithm.endswith("plain-runs"):
        assert step_kinds(metas) == (0, (NEW_TOKENS - 1) * len(metas))
        # Runs, not single steps, drew most requests' three tokens (a run grows from one token with
        # each consecutive plain call of the worker, so a batch's first call is a single step).
        runs = [sum(v is not None for v in m["longgen_plain_steps"]) for m in metas]
        assert np.mean(np.array(runs) < NEW_TOKENS - 1) > 0.9, Counter(runs)
        assert all(m["spec_verify_ct"] == NEW_TOKENS - 1 for m in metas)  # still one verify per forward
    elif algorithm.endswith("width-4"):
        widths = Counter(k for m in metas for k in [v for v in m["longgen_width_steps"] if v is not None][-1])
        assert set(widths) == {"4"}, widths  # every step verified the 4-node cut
        assert accept > 1.2, accept
    elif algorithm.endswith("adaptive"):
        spec, plain_steps = step_kinds(metas)
        assert spec > 0 and plain_steps > 0, (spec, plain_steps)  # both kinds of step drew tokens
        assert accept > 1.05, accept
    else:
        # Drafts were accepted: tokens 2-4 came out of the verifier's walk, not from single steps.
        assert accept > 1.2, accept
    p = pvalues(plain, samples, likeliest)
    print(f"{algorithm}: acceptance {accept:.2f}, p {p}")
    assert min(p.values()) > ALPHA, p


def test_the_sample_size_catches_a_5_percent_lean_toward_the_draft(plain, speculative, likeliest):
    """The same statistics at TOKENSWIFT's sample size reject its own samples once 5% of the
    verifier's draws lean toward the draft. If this passed on honest samples too, the honest test
    above would prove nothing about small biases; if the honest test failed, so would this margin."""
    samples, _, _ = speculative("TOKENSWIFT")
    biased = lean_toward_the_draft(samples, likeliest, np.random.default_rng(0))
    changed = np.mean((biased != samples).any(axis=1))
    assert 0.05 < changed < 0.15, changed  # about 3 draws x 5% x (1 - P(likeliest)) of the requests
    p = pvalues(plain, biased, likeliest)
    print(f"biased TOKENSWIFT: {changed:.3f} of requests changed, p {p}")
    assert p["likeliest"] < ALPHA, p
