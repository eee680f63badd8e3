"""The training loop every trainer shares.

A trainer hands over a :class:`Task` (its trainable module, a loss on one batch, a batch sampler,
a validation pass and a checkpoint writer); the loop owns everything else: AdamW with decoupled
weight decay on matrices only, the warmup + cosine schedule, gradient clipping, mixed precision,
the progress bar, log lines, the optional wall-time budget, periodic checkpoints and resuming.

Nothing already done is lost: checkpoints are written every ``save_every`` steps (atomically: a
crash while writing leaves the previous one), an interrupt writes one before stopping, and a
non-finite loss stops the run *without* overwriting the last good checkpoint.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from ..errors import LonggenError
from .config import LoopConfig, OptimConfig
from .device import autocast, configure, resolve_device
from .schedule import CosineSchedule

STATE_FILE = "trainer_state.pt"
SYNC_EVERY = 10  # steps between host syncs (progress bar, non-finite check)
CALIBRATION_STEPS = (3, 13)  # steps timed (after warm-up) to fit the run into max_minutes

Metrics = dict[str, torch.Tensor]


@dataclass
class Task:
    """What a trainer plugs into the loop."""

    name: str
    module: nn.Module  # owns the trainable parameters (requires_grad=True)
    loss: Callable[[torch.Tensor], tuple[torch.Tensor, Metrics]]  # batch -> (loss, detached scalars)
    batch: Callable[[torch.Generator], torch.Tensor]  # the next [B, T] batch, from the loop's generator
    evaluate: Callable[[], dict[str, float]]  # validation metrics (may be empty)
    save: Callable[[Path, "Progress"], None]  # write the checkpoint files into a directory
    out: Path
    tokens_per_batch: int = 0


@dataclass
class Progress:
    step: int = 0
    total: int = 0
    tokens: int = 0
    seconds: float = 0.0
    train: dict[str, float] = field(default_factory=dict)  # averaged over the last log window
    val: dict[str, float] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        return {
            "steps": self.step, "tokens": self.tokens, "seconds": round(self.seconds, 1),
            "tokens_per_second": round(self.tokens / self.seconds) if self.seconds else 0,
            "train": {k: round(v, 4) for k, v in self.train.items()},
            "val": {k: round(v, 4) for k, v in self.val.items()},
        }


def build_optimizer(module: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """Weight decay on matrices (linear weights, embeddings), none on norm scales and biases."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise LonggenError("nothing to train: the module has no trainable parameters")
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), fused=device.type == "cuda")


def write_files_atomically(out: Path, writer: Callable[[Path], None]) -> None:
    """Let ``writer`` fill a scratch directory, then move each file into ``out`` (os.replace).

    Each file is replaced whole, so a reader never sees a half-written tensor file.
    """
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".writing-", dir=out))
    try:
        writer(scratch)
        for path in sorted(scratch.rglob("*")):
            if path.is_file():
                target = out / path.relative_to(scratch)
                target.parent.mkdir(parents=True, exist_ok=True)
                path.chmod(0o644)  # some writers (safetensors) create owner-only files
                os.replace(path, target)
    finally:
        for path in sorted(scratch.rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        scratch.rmdir()


def _format(metrics: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.4g}" for k, v in metrics.items())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Averager:
    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}
        self.count = 0

    def add(self, metrics: Metrics) -> None:
        for k, v in metrics.items():
            v = v.detach().float()
            self.sums[k] = self.sums[k] + v if k in self.sums else v
        self.count += 1

    def take(self) -> dict[str, float]:
        out = {k: float(v) / self.count for k, v in self.sums.items()} if self.count else {}
        self.sums, self.count = {}, 0
        return out


def run(task: Task, optim: OptimConfig, loop: LoopConfig, device: torch.device, resume: bool = False,
        config: dict | None = None) -> Progress:
    """Train ``task`` for ``loop.steps`` steps (or what fits in ``loop.max_minutes``)."""
    opt = build_optimizer(task.module, optim, device)
    generator = torch.Generator().manual_seed(loop.seed)
    progress = Progress(total=loop.steps)
    state_path = task.out / STATE_FILE
    if resume:
        _load_state(state_path, task, opt, generator, progress)
    loss_fn = task.loss
    compiled = False
    if loop.compile:
        loss_fn, compiled = torch.compile(task.loss), True

    def save_checkpoint() -> None:
        def writer(scratch: Path) -> None:
            task.save(scratch, progress)
            torch.save({
                "task": task.name, "step": progress.step, "total": progress.total, "tokens": progress.tokens,
                "seconds": progress.seconds, "module": task.module.state_dict(), "optimizer": opt.state_dict(),
                "generator": generator.get_state(), "config": config or {},
            }, scratch / STATE_FILE)
        write_files_atomically(task.out, writer)

    averager, window = _Averager(), _Averager()
    pending_loss: list[torch.Tensor] = []
    last_saved = progress.step if resume else None
    budget_s = loop.max_minutes * 60.0
    t_start = time.perf_counter()
    seconds_before = progress.seconds
    calibration = None
    start_step = progress.step
    bar = tqdm(total=progress.total, initial=progress.step, desc=task.name, unit="step", dynamic_ncols=True)

    def log(message: str) -> None:
        progress.log.append(message)
        tqdm.write(message)

    def elapsed() -> float:
        return seconds_before + time.perf_counter() - t_start

    def check_finite() -> None:
        if pending_loss:
            values = torch.stack(pending_loss)
            pending_loss.clear()
            if not bool(torch.isfinite(values).all()):
                where = f"the checkpoint of step {last_saved} in {task.out} is intact" if last_saved is not None \
                    else "no checkpoint was written yet"
                raise LonggenError(f"{task.name}: the loss is not finite by step {progress.step} ({where}); "
                                   "try a lower learning rate")

    try:
        while progress.step < progress.total:
            step = progress.step
            schedule = CosineSchedule(optim.lr, progress.total, optim.warmup_steps, optim.min_lr_ratio)
            lr = schedule(step)
            for group in opt.param_groups:
                group["lr"] = lr
            batch = task.batch(generator)
            try:
                with autocast(device):
                    loss, metrics = loss_fn(batch)
                loss.backward()
            except (LonggenError, KeyboardInterrupt):
                raise
            except Exception as exc:
                if not compiled:
                    raise
                log(f"torch.compile failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); running eager")
                loss_fn, compiled = task.loss, False
                opt.zero_grad(set_to_none=True)
                with autocast(device):
                    loss, metrics = loss_fn(batch)
                loss.backward()
            if optim.grad_clip > 0:
                norm = torch.nn.utils.clip_grad_norm_(task.module.parameters(), optim.grad_clip)
                metrics = {**metrics, "gnorm": norm}
            opt.step()
            opt.zero_grad(set_to_none=True)
            progress.step += 1
            progress.tokens += task.tokens_per_batch or batch.numel()
            averager.add(metrics)
            window.add({k: v for k, v in metrics.items() if k == "loss" or k.startswith("acc")})
            pending_loss.append(loss.detach().float())

            if progress.step % SYNC_EVERY == 0 or progress.step == progress.total:
                check_finite()
                bar.set_postfix_str(_format(window.take()) + f" lr {lr:.2e}", refresh=False)
            bar.update(1)

            # Fit the run into the time budget once a few steps (after warm-up) have been timed.
            if budget_s:
                done_here = progress.step - start_step
                if done_here == CALIBRATION_STEPS[0]:
                    _sync(device)
                    calibration = time.perf_counter()
                elif done_here == CALIBRATION_STEPS[1] and calibration is not None:
                    _sync(device)
                    per_step = (time.perf_counter() - calibration) / (CALIBRATION_STEPS[1] - CALIBRATION_STEPS[0])
                    reserve = 0.05 * budget_s  # validation passes and checkpoints
                    fits = progress.step + int(max(0.0, budget_s - reserve - (elapsed() - seconds_before)) / per_step)
                    if fits < progress.total:
                        progress.total = max(progress.step, fits)
                        bar.total = progress.total
                        log(f"{task.name}: {per_step * 1000:.0f} ms/step; {loop.max_minutes:g} min fit "
                            f"{progress.total} steps (asked {loop.steps})")

            if progress.step % loop.log_every == 0 or progress.step == progress.total:
                progress.train = averager.take()
                progress.seconds = elapsed()
                tps = progress.tokens / progress.seconds if progress.seconds else 0.0
                log(f"{task.name} step {progress.step}/{progress.total} | {_format(progress.train)} | "
                    f"lr {lr:.2e} | {tps / 1000:.1f}k tok/s | {progress.seconds:.0f}s")
            if loop.eval_every and progress.step % loop.eval_every == 0 and progress.step < progress.total:
                progress.val = task.evaluate()
                if progress.val:
                    log(f"{task.name} step {progress.step} validation | {_format(progress.val)}")
            if loop.save_every and progress.step % loop.save_every == 0 and progress.step < progress.total:
                check_finite()
                progress.seconds = elapsed()
                save_checkpoint()
                last_saved = progress.step
    except KeyboardInterrupt:
        bar.close()
        if progress.step == (last_saved or 0):
            raise LonggenError(f"{task.name}: interrupted at step {progress.step}; nothing new to save") from None
        check_finite()
        progress.seconds = elapsed()
        save_checkpoint()
        raise LonggenError(f"{task.name}: interrupted at step {progress.step}; checkpoint saved in {task.out} "
                           "(continue with --resume)") from None
    bar.close()
    check_finite()
    progress.seconds = elapsed()
    progress.val = task.evaluate()
    if progress.val:
        log(f"{task.name} final validation | {_format(progress.val)}")
    save_checkpoint()
    return progress


def start_run(command: str, out: str, resume: bool, loop: LoopConfig) -> tuple[Path, torch.device]:
    """The checks every trainer makes before any work: an output directory, not another run's, a device."""
    if not out:
        raise LonggenError(f"{command} needs an output directory (--out DIR)")
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise LonggenError(f"--out {path} exists and is not a directory")
    check_fresh_start(path, resume)
    device = resolve_device(loop.device)
    configure(device, loop.threads)
    return path, device


def check_fresh_start(out: Path, resume: bool) -> None:
    """A new run must not overwrite another run's checkpoint by accident."""
    if not resume and (out / STATE_FILE).is_file():
        raise LonggenError(f"{out} already holds a training run ({STATE_FILE}); continue it with --resume, "
                           "or choose another --out")


def _load_state(path: Path, task: Task, opt: torch.optim.Optimizer, generator: torch.Generator, progress: Progress) -> None:
    if not path.is_file():
        raise LonggenError(f"--resume: no {STATE_FILE} in {task.out}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle and zip errors vary by torch version
        raise LonggenError(f"--resume: cannot read {path}: {exc}") from None
    if state.get("task") != task.name:
        raise LonggenError(f"--resume: {path} belongs to a {state.get('task')!r} run, not {task.name!r}")
    try:
        task.module.load_state_dict(state["module"])
        opt.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:
        raise LonggenError(f"--resume: {path} does not fit this model ({str(exc).splitlines()[0]})") from None
    generator.set_state(state["generator"])
    progress.step = state["step"]
    if progress.total <= progress.step:
        raise LonggenError(f"--resume: {path} is already at step {progress.step}; ask for more --steps to go on")
    progress.tokens, progress.seconds = state.get("tokens", 0), state.get("seconds", 0.0)
