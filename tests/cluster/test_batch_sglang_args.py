"""What the SGLang engine actor asks of ``sglang.Engine`` for each method, checked without SGLang:
the speculative algorithm and draft directory, and a draft directory whose ``longgen.toml`` the
plugin reads back as the job's effective settings."""

from __future__ import annotations

import pytest

from sgl_longgen.cluster.engine_common import effective_config
from sgl_longgen.cluster.sglang_engine import draft_dir_for, engine_kwargs, request_args
from sgl_longgen.config import SPECULATIVE_ALGORITHMS
from sgl_longgen.errors import LonggenError
from sgl_longgen.runtime import DRAFT_FIELD, draft_dirs, resolve_model
from sgl_longgen.sglang.draft_dir import read_defaults

GENERATION = {"ignore_eos": True, "sampling": {"temperature": 0.0, "penalty": 1.2, "penalty_window": 48},
              "owl": {"tree_size": 24}, "suffix": {"max_depth": 40}, "tokenswift": {"partial_kv": {"budget": 256}}}


@pytest.fixture(scope="module")
def tiny():
    model = resolve_model("tiny")
    return model, draft_dirs(model, {})


@pytest.mark.parametrize("method", sorted(SPECULATIVE_ALGORITHMS))
def test_each_method_runs_as_its_algorithm_with_the_jobs_settings(tiny, method):
    model, dirs = tiny
    config = effective_config({**GENERATION, "method": method}, dirs)
    checkpoint = dirs[DRAFT_FIELD[method]] if method != "suffix" else None  # SUFFIX has no checkpoint
    assert checkpoint is None or checkpoint.is_dir()
    draft = draft_dir_for(checkpoint, config)
    kw = engine_kwargs(str(model), str(draft), config, 1, {"context_length": 4096})
    assert kw["speculative_algorithm"] == SPECULATIVE_ALGORITHMS[method]
    assert kw["speculative_draft_model_path"] == str(draft) and kw["context_length"] == 4096
    # The checkpoint's files are there, its own longgen.toml replaced by the job's settings.
    assert {f.name for f in checkpoint.iterdir()} <= {f.name for f in draft.iterdir()} if checkpoint else \
        {f.name for f in draft.iterdir()} == {"longgen.toml"}
    back = read_defaults(draft)
    for table in ("tokenswift", "owl", "suffix", "howl", "longspec"):
        assert getattr(back, table) == getattr(config, table), table
    assert (back.sampling.penalty, back.sampling.penalty_window) == (1.2, 48)
    assert (back.owl.tree_size, back.suffix.max_depth) == (24, 40)
    # Our workers apply the penalty from custom_params: no logits processor rides on the request.
    args = request_args(config, 100)
    assert args["sampling_params"]["custom_params"] == {"penalty": 1.2, "penalty_window": 48}
    assert "custom_logit_processor" not in args


@pytest.mark.parametrize("method, field", [("howl", "drafter"), ("longspec", "longspec_drafter"),
                                           ("tokenswift", "heads")])
def test_a_method_without_its_draft_checkpoint_is_refused_naming_the_field(tiny, method, field):
    config = effective_config({"method": method}, {})
    with pytest.raises(LonggenError, match=f"set `{field}`"):
        engine_kwargs(str(tiny[0]), None, config, 1, {})


def test_suffix_needs_no_draft_checkpoint(tiny):
    config = effective_config({"method": "suffix"}, {})
    kw = engine_kwargs(str(tiny[0]), None, config, 1, {})
    assert kw["speculative_algorithm"] == "SUFFIX" and "speculative_draft_model_path" not in kw


def test_plain_decoding_takes_no_algorithm(tiny):
    config = effective_config({"method": "ar", "sampling": {"penalty": 1.2}}, tiny[1])
    kw = engine_kwargs(str(tiny[0]), None, config, 1, {})
    assert "speculative_algorithm" not in kw and kw["enable_custom_logit_processor"]
