"""Layers shared by the reference model and the drafters."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Llama/Qwen2 RMSNorm: statistics in float32 (at least), scale in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float() if dtype in (torch.float16, torch.bfloat16) else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
