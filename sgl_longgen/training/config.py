"""Typed trainer configs, loadable from TOML like the generation config.

Defaults are the proxy model's recipe (``proxy.py``), so ``sgl-longgen train lm --data stdlib``
with no other flag trains that model. Structs are strict: a typo in a TOML key fails at once and
names the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from ..config import Strict, convert, load_toml, merge

PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
PosFloat = Annotated[float, Meta(gt=0.0)]
Fraction = Annotated[float, Meta(ge=0.0, lt=1.0)]


class DataConfig(Strict):
    """Where training text comes from.

    ``sources``: files (``.jsonl``: one ``{"text": ...}`` per line; anything else: one document),
    directories (every file matching ``glob`` below them) or ``"stdlib"``, the ``.py`` sources of
    the running interpreter's standard library. Documents are read in a fixed order; a stable hash
    of each document's name puts ``val_fraction`` of them in the validation split.
    """

    sources: list[str] = msgspec.field(default_factory=lambda: ["stdlib"])
    glob: str = "*.py"
    val_fraction: Fraction = 0.02
    cache_dir: str = ""  # tokenized corpora; "" = $SGLANG_LONGGEN_HOME/tokens


class TokenizerConfig(Strict):
    """Byte-level BPE trained on the training split (ids 0 and 1 are BOS and EOS)."""

    vocab_size: Annotated[int, Meta(ge=260, le=65536)] = 8192
    min_frequency: PosInt = 2


class ModelShape(Strict):
    """A Llama decoder (GQA, RoPE, SwiGLU, RMSNorm); these are HF ``config.json`` fields."""

    hidden_size: PosInt = 256
    num_hidden_layers: PosInt = 8
    num_attention_heads: PosInt = 4
    num_key_value_heads: PosInt = 2
    head_dim: PosInt = 64
    intermediate_size: PosInt = 768
    max_position_embeddings: PosInt = 16384
    rope_theta: PosFloat = 500000.0
    rms_norm_eps: PosFloat = 1e-5
    tie_word_embeddings: bool = True
    init_std: PosFloat = 0.02

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (RoPE rotates pairs)")


class OptimConfig(Strict):
    """AdamW with linear warmup then cosine decay to ``min_lr_ratio * lr``."""

    lr: PosFloat = 2e-3
    min_lr_ratio: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.1
    warmup_steps: NonNegInt = 100
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: Annotated[float, Meta(ge=0.0)] = 0.1
    grad_clip: Annotated[float, Meta(ge=0.0)] = 1.0  # max global grad norm; 0 = off


class HeadsOptimConfig(OptimConfig):
    """TokenSwift's recipe (the paper's): AdamW (0.9, 0.999), wd 0.1, 50 warmup steps, lr 5e-3."""

    lr: PosFloat = 5e-3
    warmup_steps: NonNegInt = 50
    betas: tuple[float, float] = (0.9, 0.999)
    min_lr_ratio: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0


class LoopConfig(Strict):
    """Steps, batch shape and bookkeeping shared by every trainer.

    ``max_minutes`` (0 = off) caps the run's wall time: after a few timed steps the step count is
    lowered to what fits, and the cosine schedule is laid out over that count.
    """

    steps: PosInt = 1000
    batch_size: PosInt = 8
    seq_len: PosInt = 8192
    max_minutes: Annotated[float, Meta(ge=0.0)] = 0.0
    log_every: PosInt = 50
    eval_every: NonNegInt = 250  # 0 = only at the end
    eval_batches: PosInt = 4
    save_every: NonNegInt = 250  # 0 = only at the end
    seed: int = 0
    device: str = "auto"  # auto: cuda if available, else cpu
    threads: NonNegInt = 0  # CPU threads for torch; 0 = torch's default
    compile: bool = False  # torch.compile the forward (falls back to eager if it fails)


class LMTrainConfig(Strict):
    """``sgl-longgen train lm``: a tokenizer (trained unless ``tokenizer_dir`` is given) and a
    Llama-architecture LM from scratch, written as an HF checkpoint directory."""

    out: str = ""
    tokenizer_dir: str = ""
    save_dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = msgspec.field(default_factory=TokenizerConfig)
    model: ModelShape = msgspec.field(default_factory=ModelShape)
    optim: OptimConfig = msgspec.field(default_factory=OptimConfig)
    loop: LoopConfig = msgspec.field(default_factory=LoopConfig)


class HeadsLoopConfig(LoopConfig):
    """Upstream trains 200 steps of ~1M tokens; 300 steps of 65K cover the proxy's ~8.5M-token
    corpus about twice, which is what its three small heads need."""

    steps: PosInt = 300
    eval_every: NonNegInt = 100
    save_every: NonNegInt = 100


class HeadsTrainConfig(Strict):
    """``sgl-longgen train heads``: TokenSwift's chained heads on a frozen base model."""

    model: str = ""
    out: str = ""
    num_heads: PosInt = 3
    init_std: PosFloat = 0.02
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    optim: HeadsOptimConfig = msgspec.field(default_factory=HeadsOptimConfig)
    loop: HeadsLoopConfig = msgspec.field(default_factory=HeadsLoopConfig)


def load_train_config(cls: type[msgspec.Struct], path: str | Path | None, overrides: dict[str, Any]) -> Any:
    """Defaults < TOML file < command-line overrides, validated as one struct."""
    data: dict[str, Any] = load_toml(path) if path else {}
    data = merge(data, overrides)
    return convert(data, cls, str(path) if path else "from the command line")


def to_dict(cfg: msgspec.Struct) -> dict[str, Any]:
    return msgspec.to_builtins(cfg)
