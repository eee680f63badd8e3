"""Shape checks of safetensors checkpoints against the module they must load into.

Used before loading (from the file header only, cheap enough to run when a server starts) and
after, so every mismatch is reported as one error that names the file and the tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import nn

from ..errors import LonggenError


def read_config(directory: str | Path, config_file: str, fmt: str, version: int | None, what: str) -> dict:
    """A draft checkpoint's JSON config: present, valid JSON, of format ``fmt`` and ``version`` (None:
    any); every problem one error that names the file (``what``: "OWL drafter", ...)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise LonggenError(f"{what} directory not found: {directory}")
    cfg_path = directory / config_file
    if not cfg_path.is_file():
        raise LonggenError(f"{what} checkpoint is missing {cfg_path}")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise LonggenError(f"{cfg_path} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict) or cfg.get("format") != fmt:
        found = cfg.get("format") if isinstance(cfg, dict) else None
        article = "an" if what[:1].lower() in "aeiou" else "a"
        raise LonggenError(f"{cfg_path} is not {article} {what} config (format={found!r})")
    if version is not None and cfg.get("version") != version:
        raise LonggenError(f"{cfg_path}: unsupported version {cfg.get('version')!r} (this build reads {version})")
    return cfg


def expected_shapes(build) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of ``build()`` without allocating it (built on the meta device)."""
    with torch.device("meta"):
        module: nn.Module = build()
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def header_shapes(weights: Path) -> dict[str, tuple[int, ...]]:
    """Tensor shapes from a safetensors header (the tensors are not read)."""
    if not weights.is_file():
        raise LonggenError(f"checkpoint is missing {weights}")
    try:
        with safe_open(str(weights), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError) as exc:
        raise LonggenError(f"cannot read {weights}: {exc}") from None


def check_shapes(found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], weights: Path,
                 config: Path, exact: bool = False) -> None:
    """Every expected tensor present with its shape (and, if ``exact``, nothing else)."""
    missing = sorted(set(expected) - set(found))
    if missing:
        raise LonggenError(f"{weights} lacks tensors {missing[:4]}{'...' if len(missing) > 4 else ''} "
                           f"(does {config} match it?)")
    if exact:
        unexpected = sorted(set(found) - set(expected))
        if unexpected:
            raise LonggenError(f"{weights} has unexpected tensors {unexpected[:4]} (does {config} match it?)")
    for key, want in expected.items():
        if tuple(found[key]) != tuple(want):
            raise LonggenError(f"{weights}: tensor {key} has shape {tuple(found[key])}, {config.name} implies {want}")


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors; an unreadable file is one error naming it."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise LonggenError(f"cannot read {path}: {exc}") from None
