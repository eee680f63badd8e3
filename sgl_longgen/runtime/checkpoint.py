"""Loading HF-format model directories: ``config.json``, safetensors weights, ``tokenizer.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch
from safetensors import SafetensorError, safe_open

from ..errors import LonggenError
from .model import ModelConfig, Transformer
from .tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    path: Path
    config: ModelConfig
    model: Transformer
    tokenizer: Tokenizer | None

    @property
    def eos_ids(self) -> list[int]:
        ids = list(self.config.eos_ids)
        if self.tokenizer is not None and self.tokenizer.eos_id is not None and self.tokenizer.eos_id not in ids:
            ids.append(self.tokenizer.eos_id)
        return ids


def read_config(directory: str | Path) -> ModelConfig:
    directory = Path(directory)
    if not directory.is_dir():
        raise LonggenError(f"model directory not found: {directory}")
    path = directory / "config.json"
    if not path.is_file():
        raise LonggenError(f"model directory {directory} has no config.json")
    try:
        cfg = msgspec.json.decode(path.read_bytes(), type=ModelConfig)
    except msgspec.ValidationError as exc:
        raise LonggenError(f"{path}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise LonggenError(f"{path} is not valid JSON: {exc}") from None
    cfg.validate(str(path))
    return cfg


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise LonggenError(f"{index} is not a valid safetensors index: {exc}") from None
        return [directory / name for name in sorted(set(weight_map.values()))]
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(directory.glob("*.safetensors"))
    if not found:
        raise LonggenError(f"model directory {directory} has no safetensors weights (model.safetensors)")
    return found


def load_state(directory: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in _weight_files(directory):
        if not path.is_file():
            raise LonggenError(f"weights file listed in the index is missing: {path}")
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    state[key] = f.get_tensor(key)
        except (SafetensorError, OSError) as exc:
            raise LonggenError(f"cannot read {path}: {exc}") from None
    return state


def load_model(directory: str | Path, dtype: str | torch.dtype = "float64", device: str = "cpu") -> LoadedModel:
    directory = Path(directory)
    cfg = read_config(directory)
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    with torch.device("meta"):
        model = Transformer(cfg)
    state = load_state(directory)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = dict(model.state_dict())
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise LonggenError(
            f"weights in {directory} lack {len(missing)} tensors, e.g. {missing[:3]} (does config.json match?)"
        )
    for key, ref in expected.items():
        if tuple(state[key].shape) != tuple(ref.shape):
            raise LonggenError(f"{directory}: tensor {key} has shape {tuple(state[key].shape)}, config.json implies {tuple(ref.shape)}")
    model.load_state_dict({k: state[k].to(torch_dtype) for k in expected}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(device).eval().requires_grad_(False)
    tokenizer = Tokenizer.from_dir(directory) if (directory / "tokenizer.json").is_file() else None
    return LoadedModel(directory, cfg, model, tokenizer)
