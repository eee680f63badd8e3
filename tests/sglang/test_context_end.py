"""Requests that decode to the very end of the context, beside requests far from it: every
algorithm's output and finish reason are plain decoding's at the same context length, and no
request's slots leave its slot-table row (:mod:`sgl_longgen.sglang.slot_rows`).

SGLang reserves ``2 * max(num_steps * topk, num_draft_tokens)`` KV slots past each request's
committed tokens at every speculative step; without the plugin's wider rows the reserve of a
request in its last verify width ran past its row (a scheduler crash on the CPU engine; on a GPU,
slot ids written over the next request's row and leaked slots). A small context keeps it cheap.

The near-end requests are the plain engine's own greedy continuations of the harness prompts to
the end of the context, cut one to two verify widths before it: each decodes the rest (SGLang
clips ``max_new_tokens`` to the context length minus 2 minus the prompt). The fitted drafters
learned the ends of those continuations, so steps there commit several tokens, past the budget
at the last one. The harness prompts themselves decode two widths alongside, far from the end.
"""

from __future__ import annotations

import pytest
import torch
from helpers import fit_drafter, fit_longspec
from sglang_harness import PROMPTS, engine_args, greedy, heads_path, model_path, stop

from sgl_longgen.runtime import load_model
from sgl_longgen.sglang.slot_rows import reserve

CONTEXT = 512
FIT_STEPS = 12
FIT_TOKENS = 160  # the drafters learn each continuation's last tokens: the near-end requests decode them

ALGORITHMS = ("TOKENSWIFT", "OWL", "HOWL", "LONGSPEC", "SUFFIX")


@pytest.fixture(scope="module")
def plain():
    import sglang as sgl

    engine = sgl.Engine(**engine_args(context_length=CONTEXT))
    yield engine
    stop(engine)


@pytest.fixture(scope="module")
def to_the_end(plain) -> list[list[int]]:
    """Each harness prompt followed by plain decoding's greedy continuation to the end of the context."""
    outs = plain.generate(input_ids=PROMPTS, sampling_params=[greedy(CONTEXT - len(p)) for p in PROMPTS])
    seqs = [p + o["output_ids"] for p, o in zip(PROMPTS, outs)]
    assert [len(s) for s in seqs] == [CONTEXT - 2] * len(PROMPTS)  # SGLang's length clip
    return seqs


@pytest.fixture(scope="module")
def endings(to_the_end) -> torch.Tensor:
    return torch.tensor([s[-FIT_TOKENS:] for s in to_the_end])


@pytest.fixture(scope="module")
def owl_dir(endings, tmp_path_factory):
    target = load_model(model_path(), "float64").model
    return fit_drafter(target, endings, steps=FIT_STEPS).save(tmp_path_factory.mktemp("owl") / "drafter")


@pytest.fixture(scope="module")
def longspec_dir(endings, tmp_path_factory):
    target = load_model(model_path(), "float64").model
    return fit_longspec(target, endings, FIT_STEPS).save(tmp_path_factory.mktemp("longspec") / "drafter")


def draft_dir(request, algorithm: str):
    if algorithm == "SUFFIX":
        return None  # no draft model: the near-end requests repeat their own text
    if algorithm == "TOKENSWIFT":
        return heads_path()
    return request.getfixturevalue("longspec_dir" if algorithm == "LONGSPEC" else "owl_dir")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_requests_decode_to_the_end_of_the_context(plain, to_the_end, request, algorithm):
    import sglang as sgl

    draft = draft_dir(request, algorithm)
    engine = sgl.Engine(**engine_args(context_length=CONTEXT, speculative_algorithm=algorithm,
                                      **({} if draft is None else {"speculative_draft_model_path": str(draft)})))
    try:
        width = int(engine.server_args.speculative_num_draft_tokens)
        # SGLang's own rows (context + 4 + width at page size 1) could not hold the reserve here.
        assert CONTEXT - 4 + reserve(engine.server_args) > CONTEXT + 4 + width
        rooms = (width, width + width // 2, 2 * width)
        near = [seq[: CONTEXT - 2 - room] for seq, room in zip(to_the_end, rooms)]
        prompts = near + PROMPTS
        params = [greedy(CONTEXT - len(p)) for p in near] + [greedy(2 * width)] * len(PROMPTS)
        want = plain.generate(input_ids=prompts, sampling_params=params)
        got = engine.generate(input_ids=prompts, sampling_params=params)
        for w, g in zip(want, got):
            assert g["output_ids"] == w["output_ids"]
            assert g["meta_info"]["finish_reason"] == w["meta_info"]["finish_reason"]
        for prompt, room, g in zip(near, rooms, got):
            assert len(g["output_ids"]) == room  # to the context's end
            assert g["meta_info"]["finish_reason"] == {"type": "length", "length": room}
        assert max(g["meta_info"]["spec_accept_length"] for g in got[: len(near)]) > 1.2  # multi-token steps there
        # A request through the scheduler lets it go idle first, where it checks its pools for
        # leaked slots (a leak stops it); then it still serves.
        engine.get_server_info()
        again = engine.generate(input_ids=PROMPTS[:1], sampling_params=greedy(4))
        assert again[0]["output_ids"] == want[len(near)]["output_ids"][:4]
    finally:
        stop(engine)
