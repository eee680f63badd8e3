"""The ``longgen`` SGLang attention backend: registration (CPU) and inside sglang.Engine (GPU)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch


def test_register_adds_the_backend_choices():
    from sgl_longgen.sglang import backends

    assert backends.register() == backends.register()  # idempotent
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    for name in (backends.HYBRID, backends.TORCH):
        assert name in ATTENTION_BACKENDS
        assert ATTENTION_BACKEND_CHOICES.count(name) == 1
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

    from sgl_longgen.sglang.backends.hybrid import LongGenAttnBackend

    assert issubclass(LongGenAttnBackend, FlashInferAttnBackend)


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "draft_tokens,prefix_backend,extra",
    [(16, "auto", []), (64, "triton", ["--skip-graph"])],
)
def test_engine_ngram_verify(draft_tokens, prefix_backend, extra):
    """NGRAM verify through the backend: every layer checked against FlashInfer, then CUDA graphs."""
    cmd = [sys.executable, "-m", "sgl_longgen.bench.engine_check", "--draft-tokens", str(draft_tokens),
           "--prefix-backend", prefix_backend, *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    print(res.stdout[-4000:])
    if res.returncode == 3:
        pytest.skip("the installed plugin entry point does not register 'longgen'")
    assert res.returncode == 0 and "ENGINE CHECK OK" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
