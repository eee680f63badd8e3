"""The shared training loop: checkpoints survive failures, resume continues, budgets shrink runs."""

import time

import pytest
import torch
from torch import nn

from sgl_longgen.errors import LonggenError
from sgl_longgen.training import loop
from sgl_longgen.training.config import LoopConfig, OptimConfig


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, 4))


def toy_task(tmp_path, fail_at=None, interrupt_at=None, sleep=0.0):
    module = Toy()
    target = torch.eye(4)
    calls = {"n": 0}

    def loss(batch):
        calls["n"] += 1
        value = ((module.w - target) ** 2).mean()
        if fail_at is not None and calls["n"] >= fail_at:
            value = value * float("nan")
        return value, {"loss": value.detach()}

    def batch(gen):
        if interrupt_at is not None and calls["n"] + 1 == interrupt_at:
            raise KeyboardInterrupt
        time.sleep(sleep)
        return torch.randint(0, 10, (2, 3), generator=gen)

    def save(directory, progress):
        torch.save({"w": module.w.detach().clone(), "step": progress.step}, directory / "weights.pt")

    return module, loop.Task("toy", module, loss, batch, lambda: {}, save, tmp_path, tokens_per_batch=6)


OPTIM = OptimConfig(lr=0.05, warmup_steps=0, weight_decay=0.0)


def run(task, tmp_path, resume=False, **loop_kwargs):
    cfg = LoopConfig(**{"steps": 30, "batch_size": 2, "seq_len": 3, "log_every": 10, "save_every": 5,
                        "eval_every": 0, "device": "cpu", **loop_kwargs})
    return loop.run(task, OPTIM, cfg, torch.device("cpu"), resume=resume)


def saved_step(tmp_path):
    return torch.load(tmp_path / "weights.pt")["step"]


def test_trains_and_writes_the_final_checkpoint(tmp_path):
    module, task = toy_task(tmp_path)
    progress = run(task, tmp_path)
    assert progress.step == 30 and progress.tokens == 180
    assert progress.train["loss"] < 0.1 * 0.25  # started at mean((0 - I)^2) = 0.25
    assert saved_step(tmp_path) == 30 and (tmp_path / loop.STATE_FILE).is_file()
    assert not list(tmp_path.glob(".writing-*"))


def test_a_non_finite_loss_keeps_the_last_good_checkpoint(tmp_path):
    _, task = toy_task(tmp_path, fail_at=13)
    with pytest.raises(LonggenError, match="not finite.*step 10"):
        run(task, tmp_path)
    saved = torch.load(tmp_path / "weights.pt")
    assert saved["step"] == 10 and torch.isfinite(saved["w"]).all()


def test_an_interrupt_saves_then_resume_finishes_the_run(tmp_path):
    _, task = toy_task(tmp_path, interrupt_at=8)
    with pytest.raises(LonggenError, match="interrupted at step 7.*--resume"):
        run(task, tmp_path)
    assert saved_step(tmp_path) == 7
    module, task = toy_task(tmp_path)
    progress = run(task, tmp_path, resume=True)
    assert progress.step == 30 and saved_step(tmp_path) == 30
    # Same result as an uninterrupted run: same batches, same optimizer state.
    ref_module, ref_task = toy_task(tmp_path / "ref")
    run(ref_task, tmp_path / "ref")
    assert torch.allclose(module.w, ref_module.w)


def test_resume_needs_a_state_and_more_steps(tmp_path):
    _, task = toy_task(tmp_path)
    with pytest.raises(LonggenError, match="no trainer_state.pt"):
        run(task, tmp_path, resume=True)
    run(task, tmp_path)
    _, task = toy_task(tmp_path)
    with pytest.raises(LonggenError, match="already at step 30"):
        run(task, tmp_path, resume=True)


def test_a_time_budget_lowers_the_step_count(tmp_path):
    _, task = toy_task(tmp_path, sleep=0.02)
    progress = run(task, tmp_path, steps=10_000, max_minutes=0.01)  # 0.6 s
    assert 13 <= progress.step < 200
    assert any("fit" in line for line in progress.log)
