"""Write a trained model as a Hugging Face checkpoint directory.

``config.json`` carries every field HF transformers' ``LlamaConfig`` and SGLang read (not just the
subset the reference runtime needs), ``model.safetensors`` holds HF parameter names, and a tied
LM head is left out of the file, as HF does, since it *is* the embedding matrix.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..runtime.model import Transformer
from .config import ModelShape
from .tokenizer import TOKENIZER_FILES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_config(shape: ModelShape, vocab_size: int, bos_id: int, eos_id: int, dtype: str = "float32") -> dict:
    """A complete ``LlamaForCausalLM`` config.json for ``shape``."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "initializer_range": shape.init_std,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "use_cache": True,
        "torch_dtype": dtype,
    }


def parameter_count(model: Transformer) -> int:
    """Unique parameters (a tied head counts once)."""
    return sum(p.numel() for p in model.parameters())


def save_hf_model(model: Transformer, config: dict, directory: Path, dtype: str = "float32",
                  tokenizer_dir: Path | None = None) -> Path:
    """config.json, generation_config.json, model.safetensors (and the tokenizer files)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch_dtype = DTYPES[dtype]
    state = {}
    for key, value in model.state_dict().items():
        if key == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        state[key] = value.detach().to(device="cpu", dtype=torch_dtype).contiguous()
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype}, indent=2) + "\n")
    (directory / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}, indent=2) + "\n")
    if tokenizer_dir is not None and Path(tokenizer_dir).resolve() != directory.resolve():
        for name in TOKENIZER_FILES:
            shutil.copyfile(Path(tokenizer_dir) / name, directory / name)
    return directory
