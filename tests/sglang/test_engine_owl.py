"""OWL and HOWL behind ``sgl.Engine``: lossless against the same engine without speculation.

A random-init drafter almost never gets a token accepted, so the drafter here is fitted in a few
seconds to the target's own greedy continuations of the test prompts: acceptance then goes deep
into the trees, through the [SPEC] hand-off between rounds. HOWL's drafter has a reduced head (the
most frequent tokens of those continuations), so the engine also runs a token-mapped beam. With
``[owl] weights = "fp8"`` in the drafter directory the worker drafts from fp8 matrices: the same
output.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from sgl_longgen.sglang.penalty import ContextualPenaltyProcessor
from sgl_longgen.runtime import load_model
from helpers import fit_drafter
from sglang_harness import PROMPTS, check_budgets, engine_args, greedy, model_path, stop, worker_settings

NEW_TOKENS = 128
PENALTY = {"penalty": 1.3, "penalty_window": 32}
DRAFT_VOCAB = 48  # of the tiny model's 258 tokens


@pytest.fixture(scope="module")
def sequences(plain_engine) -> torch.Tensor:
    outs = plain_engine.generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS))
    penalized = plain_engine.generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS, custom_params=PENALTY),
                                      custom_logit_processor=[ContextualPenaltyProcessor.to_str()] * len(PROMPTS))
    seqs = [p + o["output_ids"] for p, o in zip(PROMPTS + PROMPTS, outs + penalized)]
    length = min(len(s) for s in seqs)
    return torch.tensor([s[:length] for s in seqs])


@pytest.fixture(scope="module")
def drafter_dir(sequences, tmp_path_factory):
    target = load_model(model_path(), "float64").model
    return fit_drafter(target, sequences, steps=12).save(tmp_path_factory.mktemp("owl") / "drafter")


@pytest.fixture(scope="module")
def reduced_drafter_dir(sequences, tmp_path_factory):
    target = load_model(model_path(), "float64").model
    drafter = fit_drafter(target, sequences, steps=12, draft_vocab=DRAFT_VOCAB)
    return drafter.save(tmp_path_factory.mktemp("owl") / "reduced")


def start(algorithm: str, drafter_dir):
    import sglang as sgl

    # Overlap scheduling left on: the plugin turns it off for its synchronous workers.
    args = engine_args(speculative_algorithm=algorithm, speculative_draft_model_path=str(drafter_dir))
    args.pop("disable_overlap_schedule")
    return sgl.Engine(**args)


@pytest.fixture(scope="module")
def owl_engine(drafter_dir):
    engine = start("OWL", drafter_dir)
    yield engine
    stop(engine)


@pytest.fixture(scope="module")
def howl_engine(reduced_drafter_dir):
    engine = start("HOWL", reduced_drafter_dir)
    yield engine
    stop(engine)


def check_identical(plain_engine, engine, min_tau: float, **extra) -> None:
    kwargs = {}
    if "custom_params" in extra:
        kwargs["custom_logit_processor"] = [ContextualPenaltyProcessor.to_str()] * len(PROMPTS)
    want = plain_engine.generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS, **extra), **kwargs)
    got = engine.generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS, **extra))
    taus = []
    for w, g in zip(want, got):
        assert g["output_ids"] == w["output_ids"]
        taus.append(g["meta_info"]["spec_accept_length"])
    assert max(taus) > min_tau, taus


def test_owl_greedy_is_identical(plain_engine, owl_engine):
    check_identical(plain_engine, owl_engine, min_tau=1.5)


def test_owl_beams_expanded_ahead_serve_most_steps(plain_engine, owl_engine):
    """Each step's beam is expanded at the end of the step before; the next step uses it (a stale
    beam would draft from the wrong states: the output would still be plain decoding's, the
    acceptance not)."""
    want = plain_engine.generate(input_ids=PROMPTS[:1], sampling_params=greedy(NEW_TOKENS))
    got = owl_engine.generate(input_ids=PROMPTS[:1],
                              sampling_params=greedy(NEW_TOKENS, custom_params={"longgen_timing": "host"}))
    assert got[0]["output_ids"] == want[0]["output_ids"]
    meta = got[0]["meta_info"]
    ahead = [x for x in meta["longgen_draft_queued_ahead"] if x is not None]
    assert len(ahead) == meta["spec_verify_ct"]
    # The first decode step drafts from the prefill's state (nothing was observed before it).
    assert ahead[0] == 0.0 and sum(ahead) >= 0.75 * len(ahead), ahead
    assert meta["spec_accept_length"] > 1.5


def test_owl_with_fp8_drafter_weights_is_identical(plain_engine, drafter_dir, tmp_path):
    """The drafter directory asks for fp8 matrices; the worker quantizes its projections and head
    once (the fp8 twin on a CPU) and every draft reads them: plain decoding's output, drafts accepted."""
    fp8_dir = tmp_path / "fp8"
    shutil.copytree(drafter_dir, fp8_dir)
    (fp8_dir / "longgen.toml").write_text('[owl]\nweights = "fp8"\n')
    engine = start("OWL", fp8_dir)
    try:
        check_identical(plain_engine, engine, min_tau=1.5)
    finally:
        stop(engine)


@pytest.mark.parametrize("algorithm", ["OWL", "HOWL"])
def test_steps_queued_by_the_call_before_are_identical(plain_engine, drafter_dir, reduced_drafter_dir, algorithm):
    """With the next step's draft and verify queued before a step returns (``.spec_ahead``,
    opt-in): the [SPEC] rows of a queued verify are cleared behind it, and the beams and
    suffix chains it drafts from are those of the step before. Plain decoding's output, with and
    without the contextual penalty, and most steps taken from the queue."""
    with worker_settings(SPEC_RUN_AHEAD="1"):
        engine = start(algorithm, drafter_dir if algorithm == "OWL" else reduced_drafter_dir)
    try:
        check_identical(plain_engine, engine, min_tau=1.5)
        check_identical(plain_engine, engine, min_tau=1.2, custom_params=PENALTY)
        got = engine.generate(input_ids=PROMPTS, sampling_params=greedy(
            NEW_TOKENS, custom_params={"longgen_report": True, "longgen_speculation": "on"}))
        for g in got:
            meta = g["meta_info"]
            spec = [v for v in meta["longgen_spec_steps"] if v is not None][-1]
            ahead = [v for v in meta.get("longgen_ahead_steps", []) if v is not None]
            assert ahead and ahead[-1] >= spec // 2, (spec, ahead[-1:])
    finally:
        stop(engine)


def test_owl_greedy_with_the_contextual_penalty(plain_engine, owl_engine):
    check_identical(plain_engine, owl_engine, min_tau=1.2, custom_params=PENALTY)


def test_howl_greedy_is_identical(plain_engine, howl_engine):
    check_identical(plain_engine, howl_engine, min_tau=1.5)


def test_howl_greedy_with_the_contextual_penalty(plain_engine, howl_engine):
    check_identical(plain_engine, howl_engine, min_tau=1.2, custom_params=PENALTY)


def test_sampled_owl_completes(owl_engine):
    params = [{"max_new_tokens": 64, "temperature": 0.9, "top_p": 0.95, "ignore_eos": True, "sampling_seed": s}
              for s in range(len(PROMPTS))]
    out = owl_engine.generate(input_ids=PROMPTS, sampling_params=params)
    assert all(len(o["output_ids"]) == 64 and o["meta_info"]["spec_accept_length"] >= 1.0 for o in out)


def test_a_heads_directory_is_not_an_owl_drafter(tmp_path):
    from sglang_harness import heads_path

    with pytest.raises(ValueError, match=r"OWL: OWL drafter checkpoint is missing .*owl.json"):
        start("OWL", heads_path())


def test_owl_token_budget_is_exact(plain_engine, owl_engine):
    check_budgets(plain_engine, owl_engine)


def test_howl_token_budget_is_exact(plain_engine, howl_engine):
    check_budgets(plain_engine, howl_engine)


def test_howl_mixes_linear_and_tree_steps(plain_engine, howl_engine):
    """The fitted drafter's training sequences repeat: HOWL verifies suffix chains on some steps and
    OWL trees on others, including the tree step right after a chain (the null [SPEC] state)."""
    want = plain_engine.generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS))
    got = howl_engine.generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS, custom_params={"longgen_timing": "host"}))
    steps = []
    for w, g in zip(want, got):
        assert g["output_ids"] == w["output_ids"]
        steps.append([x for x in g["meta_info"]["longgen_linear_steps"] if x is not None])
    linear = sum(steps, [])
    assert 0 < sum(linear) < len(linear), steps
    assert any(a == 1.0 and b == 0.0 for s in steps for a, b in zip(s, s[1:]))  # a tree right after a chain


@pytest.mark.parametrize("algorithm", ["OWL", "HOWL"])
def test_a_narrow_draft_width_is_identical(plain_engine, owl_engine, howl_engine, algorithm):
    """``longgen_width`` 4: OWL's trees cut to 4 nodes with their [SPEC] leaves on top (8 verify
    rows instead of the full width), HOWL's chains to 3 tokens; same output, drafts accepted."""
    engine = owl_engine if algorithm == "OWL" else howl_engine
    custom = {"longgen_speculation": "on", "longgen_width": 4, "longgen_report": True, "longgen_timing": "host"}
    want = plain_engine.generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS))
    got = engine.generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS, custom_params=custom))
    taus = []
    for w, g in zip(want, got):
        meta = g["meta_info"]
        assert g["output_ids"] == w["output_ids"]
        assert [v for v in meta["longgen_width_steps"] if v is not None][-1] == {"4": meta["spec_verify_ct"]}
        rows = {v for v in meta["longgen_verify_rows"] if v is not None}
        assert rows == {8.0}, rows  # 4 nodes and their [SPEC] leaves (a HOWL chain's padded to them)
        taus.append(meta["spec_accept_length"])
    assert max(taus) <= 4 and max(taus) > 1.5, taus
