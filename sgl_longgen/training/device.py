"""Where training runs and in which precision: bf16 autocast on a GPU, plain fp32 on a CPU."""

from __future__ import annotations

import contextlib

import torch

from ..errors import LonggenError


def resolve_device(name: str) -> torch.device:
    """``auto`` picks the GPU when there is one; an unusable explicit choice is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise LonggenError(f"unknown device {name!r} (use auto, cpu, cuda or cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise LonggenError(f"device {name!r} asked for, but no CUDA device is available")
    if device.type not in ("cpu", "cuda"):
        raise LonggenError(f"unsupported training device {name!r} (use auto, cpu, cuda or cuda:N)")
    return device


def autocast(device: torch.device):
    """Mixed precision on CUDA (master weights stay fp32); none on CPU, where bf16 is slow."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def configure(device: torch.device, threads: int = 0) -> None:
    """Thread count, and fast matmul settings that do not change what is being trained."""
    if threads:
        torch.set_num_threads(threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (bf16 autocast)"
    return f"cpu, {torch.get_num_threads()} threads (fp32)"
