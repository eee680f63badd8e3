"""The learning-rate schedule and the training forward pass."""

import pytest
import torch

from sgl_longgen.runtime import load_model, resolve_model
from sgl_longgen.runtime.model import ForwardSpec
from sgl_longgen.training.forward import causal_hidden
from sgl_longgen.training.schedule import CosineSchedule


def test_warmup_then_cosine_to_the_floor():
    s = CosineSchedule(peak=1e-3, total=101, warmup=10, min_ratio=0.1)
    lrs = [s(i) for i in range(101)]
    assert lrs[0] == pytest.approx(1e-4)
    assert lrs[9] == pytest.approx(1e-3)
    assert all(a < b for a, b in zip(lrs[:9], lrs[1:10]))
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] == pytest.approx(1e-4)
    assert lrs[55] == pytest.approx(1e-4 + 0.5 * 9e-4)  # halfway down the cosine


def test_warmup_longer_than_the_run_is_shortened():
    s = CosineSchedule(peak=1.0, total=20, warmup=50, min_ratio=0.0)
    assert s(1) == pytest.approx(1.0)  # warmup became 2 steps
    assert s(19) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("name", ["tiny-random", "tiny-qwen2"])
def test_training_forward_matches_the_inference_forward(name):
    """Batched cache-free forward == the runtime's KV-cache forward, row by row (GQA, bias, ties)."""
    lm = load_model(resolve_model(name), "float64")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, lm.config.vocab_size, (2, 48), generator=gen)
    batched = causal_hidden(lm.model, ids)
    for row in range(2):
        cache = lm.model.new_cache(48)
        want = lm.model(ids[row], torch.arange(48), cache, ForwardSpec(start=0))
        assert torch.allclose(batched[row], want, atol=1e-10)
