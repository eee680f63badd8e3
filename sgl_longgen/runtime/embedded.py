"""Embedded models: small HF-format checkpoints shipped with the package or built locally.

Nothing is downloaded here (models fetched on request, such as ``smollm2``, are named here too,
resolved through :mod:`.fetched`). ``tiny`` is a trained proxy (a small Llama trained on Python's standard
library, with trained TokenSwift heads) when the package ships it; the random-init models are for
fast tests. A random-init model is a deterministic function of its spec and seed, so
every machine builds the same weights; the directory is a real HF checkpoint (config.json,
model.safetensors, tokenizer.json) that SGLang can serve too, with TokenSwift heads and
per-model defaults in ``tokenswift-heads/``, a random-init OWL drafter in ``owl-drafter/`` and a
random-init LongSpec drafter in ``longspec-drafter/``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from .. import env
from ..core.heads import TokenSwiftHeads
from ..core.longspec import LongSpecDrafter
from ..core.owl import OwlDrafter
from ..errors import LonggenError
from . import fetched

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
HEADS_SUBDIR = "tokenswift-heads"
DRAFTER_SUBDIR = "owl-drafter"
LONGSPEC_SUBDIR = "longspec-drafter"
DEFAULTS_FILE = "longgen.toml"


@dataclass(frozen=True)
class RandomSpec:
    """Shape of a random-init model (HF config fields) and its defaults file."""

    config: dict
    seed: int
    defaults: str = ""
    # 2: adds owl-drafter/, 3: adds longspec-drafter/ (the weights of earlier versions are unchanged)
    version: int = 3
    heads: int = 3
    owl_steps: int = 8  # the random-init OWL drafter: unroll length (sets alpha); width = hidden size
    extra: dict = field(default_factory=dict)


_TINY_DEFAULTS = """\
# Defaults for this model's TokenSwift runs; any --config file or flag overrides them.
[tokenswift.partial_kv]
budget = 256
sinks = 16
"""

SPECS: dict[str, RandomSpec] = {
    # Llama with GQA ratio 4 and Llama-3.1 RoPE scaling.
    "tiny-random": RandomSpec(
        config=dict(
            architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=128, intermediate_size=384,
            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=16384, rms_norm_eps=1e-5, rope_theta=10000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 2048},
            tie_word_embeddings=False,
        ),
        seed=1234,
        defaults=_TINY_DEFAULTS,
    ),
    # Qwen2 (qkv bias, tied embeddings) with GQA ratio 2.
    "tiny-qwen2": RandomSpec(
        config=dict(
            architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=96, intermediate_size=256,
            num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3, head_dim=16,
            max_position_embeddings=16384, rms_norm_eps=1e-6, rope_theta=1000000.0,
            tie_word_embeddings=True,
        ),
        seed=4321,
        defaults=_TINY_DEFAULTS,
    ),
}
# Trained models shipped inside the package (sgl_longgen/models/NAME: an HF checkpoint with its
# tokenswift-heads/). ``tiny`` is the proxy that ``python -m sgl_longgen.training.proxy`` trains;
# while its directory is absent, ``tiny`` falls back to its alias below.
SHIPPED_ROOT = Path(__file__).resolve().parent.parent / "models"
SHIPPED = ("tiny",)
ALIASES = {"tiny": "tiny-random"}


def names() -> list[str]:
    return sorted({*SPECS, *SHIPPED, *ALIASES, *fetched.MODELS})


def is_name(name: str) -> bool:
    """Whether ``name`` is a model name (resolved by :func:`resolve_model`), not a path."""
    return name in SPECS or name in SHIPPED or name in ALIASES or name in fetched.MODELS


def shipped_model(name: str) -> Path | None:
    """The shipped directory of a trained embedded model, if this installation has it."""
    if name not in SHIPPED:
        return None
    directory = SHIPPED_ROOT / name
    if (directory / "config.json").is_file() and (directory / "model.safetensors").is_file():
        return directory
    return None


def cache_root() -> Path:
    root = env.get("HOME")
    return Path(root) if root else Path.home() / ".cache" / "sgl-longgen"


def resolve_model(name_or_dir: str | Path) -> Path:
    """An embedded model's directory (built if needed), a fetched model's (an error naming the
    command that fetches it, while it is not there) or an existing checkpoint directory."""
    name = str(name_or_dir)
    shipped = shipped_model(name)
    if shipped is not None:
        return shipped
    name = ALIASES.get(name, name)
    if name in SPECS:
        spec = SPECS[name]
        target = cache_root() / "models" / f"{name}-v{spec.version}"
        if not (target / "config.json").is_file():
            build_random(target, spec)
        return target
    if name in fetched.MODELS:
        return fetched.require(name)
    path = Path(name_or_dir)
    if not path.is_dir():
        raise LonggenError(f"model directory not found: {path} (embedded models: {', '.join(names())})")
    return path


# ----------------------------------------------------------------------------------------------
# building


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel tokenizers use)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def byte_tokenizer_files(directory: Path, model_max_length: int) -> int:
    """A byte-level tokenizer (ids 0-255 are the bytes) plus BOS/EOS; returns the vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS])
    tok.save(str(directory / "tokenizer.json"))
    write_tokenizer_config(directory, model_max_length)
    return tok.get_vocab_size(with_added_tokens=True)


def write_tokenizer_config(directory: Path, model_max_length: int) -> None:
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
        "add_bos_token": True, "model_max_length": model_max_length, "clean_up_tokenization_spaces": False,
    }, indent=2) + "\n")


def random_state(config: dict, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Random weights with enough scale that the next-token distributions are peaked.

    (The usual std=0.02 init gives near-uniform logits, which makes greedy decoding a coin toss
    between near-ties and drafts useless; these models should behave more like trained ones.)
    """
    from .model import ModelConfig, Transformer

    import msgspec

    cfg = msgspec.convert(config, ModelConfig)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Transformer(cfg).state_dict().items()}
    state = {}
    for key, shape in shapes.items():
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if key.endswith("norm.weight") or key.endswith("layernorm.weight"):
            state[key] = torch.ones(shape)
        elif key.endswith(".bias"):
            state[key] = torch.randn(shape, generator=generator) * 0.1
        elif key == "model.embed_tokens.weight":
            state[key] = torch.randn(shape, generator=generator)
        elif key == "lm_head.weight":
            state[key] = torch.randn(shape, generator=generator) * (3.0 / shape[1] ** 0.5)
        else:
            state[key] = torch.randn(shape, generator=generator) / shape[1] ** 0.5
    if cfg.tie_word_embeddings:
        # One matrix for input and output: scale it for the output side.
        state["model.embed_tokens.weight"] *= 3.0 / cfg.hidden_size ** 0.5
    return state


def random_longspec(config: dict, state: dict[str, torch.Tensor], seed: int) -> LongSpecDrafter:
    """A random-init LongSpec drafter for a model (config.json fields and weights), its output norm
    at the model's final norm."""
    import msgspec

    from .model import ModelConfig

    drafter = LongSpecDrafter.for_target(msgspec.convert(config, ModelConfig))
    drafter.reset_parameters(torch.Generator().manual_seed(seed), final_norm=state["model.norm.weight"])
    return drafter


def build_random(target: Path, spec: RandomSpec) -> Path:
    """Write the checkpoint into a temporary directory, then rename it into place (atomic)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        vocab = byte_tokenizer_files(tmp, spec.config["max_position_embeddings"])
        config = {**spec.config, "vocab_size": vocab, "bos_token_id": vocab - 2, "eos_token_id": vocab - 1,
                  "torch_dtype": "float32"}
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": vocab - 2, "eos_token_id": vocab - 1}, indent=2) + "\n")
        gen = torch.Generator().manual_seed(spec.seed)
        state = random_state(config, gen)
        save_file(state, str(tmp / "model.safetensors"))
        heads = TokenSwiftHeads(config["hidden_size"], spec.heads, config["rms_norm_eps"])
        heads.reset_parameters(gen)
        heads.save(tmp / HEADS_SUBDIR, base_model=target.name)
        if spec.defaults:
            (tmp / HEADS_SUBDIR / DEFAULTS_FILE).write_text(spec.defaults)
        # A separate generator: the model and heads stay exactly what version 1 built.
        owl_gen = torch.Generator().manual_seed(spec.seed + 1)
        drafter = OwlDrafter(config["hidden_size"], vocab, config["hidden_size"], spec.owl_steps, spec=True)
        drafter.reset_parameters(owl_gen, target_embeddings=state["model.embed_tokens.weight"])
        drafter.save(tmp / DRAFTER_SUBDIR, base_model=target.name)
        random_longspec(config, state, spec.seed + 2).save(tmp / LONGSPEC_SUBDIR, base_model=target.name)
        try:
            tmp.rename(target)
        except OSError:
            # Another process built it first; theirs is identical.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
