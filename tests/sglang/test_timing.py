"""Step timing is opt-in per request, bounded, and leaves nothing installed."""

from __future__ import annotations

import gc
import time
from types import SimpleNamespace

import pytest
import torch

from sgl_longgen.sglang.request_settings import parse_custom_params, with_settings
from sgl_longgen.sglang.timing import STEPS_PARAM, TIMING_PARAM, StepClock


def req(rid: str, params: dict | None = None, committed: int = 0):
    """A request as admission leaves it: its custom_params carry their parsed settings."""
    custom = with_settings(params, parse_custom_params(params))
    return SimpleNamespace(rid=rid, sampling_params=SimpleNamespace(custom_params=custom),
                           output_ids=[0] * committed, customized_info=None)


def step(clock: StepClock, reqs, accepted: int = 2) -> None:
    clock.start(reqs)
    time.sleep(0.002)
    clock.section("a")
    time.sleep(0.003)
    clock.phase("draft")
    gc.collect()
    clock.phase("verify")
    clock.finish({r.rid: accepted for r in reqs})
    for r in reqs:
        r.output_ids.extend([0] * accepted)


def series(r, key: str) -> list:
    return [x for x in (r.customized_info or {}).get(key, []) if x is not None]


def test_off_by_default_and_nothing_installed():
    clock = StepClock(torch.device("cpu"))
    plain = req("a", {"penalty": 1.2})
    callbacks = list(gc.callbacks)
    step(clock, [plain])
    assert plain.customized_info is None and not clock.active
    assert gc.callbacks == callbacks


def test_only_the_requests_that_ask_get_series_on_their_first_token():
    clock = StepClock(torch.device("cpu"))
    timed, plain = req("t", {TIMING_PARAM: "host"}, committed=3), req("p")
    callbacks = list(gc.callbacks)
    step(clock, [timed, plain], accepted=2)
    step(clock, [timed, plain], accepted=3)
    assert plain.customized_info is None
    # One entry per output token: each step's value on the first token it committed (3 and 5).
    column = timed.customized_info["longgen_draft_ms"]
    assert len(column) == 3 + 2 + 3
    assert [i for i, x in enumerate(column) if x is not None] == [3, 5]
    draft = series(timed, "longgen_draft_ms")
    assert len(draft) == 2 and all(d >= 5.0 for d in draft)
    assert all(2.0 <= a <= d for a, d in zip(series(timed, "longgen_a_ms"), draft))
    assert len(series(timed, "longgen_gc_ms")) == 2 and series(timed, "longgen_gc_ms")[0] > 0.0
    assert len(series(timed, "longgen_between_steps_ms")) == 1  # since the first timed step returned
    assert gc.callbacks == callbacks  # the collector callback lives only inside a timed step


def test_steps_recorded_per_request_are_bounded():
    clock = StepClock(torch.device("cpu"))
    timed = req("t", {TIMING_PARAM: True, STEPS_PARAM: 3})
    for _ in range(6):
        step(clock, [timed], accepted=1)
    assert len(series(timed, "longgen_verify_ms")) == 3
    assert len(timed.customized_info["longgen_verify_ms"]) == 3  # nothing appended after the bound
    clock.start([timed])
    assert not clock.active
    clock.forget("t")  # the request finished: an id used again starts afresh
    clock.start([timed])
    assert clock.active


def test_unknown_settings_are_refused_at_admission_and_off_leaves_timing_off():
    with pytest.raises(ValueError, match=TIMING_PARAM):
        req("x", {TIMING_PARAM: "nonsense"})
    clock = StepClock(torch.device("cpu"))
    clock.start([req("x", {TIMING_PARAM: "off"}), req("y", {TIMING_PARAM: False})])
    assert not clock.active
