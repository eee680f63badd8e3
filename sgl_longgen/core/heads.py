"""TokenSwift's draft heads (Eq. 1) and their checkpoint format.

Three chained residual blocks on top of the last decoder layer's raw residual stream h0:
``h_i = h_{i-1} + A_i(RMSNorm_in_i(h_{i-1}))`` and ``logits_i = LMHead(RMSNorm_out_i(h_i))``.
The base model (its final norm and LM head included) stays frozen; only A_i and the two norms
per head train. Head i predicts the token i+1 positions past the base head's prediction.

On disk a heads checkpoint is a directory with ``heads.json`` (shape and provenance) and
``heads.safetensors``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from ..errors import LonggenError
from .nn import RMSNorm
from .weights import check_shapes, expected_shapes, header_shapes, read_config, read_weights

FORMAT = "sgl-longgen.tokenswift-heads"
CONFIG_FILE = "heads.json"
WEIGHTS_FILE = "heads.safetensors"


class HeadBlock(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.norm_in = RMSNorm(hidden_size, eps)
        self.proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.norm_out = RMSNorm(hidden_size, eps)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.proj(self.norm_in(h))


class TokenSwiftHeads(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int = 3, rms_norm_eps: float = 1e-6):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.rms_norm_eps = rms_norm_eps
        self.heads = nn.ModuleList(HeadBlock(hidden_size, rms_norm_eps) for _ in range(num_heads))

    def reset_parameters(self, generator: torch.Generator | None = None, std: float = 0.02) -> None:
        """Upstream init: A_i ~ N(0, std^2), norms at 1, so each head starts near "copy h"."""
        with torch.no_grad():
            for block in self.heads:
                block.proj.weight.normal_(0.0, std, generator=generator)
                block.norm_in.weight.fill_(1.0)
                block.norm_out.weight.fill_(1.0)

    def forward(self, h0: torch.Tensor) -> list[torch.Tensor]:
        """Normalised states ready for the shared LM head, one per head (``[..., d]`` each)."""
        out, h = [], h0
        for block in self.heads:
            h = block(h)
            out.append(block.norm_out(h))
        return out

    def config(self) -> dict:
        return {
            "format": FORMAT,
            "version": 1,
            "num_heads": self.num_heads,
            "hidden_size": self.hidden_size,
            "rms_norm_eps": self.rms_norm_eps,
        }

    def save(self, directory: str | Path, **extra) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to(torch.float32).contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(directory / WEIGHTS_FILE))
        (directory / CONFIG_FILE).write_text(json.dumps({**self.config(), **extra}, indent=2) + "\n")
        return directory


def read_heads_config(directory: str | Path) -> dict:
    cfg = read_config(directory, CONFIG_FILE, FORMAT, None, "heads")
    cfg_path = Path(directory) / CONFIG_FILE
    for key in ("num_heads", "hidden_size"):
        if not isinstance(cfg.get(key), int) or cfg[key] < 1:
            raise LonggenError(f"{cfg_path}: '{key}' must be a positive integer")
    return cfg


def check_heads(directory: str | Path, hidden_size: int | None = None, num_heads: int | None = None) -> dict:
    """Validate a heads checkpoint against the model it will run on, reading only file headers."""
    directory = Path(directory)
    cfg = read_heads_config(directory)
    cfg_path = directory / CONFIG_FILE
    if hidden_size is not None and cfg["hidden_size"] != hidden_size:
        raise LonggenError(
            f"heads in {directory} have hidden size {cfg['hidden_size']} but the model's is {hidden_size} ({cfg_path})"
        )
    if num_heads is not None and cfg["num_heads"] < num_heads:
        raise LonggenError(
            f"heads in {directory} provide {cfg['num_heads']} heads but the tree needs {num_heads} ({cfg_path})"
        )
    weights = directory / WEIGHTS_FILE
    expected = expected_shapes(lambda: TokenSwiftHeads(cfg["hidden_size"], cfg["num_heads"]))
    check_shapes(header_shapes(weights), expected, weights, cfg_path)
    return cfg


def load_heads(
    directory: str | Path,
    hidden_size: int | None = None,
    num_heads: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> TokenSwiftHeads:
    """Load a heads checkpoint after :func:`check_heads`."""
    directory = Path(directory)
    cfg = check_heads(directory, hidden_size, num_heads)
    weights = directory / WEIGHTS_FILE
    state = read_weights(weights)
    heads = TokenSwiftHeads(cfg["hidden_size"], cfg["num_heads"], cfg.get("rms_norm_eps", 1e-6))
    heads.load_state_dict({k: state[k] for k in heads.state_dict()})
    return heads.to(dtype)
