"""TOKENSWIFT with verification-guided partial KV (``[tokenswift.partial_kv] policy = "verify"``)
behind ``sgl.Engine``: lossless against the same engine without speculation, the steady state
(each draft queued behind the commit, from the verify's per-layer selections) reached, and the
policy refused on a backend that cannot score the verify."""

from __future__ import annotations


import pytest

from sglang_harness import PROMPTS, engine_args, greedy, heads_with, spec_args, stop

NEW_TOKENS = 320
SETTINGS = '[tokenswift.partial_kv]\nbudget = 64\nsinks = 4\npolicy = "verify"\n'


def verify_heads(root):
    return heads_with(root / "tokenswift-heads", SETTINGS)


@pytest.fixture(scope="module")
def verify_engine(tmp_path_factory):
    """A partial KV of 64 positions (4 sinks): past the first 60 committed tokens every draft reads
    a real per-layer choice of positions."""
    import sglang as sgl

    engine = sgl.Engine(**spec_args(speculative_draft_model_path=str(verify_heads(tmp_path_factory.mktemp("v")))))
    yield engine
    stop(engine)


def test_greedy_outputs_are_identical_and_most_drafts_chain(plain_engine, verify_engine):
    want = plain_engine.generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS))
    got = verify_engine.generate(input_ids=PROMPTS,
                                 sampling_params=greedy(NEW_TOKENS, custom_params={"longgen_timing": "host"}))
    for w, g in zip(want, got):
        assert len(w["output_ids"]) == NEW_TOKENS
        assert g["output_ids"] == w["output_ids"]
        meta = g["meta_info"]
        assert meta["spec_accept_length"] > 1.5  # it speculated, or the comparison proves nothing
    # Past the first selections every step's verify selected a full partial KV, so the next draft
    # was built on the device from it and queued behind the commit.
    chained = [x for x in got[0]["meta_info"]["longgen_draft_chained"] if x is not None]
    assert len(chained) == got[0]["meta_info"]["spec_verify_ct"]
    assert sum(chained) >= 0.5 * len(chained)


def test_a_backend_that_cannot_score_the_verify_is_refused(tmp_path):
    import sglang as sgl

    heads = verify_heads(tmp_path)
    with pytest.raises(ValueError, match=r"TOKENSWIFT: .*longgen.toml: \[tokenswift.partial_kv\] policy = \"verify\" "
                                         r"needs .* --attention-backend longgen, longgen_torch .*not flashinfer"):
        sgl.Engine(**engine_args(speculative_algorithm="TOKENSWIFT", speculative_draft_model_path=str(heads),
                                 attention_backend="flashinfer"))
