import gc
import time

import torch

from sgl_longgen.plugin.gc_pauses import GcPauses
from sgl_longgen.plugin.step_timer import DETAIL_ENV, StepTimer


def _step(timer: StepTimer) -> dict[str, float]:
    time.sleep(0.002)
    timer.section("a")
    time.sleep(0.004)
    timer.phase("draft")
    time.sleep(0.001)
    timer.phase("verify", sync=True)
    return timer.values


def test_coarse_phases_always_and_sections_only_in_detail_mode(monkeypatch):
    monkeypatch.delenv(DETAIL_ENV, raising=False)
    timer = StepTimer(torch.device("cpu"))
    timer.start()
    coarse = _step(timer)
    assert set(coarse) == {"longgen_draft_ms", "longgen_verify_ms"}
    assert coarse["longgen_draft_ms"] >= 6.0 and coarse["longgen_verify_ms"] >= 1.0

    timer.start(detail=True)  # one request asked for it
    detail = _step(timer)
    assert set(detail) == {"longgen_a_ms", "longgen_draft_ms", "longgen_verify_ms"}
    assert 2.0 <= detail["longgen_a_ms"] <= detail["longgen_draft_ms"]

    timer.start()  # the next step is coarse again
    assert "longgen_a_ms" not in _step(timer)


def test_the_environment_turns_detail_on_for_every_step(monkeypatch):
    monkeypatch.setenv(DETAIL_ENV, "1")
    timer = StepTimer(torch.device("cpu"))
    timer.start()
    assert "longgen_a_ms" in _step(timer)


def test_host_mode_times_sections_without_synchronising(monkeypatch):
    monkeypatch.delenv(DETAIL_ENV, raising=False)
    timer = StepTimer(torch.device("cpu"))
    timer.start(detail="host")
    timer.gpu_mark("draft_gpu")  # CPU: no events, no GPU span
    values = _step(timer)
    assert timer.detail == "host"
    assert set(timer.finish()) == {"longgen_a_ms", "longgen_draft_ms", "longgen_verify_ms", "longgen_gc_ms"}
    assert 2.0 <= values["longgen_a_ms"] <= values["longgen_draft_ms"]
    timer.start(detail="nonsense")  # an unknown setting leaves detail off
    assert timer.detail is None
    monkeypatch.setenv(DETAIL_ENV, "host")
    assert StepTimer(torch.device("cpu")).default_detail == "host"


def test_collection_pauses_are_measured_and_taken_once():
    pauses = GcPauses()
    try:
        pauses.take()
        gc.collect()
        assert pauses.take() > 0.0
        assert pauses.take() == 0.0  # taken
    finally:
        pauses.close()
    gc.collect()
    assert pauses.take() == 0.0  # closed: no longer called
