"""Which attention backend our algorithms run on when a launch names one.

SGLang's FA3 backend cannot verify a draft tree. On a GPU a launch that asks for it (SGLang's
default on Hopper, so common in launch scripts) runs on ``longgen``, whose verify reads the long
prefix with FA3's kernel; on any other device the startup refusal stands
(``test_startup_errors.py`` starts a CPU engine with ``fa3`` and sees it refused).
"""

from __future__ import annotations

import logging

import pytest

from sgl_longgen.sglang import backends
from sgl_longgen.sglang.plugin import SUPPORTED_BACKENDS, backend_for


@pytest.mark.parametrize("device", [None, "cuda", "cuda:1"])
def test_fa3_on_a_gpu_runs_on_the_hybrid_backend_with_a_warning(device, caplog):
    with caplog.at_level(logging.WARNING, logger="sgl_longgen.sglang.plugin"):
        assert backend_for("TOKENSWIFT", "fa3", device) == backends.HYBRID
    assert "fa3 cannot verify draft trees" in caplog.text
    assert backends.HYBRID in SUPPORTED_BACKENDS


@pytest.mark.parametrize("backend", [None, "flashinfer", backends.HYBRID, backends.TORCH, "triton", "torch_native"])
def test_other_choices_are_left_as_asked(backend):
    assert backend_for("OWL", backend, "cuda") == backend


def test_fa3_off_a_gpu_is_left_to_the_refusal():
    assert backend_for("HOWL", "fa3", "cpu") == "fa3"
