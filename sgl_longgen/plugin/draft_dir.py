"""The directory behind ``--speculative-draft-model-path``: checked before the server starts.

For TOKENSWIFT it holds the heads checkpoint (``heads.json`` + ``heads.safetensors``) and an
optional ``longgen.toml`` with per-checkpoint defaults (tree, n-gram, partial KV, penalty). Every
problem is reported naming the file, while the server is still starting, instead of as a
tensor-shape error deep inside a scheduler process.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..config import GenerateConfig, convert, load_toml
from ..core.heads import CONFIG_FILE, WEIGHTS_FILE, TokenSwiftHeads, read_heads_config
from ..errors import LonggenError

DEFAULTS_FILE = "longgen.toml"


@dataclass
class DraftDir:
    path: Path
    heads_config: dict
    defaults: GenerateConfig  # only .tokenswift and .sampling.penalty* matter to the server


def target_hidden_size(model_path: str | Path) -> int | None:
    """hidden_size from the target's config.json (None when it cannot be read here)."""
    cfg = Path(model_path) / "config.json"
    if not cfg.is_file():
        return None
    try:
        data = json.loads(cfg.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    data = data.get("text_config", data)
    return data.get("hidden_size")


def read_defaults(path: Path) -> GenerateConfig:
    f = path / DEFAULTS_FILE
    if not f.is_file():
        return GenerateConfig()
    return convert(load_toml(f), GenerateConfig, str(f))


def inspect_heads_draft_dir(path: str | Path | None, hidden_size: int | None) -> DraftDir:
    """Validate a TokenSwift heads directory without loading the weights."""
    if path is None:
        raise LonggenError("TOKENSWIFT needs --speculative-draft-model-path: a directory with heads.json and heads.safetensors")
    path = Path(path)
    cfg = read_heads_config(path)
    if hidden_size is not None and cfg["hidden_size"] != hidden_size:
        raise LonggenError(
            f"{path / CONFIG_FILE}: heads have hidden size {cfg['hidden_size']} but the target model's is {hidden_size}"
        )
    defaults = read_defaults(path)
    need = defaults.tokenswift.num_heads
    if cfg["num_heads"] < need:
        raise LonggenError(
            f"{path / CONFIG_FILE}: {cfg['num_heads']} heads, but the tree {defaults.tokenswift.tree} "
            f"in {path / DEFAULTS_FILE} needs {need}"
        )
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise LonggenError(f"heads checkpoint is missing {weights}")
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in TokenSwiftHeads(cfg["hidden_size"], cfg["num_heads"]).state_dict().items()}
    try:
        with safe_open(str(weights), framework="pt") as f:
            found = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError) as exc:
        raise LonggenError(f"cannot read {weights}: {exc}") from None
    for key, shape in expected.items():
        if key not in found:
            raise LonggenError(f"{weights} lacks tensor {key}")
        if found[key] != shape:
            raise LonggenError(f"{weights}: tensor {key} has shape {found[key]}, {CONFIG_FILE} implies {shape}")
    return DraftDir(path, cfg, defaults)
