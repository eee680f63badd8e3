"""A failure inside drafting costs speculation, never the request, its output or the server."""

from __future__ import annotations

import pytest

from sgl_longgen import env
from sglang_harness import PROMPTS, greedy, spec_args, stop

NEW_TOKENS = 96
FAULT_AT = 4  # the decode step whose drafting raises


@pytest.fixture(scope="module")
def failing_engine(tmp_path_factory):
    """TOKENSWIFT whose drafting raises once, at its 4th decode step (the scheduler reads the
    variable when it builds the worker), and the file its scheduler logs to (its stderr)."""
    import os

    import sglang as sgl

    log = tmp_path_factory.mktemp("fault") / "scheduler.log"
    saved = os.dup(2)
    os.environ[env.name("INJECT_DRAFT_FAULT")] = str(FAULT_AT)
    try:
        with open(log, "w") as f:
            os.dup2(f.fileno(), 2)  # inherited by the scheduler process
            engine = sgl.Engine(**spec_args())
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        del os.environ[env.name("INJECT_DRAFT_FAULT")]
    yield engine, log
    stop(engine)


def test_a_failing_draft_falls_back_to_plain_steps(plain_engine, failing_engine):
    failing_engine, log = failing_engine
    want = plain_engine.generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS))
    got = failing_engine.generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS))
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    for g in got:
        meta = g["meta_info"]
        # A few speculative steps before the fault, one exact token per step after it.
        assert FAULT_AT <= meta["spec_verify_ct"] < NEW_TOKENS
        assert meta["spec_verify_ct"] > NEW_TOKENS - 3 * FAULT_AT
    logged = log.read_text()
    # Logged once per request, with its cause.
    assert logged.count("decodes without speculation from here on") == len(PROMPTS)
    assert logged.count("injected by SGLANG_LONGGEN_INJECT_DRAFT_FAULT") >= len(PROMPTS)

    # The server keeps serving, and new requests speculate again.
    again = failing_engine.generate(input_ids=PROMPTS[:1], sampling_params=greedy(NEW_TOKENS))
    assert again[0]["output_ids"] == want[0]["output_ids"]
    assert again[0]["meta_info"]["spec_accept_length"] > 1.5
